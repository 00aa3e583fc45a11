"""Cosmos 3's generator (diffusers' `Cosmos3OmniTransformer`, in the latent space of its
pipeline's Wan 2.2 VAE) behind the call every flow model of nebula-rl answers.

The transformer is a mixture of transformers over one packed sequence per sample: the prompt's
token ids (the understanding pathway, causal) then the patchified latents of the clip (the
generation pathway, which attends to both), with 3-D M-RoPE positions and the noise level added
to the noisy frames' tokens. It reads token ids, not text embeddings, and its pipeline
(`Cosmos3OmniPipeline`) tokenizes a caption with its chat template, system prompt and metadata
templates (duration and frame rate, resolution) before appending `<|im_end|>` and
`<|vision_start|>`.

So here:

- :class:`Cosmos3Prompts` is the model's "text encoder": it tokenizes captions with the
  pipeline's own `tokenize_prompt` (at the run's frame count and size, 24 frames per second: the
  pipeline's default) and gives the ids as rows of a float32 tensor [B, L, 1] holding `id + 1`
  (0 pads, so the usual text mask marks the tokens; float32 holds ids below 2^24 exactly). The
  empty caption stands for guidance's unconditional branch: the pipeline's negative prompt (empty,
  with its inverse templates). Stored text embeddings of a dataset are not used: the captions are.
- :func:`cosmos3_velocity` builds each sample's packed sequence with the pipeline's own
  `_prepare_text_segment` / `_prepare_vision_segment` and calls the transformer once per
  sample (its packed attention has no batch), with the
  pipeline's timestep `1000 sigma`; the velocity is the rectified flow's `noise - x0`, as the
  pipeline's flow-prediction scheduler reads it. Conditioning frames (the pipeline's image- and
  video-to-world modes) are latent frames left clean and out of the noisy tokens.

Sound and action generation are not built for it (no key asks for them); context parallelism
splits its latent patches through the transformer's own seams (`flow.context_parallel`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

__all__ = [
    "COSMOS3_CLASS",
    "COSMOS3_FPS",
    "COSMOS3_PIPELINE",
    "TINY_LATENT_PATCH",
    "Cosmos3Prompts",
    "cosmos3_velocity",
    "tiny_cosmos3_transformer",
]

COSMOS3_CLASS = "Cosmos3OmniTransformer"
COSMOS3_PIPELINE = "Cosmos3OmniPipeline"
COSMOS3_FPS = 24.0
"""The frame rate the prompt templates and M-RoPE positions use (the pipeline's default)."""

KEY = "policy.model_name_or_path"
TINY_LATENT_PATCH = 2
"""The latent patch (2 x 2 latent pixels) of :func:`tiny_cosmos3_transformer`."""

_SETTINGS = ("default_use_system_prompt", "use_native_flow_schedule")
"""The pipeline's own settings the prompts' pipeline takes from its source folder, and an export
keeps (with its `enable_safety_checker`)."""


def _pipeline_class() -> Any:
    try:
        from diffusers import Cosmos3OmniPipeline
    except ImportError as err:
        raise ValueError(
            f"{KEY}: Cosmos 3's generator needs diffusers >= 0.42.1 (Cosmos3OmniPipeline): "
            "pip install 'nebula-rl[wfm]'"
        ) from err
    return Cosmos3OmniPipeline


def _scheduler(folder: Path | None) -> Any:
    """The pipeline's scheduler: the folder's `scheduler/`, else a flow-matching UniPC one
    (sampling in nebula-rl does not use it; an export's pipeline does)."""
    from diffusers import UniPCMultistepScheduler

    if folder is not None and (folder / "scheduler").is_dir():
        return UniPCMultistepScheduler.from_pretrained(str(folder / "scheduler"))
    return UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=1.0
    )


