"""The policy's training step: token log-probs, batch assembly, the RL and SFT updates.

One `PolicyTrainer` owns a model, its optimiser and LR schedule (`policy/optim.py`). `grpo_step` takes scored
rollout groups and performs `mu_iterations` optimiser steps over them; `sft_step` takes tokenised
conversations and performs one. Both accumulate gradients over micro-batches of `mini_batch`
sequences with the step's global token and sequence counts as loss denominators (STYLE rule 3),
so the result does not depend on how the batch is split. With a :class:`ReplicaGroup` the step
spans several policy replicas: counts and gradients are summed over them before the update, and
the returned metrics describe the union of their batches. With `train.sequence_packing`,
`sft_step` packs its conversations into rows of up to `policy.model_max_length` tokens with a
block-diagonal causal mask (:mod:`nebula_rl.data.packing`); a micro-batch is then `mini_batch`
packed rows, and the loss is the same as unpacked.

The PPO ratio is taken against the proximal ("old") policy. When the step needs one
(`mu_iterations > 1`, decoupled PPO, AIPO) its log-probs are recomputed here at the start of the
step, and the rollout engine's log-probs enter as behaviour-policy weights; otherwise the ratio
is taken against the rollout's own log-probs: 1 for on-policy samples, a clipped correction for
stale ones.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from nebula_rl.algorithms import ALGORITHMS, LossSettings, PolicyBatch, sft_loss_from_logprobs
from nebula_rl.config import Config, GrpoConfig
from nebula_rl.data.packing import first_fit, packed_attention_mask, segment_positions
from nebula_rl.policy.optim import build_optimizer, lr_lambda
from nebula_rl.policy.replicas import DataParallelSums, ReplicaGroup
from nebula_rl.protocol import RolloutGroup

__all__ = [
    "PolicyTrainer",
    "TokenBatch",
    "collate_groups",
    "loss_settings",
    "lr_lambda",
    "pack_examples",
    "token_logprobs",
]


def token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    position_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of each next token, [B, L-1], and optionally the per-position entropy [B, L-1].

    Position t holds log p(input_ids[:, t + 1] | input_ids[:, :t + 1]) at `temperature`. Logits are
    upcast to float32 before the softmax. `attention_mask` is [B, L] (1 on real tokens) or, for
    packed rows, a prepared [B, 1, L, L] mask that comes with their `position_ids` [B, L].
    """
    logits = (
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        .logits[:, :-1]
        .float()
    )
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = F.log_softmax(logits, dim=-1)
    logprobs = logp_all.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    return logprobs, entropy


@dataclass(frozen=True, slots=True)
class TokenBatch:
    """Right-padded sequences with per-target-position tensors (position t predicts t + 1)."""

    input_ids: Tensor
    """[N, L] prompt + response tokens."""
    attention_mask: Tensor
    """[N, L] 1 on real tokens."""
    target_mask: Tensor
    """[N, L-1] float, 1 where the target token is a trained token (response / assistant)."""
    behaviour_logprobs: Tensor
    """[N, L-1] rollout log-probs aligned with `target_mask` (0 elsewhere)."""
    advantages: Tensor
    """[N] per-sequence advantage (0 for SFT)."""
    segment_ids: Tensor | None = None
    """[N, L] packed rows only: 1, 2, ... for the examples of a row, 0 on padding."""

    def rows(self, start: int, stop: int) -> TokenBatch:
        """Rows [start, stop), trimmed of columns that are padding in all of them."""
        length = int(self.attention_mask[start:stop].sum(1).max())
        return TokenBatch(
            input_ids=self.input_ids[start:stop, :length],
            attention_mask=self.attention_mask[start:stop, :length],
            target_mask=self.target_mask[start:stop, : length - 1],
            behaviour_logprobs=self.behaviour_logprobs[start:stop, : length - 1],
            advantages=self.advantages[start:stop],
            segment_ids=(
                None if self.segment_ids is None else self.segment_ids[start:stop, :length]
            ),
        )


