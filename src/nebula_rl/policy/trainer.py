"""The policy's training step: the RL and SFT updates.

One `PolicyTrainer` owns a model, its optimiser and LR schedule (`policy/optim.py`). `grpo_step`
takes scored rollout groups and performs `mu_iterations` passes over them, one optimiser update
per slice of `batch_size_per_optimize` sequences per pass (one slice when unset); `sft_step` takes
tokenised conversations and performs one update. Both accumulate gradients over micro-batches
(`mini_batch` sequences, or `max_token_len_per_mini_batch` tokens) with the global token and
sequence counts of the update as loss denominators (STYLE rule 3), so the result does not depend
on how the batch is split. With a :class:`ReplicaGroup` the step spans several policy replicas:
counts and gradients are summed over them before the update, every replica takes the same number
of updates, and the returned metrics describe the union of their batches. With
`train.sequence_packing`, `sft_step` packs its conversations into rows of up to
`policy.model_max_length` tokens with a block-diagonal causal mask
(:mod:`nebula_rl.data.packing`); the loss is the same as unpacked.

Precision: the model holds `train.master_dtype` weights (its callers load it so, see
`policy/setup.py`); forward and backward run under autocast to `train.param_dtype` unless FSDP2
casts the parameters itself; logits are cast to `train.logprob_dtype` before the log-softmax,
which runs a chunk of target positions at a time (`policy/logprobs.py`).

The PPO ratio is taken against the proximal ("old") policy: the rollout's own log-probs with
`use_rollout_logprobs_for_loss` (1 for on-policy samples, a clipped correction for stale ones),
otherwise log-probs the policy recomputes at the start of the step. Decoupled PPO and AIPO always
recompute them, and weigh tokens by the rollout's (behaviour) log-probs; without
`collect_rollout_logprobs` the rollouts send none and nothing reads them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from nebula_rl.algorithms import (
    ALGORITHMS,
    LossFn,
    LossSettings,
    PolicyBatch,
    policy_loss,
    positive_nll,
    sft_loss_from_logprobs,
)
from nebula_rl.config import Config, GrpoConfig
from nebula_rl.data.packing import packed_attention_mask, segment_positions
from nebula_rl.models import resolve_dtype
from nebula_rl.policy.batching import (
    TokenBatch,
    collate_groups,
    pack_examples,
    pad_batch,
    token_budget_micro_batches,
)
from nebula_rl.policy.logprobs import token_logprobs
from nebula_rl.policy.optim import build_optimizer, lr_lambda
from nebula_rl.policy.replicas import DataParallelSums, ReplicaGroup
from nebula_rl.policy.setup import compute_dtype
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


def _chunks(n: int, size: int) -> Iterator[list[int]]:
    for start in range(0, n, size):
        yield list(range(start, min(n, start + size)))


def _sharded(model: nn.Module) -> bool:
    """Whether FSDP2 (or its replicate) manages `model`'s parameters, and so its precision."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _eos_ids(model: nn.Module) -> tuple[int, ...]:
    eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)


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
        self.compute_dtype = compute_dtype(t, sharded=_sharded(model))
        self.logprob_dtype = resolve_dtype(t.logprob_dtype)
        self.optimizer = build_optimizer(model, t)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(t, total_steps)
        )
        self.device = next(model.parameters()).device
        self.eos_token_ids = _eos_ids(model)
        self.planned_updates: int | None = None
        """Optimiser updates the step in progress (or the last one) takes, once every replica
        agreed on it; None before."""

    # -- collectives over data-parallel ranks and replicas -----------------------------------------

    def _global_sums(self, *values: float) -> list[float]:
        """`values` summed over the data-parallel ranks of this replica and over the replicas."""
        totals = torch.tensor(values, dtype=torch.float64)
        if self.data_parallel is not None:
            self.data_parallel.sum_(totals)
        if self.replicas is not None:
            self.replicas.sum_(totals)
        return totals.tolist()

    def _global_max(self, value: int) -> int:
        """The largest `value` over the data-parallel ranks and replicas."""
        top = torch.tensor([value], dtype=torch.float64)
        if self.data_parallel is not None:
            self.data_parallel.max_(top)
        if self.replicas is not None:
            self.replicas.max_(top)
        return int(top.item())

    def _num_ranks(self) -> int:
        """Ranks whose gradients are summed into one update (data-parallel x replicas)."""
        ranks = 1 if self.data_parallel is None else self.data_parallel.size
        return ranks * (1 if self.replicas is None else self.replicas.size)

    # -- pieces of a step ------------------------------------------------------------------------

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

    def _micro_batches(self, batch: TokenBatch, rows: Sequence[int]) -> list[list[int]]:
        """`rows` of `batch` cut into forward passes: by `max_token_len_per_mini_batch` tokens
        (RL, when set) or by `mini_batch` sequences."""
        p = self.cfg.train.train_policy
        budget = p.max_token_len_per_mini_batch if isinstance(p, GrpoConfig) else None
        if budget is None:
            return [[rows[i] for i in chunk] for chunk in _chunks(len(rows), p.mini_batch)]
        lengths = batch.lengths
        parts = token_budget_micro_batches([lengths[r] for r in rows], max_tokens=budget)
        return [[rows[i] for i in part] for part in parts]

    def target_logprobs(self, batch: TokenBatch) -> tuple[Tensor, Tensor]:
        """Log-probs and entropy [N, L-1] of the policy at `batch`'s target tokens (0 off
        `target_mask`), as the RL loss sees them: at `train_policy.temperature`, computed in the
        compute dtype and cast to the log-prob dtype. The entropy carries gradient only when
        the loss has an entropy bonus (`entropy_coeff` > 0); otherwise it is only logged."""
        p = self.cfg.grpo
        logprobs, entropy = token_logprobs(
            self.model,
            batch.input_ids.to(self.device),
            batch.attention_mask.to(self.device),
            temperature=p.temperature,
            target_mask=batch.target_mask.to(self.device),
            logprob_dtype=self.logprob_dtype,
            compute_dtype=self.compute_dtype,
            with_entropy=True,
            entropy_grad=p.entropy_coeff > 0,
        )
        assert entropy is not None
        return logprobs, entropy

    @torch.no_grad()
    def _logprobs_no_grad(self, model: nn.Module, batch: TokenBatch, temperature: float) -> Tensor:
        """[N, L-1] log-probs of `model` at `batch`'s target tokens, in float32 on the CPU."""
        out = torch.zeros_like(batch.target_mask)
        for rows in self._micro_batches(batch, range(batch.input_ids.shape[0])):
            mb = batch.select(rows)
            lp, _ = token_logprobs(
                model,
                mb.input_ids.to(self.device),
                mb.attention_mask.to(self.device),
                temperature=temperature,
                target_mask=mb.target_mask.to(self.device),
                logprob_dtype=self.logprob_dtype,
                compute_dtype=self.compute_dtype,
            )
            out[torch.tensor(rows), : lp.shape[1]] = lp.float().cpu()
        return out

    def _reset_reference(self) -> None:
        """Every `reference_reset_interval` steps (with a KL penalty) the reference takes the
        current weights; with `reset_optimizer_with_reference` the optimiser's moments are
        cleared too, as a fresh optimiser's would be, while the LR schedule keeps its place."""
        p = self.cfg.grpo
        interval = p.reference_reset_interval
        if not interval or interval < 0 or p.kl_beta == 0 or self.ref_model is None:
            return
        if self.scheduler.last_epoch % interval:
            return
        self.ref_model.load_state_dict(self.model.state_dict())
        if p.reset_optimizer_with_reference:
            self.optimizer.state.clear()

    # -- RL ----------------------------------------------------------------------------------------

    def grpo_step(self, groups: Sequence[RolloutGroup]) -> dict[str, float]:
        """One training step of the configured RL variant over scored groups.

        Metrics are those of the first pass (`mu_iterations`), each slice's a share of that
        slice's mean, averaged over the slices; `positive_nll` (with `positive_nll_coef`) is
        reported apart from `loss`, which does not include it; `planned_updates` holds the
        number of optimiser updates the step takes."""
        p: GrpoConfig = self.cfg.grpo
        settings = loss_settings(self.cfg)
        loss_fn = policy_loss(p.variant, settings)
        use_behaviour = p.use_decoupled_loss or settings.aipo_rho is not None
        if use_behaviour and not p.collect_rollout_logprobs:
            raise ValueError(
                "train.train_policy.aipo_rho (AIPO weighs tokens by the rollout's log-probs) "
                "needs train.train_policy.collect_rollout_logprobs = true"
            )
        rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
        advantages = ALGORITHMS[p.variant].advantages(rewards, settings)
        batch = collate_groups(
            groups,
            advantages,
            pad_id=self.pad_id,
            with_logprobs=p.collect_rollout_logprobs,
            min_filter_prefix_tokens=p.min_filter_prefix_tokens,
            eos_token_ids=self.eos_token_ids,
        )
        positive = rewards.flatten() > 0
        # The proximal policy: the rollout's log-probs, or recomputed now (decoupled PPO and
        # AIPO weigh by pi_prox / pi_behaviour, so they need both).
        recompute = use_behaviour or not p.use_rollout_logprobs_for_loss
        old = (
            self._logprobs_no_grad(self.model, batch, p.temperature)
            if recompute
            else batch.behaviour_logprobs
        )
        ref = None
        if p.kl_beta > 0:
            if self.ref_model is None:
                raise ValueError("train.train_policy.kl_beta > 0 needs a reference model")
            ref = self._logprobs_no_grad(self.ref_model, batch, p.temperature)

        # Slices of `batch_size_per_optimize` sequences, one update each; every rank and replica
        # takes as many updates as the one with the most slices (the others' extra slices are
        # empty: their gradients are summed in as zeros).
        num_rows = batch.input_ids.shape[0]
        slices = list(_chunks(num_rows, p.batch_size_per_optimize or max(num_rows, 1)))
        num_slices = self._global_max(len(slices))
        slices += [[] for _ in range(num_slices - len(slices))]
        self.planned_updates = num_slices * p.mu_iterations
        local = [
            (
                float(batch.target_mask[rows].sum()),
                float(len(rows)),
                float((batch.target_mask[rows] * positive[rows, None]).sum()),
            )
            for rows in slices
        ]
        counts = self._global_sums(*(c for slice_counts in local for c in slice_counts))
        token_mean_local = p.loss_type == "token-mean" and not p.balance_dp_token

        self.model.train()
        sums: dict[str, float] = {}
        grad_norm = 0.0
        for iteration in range(p.mu_iterations):
            for k, rows in enumerate(slices):
                num_tokens, num_sequences, num_positive = counts[3 * k : 3 * k + 3]
                if token_mean_local:  # this rank's own mean; the summed gradients average them
                    num_tokens = local[k][0] * self._num_ranks()
                for mb_rows in self._micro_batches(batch, rows):
                    metrics = self._grpo_micro_batch(
                        batch.select(mb_rows),
                        old[mb_rows],
                        None if ref is None else ref[mb_rows],
                        positive[mb_rows],
                        loss_fn,
                        settings,
                        use_behaviour=use_behaviour,
                        num_tokens=num_tokens,
                        num_sequences=num_sequences,
                        num_positive=num_positive,
                    )
                    if iteration == 0:
                        for key, value in metrics.items():
                            sums[key] = sums.get(key, 0.0) + value / num_slices
                grad_norm = self._optimizer_step()
        self.scheduler.step()
        self._reset_reference()
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
        num_tokens_total, num_sequences_total = sum(counts[0::3]), sum(counts[1::3])
        return {
            **dict(zip(keys, totals[: len(keys)], strict=True)),
            "grad_norm": grad_norm,
            "lr": float(self.scheduler.get_last_lr()[0]),
            "reward_mean": reward_sum / count,
            "reward_std": math.sqrt(max(variance, 0.0)),
            "response_length_mean": length_sum / num_sequences_total,
            "num_tokens": num_tokens_total,
            "num_sequences": num_sequences_total,
        }

    def _grpo_micro_batch(
        self,
        mb: TokenBatch,
        old: Tensor,
        ref: Tensor | None,
        positive: Tensor,
        loss_fn: LossFn,
        settings: LossSettings,
        *,
        use_behaviour: bool,
        num_tokens: float,
        num_sequences: float,
        num_positive: float,
    ) -> dict[str, float]:
        """Forward and backward of one micro-batch; its metrics (shares of the update's)."""
        p = self.cfg.grpo
        dev, width = self.device, mb.target_mask.shape[1]
        logprobs, entropy = self.target_logprobs(mb)
        mask = mb.target_mask.to(dev)
        batch = PolicyBatch(
            logprobs=logprobs,
            old_logprobs=old[:, :width].to(dev),
            advantages=mb.advantages.to(dev),
            mask=mask,
            behaviour_logprobs=mb.behaviour_logprobs.to(dev) if use_behaviour else None,
            ref_logprobs=None if ref is None else ref[:, :width].to(dev),
            entropy=entropy,
        )
        loss, metrics = loss_fn(batch, settings, num_tokens=num_tokens, num_sequences=num_sequences)
        out = {"loss": loss.item(), **{k: float(v) for k, v in metrics.items()}}
        if p.positive_nll_coef is not None:
            nll = positive_nll(logprobs, mask, positive.to(dev), num_tokens=num_positive)
            loss = loss + p.positive_nll_coef * nll
            out["positive_nll"] = nll.item()
        loss.backward()
        return out

    # -- SFT ---------------------------------------------------------------------------------------

    def _sft_batch(self, examples: Sequence[tuple[list[int], list[int]]]) -> TokenBatch:
        """Right-padded rows, or packed ones with `train.sequence_packing`."""
        if self.cfg.train.sequence_packing:
            return pack_examples(
                examples, max_length=self.cfg.policy.model_max_length, pad_id=self.pad_id
            )
        return pad_batch(
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
        for rows in _chunks(batch.input_ids.shape[0], rows_per_forward):
            mb = batch.select(rows)
            attention_mask, position_ids = mb.attention_mask.to(self.device), None
            if mb.segment_ids is not None:
                segment_ids = mb.segment_ids.to(self.device)
                attention_mask = packed_attention_mask(segment_ids, self.model.config)
                position_ids = segment_positions(segment_ids)
            mask = mb.target_mask.to(self.device)
            logprobs, _ = token_logprobs(
                self.model,
                mb.input_ids.to(self.device),
                attention_mask,
                position_ids=position_ids,
                target_mask=mask,
                logprob_dtype=self.logprob_dtype,
                compute_dtype=self.compute_dtype,
            )
            loss = sft_loss_from_logprobs(logprobs, mask, num_tokens=num_tokens)
            if backward:
                loss.backward()
            total += loss.item()
        return total

    def sft_step(self, examples: Sequence[tuple[list[int], list[int]]]) -> dict[str, float]:
        """One optimiser step of next-token cross-entropy on the masked (assistant) tokens.

        The loss is normalised by the assistant tokens of the whole step over every
        data-parallel rank (`balance_dp_token`), or by this rank's own, the summed gradients
        then averaging the ranks' means. Metrics: `loss`, `grad_norm`, `lr`, `num_tokens`
        (assistant target tokens of the step) and `num_rows` (rows forwarded: fewer than the
        examples when packed)."""
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
