"""The RL update of a `PolicyTrainer` (`grpo_step`): advantages, the step's slices and forward
passes, the proximal and reference log-probs (recomputed when the loss needs them), on-policy
distillation's terms, and the configured variant's loss over (logits, labels)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from nebula_rl.algorithms import (
    ALGORITHMS,
    LossFn,
    LossSettings,
    PolicyBatch,
    distillation_advantages,
    policy_loss,
    positive_nll,
    sampled_token_divergence,
    token_mean_metric,
    top_k_divergence,
)
from nebula_rl.config import GrpoConfig
from nebula_rl.data.vision import VisionInputs
from nebula_rl.policy.batching import TokenBatch, collate_groups, token_budget_micro_batches
from nebula_rl.policy.forward import (
    ADVANTAGE,
    BEHAVIOUR,
    DIVERGENCE,
    MASK,
    OLD,
    POSITION,
    POSITIVE,
    REF,
    ROW,
    SHAPING,
    TARGET,
    TOP_K_IDS,
    _attach,
    _Forward,
    _labels,
    _payload,
)
from nebula_rl.policy.logprobs import logits_logprobs, token_logprobs
from nebula_rl.policy.loss_settings import loss_settings
from nebula_rl.policy.parallelize import LossFn as ParallelLossFn
from nebula_rl.policy.trainer_base import _chunks, _TrainerBase
from nebula_rl.protocol import RolloutGroup


class _RLStep(_TrainerBase):
    """`grpo_step` and its pieces."""

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
        batch = self._grpo_batch(groups, advantages, media)
        positive = rewards.flatten() > 0
        num_slices, slices, plan = self._grpo_plan(batch)
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
        return self._grpo_metrics(groups, rewards, sums, counts, grad_norm)

    def _grpo_batch(
        self,
        groups: Sequence[RolloutGroup],
        advantages: Tensor,
        media: Sequence[VisionInputs | None] | None,
    ) -> TokenBatch:
        """The groups' sequences as one batch, each row with its prompt's media (if any)."""
        p = self.cfg.grpo
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
        return batch

    def _grpo_plan(self, batch: TokenBatch) -> tuple[int, list[list[int]], list[list[list[int]]]]:
        """The step's slices (their number over every rank and replica, this rank's rows of
        each) and this rank's forward passes of each."""
        p = self.cfg.grpo
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
        return num_slices, slices, plan

    def _grpo_metrics(
        self,
        groups: Sequence[RolloutGroup],
        rewards: Tensor,
        sums: dict[str, float],
        counts: list[float],
        grad_norm: float,
    ) -> dict[str, float]:
        """The step's metrics from this rank's shares of the losses' (`sums`), the slices'
        global counts and the groups' rewards and lengths."""
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
