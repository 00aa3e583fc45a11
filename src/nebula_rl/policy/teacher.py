"""The distillation teacher: scores the student's completions token by token.

A :class:`Teacher` holds the `[distillation]` model (frozen, in `distillation.master_dtype`,
forward under autocast to `param_dtype`, logits cast to `logprob_dtype`) and fills each
completion's `teacher_logprobs` (and with `top_k` > 0 `teacher_top_k_ids` /
`teacher_top_k_logprobs`) for the policy's loss (`nebula_rl.algorithms.distill`). Log-probs are
taken at `train.train_policy.temperature`, the temperature of the student's log-probs they are
compared with. It scores requests of `batch_size_per_replica` sequences, each in forward passes
of `mini_batch` sequences (or of at most `max_token_len_per_mini_batch` padded tokens).

Each teacher runs whole in one process (a split one is refused by name). `nebula-rl train
--local` runs one in its process. In the multi-process job each teacher replica (`nebula-rl
replica --role teacher`; `distillation.parallelism.n_init_replicas` of them, or `nebula-rl
train --teacher N`) runs :func:`run_teacher`: it takes the groups the rollouts pushed for
scoring from the controller's queue and hands them back scored
(`nebula_rl.controller.state.teacher`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from nebula_rl.config import Config
from nebula_rl.models import load_model, load_tokenizer, resolve_dtype
from nebula_rl.protocol import Completion, RolloutGroup

if TYPE_CHECKING:
    from nebula_rl.controller.client import ReplicaSession

__all__ = ["Teacher", "check_same_tokenizer", "check_teacher", "run_teacher"]

log = logging.getLogger(__name__)


def check_same_tokenizer(cfg: Config) -> None:
    """ValueError unless the teacher's tokenizer is the policy's (same vocabulary and special
    tokens): the teacher scores the student's token ids as they are."""
    d = cfg.distillation
    student = load_tokenizer(cfg.policy.model_name_or_path, revision=cfg.policy.model_revision)
    teacher = load_tokenizer(d.model_name_or_path, revision=d.model_revision)
    if student.get_vocab() != teacher.get_vocab() or (
        student.all_special_tokens != teacher.all_special_tokens
    ):
        raise ValueError(
            f"distillation.model_name_or_path ({d.model_name_or_path!r}) has another tokenizer "
            f"than policy.model_name_or_path ({cfg.policy.model_name_or_path!r}): on-policy "
            "distillation scores the student's token ids with the teacher, so both must share "
            "one tokenizer"
        )


def check_teacher(cfg: Config) -> None:
    """ValueError for a teacher that cannot run: split over several processes (not built), or
    of another tokenizer than the policy."""
    world = cfg.distillation.parallelism
    sizes = (world.tp_size, world.cp_size, world.pp_size, world.dp_replicate_size)
    if any(s > 1 for s in sizes) or world.dp_shard_size != 1:
        raise ValueError(
            "distillation.parallelism: a teacher replica split over several processes is not "
            "built yet; each teacher replica runs whole in one process (set tp_size, cp_size, "
            "pp_size, dp_replicate_size and dp_shard_size to 1, and scale with n_init_replicas)"
        )
    check_same_tokenizer(cfg)


def _passes(lengths: Sequence[int], *, mini_batch: int, max_tokens: int | None) -> Iterator[range]:
    """Consecutive index ranges, each one forward pass: `mini_batch` sequences, or as many as
    fit `max_tokens` padded tokens (at least one)."""
    start = 0
    while start < len(lengths):
        stop = start + 1
        if max_tokens is None:
            stop = min(start + mini_batch, len(lengths))
        else:
            longest = lengths[start]
            while stop < len(lengths):
                longest = max(longest, lengths[stop])
                if longest * (stop - start + 1) > max_tokens:
                    break
                stop += 1
        yield range(start, stop)
        start = stop


