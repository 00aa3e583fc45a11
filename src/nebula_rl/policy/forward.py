"""How a batch goes through a model for a loss: the labels that travel with the tokens (their
channels), the loss that carries back what it computed, and `_Forward`, one model's way of
running them (split by a ParallelModel, or whole in this process)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nebula_rl.data.packing import packed_attention_mask, segment_positions
from nebula_rl.data.vision import media_kwargs
from nebula_rl.policy.batching import TokenBatch
from nebula_rl.policy.parallelize import LossFn as ParallelLossFn
from nebula_rl.policy.parallelize import ParallelModel, whole_model_loss

# Per-token labels: `labels[..., c]` at input position t describes the prediction of token t + 1
# (the last position predicts nothing: its mask is 0). Token ids travel as float32, exact below
# 2**24, far above any vocabulary.
TARGET, MASK = 0, 1
"""Channels of every batch's labels: the next token id and the trained-token mask."""
OLD, ADVANTAGE, BEHAVIOUR, REF, POSITIVE, SHAPING, DIVERGENCE = 2, 3, 4, 5, 6, 7, 8
"""Channels of an RL batch's labels: proximal, rollout and reference log-probs, the sequence's
advantage, whether its reward is > 0, and on-policy distillation's per-token advantage term and
student-teacher divergence (0 without)."""
ROW, POSITION, TOP_K_IDS = 2, 3, 4
"""Channels of a log-prob recomputation's labels: where each token's log-prob goes, and (from
TOP_K_IDS on) the token ids whose log-probs are wanted when not the target's."""


def _labels(mb: TokenBatch, extra: Sequence[Tensor] = ()) -> Tensor:
    """[b, L, 2 + len(extra)] labels of `mb`: next-token ids, target mask, then `extra`, each
    [b, L-1] in target space or [b] per sequence."""
    b, length = mb.input_ids.shape
    columns = [F.pad(mb.input_ids[:, 1:].float(), (0, 1)), F.pad(mb.target_mask.float(), (0, 1))]
    for values in extra:
        if values.dim() == 1:
            columns.append(values.float()[:, None].expand(b, length))
        else:
            columns.append(F.pad(values.float(), (0, 1)))
    return torch.stack(columns, dim=-1)


def _attach(loss: Tensor, payload: Any) -> Tensor:
    """`loss` carrying `payload` (metrics, log-probs): a pipeline schedule hands back the loss
    objects `loss_fn` returned, and its metadata inference calls `loss_fn` once more, so a
    `loss_fn` passes what it computed along with the loss rather than by a side effect."""
    loss.payload = payload  # type: ignore[attr-defined]
    return loss


def _payload(loss: Tensor) -> Any:
    return loss.payload  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class _Forward:
    """How batches go through one model (the policy, or the reference): split by a
    ParallelModel, or whole in this process."""

    module: nn.Module
    parallel: ParallelModel | None
    compute_dtype: torch.dtype | None

    def run(
        self,
        mb: TokenBatch,
        labels: Tensor,
        loss_fn: ParallelLossFn,
        *,
        backward: bool,
        device: torch.device,
    ) -> list[Tensor]:
        """The losses `loss_fn(logits, labels)` of `mb` on this rank (see `ParallelModel.run`),
        backpropagated with `backward`, else computed under no_grad."""
        attention_mask, position_ids = None, None
        if mb.segment_ids is not None:  # packed rows: a block-diagonal mask
            segment_ids = mb.segment_ids.to(device)
            attention_mask = packed_attention_mask(segment_ids, self.module.config)
            position_ids = segment_positions(segment_ids)
        # Right-padded rows need no attention mask: the causal mask alone is exact for the
        # real tokens (and PP and CP take none).
        inputs = None
        if mb.media is not None:  # a vision-language model's pixels, grids and token types
            config: Any = self.module.config
            media = media_kwargs(
                mb.media,
                mb.input_ids,
                image_token_id=int(config.image_token_id),
                video_token_id=int(config.video_token_id),
                attention_mask=mb.attention_mask,
            )
            inputs = {k: v.to(device) for k, v in media.items()}
        input_ids, labels = mb.input_ids.to(device), labels.to(device)
        if self.parallel is not None:
            return self.parallel.run(
                input_ids,
                labels,
                loss_fn,
                backward=backward,
                attention_mask=attention_mask,
                position_ids=position_ids,
                inputs=inputs,
            )
        with torch.enable_grad() if backward else torch.no_grad():
            loss = whole_model_loss(
                self.module,
                input_ids,
                labels,
                loss_fn,
                backward=backward,
                compute_dtype=self.compute_dtype,
                attention_mask=attention_mask,
                position_ids=position_ids,
                inputs=inputs,
            )
        return [loss]
