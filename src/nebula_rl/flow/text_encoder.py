"""Text embeddings computed online, by the text encoder of the model's own diffusers pipeline.

A prompt dataset (:mod:`nebula_rl.flow.prompts`) carries captions and no embeddings. The
pipeline folder the transformer comes from also holds the text encoder it was trained with
(`text_encoder/` and `tokenizer/`, named in `model_index.json`); :class:`PipelineTextEncoder`
loads that pipeline with its text parts only and calls its own `encode_prompt`, so a caption is
embedded exactly as the pipeline embeds it at inference:

- Wan's UMT5 states, zero past the caption's tokens;
- Stable Diffusion 3's two CLIP encoders' states, then T5's;
- Sana's and SANA-Video's Gemma 2 states, zeroed past the caption's tokens here (their
  transformers take the pipeline's mask, which the zero rows give back: `flow.data.clip_text`);
- Cosmos-Predict2.5's Qwen2.5-VL states of every layer, each normalised, side by side, at every
  position of the chat-formatted caption.

The T5, Gemma and Qwen parts are padded to `max_length` tokens
(`policy.diffusers.max_prompt_length`), as the pipelines pad.

Cosmos-Predict2.5's pipeline builds its `cosmos_guardrail` safety checker and reads its VAE
config whenever it is constructed, neither of which embedding needs: its text parts are loaded
by transformers and handed to a pipeline object made without that constructor, whose own
`encode_prompt` then runs.

Stable Diffusion 3's transformer also takes the pooled vector of its CLIP encoders. It travels
as the first row of the caption's embeddings (zero-padded to their width, :data:`POOLED_ROW`),
which its flow model splits off (`flow.diffusers_models`); without a text encoder (precomputed
embeddings) that model pools the caption's tokens instead.

Classifier-free guidance's unconditional branch embeds the pipeline's default negative prompt
(:attr:`PipelineTextEncoder.negative_prompt`): empty for Wan, SD3 and Sana, Cosmos-Predict2.5's
description of bad videos for it.

The encoder is frozen, runs without gradients on the process's device in the run's compute
dtype (with `policy.diffusers.offload` it waits on the CPU between calls), and loads on first
use; it keeps the embeddings of the latest captions (a group's samples and a replica's steps
share captions) on the CPU, in that dtype, up to `cache_bytes` (Cosmos-Predict2.5's are about
100 MB a caption in bf16).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from nebula_rl.flow.cosmos3 import Cosmos3Prompts

__all__ = [
    "TEXT_PIPELINES",
    "PipelineTextEncoder",
    "flow_text_encoder",
    "text_encoders",
    "text_pipeline",
]

TEXT_PIPELINES = (
    "WanPipeline",
    "StableDiffusion3Pipeline",
    "SanaPipeline",
    "SanaVideoPipeline",
    "Cosmos2_5_PredictBasePipeline",
)
"""The pipelines whose text encoder nebula-rl runs."""

_MASKED = ("SanaPipeline", "SanaVideoPipeline")
"""Pipelines whose `encode_prompt` also gives the text's attention mask."""

