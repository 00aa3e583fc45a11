"""The SFT update of a `PolicyTrainer` (`sft_step`, and `sft_eval`): next-token cross-entropy
on the assistant tokens of tokenised conversations, right-padded or packed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from nebula_rl.algorithms import sft_loss_from_logprobs
from nebula_rl.data.vision import VisionInputs
from nebula_rl.policy.batching import TokenBatch, pack_examples, pad_batch
from nebula_rl.policy.forward import MASK, TARGET, _labels
from nebula_rl.policy.logprobs import logits_logprobs
from nebula_rl.policy.trainer_base import _chunks, _TrainerBase

SftExample = tuple[list[int], list[int]] | tuple[list[int], list[int], VisionInputs | None]
"""An SFT conversation: token ids, loss mask, and for a vision-language model its media."""


class _SftStep(_TrainerBase):
    """`sft_step`, `sft_eval` and their pieces."""

    def _sft_batch(self, examples: Sequence[SftExample]) -> TokenBatch:
        """Right-padded rows, or packed ones with `train.sequence_packing`; an example's third
        item, when there is one, holds its images and videos (a vision-language model)."""
        media = tuple(e[2] if len(e) > 2 else None for e in examples)  # type: ignore[misc]
        with_media = any(m is not None for m in media)
        if self.cfg.train.sequence_packing:
            if with_media:
                raise ValueError(
                    "train.sequence_packing is not supported for conversations with images or "
                    "videos yet (their 3-D positions would have to restart per conversation)"
                )
            return pack_examples(
                [(e[0], e[1]) for e in examples],
                max_length=self.cfg.policy.model_max_length,
                pad_id=self.pad_id,
            )
        batch = pad_batch(
            [(e[0], e[1], [0.0] * len(e[0])) for e in examples],
            torch.zeros(len(examples)),
            self.pad_id,
        )
        return replace(batch, media=media) if with_media else batch

    def _sft_loss_sum(
        self, batch: TokenBatch, *, num_tokens: float, rows_per_forward: int, backward: bool
    ) -> float:
        """Sum over micro-batches of the SFT loss (normalised by `num_tokens`) that this rank
        computed, backpropagated micro-batch by micro-batch when `backward`."""

        def compute(logits: Tensor, labels: Tensor) -> Tensor:
            with torch.autocast(logits.device.type, enabled=False):
                mask = labels[..., MASK]
                logprobs, _ = logits_logprobs(
                    logits, labels[..., TARGET].long(), mask > 0, logprob_dtype=self.logprob_dtype
                )
                return sft_loss_from_logprobs(logprobs, mask, num_tokens=num_tokens)

        (passes,) = self._in_step([list(_chunks(batch.input_ids.shape[0], rows_per_forward))])
        total = 0.0
        for rows in passes:
            mb, labels = (
                (batch.select(rows), _labels(batch.select(rows))) if rows else self._dummy(2)
            )
            for loss in self._policy.run(
                mb, labels, compute, backward=backward, device=self.device
            ):
                total += loss.item()
        return total

    def sft_step(self, examples: Sequence[SftExample]) -> dict[str, float]:
        """One optimiser step of next-token cross-entropy on the masked (assistant) tokens.

        `examples` are this rank's share (with a ParallelModel: its data-parallel rank's; TP,
        PP and CP ranks of one data-parallel rank pass the same). The loss is normalised by the
        assistant tokens of the whole step over every data-parallel rank
        (`balance_dp_token`), or by this rank's own, the summed gradients then averaging the
        ranks' means. Metrics: `loss`, `grad_norm`, `lr`, `num_tokens` (assistant target
        tokens of the step) and `num_rows` (rows forwarded: fewer than the examples when
        packed)."""
        batch = self._sft_batch(examples)
        local_tokens = float(batch.target_mask.sum())
        num_tokens, num_rows = self._global_sums(local_tokens, float(batch.input_ids.shape[0]))
        balanced = self.cfg.train.train_policy.balance_dp_token
        self.model.train()
        total = self._sft_loss_sum(
            batch,
            num_tokens=num_tokens if balanced else local_tokens * self._num_ranks(),
            rows_per_forward=self.cfg.train.train_policy.mini_batch,
            backward=True,
        )
        grad_norm = self._optimizer_step()
        self.scheduler.step()
        (total,) = self._global_sums(self._loss_metrics({"loss": total})["loss"])
        return {
            "loss": total,
            "grad_norm": grad_norm,
            "lr": float(self.scheduler.get_last_lr()[0]),
            "num_tokens": num_tokens,
            "num_rows": num_rows,
        }

    @torch.no_grad()
    def sft_eval(self, examples: Sequence[SftExample], *, rows_per_forward: int) -> float:
        """Mean next-token cross-entropy over the assistant tokens of `examples`, in eval mode and
        without gradients. With a :class:`ReplicaGroup` every replica passes its share and all
        get the mean over the union (with a ParallelModel, every data-parallel rank its own)."""
        batch = self._sft_batch(examples)
        (num_tokens,) = self._global_sums(float(batch.target_mask.sum()))
        self.model.eval()
        total = self._sft_loss_sum(
            batch, num_tokens=num_tokens, rows_per_forward=rows_per_forward, backward=False
        )
        (total,) = self._global_sums(self._loss_metrics({"loss": total})["loss"])
        return total
