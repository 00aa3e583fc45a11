"""A vision-language reasoner as the judge of generated images and videos: the reward service's
model-based reward `reasoner_judge` (`[[reward_args]] reward_type = "reasoner_judge"`,
`model_path = ...`), as cosmos-rl's DDRL configs score clips with Cosmos-Reason.

The judge is any vision-language model nebula-rl reads (Qwen2.5-VL, Qwen3-VL, Cosmos-Reason,
Cosmos 3's reasoner), from a folder, the Hub or a preset. For each sample it is shown the frames
(an image, or the clip as a video at `JUDGE_FPS` frames a second) and asked `JUDGE_QUESTION`
(both in `nebula_rl.data.judge`, whose `builtin:brightness_judge` task trains a small judge);
the score is the probability of "yes" against "no" at the answer's first token,
`softmax(logit_yes, logit_no)[0]` in [0, 1]. One forward pass per sample, no sampling, so a
sample's score does not depend on its batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from nebula_rl.data.judge import judge_messages
from nebula_rl.rewards.visual import check_pixels

__all__ = ["MODEL_REWARDS", "ReasonerJudge"]


class ReasonerJudge:
    """`reasoner_judge`: scores uint8 RGB pixels [B, 3, T, H, W] against their prompts with the
    vision-language model `model_path` (loaded once, in `dtype` on `device`)."""

    def __init__(self, model_path: str, *, dtype: str = "", device: str = "") -> None:
        from nebula_rl.data.vision import VisionProcessor
        from nebula_rl.models import load_model, resolve_dtype

        self.device = torch.device(device or "cpu")
        self.model = load_model(
            model_path, dtype=resolve_dtype(dtype or "float32"), device=self.device
        ).eval()
        self.processor = VisionProcessor.from_pretrained(model_path)
        tok = self.processor.tokenizer
        self.yes, self.no = (
            tok.encode(word, add_special_tokens=False)[0] for word in ("yes", "no")
        )
        if self.yes == self.no:
            raise ValueError(f"model_path = {model_path!r}: its tokenizer starts yes and no alike")

    def _inputs(self, sample: Tensor, prompt: str) -> dict[str, Tensor]:
        from PIL import Image

        from nebula_rl.data.vision import collate

        frames = [Image.fromarray(f.permute(1, 2, 0).numpy()) for f in sample.unbind(1)]
        inputs = self.processor(judge_messages(frames, prompt), add_generation_prompt=True)
        layout = self.processor.layout
        batch = collate(
            [inputs],
            pad_token_id=int(self.processor.tokenizer.pad_token_id or 0),
            image_token_id=layout.image_token_id,
            video_token_id=layout.video_token_id,
        )
        if layout.model_type != "qwen2_5_vl":  # (Qwen3-VL: time comes from text timestamps)
            batch.pop("second_per_grid_ts", None)
        return {k: v.to(self.device) for k, v in batch.items()}

    @torch.no_grad()
    def __call__(self, pixels: Tensor, prompts: Sequence[str]) -> list[float]:
        check_pixels(pixels, prompts, who="the reasoner judge and the visual rewards")
        scores = []
        for sample, prompt in zip(pixels, prompts, strict=True):
            logits = self.model(**self._inputs(sample, prompt)).logits[0, -1].float()
            scores.append(float(logits[[self.yes, self.no]].softmax(-1)[0]))
        return scores


MODEL_REWARDS: dict[str, type[ReasonerJudge]] = {"reasoner_judge": ReasonerJudge}
"""Rewards that load a model (`model_path`), by the name a reward-service config gives."""