def _pad_batch(
    sequences: Sequence[tuple[list[int], list[int], list[float]]], advantages: Tensor, pad_id: int
) -> TokenBatch:
    """(token ids, trained-token mask, behaviour logprobs per token) -> right-padded TokenBatch."""
    n, length = len(sequences), max(len(ids) for ids, _, _ in sequences)
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention = torch.zeros((n, length), dtype=torch.long)
    mask = torch.zeros((n, length), dtype=torch.float32)
    behaviour = torch.zeros((n, length), dtype=torch.float32)
    for i, (ids, m, lp) in enumerate(sequences):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
        behaviour[i, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
    # Shift to target space: entry t describes input_ids[:, t + 1].
    return TokenBatch(input_ids, attention, mask[:, 1:], behaviour[:, 1:], advantages)


def pack_examples(
    examples: Sequence[tuple[list[int], list[int]]], *, max_length: int, pad_id: int
) -> TokenBatch:
    """(token ids, assistant mask) conversations packed first-fit into rows of at most
    `max_length` tokens, with their segment ids.

    An example's first token is no target: in its own row nothing before it would predict it, and
    in a packed row it would be predicted from the previous example.
    """
    rows = first_fit([len(ids) for ids, _ in examples], max_length=max_length)
    sequences, segments = [], []
    for row in rows:
        ids: list[int] = []
        mask: list[int] = []
        segment: list[int] = []
        for number, i in enumerate(row, start=1):
            example_ids, example_mask = examples[i]
            ids += example_ids
            mask += [0, *example_mask[1:]]
            segment += [number] * len(example_ids)
        sequences.append((ids, mask, [0.0] * len(ids)))
        segments.append(segment)
    batch = _pad_batch(sequences, torch.zeros(len(rows)), pad_id)
    segment_ids = torch.zeros_like(batch.input_ids)
    for r, segment in enumerate(segments):
        segment_ids[r, : len(segment)] = torch.tensor(segment)
    return TokenBatch(
        batch.input_ids,
        batch.attention_mask,
        batch.target_mask,
        batch.behaviour_logprobs,
        batch.advantages,
        segment_ids,
    )


def collate_groups(
    groups: Sequence[RolloutGroup], advantages: Tensor, *, pad_id: int
) -> TokenBatch:
    """Flatten groups to one row per completion: prompt + response, response tokens trained."""
    sequences = []
    for group in groups:
        p = group.prompt_token_ids
        for c in group.completions:
            sequences.append(
                (
                    p + c.token_ids,
                    [0] * len(p) + [1] * len(c.token_ids),
                    [0.0] * len(p) + c.logprobs,
                )
            )
    return _pad_batch(sequences, advantages.flatten().float(), pad_id)


def loss_settings(cfg: Config) -> LossSettings:
    """The algorithm knobs from `[train.train_policy]` (the config is authoritative)."""
    p = cfg.grpo
    max_tokens = p.unbiased_loss_max_tokens
    if max_tokens is None and p.loss_type == "seq-mean-token-sum-norm":
        max_tokens = cfg.rollout.max_response_length
    return LossSettings(
        epsilon_low=p.epsilon_low,
        epsilon_high=p.epsilon_high,
        lower_bound_ratio=p.lower_bound_ratio,
        loss_type=p.loss_type,
        kl_beta=p.kl_beta,
        unbiased_kl_estimate=p.unbiased_kl_estimate,
        entropy_coef=p.entropy_coeff,
        aipo_rho=p.aipo_rho,
        behaviour_weight_cap=p.behav_imp_weight_cap,
        max_tokens=max_tokens,
        normalize_std=not p.unbiased_advantage,
        advantage_low=p.advantage_low,
        advantage_high=p.advantage_high,
        off_policy_masking_delta=p.off_policy_masking_delta,
    )


def _chunks(n: int, size: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n, size):
        yield start, min(n, start + size)


class PolicyTrainer:
    """Model + optimiser + schedule, and the two kinds of update."""

    def __init__(
        self,
        model: nn.Module,
        cfg: Config,
        *,
        total_steps: int,
        pad_id: int,
        ref_model: nn.Module | None = None,
        replicas: ReplicaGroup | None = None,
        data_parallel: DataParallelSums | None = None,
    ) -> None:
        self.model, self.cfg, self.pad_id, self.ref_model = model, cfg, pad_id, ref_model
        self.replicas, self.data_parallel = replicas, data_parallel
        t = cfg.train
        self.optimizer = build_optimizer(model, t)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(t, total_steps)
        )
        self.device = next(model.parameters()).device

    def _global_sums(self, *values: float) -> list[float]:
        """`values` summed over the data-parallel ranks of this replica and over the replicas."""
        totals = torch.tensor(values, dtype=torch.float64)
        if self.data_parallel is not None:
            self.data_parallel.sum_(totals)
        if self.replicas is not None:
            self.replicas.sum_(totals)
        return totals.tolist()

    def _optimizer_step(self) -> float:
        if self.replicas is not None:
            self.replicas.all_reduce_grads(self.model.parameters())
        clip = self.cfg.train.optm_grad_norm_clip
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        if isinstance(norm, DTensor):  # sharded gradients (FSDP2): the norm over all shards
            norm = norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    @torch.no_grad()
    def _logprobs_no_grad(self, model: nn.Module, batch: TokenBatch, temperature: float) -> Tensor:
        out = torch.zeros_like(batch.target_mask)
        for start, stop in _chunks(
            batch.input_ids.shape[0], self.cfg.train.train_policy.mini_batch
        ):
            mb = batch.rows(start, stop)
            lp, _ = token_logprobs(
                model,
                mb.input_ids.to(self.device),
                mb.attention_mask.to(self.device),
                temperature=temperature,
            )
            out[start:stop, : lp.shape[1]] = lp.cpu()
        return out

    def grpo_step(self, groups: Sequence[RolloutGroup]) -> dict[str, float]:
        """One training step of the configured RL variant over scored groups."""
        p: GrpoConfig = self.cfg.grpo
        algorithm, settings = ALGORITHMS[p.variant], loss_settings(self.cfg)
        rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
        advantages = algorithm.advantages(rewards, settings)
        batch = collate_groups(groups, advantages, pad_id=self.pad_id)
        num_tokens, num_sequences = self._global_sums(
            float(batch.target_mask.sum()), float(batch.input_ids.shape[0])
        )
        use_behaviour = p.use_decoupled_loss or p.variant == "aipo"
        needs_old = p.mu_iterations > 1 or use_behaviour
        old = self._logprobs_no_grad(self.model, batch, p.temperature) if needs_old else None
        ref = None
        if p.kl_beta > 0:
            if self.ref_model is None:
                raise ValueError("train.train_policy.kl_beta > 0 needs a reference model")
            ref = self._logprobs_no_grad(self.ref_model, batch, p.temperature)

        self.model.train()
        sums: dict[str, float] = {}
        grad_norm = 0.0
        for iteration in range(p.mu_iterations):
            for start, stop in _chunks(batch.input_ids.shape[0], p.mini_batch):
                mb = batch.rows(start, stop)
                width = mb.target_mask.shape[1]
                logprobs, entropy = token_logprobs(
                    self.model,
                    mb.input_ids.to(self.device),
                    mb.attention_mask.to(self.device),
                    temperature=p.temperature,
                    with_entropy=True,
                )
                assert entropy is not None
                if settings.entropy_coef == 0:
                    entropy = entropy.detach()
                dev = self.device
                policy_batch = PolicyBatch(
                    logprobs=logprobs,
                    # Without a recomputed proximal policy, the ratio is taken against the
                    # policy that sampled the tokens: 1 on-policy, a correction when stale.
                    old_logprobs=(
                        old[start:stop, :width].to(dev)
                        if old is not None
                        else mb.behaviour_logprobs.to(dev)
                    ),
                    advantages=mb.advantages.to(dev),
                    mask=mb.target_mask.to(dev),
                    behaviour_logprobs=mb.behaviour_logprobs.to(dev) if use_behaviour else None,
                    ref_logprobs=ref[start:stop, :width].to(dev) if ref is not None else None,
                    entropy=entropy,
                )
                loss, metrics = algorithm.loss(
                    policy_batch, settings, num_tokens=num_tokens, num_sequences=num_sequences
                )
                loss.backward()
                if iteration == 0:
                    sums["loss"] = sums.get("loss", 0.0) + loss.item()
                    for key, value in metrics.items():
                        sums[key] = sums.get(key, 0.0) + float(value)
            grad_norm = self._optimizer_step()
        self.scheduler.step()
        lengths = [len(c.token_ids) for g in groups for c in g.completions]
        # Token-normalised metrics are already this replica's share of the global mean.
        keys = sorted(sums)
        totals = self._global_sums(
            *(sums[k] for k in keys),
            float(rewards.sum()),
            float((rewards**2).sum()),
            float(rewards.numel()),
            float(sum(lengths)),
        )
        reward_sum, reward_sq, count, length_sum = totals[len(keys) :]
        variance = (reward_sq - reward_sum**2 / count) / (count - 1) if count > 1 else 0.0
        return {
            **dict(zip(keys, totals[: len(keys)], strict=True)),
            "grad_norm": grad_norm,
            "lr": float(self.scheduler.get_last_lr()[0]),
            "reward_mean": reward_sum / count,
            "reward_std": math.sqrt(max(variance, 0.0)),
            "response_length_mean": length_sum / num_sequences,
            "num_tokens": num_tokens,
            "num_sequences": num_sequences,
        }

    def _sft_batch(self, examples: Sequence[tuple[list[int], list[int]]]) -> TokenBatch:
        """Right-padded rows, or packed ones with `train.sequence_packing`."""
        if self.cfg.train.sequence_packing:
            return pack_examples(
                examples, max_length=self.cfg.policy.model_max_length, pad_id=self.pad_id
            )
        return _pad_batch(
            [(ids, mask, [0.0] * len(ids)) for ids, mask in examples],
            torch.zeros(len(examples)),
            self.pad_id,
        )

    def _sft_loss_sum(
        self, batch: TokenBatch, *, num_tokens: float, rows_per_forward: int, backward: bool
    ) -> float:
        """Sum over micro-batches of the SFT loss (normalised by `num_tokens`), backpropagated
        micro-batch by micro-batch when `backward`."""
        total = 0.0
        for start, stop in _chunks(batch.input_ids.shape[0], rows_per_forward):
            mb = batch.rows(start, stop)
            attention_mask, position_ids = mb.attention_mask.to(self.device), None
            if mb.segment_ids is not None:
                segment_ids = mb.segment_ids.to(self.device)
                attention_mask = packed_attention_mask(segment_ids, self.model.config)
                position_ids = segment_positions(segment_ids)
            logprobs, _ = token_logprobs(
                self.model, mb.input_ids.to(self.device), attention_mask, position_ids=position_ids
            )
            loss = sft_loss_from_logprobs(
                logprobs, mb.target_mask.to(self.device), num_tokens=num_tokens
            )
            if backward:
                loss.backward()
            total += loss.item()
        return total

    def sft_step(self, examples: Sequence[tuple[list[int], list[int]]]) -> dict[str, float]:
        """One optimiser step of next-token cross-entropy on the masked (assistant) tokens.

        Metrics: `loss`, `grad_norm`, `lr`, `num_tokens` (assistant target tokens, the loss
        denominator) and `num_rows` (rows forwarded: fewer than the examples when packed)."""
        batch = self._sft_batch(examples)
        num_tokens, num_rows = self._global_sums(
            float(batch.target_mask.sum()), float(batch.input_ids.shape[0])
        )
        self.model.train()
        total = self._sft_loss_sum(
            batch,
            num_tokens=num_tokens,
            rows_per_forward=self.cfg.train.train_policy.mini_batch,
            backward=True,
        )
        grad_norm = self._optimizer_step()
        self.scheduler.step()
        (total,) = self._global_sums(total)
        return {
            "loss": total,
            "grad_norm": grad_norm,
            "lr": float(self.scheduler.get_last_lr()[0]),
            "num_tokens": num_tokens,
            "num_rows": num_rows,
        }

    @torch.no_grad()
    def sft_eval(
        self, examples: Sequence[tuple[list[int], list[int]]], *, rows_per_forward: int
    ) -> float:
        """Mean next-token cross-entropy over the assistant tokens of `examples`, in eval mode and
        without gradients. With a :class:`ReplicaGroup` every replica passes its share and all
        get the mean over the union."""
        batch = self._sft_batch(examples)
        (num_tokens,) = self._global_sums(float(batch.target_mask.sum()))
        self.model.eval()
        total = self._sft_loss_sum(
            batch, num_tokens=num_tokens, rows_per_forward=rows_per_forward, backward=False
        )
        (total,) = self._global_sums(total)
        return total