class Teacher:
    """The frozen teacher model of `[distillation]` and its scoring."""

    def __init__(self, cfg: Config, *, device: torch.device | str) -> None:
        d = cfg.distillation
        check_teacher(cfg)
        self.cfg = cfg
        self.device = torch.device(device)
        seed = d.seed if d.seed is not None else cfg.train.seed or 0
        self.model: nn.Module = load_model(
            d.model_name_or_path,
            dtype=resolve_dtype(d.master_dtype),
            device=self.device,
            seed=seed,
            revision=d.model_revision,
        )
        self.model.eval().requires_grad_(False)
        if d.compile:
            from nebula_rl.policy.parallelize import apply_compile

            apply_compile(self.model)
        param = resolve_dtype(d.param_dtype)
        self.autocast_dtype = None if param == resolve_dtype(d.master_dtype) else param
        self.logprob_dtype = resolve_dtype(d.logprob_dtype)
        tokenizer = load_tokenizer(d.model_name_or_path, revision=d.model_revision)
        self.pad_id = int(tokenizer.pad_token_id or 0)

    def score(self, groups: Sequence[RolloutGroup]) -> list[RolloutGroup]:
        """`groups` with every completion's teacher fields filled in."""
        d = self.cfg.distillation
        rows = [(g.prompt_token_ids, c) for g in groups for c in g.completions]
        scored: list[Completion] = []
        for start in range(0, len(rows), d.batch_size_per_replica):
            scored += self._score_request(rows[start : start + d.batch_size_per_replica])
        out, i = [], 0
        for g in groups:
            n = len(g.completions)
            out.append(dataclasses.replace(g, completions=scored[i : i + n]))
            i += n
        return out

    def _score_request(self, rows: list[tuple[list[int], Completion]]) -> list[Completion]:
        """One request's completions, scored in forward passes."""
        d = self.cfg.distillation
        lengths = [len(p) + len(c.token_ids) for p, c in rows]
        out: list[Completion] = []
        for span in _passes(
            lengths, mini_batch=d.mini_batch, max_tokens=d.max_token_len_per_mini_batch
        ):
            out += self._forward([rows[i] for i in span])
        return out

    @torch.no_grad()
    def _forward(self, rows: list[tuple[list[int], Completion]]) -> list[Completion]:
        """One forward pass over right-padded prompt + completion rows."""
        d = self.cfg.distillation
        width = max(len(p) + len(c.token_ids) for p, c in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for r, (p, c) in enumerate(rows):
            seq = p + c.token_ids
            ids[r, : len(seq)] = torch.tensor(seq)
            attention[r, : len(seq)] = 1
        ids, attention = ids.to(self.device), attention.to(self.device)
        with torch.autocast(
            self.device.type,
            dtype=self.autocast_dtype or torch.float32,
            enabled=self.autocast_dtype is not None,
        ):
            logits = self.model(input_ids=ids, attention_mask=attention).logits
        temperature = self.cfg.grpo.temperature
        out = []
        for r, (p, c) in enumerate(rows):
            n = len(c.token_ids)
            if n == 0:
                out.append(c)
                continue
            # Positions len(p)-1 ... len(p)+n-2 predict the completion's tokens.
            row_logits = logits[r, len(p) - 1 : len(p) - 1 + n].to(self.logprob_dtype)
            logprobs = torch.log_softmax(row_logits / temperature, dim=-1)
            sampled = logprobs.gather(-1, ids[r, len(p) : len(p) + n, None])[:, 0]
            fields: dict[str, Any] = {"teacher_logprobs": sampled.float().cpu().tolist()}
            if d.top_k > 0:
                top = logprobs.topk(d.top_k, dim=-1)
                fields["teacher_top_k_ids"] = top.indices.cpu().tolist()
                fields["teacher_top_k_logprobs"] = top.values.float().cpu().tolist()
            out.append(dataclasses.replace(c, **fields))
        return out


def run_teacher(session: ReplicaSession, *, device: torch.device) -> None:
    """Body of a teacher replica: score queued groups until the job ends. A request is up to
    `batch_size_per_replica` sequences' worth of groups (at least one group)."""
    cfg = session.cfg
    teacher = Teacher(cfg, device=device)
    session.mark_ready()
    state, num_groups = session.state, 0
    groups_per_request = max(1, cfg.distillation.batch_size_per_replica // cfg.rollout.n_generation)
    while session.finished() is None:
        claimed = state.claim_for_teacher(session.name, groups_per_request, block_ms=500)
        if not claimed:
            continue
        scored = teacher.score([group for _, group in claimed])
        for (msg_id, _), group in zip(claimed, scored, strict=True):
            state.push_scored(msg_id, group)
        num_groups += len(claimed)
    log.info("teacher %s scored %d groups", session.name, num_groups)