class Cosmos3Prompts:
    """Captions -> Cosmos 3 prompt token ids as float32 rows [B, L, 1] of `id + 1` (module
    docstring), by the pipeline's `tokenize_prompt` for clips of `frames` frames of
    `height` x `width` pixels; also the pipeline object that packs each sample's sequence."""

    replaces_embeddings = True
    """A dataset's stored text embeddings are not used: the model reads its captions' tokens."""

    negative_prompt = ""
    """The caption of guidance's unconditional branch (the pipeline's negative prompt)."""

    def __init__(
        self,
        transformer: nn.Module,
        tokenizer: Any,
        vae: nn.Module,
        *,
        frames: int,
        height: int,
        width: int,
        folder: Path | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.folder = folder
        """The pipeline folder the tokenizer and scheduler came from (None: a preset)."""
        self.frames, self.height, self.width = frames, height, width
        settings = {k: v for k, v in self.source_index().items() if k in _SETTINGS}
        self.pipeline = _pipeline_class()(
            transformer=transformer, text_tokenizer=tokenizer, vae=vae,
            scheduler=_scheduler(folder), enable_safety_checker=False, **settings,
        )  # fmt: skip
        self._ids: dict[str, list[int]] = {}
        self._segments: dict[tuple[Any, ...], dict[str, Any]] = {}

    @classmethod
    def from_folder(
        cls, name: str, folder: Path, transformer: nn.Module, vae: nn.Module, **shape: int
    ) -> Cosmos3Prompts:
        """The prompts of the Cosmos 3 pipeline folder `folder` (`name`, as the user wrote it):
        its `text_tokenizer/` and `scheduler/`."""
        from transformers import AutoTokenizer

        if not (folder / "text_tokenizer").is_dir():
            raise ValueError(
                f"{KEY}: {name}: a Cosmos3OmniTransformer reads prompt tokens: name its pipeline "
                "folder, whose text_tokenizer/ tokenizes the captions"
            )
        tokenizer = AutoTokenizer.from_pretrained(str(folder / "text_tokenizer"))
        return cls(transformer, tokenizer, vae, folder=folder, **shape)

    def source_index(self) -> dict[str, Any]:
        """The source pipeline folder's `model_index.json` (empty for a preset)."""
        if self.folder is None or not (self.folder / "model_index.json").is_file():
            return {}
        return json.loads((self.folder / "model_index.json").read_text())  # type: ignore[no-any-return]

    def __deepcopy__(self, memo: dict[int, Any]) -> Cosmos3Prompts:
        return self  # (frozen: a copy of the model, e.g. the KL reference, shares it)

    def ids(self, caption: str) -> list[int]:
        """The prompt token ids of `caption` (the empty caption: the unconditional prompt's)."""
        if caption not in self._ids:
            cond, uncond = self.pipeline.tokenize_prompt(
                caption or "(none)", None, num_frames=self.frames, height=self.height,
                width=self.width, fps=COSMOS3_FPS,
            )  # fmt: skip
            self._ids[caption] = list(uncond if not caption else cond)
        return self._ids[caption]

    def __call__(self, captions: Sequence[str]) -> Tensor:
        rows = [self.ids(c) for c in captions]
        out = torch.zeros(len(rows), max(len(r) for r in rows), 1)
        for i, row in enumerate(rows):
            out[i, : len(row), 0] = torch.tensor(row, dtype=torch.float32) + 1
        return out

    def segments(
        self,
        ids: list[int],
        shape: tuple[int, ...],
        device: torch.device,
        given: tuple[int, ...] = (),
    ) -> dict[str, Any]:
        """The transformer's arguments but the step's latents and timesteps for a sample of
        prompt `ids`, latents of `shape` [1, C, T, H, W] and the `given` (clean) latent frames,
        from the pipeline's own packing."""
        key = (tuple(ids), shape, str(device), given)
        if key not in self._segments:
            pipe = self.pipeline
            text = pipe._prepare_text_segment(ids, device=device)
            vision = pipe._prepare_vision_segment(
                input_vision_tokens=torch.empty(shape, device="meta"),
                has_image_condition=bool(given), mrope_offset=text["vision_start_temporal_offset"],
                vision_fps=COSMOS3_FPS, curr=text["und_len"], device=device,
                condition_frame_indexes=list(given),
            )  # fmt: skip
            self._segments[key] = {
                "input_ids": text["input_ids"],
                "text_indexes": text["text_indexes"],
                "position_ids": torch.cat([text["text_mrope_ids"], vision["vision_mrope_ids"]], 1),
                "und_len": text["und_len"],
                "sequence_length": text["und_len"] + vision["num_vision_tokens"],
                "vision_token_shapes": vision["vision_token_shapes"],
                "vision_sequence_indexes": vision["vision_sequence_indexes"],
                "vision_mse_loss_indexes": vision["vision_mse_loss_indexes"],
                "vision_noisy_frame_indexes": vision["vision_noisy_frame_indexes"],
                "noisy_tokens": vision["num_noisy_vision_tokens"],
            }
            while len(self._segments) > 1024:  # (captions x shapes x devices seen lately)
                self._segments.pop(next(iter(self._segments)))
        return self._segments[key]

    def save(self, folder: Path) -> dict[str, Any]:
        """Write the tokenizer and scheduler beside an export (`text_tokenizer/`,
        `scheduler/`); their `model_index.json` entries."""
        self.tokenizer.save_pretrained(str(folder / "text_tokenizer"))
        self.pipeline.scheduler.save_pretrained(str(folder / "scheduler"))
        kept = (*_SETTINGS, "enable_safety_checker")
        source = {k: v for k, v in self.source_index().items() if k in kept}
        return {
            "text_tokenizer": ["transformers", type(self.tokenizer).__name__],
            "scheduler": ["diffusers", type(self.pipeline.scheduler).__name__],
            "sound_tokenizer": [None, None],
            "safety_checker": [None, None],
            "enable_safety_checker": False,
            **source,
        }


def cosmos3_velocity(
    transformer: nn.Module,
    prompts: Cosmos3Prompts,
    x: Tensor,
    sigma: Tensor,
    text: Tensor,
    condition: Tensor | None = None,
) -> Tensor:
    """The velocity [B, C, T, H, W] of latents `x` at noise levels `sigma` [B] for prompt rows
    `text` [B, L, 1] (:class:`Cosmos3Prompts`), one packed sequence per sample; `condition`
    [B, T] (1: a given latent frame) leaves those frames clean and out of the noisy tokens, as
    the pipeline's image- and video-conditioned modes do (their velocity is 0)."""
    dtype = next(transformer.parameters()).dtype
    out = []
    for b in range(x.shape[0]):
        row = text[b, :, 0].float().round().long()
        ids = (row[row > 0] - 1).tolist() or prompts.ids("")  # (no tokens: unconditional)
        sample = x[b : b + 1].to(dtype)
        given = () if condition is None else tuple(condition[b].nonzero().flatten().tolist())
        parts = dict(prompts.segments(ids, tuple(sample.shape), x.device, given))
        noisy = parts.pop("noisy_tokens")
        timesteps = torch.full((noisy,), float(sigma[b]) * 1000, device=x.device)
        velocity = transformer(
            vision_tokens=[sample], vision_timesteps=timesteps, return_dict=False, **parts
        )[0][0]
        out.append(velocity)
    return torch.cat(out)


def tiny_cosmos3_transformer(latent_channels: int, vocab_size: int) -> nn.Module:
    """A two-layer `Cosmos3OmniTransformer` of width 64 (two heads of 32, one key-value head,
    latent patches of 2 x 2) for latents of `latent_channels` and a vocabulary of
    `vocab_size`."""
    import diffusers

    patch = TINY_LATENT_PATCH
    module: Any = diffusers.Cosmos3OmniTransformer(
        head_dim=32, hidden_size=64, intermediate_size=128, num_attention_heads=2,
        num_hidden_layers=2, num_key_value_heads=1, latent_channel=latent_channels,
        latent_patch_size=patch, patch_latent_dim=patch * patch * latent_channels,
        vocab_size=vocab_size, rope_axes_dim=[6, 5, 5], dtype="float32",
    )  # fmt: skip
    return cast(nn.Module, module)
