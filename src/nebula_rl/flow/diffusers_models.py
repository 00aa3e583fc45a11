"""diffusers transformers as flow models: `CosmosTransformer3DModel` (Cosmos-Predict2.5),
`WanTransformer3DModel` (Wan 2.x) and `SD3Transformer2DModel` (Stable Diffusion 3), each behind the
call every flow model of nebula-rl answers, `model(x, sigma, text, text_mask) -> velocity`.

The three predict the rectified-flow velocity `noise - x0`, as the built-in DiT does; they differ
in how they take the noise level and the text:

- Cosmos-Predict2.5 takes sigma itself (in [0, 1]) as its timestep; Wan and SD3 take
  `1000 sigma` (their schedulers' timesteps);
- the text embeddings go in as `encoder_hidden_states`, zeroed past each caption's tokens (the
  pipelines' zero padding; a row without text, guidance's unconditional branch, is all zeros);
- SD3 also takes a pooled text vector: here the mean of the caption's token embeddings (the
  datasets carry no CLIP pooled embedding), and it makes images only (one frame).

The models run in pixel space (`in_channels = 3`): the VAEs that map clips to the latents the
released checkpoints expect are not run yet, so a latent-space checkpoint is refused by name.
diffusers is an optional extra (`pip install nebula-rl[wfm]`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from nebula_rl.flow.dit import autocast

__all__ = [
    "DIFFUSERS_CLASSES",
    "DIFFUSERS_PRESETS",
    "DiffusersFlowModel",
    "check_diffusers_folder",
    "diffusers_class_of",
    "load_diffusers_flow_model",
    "tiny_diffusers_flow_model",
]

DIFFUSERS_CLASSES = ("CosmosTransformer3DModel", "WanTransformer3DModel", "SD3Transformer2DModel")
"""The diffusers transformer classes nebula-rl trains."""

DIFFUSERS_PRESETS = {
    "tiny:cosmos_transformer3d": "CosmosTransformer3DModel",
    "tiny:wan_transformer3d": "WanTransformer3DModel",
    "tiny:sd3_transformer2d": "SD3Transformer2DModel",
}
"""Random-init miniatures of each class (two blocks, width 64) for CPU tests and demos."""

_THOUSAND = {"WanTransformer3DModel", "SD3Transformer2DModel"}
"""Classes whose timestep is 1000 sigma."""

KEY = "policy.model_name_or_path"


def _diffusers() -> Any:
    try:
        import diffusers
    except ImportError as err:
        raise ValueError(
            f"{KEY}: diffusers models need the diffusers package: pip install 'nebula-rl[wfm]'"
        ) from err
    return diffusers


class DiffusersFlowModel(nn.Module):
    """A diffusers transformer behind `forward(x [B, C, T, H, W], sigma [B], text [B, L, D],
    text_mask [B, L]) -> velocity [B, C, T, H, W]`."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.transformer = transformer
        self.kind = type(transformer).__name__
        if self.kind not in DIFFUSERS_CLASSES:
            raise ValueError(f"{KEY}: {self.kind} is not one of {DIFFUSERS_CLASSES}")

    @property
    def config(self) -> Any:
        """The transformer's diffusers config."""
        return self.transformer.config

    compute_dtype: torch.dtype = torch.float32
    """The dtype the forward computes in (`train.param_dtype`; autocast below float32)."""

    def forward(self, x: Tensor, sigma: Tensor, text: Tensor, text_mask: Tensor) -> Tensor:
        with autocast(self.compute_dtype, x):
            return self._velocity(x, sigma, text, text_mask)

    def _velocity(self, x: Tensor, sigma: Tensor, text: Tensor, text_mask: Tensor) -> Tensor:
        dtype = next(self.transformer.parameters()).dtype
        text = (text * text_mask.unsqueeze(-1).to(text.dtype)).to(dtype)
        t = (sigma * 1000 if self.kind in _THOUSAND else sigma).to(dtype)
        hidden = x.to(dtype)
        if self.kind == "SD3Transformer2DModel":
            if x.shape[2] != 1:
                raise ValueError(f"SD3Transformer2DModel makes images: got {x.shape[2]} frames")
            counts = text_mask.sum(dim=1, keepdim=True).clamp(min=1).to(dtype)
            pooled = text.sum(dim=1) / counts
            out = self.transformer(
                hidden[:, :, 0], encoder_hidden_states=text, pooled_projections=pooled,
                timestep=t, return_dict=False,
            )[0].unsqueeze(2)  # fmt: skip
        elif self.kind == "CosmosTransformer3DModel":
            padding = None
            if self.config.concat_padding_mask:  # (no padded pixels)
                padding = x.new_zeros(1, x.shape[-2], x.shape[-1], dtype=dtype)
            out = self.transformer(
                hidden, t, text, padding_mask=padding, return_dict=False
            )[0]  # fmt: skip
        else:
            out = self.transformer(hidden, t, text, return_dict=False)[0]
        return out.to(x.dtype)


