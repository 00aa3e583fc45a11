"""The VAEs of latent-space world models: a frozen diffusers VAE between a clip's pixels
[B, 3, T, H, W] in [-1, 1] and the normalised latents [B, C, T', H', W'] its flow model samples
and trains on.

- `AutoencoderKLWan` (Wan 2.1 and 2.2; Cosmos-Predict2.5 uses Wan 2.1's): a causal video VAE.
  A clip of `1 + 4k` frames has `1 + 4k / temporal` latent frames (diffusers encodes the first
  frame, then 4 frames at a time), each `spatial` times smaller (8 for Wan 2.1, 16 for 2.2).
  Latents are normalised per channel with the config's `latents_mean` / `latents_std`,
  `z = (mu - mean) / std`, as the Wan and Cosmos-Predict2.5 pipelines do.
- `AutoencoderKL` (Stable Diffusion 3): an image VAE, run on each frame;
  `z = (mu - shift_factor) * scaling_factor`, as the SD3 pipeline does.
- `AutoencoderDC` (Sana's deep-compression autoencoder, 32x smaller frames): an image VAE, run on
  each frame; its encoder's latent (it has no distribution) times `scaling_factor`, as the Sana
  pipeline does.

A clip encodes to its posterior's mean (deterministic, as cosmos-rl's tokenizer does: a rollout
and the policy encode a clip alike); latents decode to pixels clamped to [-1, 1], one sample at a
time (the VAE's slicing). Only what needs a clip's latents encodes (DDRL's data term, SFT); only
rewards, the distance to the data and sample grids decode.

The VAE is float32 (cosmos-rl keeps it so for stability), in eval mode and frozen. The flow model
holds it as a plain attribute, not a submodule: it is in no optimiser, no state dict, no
checkpoint and no weight push, and copies of the model (DiffusionNFT's old weights, the KL
reference) share it. It follows the tensors it is given to their device; with
`policy.diffusers.offload` it goes back to the CPU after each pass (cosmos-rl's offload; on a
CPU-only run it never leaves the CPU).
`policy.diffusers.tokenizer.compile_encode` compiles its encoder call with `torch.compile`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "VAE_CLASSES",
    "FlowVAE",
    "check_vae_shape",
    "flow_vae",
    "pixels_to_samples",
    "sample_shape",
    "samples_to_pixels",
    "vae_factors",
]

VAE_CLASSES = ("AutoencoderKLWan", "AutoencoderKL", "AutoencoderDC")
"""The diffusers VAE classes nebula-rl runs."""

KEY = "policy.model_name_or_path"


def vae_factors(class_name: str, config: Mapping[str, Any]) -> tuple[int, int, int]:
    """(latent channels, spatial factor, temporal factor) of a VAE of `class_name` with the
    diffusers config `config`, read from its architecture."""
    if class_name == "AutoencoderKLWan":
        downsample = list(config.get("temperal_downsample", [False, True, True]))
        spatial = 2 ** len(downsample) * int(config.get("patch_size") or 1)
        return int(config.get("z_dim", 16)), spatial, 2 ** sum(map(bool, downsample))
    if class_name == "AutoencoderKL":
        blocks = config.get("block_out_channels", [64])
        return int(config.get("latent_channels", 4)), 2 ** (len(blocks) - 1), 1
    if class_name == "AutoencoderDC":
        blocks = config.get("encoder_block_out_channels", [128, 256, 512, 512, 1024, 1024])
        return int(config.get("latent_channels", 32)), 2 ** (len(blocks) - 1), 1
    if class_name == "AutoencoderKLCosmos":
        raise ValueError(
            f"{KEY}: AutoencoderKLCosmos is Cosmos-Predict1's tokenizer, which belongs to its EDM "
            "pipeline, not a rectified flow; nebula-rl runs AutoencoderKLWan (Wan, "
            "Cosmos-Predict2/2.5), AutoencoderKL (SD3) and AutoencoderDC (Sana)"
        )
    raise ValueError(f"{KEY}: a {class_name} VAE; nebula-rl runs {', '.join(VAE_CLASSES)}")


def check_vae_shape(
    class_name: str, config: Mapping[str, Any], *, frames: int, height: int, width: int
) -> None:
    """Raise, naming the config keys, unless clips of `frames` frames of `height` x `width`
    pixels encode to whole latents."""
    _, spatial, _ = vae_factors(class_name, config)
    if height % spatial or width % spatial:
        raise ValueError(
            f"policy.diffusers.inference_size = {[height, width]}: the {class_name} VAE shrinks "
            f"frames {spatial} times, so both sides must be multiples of {spatial}"
        )
    if class_name == "AutoencoderKLWan" and (frames - 1) % 4:
        raise ValueError(
            f"policy.diffusers.inference_frames = {frames}: the {class_name} VAE encodes the "
            "first frame, then 4 at a time; a clip has 1 + 4k frames (1, 5, 9, ..., 81, 93)"
        )


class FlowVAE:
    """A frozen diffusers VAE (:data:`VAE_CLASSES`) between pixels [B, 3, T, H, W] in [-1, 1]
    and normalised latents [B, C, T', H', W'] (see the module docstring)."""

    def __init__(self, module: nn.Module, *, compile_encode: bool = False) -> None:
        self.kind = type(module).__name__
        config: dict[str, Any] = dict(module.config)  # type: ignore[arg-type]
        self.channels, self.spatial, self.temporal = vae_factors(self.kind, config)
        self.module = module.float().eval().requires_grad_(False)
        self.module.enable_slicing()  # type: ignore[operator]
        if self.kind == "AutoencoderKLWan":
            view = (1, self.channels, 1, 1, 1)
            self.shift = torch.tensor(config["latents_mean"], dtype=torch.float32).view(view)
            self.scale = 1 / torch.tensor(config["latents_std"], dtype=torch.float32).view(view)
        else:  # (AutoencoderDC has no shift)
            self.shift = torch.tensor(float(config.get("shift_factor") or 0.0))
            self.scale = torch.tensor(float(config["scaling_factor"]))
        self._encode = torch.compile(self._mean, dynamic=False) if compile_encode else self._mean

    def __deepcopy__(self, memo: dict[int, Any]) -> FlowVAE:
        return self  # (frozen: copies of a flow model share their VAE)

    @property
    def config(self) -> Any:
        """The VAE's diffusers config."""
        return self.module.config

    def latent_shape(self, shape: Sequence[int]) -> tuple[int, int, int, int]:
        """The latents' [C, T', H', W'] of clips of pixels [3, T, H, W]."""
        _, frames, height, width = shape
        return (
            self.channels,
            1 + (frames - 1) // self.temporal,
            height // self.spatial,
            width // self.spatial,
        )

    offload: bool = False
    """Move the VAE back to the CPU after each pass (`policy.diffusers.offload`)."""

    def _on(self, device: torch.device) -> None:
        if self.shift.device != device:
            self.module.to(device)
            self.shift, self.scale = self.shift.to(device), self.scale.to(device)

    def _done(self) -> None:
        if self.offload:
            self._on(torch.device("cpu"))

    def _mean(self, pixels: Tensor) -> Tensor:
        encoded = self.module.encode(pixels)  # type: ignore[operator]
        if self.kind == "AutoencoderDC":  # (a deterministic encoder)
            return encoded.latent  # type: ignore[no-any-return]
        return encoded.latent_dist.mode()  # type: ignore[no-any-return]

    def _frames(self, x: Tensor, run: Any) -> Tensor:
        """`run` on `x` [B, C, T, H, W]: whole for a video VAE, frame by frame for an image one."""
        if self.kind == "AutoencoderKLWan":
            return run(x)  # type: ignore[no-any-return]
        frames = x.shape[2]
        out = run(x.transpose(1, 2).flatten(0, 1))
        return out.unflatten(0, (-1, frames)).transpose(1, 2)  # type: ignore[no-any-return]

    @torch.no_grad()
    def encode(self, pixels: Tensor) -> Tensor:
        """The normalised latents of `pixels` [B, 3, T, H, W] in [-1, 1] (float32)."""
        self._on(pixels.device)
        mu = self._frames(pixels.float(), self._encode)
        latents = (mu - self.shift) * self.scale
        self._done()
        return latents

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """The pixels [B, 3, T, H, W] in [-1, 1] (float32) of normalised `latents`."""
        self._on(latents.device)
        z = latents.float() / self.scale + self.shift
        pixels = self._frames(z, lambda x: self.module.decode(x).sample)  # type: ignore[operator]
        self._done()
        return pixels.clamp(-1, 1)


def flow_vae(model: nn.Module) -> FlowVAE | None:
    """The VAE of a latent-space flow model; None for a pixel-space one."""
    vae = getattr(model, "vae", None)
    return vae if isinstance(vae, FlowVAE) else None


def sample_shape(model: nn.Module, shape: Sequence[int]) -> tuple[int, ...]:
    """The shape [C, T, H, W] `model` samples for clips of pixels `shape` [3, T, H, W]."""
    vae = flow_vae(model)
    return tuple(shape) if vae is None else vae.latent_shape(shape)


def pixels_to_samples(model: nn.Module, pixels: Tensor) -> Tensor:
    """Clips' pixels [B, 3, T, H, W] in [-1, 1] as `model`'s samples (its VAE's latents)."""
    vae = flow_vae(model)
    return pixels if vae is None else vae.encode(pixels)


def samples_to_pixels(model: nn.Module, samples: Tensor) -> Tensor:
    """`model`'s samples as pixels [B, 3, T, H, W] in [-1, 1] (its VAE decodes latents)."""
    vae = flow_vae(model)
    return samples if vae is None else vae.decode(samples)
