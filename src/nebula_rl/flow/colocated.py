"""A colocated policy replica's world-model generation (`mode = "colocated"`): each rank samples
its share of a round's prompts with the SDE sampler on its own copy of the flow model, decodes
and scores them; rank 0 claims the prompts, stores the groups' trajectories and pushes the
groups as a world-model rollout replica does (`policy.colocated` runs the rounds)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from nebula_rl.controller.client import ReplicaSession
from nebula_rl.flow.local import roll_out
from nebula_rl.flow.runtime import (
    SampledGroup,
    flow_sampling,
    push_group,
    push_validated,
    scored_groups,
    trajectory_server,
)
from nebula_rl.flow.validation import scored_clips
from nebula_rl.protocol import Prompt
from nebula_rl.utils.ranks import cpu_threads

__all__ = ["WorldRounds"]

log = logging.getLogger(__name__)

_Work = tuple[str, Prompt]
"""A claimed prompt: its stream id and the prompt (every rank reads the clips itself)."""


class WorldRounds:
    """One rank's generation in a colocated world-model replica (the `policy.colocated.Rounds`
    of world models). Its copy of the model is unsharded and frozen, so a rank samples alone,
    without lock step with the FSDP2-sharded training module; its noise is its own (seeded by
    replica and rank)."""

    def __init__(
        self, session: ReplicaSession, device: torch.device, *, rank: int, **_: Any
    ) -> None:
        self.session = session
        cfg = self.cfg = session.cfg
        # The starting weights are copied in from the policy before the first round.
        self.sampling = flow_sampling(session, device)
        self.params = dict(self.sampling.model.named_parameters())
        base = cfg.rollout.seed if cfg.rollout.seed is not None else cfg.train.seed or 0
        replica = session.registration["replica_id"] - 1  # (ids count from 1)
        self.generator = torch.Generator(device=device).manual_seed(base + 1000 * replica + rank)
        self.lead = rank == 0
        if self.lead:  # (rank 0 stores every group's trajectory and serves other hosts)
            self.server = trajectory_server(session)
            self.server.start()

    def load(
        self, weights: Iterable[tuple[str, torch.Tensor]], version: int, *, first: bool
    ) -> None:
        seen = set()
        with torch.no_grad():
            for name, tensor in weights:
                target = self.params.get(name)
                if target is None:
                    raise KeyError(f"the policy sent {name}, which the sampler's model lacks")
                target.copy_(tensor)
                seen.add(name)
        if first and (missing := self.params.keys() - seen):
            raise KeyError(f"the policy sent no {sorted(missing)[:5]}")

    def claim(self, version: int) -> list[_Work]:
        """Rank 0: up to `rollout.batch_size` prompts, validation prompts first."""
        state, name = self.session.state, self.session.name
        size = max(1, self.cfg.rollout.batch_size)
        claimed: list[_Work] = []
        if self.sampling.val_clips is not None:
            claimed += state.claim_validation(name, size)
        if len(claimed) < size:
            block_ms = 0 if claimed else 100
            claimed += state.claim_prompts(name, size - len(claimed), block_ms=block_ms)
        for _, prompt in claimed:
            assert prompt.min_version <= version, (
                f"prompt {prompt.prompt_id} needs weights of version {prompt.min_version}; this "
                f"replica holds {version}"
            )
        return claimed

    def generate(self, work: list[_Work]) -> list[Any]:
        """Sample and score this rank's share: a :class:`SampledGroup` per training prompt, and
        per validation prompt its rewards and distances (`flow.validation.scored_clips`)."""
        validating = [i for i, (_, p) in enumerate(work) if p.validation_step is not None]
        training = [i for i, (_, p) in enumerate(work) if p.validation_step is None]
        results: list[Any] = [None] * len(work)
        s = self.sampling
        with cpu_threads(self.cfg.rollout.cpu_threads):
            if validating:
                assert s.val_clips is not None
                indices = [work[i][1].index for i in validating]
                scored = scored_clips(
                    s.model, s.val_clips, indices, s.settings, self.cfg, s.val_score
                )
                for i, result in zip(validating, scored, strict=True):
                    results[i] = result
            if training:
                n = self.cfg.rollout.n_generation
                real = [s.clips[work[i][1].index] for i in training for _ in range(n)]
                *_, trajectory = roll_out(s.model, real, s.settings, self.generator)
                groups = scored_groups(s.model, trajectory, real, n, s.clips, s.score)
                for i, group in zip(training, groups, strict=True):
                    results[i] = group
        return results

    def push(self, work: list[_Work], results: list[Any], version: int) -> None:
        """Rank 0: store and push each group, then acknowledge its prompt."""
        for (msg_id, prompt), result in zip(work, results, strict=True):
            if isinstance(result, SampledGroup):
                push_group(self.session, self.server, msg_id, prompt, result, version)
            else:
                rewards, distances = result
                push_validated(self.session, msg_id, prompt, rewards, distances, version)

    def close(self) -> None:
        if self.lead:
            self.server.stop(job_ended=self.session.finished() is not None)