def diffusers_class_of(folder: Path) -> tuple[str, Path] | None:
    """(class name, transformer folder) of a diffusers pipeline folder (`model_index.json` and
    `transformer/`) or transformer folder (`config.json` with `_class_name`); None otherwise."""
    index = folder / "model_index.json"
    if index.is_file():
        entry = json.loads(index.read_text()).get("transformer")
        if isinstance(entry, list) and len(entry) == 2:
            return str(entry[1]), folder / "transformer"
    config = folder / "config.json"
    if config.is_file():
        name = json.loads(config.read_text()).get("_class_name")
        if isinstance(name, str) and name.endswith("Model") and "Transformer" in name:
            return name, folder
    return None


def check_diffusers_folder(name: str, folder: Path) -> tuple[str, Path]:
    """(class name, transformer folder) of a diffusers folder nebula-rl can train, read from its
    configs without loading weights; a ValueError naming the key otherwise."""
    found = diffusers_class_of(folder)
    if found is None:
        raise ValueError(f"{KEY}: {name} is not a diffusers pipeline or transformer folder")
    class_name, where = found
    if class_name not in DIFFUSERS_CLASSES:
        raise ValueError(
            f"{KEY}: {name} holds a {class_name}; nebula-rl trains {', '.join(DIFFUSERS_CLASSES)}"
        )
    channels = json.loads((where / "config.json").read_text()).get("in_channels")
    if channels != 3:
        raise ValueError(
            f"{KEY}: {name} is a latent-space {class_name} (in_channels = {channels}); "
            "nebula-rl does not run the VAE its clips need yet, so only pixel-space models "
            "(in_channels = 3) train"
        )
    return class_name, where


def load_diffusers_flow_model(name: str, folder: Path) -> DiffusersFlowModel:
    """The transformer of the diffusers folder `folder` (`name`, as the user wrote it)."""
    class_name, where = check_diffusers_folder(name, folder)
    return DiffusersFlowModel(getattr(_diffusers(), class_name).from_pretrained(str(where)))


def tiny_diffusers_flow_model(
    preset: str, *, frames: int, size: int, text_dim: int, seed: int = 0
) -> DiffusersFlowModel:
    """The random-init miniature `preset` of :data:`DIFFUSERS_PRESETS` for `frames` frames of
    `size` x `size` pixels and text embeddings `text_dim` wide."""
    diffusers = _diffusers()
    class_name = DIFFUSERS_PRESETS[preset]
    torch.manual_seed(seed)
    heads, head_dim = 2, 32
    if class_name == "CosmosTransformer3DModel":
        transformer = diffusers.CosmosTransformer3DModel(
            in_channels=3, out_channels=3, num_attention_heads=heads, attention_head_dim=head_dim,
            num_layers=2, text_embed_dim=text_dim, adaln_lora_dim=16,
            max_size=(max(frames, 2), size, size), patch_size=(1, 2, 2),
            concat_padding_mask=False, encoder_hidden_states_channels=text_dim,
        )  # fmt: skip
    elif class_name == "WanTransformer3DModel":
        transformer = diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim,
            in_channels=3, out_channels=3, text_dim=text_dim, freq_dim=32, ffn_dim=128,
            num_layers=2, rope_max_seq_len=64,
        )  # fmt: skip
    else:
        if frames != 1:
            raise ValueError(
                f"{KEY} = {preset!r} makes images: set policy.diffusers.is_video = false"
            )
        transformer = diffusers.SD3Transformer2DModel(
            sample_size=size, patch_size=2, in_channels=3, out_channels=3, num_layers=2,
            attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=text_dim,
            caption_projection_dim=heads * head_dim, pooled_projection_dim=text_dim,
            pos_embed_max_size=size,
        )  # fmt: skip
    return DiffusersFlowModel(transformer)
