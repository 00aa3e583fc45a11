"""Text embeddings computed online, by the text encoder of the model's own diffusers pipeline.

A prompt dataset (:mod:`nebula_rl.flow.prompts`) carries captions and no embeddings. The
pipeline folder the transformer comes from also holds the text encoder it was trained with
(`text_encoder/` and `tokenizer/`, named in `model_index.json`); :class:`PipelineTextEncoder`
loads that pipeline with its text parts only and calls its own `encode_prompt`, so a caption is
embedded exactly as the pipeline embeds it at inference: Wan's UMT5 states, zero past the
caption's tokens; Stable Diffusion 3's two CLIP encoders' states then T5's. The T5 part is
padded to `max_length` tokens (`policy.diffusers.max_prompt_length`), as the pipelines pad.

Cosmos-Predict2.5's pipeline is not among them: diffusers builds its guardrail (the
`cosmos_guardrail` package and its models) and reads its VAE whenever the pipeline is
constructed, so its text encoder cannot be loaded alone; give such a model a clip folder whose
`t5_xxl/` holds precomputed embeddings.

Stable Diffusion 3's transformer also takes the pooled vector of its CLIP encoders. It travels
as the first row of the caption's embeddings (zero-padded to their width, :data:`POOLED_ROW`),
which its flow model splits off (`flow.diffusers_models`); without a text encoder (precomputed
embeddings) that model pools the caption's tokens instead.

The encoder is frozen, runs without gradients on the process's device in the run's compute
dtype, and loads on first use; it keeps the embeddings of the latest captions (a group's
samples and a replica's steps share captions), as float32 on the CPU.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["TEXT_PIPELINES", "PipelineTextEncoder", "flow_text_encoder", "text_pipeline"]

TEXT_PIPELINES = ("WanPipeline", "StableDiffusion3Pipeline")
"""The pipelines whose text encoder nebula-rl runs."""

_NOT_RUN = {
    "Cosmos2_5_PredictBasePipeline": (
        " (diffusers builds its cosmos_guardrail safety checker and reads its VAE whenever the "
        "pipeline is made)"
    ),
}

POOLED_ROW = ("StableDiffusion3Pipeline",)
"""Pipelines whose embeddings lead with the pooled vector's row."""

KEY = "policy.model_name_or_path"


def text_pipeline(folder: Path) -> str | None:
    """The pipeline class of a diffusers folder whose `model_index.json` names a text encoder and
    a tokenizer; None where it names none."""
    index_path = folder / "model_index.json"
    if not index_path.is_file():
        return None
    index = json.loads(index_path.read_text())
    if not isinstance(index.get("text_encoder"), list) or not isinstance(
        index.get("tokenizer"), list
    ):
        return None
    return str(index.get("_class_name"))


class PipelineTextEncoder:
    """Captions -> embeddings [B, max_length, D] (float32, CPU) by the `encode_prompt` of the
    diffusers pipeline in `folder`, loaded with its text encoder and tokenizer only."""

    def __init__(
        self,
        folder: Path,
        *,
        max_length: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        cache_size: int = 64,
    ) -> None:
        name = text_pipeline(folder)
        if name is None:
            raise ValueError(
                f"{KEY}: {folder} names no text_encoder and tokenizer in model_index.json; a "
                "prompt dataset needs the pipeline's text encoder"
            )
        if name not in TEXT_PIPELINES:
            why = _NOT_RUN.get(name, "")
            raise ValueError(
                f"{KEY}: {folder}: nebula-rl runs the text encoders of {', '.join(TEXT_PIPELINES)}"
                f", not {name}'s{why}: give the dataset precomputed embeddings (a clip folder's "
                "t5_xxl/)"
            )
        self.folder = folder
        self.pipeline_class = name
        self.pooled_row = name in POOLED_ROW
        """Whether each caption's embeddings lead with its pooled vector (zero-padded)."""
        self.max_length = max_length
        self.dtype = dtype
        self.device = device
        self.cache_size = cache_size
        self._pipeline: Any = None
        self._cache: OrderedDict[str, Tensor] = OrderedDict()

    def __deepcopy__(self, memo: dict[int, Any]) -> PipelineTextEncoder:
        return self  # (frozen: a copy of the model, e.g. the KL reference, shares it)

    def _load(self) -> Any:
        import diffusers

        cls = getattr(diffusers, self.pipeline_class)
        expected, optional = cls._get_signature_keys(cls)
        others = {
            k: None
            for k in (*expected, *optional)
            if not k.startswith(("text_encoder", "tokenizer"))
        }
        pipeline = cls.from_pretrained(str(self.folder), dtype=self.dtype, **others)
        if self.device is None:
            self.device = (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else torch.device("cpu")
            )
        for name, part in pipeline.components.items():  # (SD3: text_encoder, _2 and _3)
            if name.startswith("text_encoder") and part is not None:
                part.requires_grad_(False).eval().to(self.device)
        return pipeline

    def __call__(self, captions: Sequence[str]) -> Tensor:
        todo = list(dict.fromkeys(c for c in captions if c not in self._cache))
        if todo:
            if self._pipeline is None:
                self._pipeline = self._load()
            with torch.no_grad():
                others = {"prompt_2": None, "prompt_3": None} if self.pooled_row else {}
                encoded = self._pipeline.encode_prompt(
                    prompt=todo, do_classifier_free_guidance=False,
                    max_sequence_length=self.max_length, device=self.device, **others,
                )  # fmt: skip
            embeds = encoded[0]
            if self.pooled_row:  # (Stable Diffusion 3: prompt, negative, pooled, negative)
                pooled = encoded[2]
                if pooled.shape[-1] > embeds.shape[-1]:
                    raise ValueError(
                        f"{KEY}: {self.folder}: a pooled vector of {pooled.shape[-1]} is wider "
                        f"than the token embeddings ({embeds.shape[-1]})"
                    )
                pooled = nn.functional.pad(pooled, (0, embeds.shape[-1] - pooled.shape[-1]))
                embeds = torch.cat([pooled[:, None], embeds], dim=1)
            for caption, row in zip(todo, embeds.float().cpu(), strict=True):
                self._cache[caption] = row
        out = torch.stack([self._cache[c] for c in captions])
        for caption in captions:
            self._cache.move_to_end(caption)
        while len(self._cache) > max(self.cache_size, len(captions)):
            self._cache.popitem(last=False)
        return out


def flow_text_encoder(model: Any) -> PipelineTextEncoder | None:
    """The text encoder a flow model was given for a prompt dataset; None where it has none."""
    encoder = getattr(model, "text_encoder", None)
    return encoder if isinstance(encoder, PipelineTextEncoder) else None
