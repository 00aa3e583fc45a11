"""The latent presets' miniature VAEs: their configs (:func:`tiny_vae_config`, at a fixed random
init for the `_latent` presets) and the trained miniature Wan VAE of `tiny:cosmos3_omni_generator`
(the same architecture as the Wan one: 4 latent channels, frames halved in size and in time),
trained to reconstruct 5-frame 16 x 16 clips, shipped as package data (:data:`TINY_VAE_FILE`,
0.5 MB).

A random-init VAE decodes most latents to much the same dull clip, so a reward of the decoded
pixels barely moves whatever the transformer learns (the other `_latent` presets); a trained one
decodes what the transformer makes, as a real pipeline's VAE does, so a latent-space run can be
seen to learn on a CPU. `python -m nebula_rl.flow.tiny_vae` trains it again (1,500 steps, minutes
on 2 CPU cores, seeded): on the toy dataset's clips (`flow.clips`) and as many smooth random colour
fields (so it also decodes clips unlike the toy ones: brighter, other colours), with the
reconstruction error plus a small KL term (the latents stay near a unit Gaussian, where the
transformer's samples start); its `latents_mean` / `latents_std` are then measured on the toy
clips, as a pipeline's are on its data.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["TINY_VAE_FILE", "TINY_VAE_SEED", "load_tiny_vae", "tiny_vae_config", "train_tiny_vae"]

TINY_VAE_FILE = Path(__file__).with_name("tiny_wan_vae.safetensors")
"""The trained weights, with their config (and its latent statistics) in the file's metadata."""


def tiny_vae_config(class_name: str) -> dict[str, Any]:
    """The miniature VAE of the latent presets: 4 latent channels, frames halved in size (Wan's
    also in time), normalised to about unit scale on the toy dataset."""
    if class_name == "AutoencoderKLWan":
        return {
            "base_dim": 8, "z_dim": 4, "dim_mult": [1, 2], "num_res_blocks": 1,
            "temperal_downsample": [True], "scale_factor_temporal": 2, "scale_factor_spatial": 2,
            "latents_mean": [-0.17, 0.07, -0.31, -0.36], "latents_std": [0.09, 0.11, 0.14, 0.23],
        }  # fmt: skip
    if class_name == "AutoencoderDC":
        return {
            "latent_channels": 4, "attention_head_dim": 8,
            "encoder_block_types": ["ResBlock"] * 2, "decoder_block_types": ["ResBlock"] * 2,
            "encoder_block_out_channels": [8, 16], "decoder_block_out_channels": [8, 16],
            "encoder_layers_per_block": [1, 1], "decoder_layers_per_block": [1, 1],
            "encoder_qkv_multiscales": [[], []], "decoder_qkv_multiscales": [[], []],
            "upsample_block_type": "interpolate", "downsample_block_type": "Conv",
            "decoder_norm_types": "rms_norm", "decoder_act_fns": "silu", "scaling_factor": 1.2,
        }  # fmt: skip
    assert class_name == "AutoencoderKL"
    return {
        "down_block_types": ["DownEncoderBlock2D"] * 2, "up_block_types": ["UpDecoderBlock2D"] * 2,
        "block_out_channels": [8, 16], "layers_per_block": 1, "latent_channels": 4,
        "norm_num_groups": 4, "use_quant_conv": False, "use_post_quant_conv": False,
        "shift_factor": -0.03, "scaling_factor": 2.8,
    }  # fmt: skip


TINY_VAE_SEED = 0
"""The latent presets' VAE is the same whatever the run's seed (a pretrained VAE stands in)."""


def load_tiny_vae() -> nn.Module:
    """The trained miniature `AutoencoderKLWan` (float32, frozen by its caller)."""
    import diffusers
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(TINY_VAE_FILE), "pt") as f:
        config = json.loads(f.metadata()["config"])
    module: Any = diffusers.AutoencoderKLWan(**config)
    module.load_state_dict(load_file(str(TINY_VAE_FILE)))
    return cast(nn.Module, module)


def _fields(n: int, frames: int, size: int, generator: torch.Generator) -> Tensor:
    """`n` smooth random colour clips [n, 3, T, H, W] in [-1, 1] (coarse noise, upsampled, with
    a random brightness offset), drifting slowly over the frames."""
    coarse = torch.rand(n, 3, 2, 4, 4, generator=generator) * 2 - 1
    offset = torch.rand(n, 3, 1, 1, 1, generator=generator) * 2 - 1
    field = F.interpolate(coarse, size=(frames, size, size), mode="trilinear")
    return (0.6 * field + offset).clamp(-1, 1)


def train_tiny_vae(
    out: Path = TINY_VAE_FILE, *, steps: int = 1500, batch: int = 16, seed: int = 0
) -> dict[str, Any]:
    """Train the miniature VAE (module docstring) and write it to `out`; its config."""
    import diffusers
    from safetensors.torch import save_file

    from nebula_rl.flow.data import clip_pixels, read_local_dataset

    torch.manual_seed(TINY_VAE_SEED)
    config = tiny_vae_config("AutoencoderKLWan")
    vae: Any = diffusers.AutoencoderKLWan(**config)
    with tempfile.TemporaryDirectory() as tmp:
        from nebula_rl.flow.clips import make_toy_dataset

        root = make_toy_dataset(Path(tmp), clips_per_prompt=32, frames=5, size=16, seed=seed)
        toy = clip_pixels(read_local_dataset(root, num_frames=5))
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=2e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    for step in range(steps):
        chosen = torch.randint(len(toy), (batch // 2,), generator=generator)
        x = torch.cat([toy[chosen], _fields(batch - batch // 2, 5, 16, generator)])
        posterior = vae.encode(x).latent_dist
        recon = vae.decode(posterior.sample(generator)).sample
        loss = F.mse_loss(recon, x) + 1e-4 * posterior.kl().mean() / x[0].numel()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    vae.eval()
    with torch.no_grad():
        mu = vae.encode(toy).latent_dist.mode()
    config["latents_mean"] = [round(v, 4) for v in mu.mean(dim=(0, 2, 3, 4)).tolist()]
    config["latents_std"] = [round(v, 4) for v in mu.std(dim=(0, 2, 3, 4)).tolist()]
    state = {k: v.detach().contiguous() for k, v in vae.state_dict().items()}
    save_file(state, str(out), metadata={"config": json.dumps(config)})
    return config


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Train the miniature Wan VAE again.")
    parser.add_argument("--out", type=Path, default=TINY_VAE_FILE)
    parser.add_argument("--steps", type=int, default=1500)
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(train_tiny_vae(args.out, steps=args.steps))
