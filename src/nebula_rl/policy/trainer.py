"""The policy's training step: the RL and SFT updates.

One `PolicyTrainer` owns a model, its optimiser and LR schedule (`policy/optim.py`), and with
`train.ema_enable` the averages of its weights (`policy/ema.py`). `grpo_step`
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
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nebula_rl.algorithms import (
    ALGORITHMS,
    LossFn,
    LossSettings,
    PolicyBatch,
    distillation_advantages,
    policy_loss,
    positive_nll,
    sampled_token_divergence,
    sft_loss_from_logprobs,
    token_mean_metric,
    top_k_divergence,
)
from nebula_rl.config import Config, GrpoConfig
from nebula_rl.data.packing import packed_attention_mask, segment_positions
from nebula_rl.data.vision import VisionInputs, media_kwargs
from nebula_rl.models import resolve_dtype
from nebula_rl.policy.batching import (
    TokenBatch,
    collate_groups,
    pack_examples,
    pad_batch,
    token_budget_micro_batches,
)
from nebula_rl.policy.ema import WeightEMA
from nebula_rl.policy.logprobs import logits_logprobs, token_logprobs
from nebula_rl.policy.optim import build_optimizer, lr_lambda
from nebula_rl.policy.parallelize import LossFn as ParallelLossFn
from nebula_rl.policy.parallelize import ParallelModel, total_grad_norm, whole_model_loss
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

SftExample = tuple[list[int], list[int]] | tuple[list[int], list[int], VisionInputs | None]
"""An SFT conversation: token ids, loss mask, and for a vision-language model its media."""


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


class PolicyTrainer:
    """Model + optimiser + schedule, and the two kinds of update.

    `model` is an HF causal LM trained whole in this process, or a :class:`ParallelModel`
    (`policy/setup.py`'s `parallelize_policy`), split over this process group: then every rank
    calls `grpo_step` with the same groups and `sft_step` with its own data-parallel share, and
    `ref_model` is split the same way (`parallelize_reference`).
    """

    def __init__(
        self,
        model: nn.Module | ParallelModel,
        cfg: Config,
        *,
        total_steps: int,
        pad_id: int,
        ref_model: nn.Module | ParallelModel | None = None,
        replicas: ReplicaGroup | None = None,
        data_parallel: DataParallelSums | None = None,
    ) -> None:
        self.parallel = model if isinstance(model, ParallelModel) else None
        self.model: nn.Module = model.module if isinstance(model, ParallelModel) else model
        """This rank's modules (under PP, its stages' layers; parameters keep their names)."""
        self.cfg, self.pad_id = cfg, pad_id
        self.replicas = replicas
        if data_parallel is None and self.parallel is not None and self.parallel.dp_size > 1:
            data_parallel = DataParallelSums(self.parallel.mesh["dp"].get_group())
        self.data_parallel = data_parallel
        t = cfg.train
        self.compute_dtype = (
            self.parallel.compute_dtype
            if self.parallel is not None
            else compute_dtype(t, sharded=_sharded(self.model))
        )
        self.logprob_dtype = resolve_dtype(t.logprob_dtype)
        self.optimizer = build_optimizer(self.model, t)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(t, total_steps)
        )
        self.ema = (
            WeightEMA(self.model, decay=t.ema_decay, interval=t.ema_update_step_interval)
            if t.ema_enable
            else None
        )
        """`train.ema_enable`: the averages of this rank's share of the weights, moved after
        each optimiser update (`policy/ema.py`)."""
        self.device = next(self.model.parameters()).device
        self.eos_token_ids = _eos_ids(self.model)
        self._policy = _Forward(self.model, self.parallel, self.compute_dtype)
        self._reference: _Forward | None = None
        self.ref_model: nn.Module | None = None
        if isinstance(ref_model, ParallelModel):
            self.ref_model = ref_model.module
            self._reference = _Forward(ref_model.module, ref_model, ref_model.compute_dtype)
        elif ref_model is not None:
            self.ref_model = ref_model
            self._reference = _Forward(ref_model, None, self.compute_dtype)
        self.planned_updates: int | None = None
        """Optimiser updates the step in progress (or the last one) takes, once every replica
        agreed on it; None before."""
        if isinstance(t.train_policy, GrpoConfig) and self.parallel and self.parallel.dims.cp > 1:
            _check_context_parallel_loss(loss_settings(cfg), t.train_policy)

    @property
    def dp_rank(self) -> int:
        """This rank's share of an RL step's sequences (rows dp_rank::dp_size of each slice)."""
        return 0 if self.parallel is None else self.parallel.dp_rank

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks of this replica (1 without a ParallelModel)."""
        return 1 if self.parallel is None else self.parallel.dp_size

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

    def _loss_metrics(self, values: dict[str, float]) -> dict[str, float]:
        """Metrics of the losses this rank computed, made its data-parallel rank's (CP shards
        summed, PP's last stage's on every stage)."""
        return values if self.parallel is None else self.parallel.gather_loss_metrics(values)

    # -- pieces of a step ------------------------------------------------------------------------

    def _optimizer_step(self) -> float:
        if self.parallel is not None:
            self.parallel.reduce_tied_grads()
        if self.replicas is not None:
            self.replicas.all_reduce_grads(self.model.parameters())
        clip = self.cfg.train.optm_grad_norm_clip
        max_norm = clip if clip > 0 else float("inf")
        if self.parallel is not None:
            norm = self.parallel.clip_grad_norm_(max_norm)
        else:
            params = [p for p in self.model.parameters() if p.grad is not None]
            total = total_grad_norm([p.grad for p in params if p.grad is not None])
            if max_norm < float("inf"):
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
            norm = float(total)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.step()
        return norm

    def _micro_batches(self, batch: TokenBatch, rows: Sequence[int]) -> list[list[int]]:
        """`rows` of `batch` cut into forward passes: by `max_token_len_per_mini_batch` tokens
        (RL, when set) or by `mini_batch` sequences of similar lengths (sorted by length, so a
        pass pads little; the loss is normalised over the whole update, so which rows share a
        pass changes nothing but the padding)."""
        p = self.cfg.train.train_policy
        budget = p.max_token_len_per_mini_batch if isinstance(p, GrpoConfig) else None
        if budget is None:
            lengths = batch.lengths
            ordered = sorted(rows, key=lambda r: lengths[r])
            return [[ordered[i] for i in chunk] for chunk in _chunks(len(rows), p.mini_batch)]
        lengths = batch.lengths
        parts = token_budget_micro_batches([lengths[r] for r in rows], max_tokens=budget)
        return [[rows[i] for i in part] for part in parts]

    def _in_step(self, plan: list[list[list[int]]]) -> list[list[list[int]]]:
        """`plan` (forward passes per update) padded with empty passes to the largest count
        over the data-parallel ranks: FSDP and DDP pair their collectives up pass by pass, so
        every rank runs as many (an empty pass runs a dummy row that carries no loss)."""
        if self.data_parallel is None or self.data_parallel.size == 1:
            return plan
        counts = torch.tensor([len(passes) for passes in plan], dtype=torch.float64)
        self.data_parallel.max_(counts)
        return [
            passes + [[] for _ in range(int(n) - len(passes))]
            for passes, n in zip(plan, counts.tolist(), strict=True)
        ]

    def _dummy(self, width: int) -> tuple[TokenBatch, Tensor]:
        """One row of padding without targets and its (zero) labels of `width` channels."""
        mb = pad_batch([([self.pad_id] * 2, [0, 0], [0.0, 0.0])], torch.zeros(1), self.pad_id)
        return mb, torch.zeros((1, 2, width))

    def target_logprobs(self, batch: TokenBatch) -> tuple[Tensor, Tensor]:
        """Log-probs and entropy [N, L-1] of the policy at `batch`'s target tokens (0 off
        `target_mask`), as the RL loss sees them: at `train_policy.temperature`, computed in the
        compute dtype and cast to the log-prob dtype (a model trained whole in this process).
        The entropy carries gradient only when the loss has an entropy bonus
        (`entropy_coeff` > 0); otherwise it is only logged."""
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

    def _recompute_logprobs(
        self,
        forward: _Forward,
        batch: TokenBatch,
        plan: list[list[list[int]]],
        temperature: float,
        *,
        token_ids: Tensor | None = None,
    ) -> Tensor:
        """[N, L-1] log-probs of `forward`'s model at `batch`'s target tokens, in float32 on the
        CPU, where this rank computes a loss over them (its rows; under PP on the last stage
        only, under CP at its sequence shard's positions), forward passes as in `plan`. With
        `token_ids` [N, L-1, K]: [N, L-1, K] log-probs of those tokens instead."""
        out = torch.zeros_like(batch.target_mask)
        if token_ids is not None:
            out = out[..., None].repeat(1, 1, token_ids.shape[-1])

        def logprobs(logits: Tensor, labels: Tensor) -> Tensor:
            with torch.autocast(logits.device.type, enabled=False):
                if token_ids is None:
                    lp, _ = logits_logprobs(
                        logits,
                        labels[..., TARGET].long(),
                        labels[..., MASK] > 0,
                        temperature=temperature,
                        logprob_dtype=self.logprob_dtype,
                    )
                else:  # only the masked positions' full distributions
                    keep = labels[..., MASK] > 0
                    picked = logits[keep].to(self.logprob_dtype) / temperature
                    wanted = labels[..., TOP_K_IDS:][keep].long()
                    lp = logits.new_zeros((*keep.shape, wanted.shape[-1]), dtype=picked.dtype)
                    lp[keep] = torch.log_softmax(picked, dim=-1).gather(-1, wanted)
            return _attach(lp.new_zeros(()), (labels, lp))

        for rows in (rows for passes in plan for rows in passes):
            if rows:
                mb = batch.select(rows)
                where = torch.tensor(rows, dtype=torch.float32)[:, None].expand_as(mb.target_mask)
                positions = torch.arange(mb.target_mask.shape[1], dtype=torch.float32)
                extra = [where, positions.expand_as(mb.target_mask)]
                if token_ids is not None:
                    extra += list(token_ids[rows, : mb.target_mask.shape[1]].unbind(-1))
                labels = _labels(mb, extra)
            else:
                mb, labels = self._dummy(
                    TOP_K_IDS + (0 if token_ids is None else token_ids.shape[-1])
                )
            for piece in forward.run(mb, labels, logprobs, backward=False, device=self.device):
                labels_seen, lp = _payload(piece)
                keep = labels_seen[..., MASK] > 0
                index = labels_seen[..., ROW][keep].long().cpu(), labels_seen[..., POSITION][keep]
                out[index[0], index[1].long().cpu()] = lp[keep].float().cpu()
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

    def grpo_step(
        self,
        groups: Sequence[RolloutGroup],
        media: Sequence[VisionInputs | None] | None = None,
    ) -> dict[str, float]:
        """One training step of the configured RL variant over scored groups.

        With a ParallelModel every rank passes the same groups: each computes the advantages
        and collates all sequences, then trains on its data-parallel share of every slice
        (rows dp_rank::dp_size); counts are summed over the data-parallel ranks and replicas,
        so the step is the one of the whole batch. Metrics are those of the first pass
        (`mu_iterations`), each slice's a share of that slice's mean, averaged over the slices;
        `positive_nll` (with `positive_nll_coef`) is reported apart from `loss`, which does not
        include it; `planned_updates` holds the number of optimiser updates the step takes.
        `media`: a vision-language model's images and videos of each group's prompt
        (`batching.rollout_media`), which its forwards take with the tokens."""
        p: GrpoConfig = self.cfg.grpo
        settings = loss_settings(self.cfg)
        loss_fn = policy_loss(p.variant, settings)
        use_behaviour = p.use_decoupled_loss or settings.aipo_rho is not None
        if use_behaviour and not p.collect_rollout_logprobs:
            raise ValueError(
                "train.train_policy.aipo_rho (AIPO weighs tokens by the rollout's log-probs) "
                "needs train.train_policy.collect_rollout_logprobs = true"
            )
        if p.kl_beta > 0 and self._reference is None:
            raise ValueError("train.train_policy.kl_beta > 0 needs a reference model")
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
        if media is not None and any(m is not None for m in media):
            per_row = tuple(m for m, g in zip(media, groups, strict=True) for _ in g.completions)
            batch = replace(batch, media=per_row)
        positive = rewards.flatten() > 0

        # Slices of `batch_size_per_optimize` sequences, one update each; every rank and replica
        # takes as many updates as the one with the most slices (the others' extra slices are
        # empty: their gradients are summed in as zeros). Each data-parallel rank trains on its
        # share of every slice.
        num_rows = batch.input_ids.shape[0]
        slices = list(_chunks(num_rows, p.batch_size_per_optimize or max(num_rows, 1)))
        num_slices = self._global_max(len(slices))
        slices += [[] for _ in range(num_slices - len(slices))]
        slices = [rows[self.dp_rank :: self.dp_size] for rows in slices]
        plan = self._in_step([self._micro_batches(batch, rows) for rows in slices])
        self.planned_updates = num_slices * p.mu_iterations
        # The proximal policy: the rollout's log-probs, or recomputed now (decoupled PPO and
        # AIPO weigh by pi_prox / pi_behaviour, so they need both).
        recompute = use_behaviour or not p.use_rollout_logprobs_for_loss
        old = (
            self._recompute_logprobs(self._policy, batch, plan, p.temperature)
            if recompute
            else batch.behaviour_logprobs
        )
        ref = (
            None
            if self._reference is None or p.kl_beta == 0
            else self._recompute_logprobs(self._reference, batch, plan, p.temperature)
        )
        shaping, divergence = (
            self._distillation(groups, batch, plan, old)
            if self.cfg.distillation.enable
            else (None, None)
        )
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
            for k, passes in enumerate(plan):
                num_tokens, num_sequences, num_positive = counts[3 * k : 3 * k + 3]
                if token_mean_local:  # this rank's own mean; the summed gradients average them
                    num_tokens = local[k][0] * self._num_ranks()
                compute = self._grpo_loss(
                    loss_fn,
                    settings,
                    use_behaviour=use_behaviour,
                    with_ref=ref is not None,
                    num_tokens=num_tokens,
                    num_sequences=num_sequences,
                    num_positive=num_positive,
                )
                for rows in passes:
                    mb, labels = self._grpo_inputs(
                        batch, rows, old, ref, positive, shaping, divergence
                    )
                    pieces = self._policy.run(
                        mb, labels, compute, backward=True, device=self.device
                    )
                    if iteration == 0:
                        for piece in pieces:
                            for key, value in _payload(piece).items():
                                sums[key] = sums.get(key, 0.0) + float(value) / num_slices
                grad_norm = self._optimizer_step()
        self.scheduler.step()
        self._reset_reference()
        sums = self._loss_metrics(sums)
        # Token-normalised metrics are already this rank's share of the global mean. Rewards
        # and lengths describe the groups, which every data-parallel rank holds: rank 0 counts
        # them.
        whole = float(self.dp_rank == 0)
        lengths = [len(c.token_ids) for g in groups for c in g.completions]
        keys = sorted(sums)
        totals = self._global_sums(
            *(sums[k] for k in keys),
            whole * float(rewards.sum()),
            whole * float((rewards**2).sum()),
            whole * float(rewards.numel()),
            whole * float(sum(lengths)),
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

    def _distillation(
        self,
        groups: Sequence[RolloutGroup],
        batch: TokenBatch,
        plan: list[list[list[int]]],
        student: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """On-policy distillation's per-token advantage term and divergence, [N, L-1] each, 0
        off `target_mask`, from the teacher's scores on the completions. `student`: the
        proximal policy's log-probs of the sampled tokens (the current policy's on the first
        pass of an on-policy step); with `top_k` > 0 the policy's log-probs of the teacher's
        top-k tokens are computed here."""
        d = self.cfg.distillation
        mask = batch.target_mask
        k = max(d.top_k, 0)
        teacher = torch.zeros((*mask.shape, max(k, 1)))
        ids = torch.zeros((*mask.shape, max(k, 1)), dtype=torch.long)
        rows = [(g, c) for g in groups for c in g.completions]
        for r, (g, c) in enumerate(rows):
            num_scores = len(c.teacher_logprobs if k == 0 else c.teacher_top_k_logprobs)
            if num_scores != len(c.token_ids):
                raise ValueError(
                    f"prompt {g.prompt.prompt_id}: a completion of {len(c.token_ids)} tokens "
                    f"carries {num_scores} teacher scores; distillation.enable trains only on "
                    "completions a teacher scored"
                )
            if not c.token_ids:
                continue
            at = slice(len(g.prompt_token_ids) - 1, len(g.prompt_token_ids) - 1 + len(c.token_ids))
            if k == 0:
                teacher[r, at, 0] = torch.tensor(c.teacher_logprobs)
            else:
                teacher[r, at] = torch.tensor(c.teacher_top_k_logprobs)
                ids[r, at] = torch.tensor(c.teacher_top_k_ids)
        if k == 0:
            divergence = sampled_token_divergence(student, teacher[..., 0])
        else:
            on_ids = self._recompute_logprobs(
                self._policy, batch, plan, self.cfg.grpo.temperature, token_ids=ids
            )
            divergence = top_k_divergence(on_ids, teacher, beta=d.jsd_beta)
        divergence = divergence * mask
        shaping = distillation_advantages(
            divergence,
            mask,
            kl_penalty_coef=d.kl_penalty_coef,
            kl_discount_factor=d.kl_discount_factor,
        )
        return shaping, divergence

    def _grpo_inputs(
        self,
        batch: TokenBatch,
        rows: list[int],
        old: Tensor,
        ref: Tensor | None,
        positive: Tensor,
        shaping: Tensor | None,
        divergence: Tensor | None,
    ) -> tuple[TokenBatch, Tensor]:
        """One forward pass's rows and their labels (channels TARGET ... DIVERGENCE)."""
        if not rows:
            return self._dummy(DIVERGENCE + 1)
        mb = batch.select(rows)
        width = mb.target_mask.shape[1]
        index = torch.tensor(rows)
        labels = _labels(
            mb,
            [
                old[index, :width],
                mb.advantages,
                mb.behaviour_logprobs,
                torch.zeros_like(mb.target_mask) if ref is None else ref[index, :width],
                positive[index],
                torch.zeros_like(mb.target_mask) if shaping is None else shaping[index, :width],
                torch.zeros_like(mb.target_mask)
                if divergence is None
                else divergence[index, :width],
            ],
        )
        return mb, labels

    def _grpo_loss(
        self,
        loss_fn: LossFn,
        settings: LossSettings,
        *,
        use_behaviour: bool,
        with_ref: bool,
        num_tokens: float,
        num_sequences: float,
        num_positive: float,
    ) -> ParallelLossFn:
        """The RL loss of one slice as a function of (logits, labels): the variant's loss (plus
        `positive_nll_coef` times VAPO's positive-example NLL), carrying its metrics (shares of
        the slice's)."""
        p = self.cfg.grpo
        distill = self.cfg.distillation.enable

        def compute(logits: Tensor, labels: Tensor) -> Tensor:
            with torch.autocast(logits.device.type, enabled=False):
                mask = labels[..., MASK]
                logprobs, entropy = logits_logprobs(
                    logits,
                    labels[..., TARGET].long(),
                    mask > 0,
                    temperature=p.temperature,
                    with_entropy=True,
                    entropy_grad=p.entropy_coeff > 0,
                    logprob_dtype=self.logprob_dtype,
                )
                batch = PolicyBatch(
                    logprobs=logprobs,
                    old_logprobs=labels[..., OLD],
                    advantages=(
                        labels[:, 0, ADVANTAGE, None] + labels[..., SHAPING]
                        if distill
                        else labels[:, 0, ADVANTAGE]
                    ),
                    mask=mask,
                    behaviour_logprobs=labels[..., BEHAVIOUR] if use_behaviour else None,
                    ref_logprobs=labels[..., REF] if with_ref else None,
                    entropy=entropy,
                )
                loss, metrics = loss_fn(
                    batch, settings, num_tokens=num_tokens, num_sequences=num_sequences
                )
                values = {"loss": loss.detach(), **{k: v.detach() for k, v in metrics.items()}}
                if distill:  # the step's mean per-token divergence (reverse KL with top_k 0)
                    values["distill_kl"] = token_mean_metric(
                        labels[..., DIVERGENCE], mask, num_tokens=num_tokens
                    ).detach()
                if p.positive_nll_coef is not None:
                    positive = labels[:, 0, POSITIVE] > 0
                    nll = positive_nll(logprobs, mask, positive, num_tokens=num_positive)
                    loss = loss + p.positive_nll_coef * nll
                    values["positive_nll"] = nll.detach()
            return _attach(loss, values)

        return compute

    # -- SFT ---------------------------------------------------------------------------------------

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


def _check_context_parallel_loss(settings: LossSettings, p: GrpoConfig) -> None:
    """Under CP a sequence's tokens are spread over ranks: losses that reduce over a whole
    sequence first are refused, naming their keys."""
    per_sequence = []
    if p.variant == "gspo":
        per_sequence.append("variant = 'gspo' (a sequence-level ratio)")
    if settings.loss_type == "seq-mean-token-mean" and settings.max_tokens is None:
        per_sequence.append("loss_type = 'seq-mean-token-mean' (a per-sequence token mean)")
    if settings.off_policy_masking_delta is not None:
        per_sequence.append("off_policy_masking_delta (a per-sequence mean)")
    if per_sequence:
        raise ValueError(
            "policy.parallelism.cp_size > 1 spreads each sequence over ranks; "
            f"train.train_policy.{', '.join(per_sequence)} needs whole sequences"
        )