_BARE = ("Cosmos2_5_PredictBasePipeline",)
"""Pipelines made without their constructor (which builds parts embedding does not need)."""

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
    """Captions -> embeddings [B, max_length, D] (on the CPU, in `dtype`) by the `encode_prompt`
    of the diffusers pipeline in `folder`, loaded with its text encoder and tokenizer only."""

    def __init__(
        self,
        folder: Path,
        *,
        max_length: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        cache_bytes: int = 1 << 30,
        offload: bool = False,
    ) -> None:
        name = text_pipeline(folder)
        if name is None:
            raise ValueError(
                f"{KEY}: {folder} names no text_encoder and tokenizer in model_index.json; a "
                "prompt dataset needs the pipeline's text encoder"
            )
        if name not in TEXT_PIPELINES:
            raise ValueError(
                f"{KEY}: {folder}: nebula-rl runs the text encoders of {', '.join(TEXT_PIPELINES)}"
                f", not {name}'s: give the dataset precomputed embeddings (a clip folder's "
                "t5_xxl/)"
            )
        self.folder = folder
        self.pipeline_class = name
        self.pooled_row = name in POOLED_ROW
        """Whether each caption's embeddings lead with its pooled vector (zero-padded)."""
        self.max_length = max_length
        self.dtype = dtype
        self.device = device
        self.cache_bytes = cache_bytes
        self.offload = offload
        """Keep the text encoders on the CPU between calls (`policy.diffusers.offload`)."""
        self._pipeline: Any = None
        self._cache: OrderedDict[str, Tensor] = OrderedDict()

    def __deepcopy__(self, memo: dict[int, Any]) -> PipelineTextEncoder:
        return self  # (frozen: a copy of the model, e.g. the KL reference, shares it)

    @property
    def negative_prompt(self) -> str:
        """The caption of guidance's unconditional branch: the pipeline's default negative
        prompt."""
        if self.pipeline_class == "Cosmos2_5_PredictBasePipeline":
            from diffusers.pipelines.cosmos import pipeline_cosmos2_5_predict

            return pipeline_cosmos2_5_predict.DEFAULT_NEGATIVE_PROMPT
        return ""

    def _load(self) -> Any:
        import diffusers

        cls = getattr(diffusers, self.pipeline_class)
        if self.pipeline_class in _BARE:
            pipeline = self._bare(cls)
        else:
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
        for part in text_encoders(pipeline):
            part.requires_grad_(False).eval()
            part.to("cpu" if self.offload else self.device)
        return pipeline

    def _bare(self, cls: Any) -> Any:
        """A `cls` holding only the folder's text encoder and tokenizer, made without its
        constructor."""
        import diffusers
        import transformers

        index = json.loads((self.folder / "model_index.json").read_text())
        library, encoder_class = index["text_encoder"]
        if library != "transformers":
            raise ValueError(
                f"{KEY}: {self.folder}: text_encoder is a {library} {encoder_class}, not a "
                "transformers model"
            )
        encoder = getattr(transformers, encoder_class).from_pretrained(
            str(self.folder / "text_encoder"), dtype=self.dtype
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(self.folder / "tokenizer"))
        pipeline = cls.__new__(cls)
        diffusers.DiffusionPipeline.__init__(pipeline)
        pipeline.register_modules(text_encoder=encoder, tokenizer=tokenizer)
        return pipeline

    def __call__(self, captions: Sequence[str]) -> Tensor:
        todo = list(dict.fromkeys(c for c in captions if c not in self._cache))
        if todo:
            if self._pipeline is None:
                self._pipeline = self._load()
            parts = text_encoders(self._pipeline) if self.offload else []
            for part in parts:
                part.to(self.device)
            with torch.no_grad():
                others = {"prompt_2": None, "prompt_3": None} if self.pooled_row else {}
                encoded = self._pipeline.encode_prompt(
                    prompt=todo, do_classifier_free_guidance=False,
                    max_sequence_length=self.max_length, device=self.device, **others,
                )  # fmt: skip
            for part in parts:
                part.to("cpu")
            embeds = encoded[0]
            if self.pipeline_class in _MASKED:  # (prompt, mask, negative, its mask)
                embeds = embeds * encoded[1].unsqueeze(-1).to(embeds.dtype)
            if self.pooled_row:  # (Stable Diffusion 3: prompt, negative, pooled, negative)
                pooled = encoded[2]
                if pooled.shape[-1] > embeds.shape[-1]:
                    raise ValueError(
                        f"{KEY}: {self.folder}: a pooled vector of {pooled.shape[-1]} is wider "
                        f"than the token embeddings ({embeds.shape[-1]})"
                    )
                pooled = nn.functional.pad(pooled, (0, embeds.shape[-1] - pooled.shape[-1]))
                embeds = torch.cat([pooled[:, None], embeds], dim=1)
            for caption, row in zip(todo, embeds.cpu(), strict=True):
                self._cache[caption] = row
        out = torch.stack([self._cache[c] for c in captions])
        for caption in captions:
            self._cache.move_to_end(caption)
        row_bytes = out[0].nbytes
        while len(self._cache) > max(self.cache_bytes // row_bytes, len(set(captions))):
            self._cache.popitem(last=False)
        return out


def text_encoders(pipeline: Any) -> list[nn.Module]:
    """The text encoder models a pipeline holds (SD3: `text_encoder`, `_2` and `_3`)."""
    names = [k for k in pipeline.config if k.startswith("text_encoder")]
    return [part for k in names if (part := getattr(pipeline, k, None)) is not None]


def flow_text_encoder(model: Any) -> PipelineTextEncoder | Cosmos3Prompts | None:
    """The text encoder a flow model was given for a prompt dataset, or the prompt tokenizer of
    Cosmos 3's generator (which reads every caption's tokens); None where it has none."""
    encoder = getattr(model, "text_encoder", None)
    return encoder if isinstance(encoder, PipelineTextEncoder | Cosmos3Prompts) else None
