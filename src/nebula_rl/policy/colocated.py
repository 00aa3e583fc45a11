"""Colocated replica (`mode = "colocated"`): a policy replica whose ranks also generate, taking
turns with training, with the same controller, ledger and algorithms as disaggregated mode, for
language, vision-language and world models alike.

The replica is a :class:`~nebula_rl.policy.worker.PolicyWorker` (regroups, `train` commands,
checkpoints, export: all unchanged) whose loop, between commands, runs generation rounds with
its modality's :class:`Rounds` (text: `rollout.colocated.TextRounds`, the built-in engine; world
models: `flow.colocated.WorldRounds`, the SDE sampler):

1. rank 0 claims up to `rollout.batch_size` prompts from the job's streams (validation prompts
   first), exactly as a rollout replica does, and hands them to the replica's ranks;
2. if the weights changed since the last round (a step, a regroup), every rank copies the
   policy's weights into its generator's own copy of the model (sharded parameters are gathered
   whole: one all-gather per parameter per step, the traffic of one forward pass);
3. rank `r` of `n` generates prompts `r, r + n, ...`; rank 0 collects the results, scores and
   pushes each group before acknowledging its prompt.

So groups go back through the controller as in disaggregated mode: a crashed colocated replica
loses no prompt (its claims are requeued), the controller judges staleness and forms the batch,
and the step's `train` command comes like any other. A `train` command waits for the round in
progress (at most `rollout.batch_size` prompts) and is taken before the next one. The generator's
own copy (no optimiser state, no gradients) lets each rank generate alone, without lock step with
the sharded training module; no weights cross process boundaries.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import torch

from nebula_rl.controller.client import ReplicaSession
from nebula_rl.policy.worker import PolicyBuilder, PolicyWorker

__all__ = ["ColocatedWorker", "Rounds", "RoundsBuilder", "run_colocated"]

log = logging.getLogger(__name__)


class Rounds(Protocol):
    """One rank's generation in a colocated replica, as its modality makes it. Work items and
    results cross ranks pickled."""

    def claim(self, version: int) -> list[Any]:
        """Rank 0: up to `rollout.batch_size` claimed prompts ready to generate, validation
        prompts first (one that cannot be generated is answered at once, not returned)."""
        ...

    def load(
        self, weights: Iterable[tuple[str, torch.Tensor]], version: int, *, first: bool
    ) -> None:
        """Copy the policy's (whole) weights of `version` into the generator's model: every
        tensor when `first`, later only those that train (frozen ones never change)."""
        ...

    def generate(self, work: list[Any]) -> list[Any]:
        """Generate this rank's share of a round, one result per work item."""
        ...

    def push(self, work: list[Any], results: list[Any], version: int) -> None:
        """Rank 0: score and push the round's groups, then acknowledge their prompts."""
        ...

    def close(self) -> None: ...


RoundsBuilder = Callable[..., Rounds]
"""`(session, device, *, rank, tokenizer, vision)` -> this rank's :class:`Rounds`."""


class ColocatedWorker(PolicyWorker):
    """One colocated replica (this process: one of its ranks); see the module docstring."""

    def __init__(
        self,
        session: ReplicaSession,
        *,
        device: torch.device,
        rounds: RoundsBuilder,
        build: PolicyBuilder | None = None,
    ) -> None:
        super().__init__(session, device=device, build=build)
        self.rounds = rounds(
            session, device, rank=self.local_rank, tokenizer=self.tokenizer, vision=self.vision
        )
        self._stale = True
        """Whether the generator's weights lag the policy's."""
        self._loaded = False
        """Whether the generator holds the frozen tensors too (from its first load)."""

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> None:
        """Carry out commands until `stop` or the end of the job, generating in between."""
        session = self.session
        session.policy_version = lambda: self.version
        session.start_heartbeats()
        session.mark_ready()
        busy = False
        try:
            while True:
                tick = self._tick(block_ms=0 if busy else 100)
                if tick.finished is not None:
                    return
                if self.run_commands(tick.commands):
                    return
                if tick.commands:  # (look for more before generating)
                    busy = True
                    continue
                busy = self.in_sync and self.clean and self.generate_round()
        finally:
            self.rounds.close()

    def _regrouped_weights(self) -> None:
        self._stale = True  # (the state agreed with the group may be another replica's)

    def _stepped_weights(self, *, push: bool) -> None:
        self._stale = True  # (there are no rollout replicas to push to)

    # -- generation -----------------------------------------------------------------------------

    def generate_round(self) -> bool:
        """Claim prompts, generate them on every rank, score and push them (see the module
        docstring); whether there were any."""
        work = self._share(self.rounds.claim(self.version) if self.lead else None)
        if not work:
            return False
        if self._stale:
            self._load_policy_weights()
        rank, ranks = self.local_rank, self.num_ranks
        mine = work[rank::ranks]
        shares = self._gather(self.rounds.generate(mine) if mine else [])
        if self.lead:
            ordered = [shares[i % ranks][i // ranks] for i in range(len(work))]
            self.rounds.push(work, ordered, self.version)
        return True

    def _load_policy_weights(self) -> None:
        """Copy the policy's weights into the generator (a collective of the replica's ranks
        when the parameters are sharded: each is gathered whole)."""

        def full(tensor: torch.Tensor) -> torch.Tensor:
            gather = getattr(tensor, "full_tensor", None)  # (a DTensor shard)
            return gather() if gather is not None else tensor

        def changing(tensor: torch.Tensor) -> bool:  # (a LoRA policy's merged tensors change)
            return not isinstance(tensor, torch.nn.Parameter) or tensor.requires_grad

        first = not self._loaded
        with torch.no_grad():
            named = self.generated_weights()  # (a LoRA policy's: merged, under the plain names)
            pairs = named.items() if isinstance(named, Mapping) else named
            weights = ((name, full(p.detach())) for name, p in pairs if first or changing(p))
            self.rounds.load(weights, self.version, first=first)
        self._stale, self._loaded = False, True


def run_colocated(
    session: ReplicaSession,
    *,
    device: torch.device,
    rounds: RoundsBuilder,
    build: PolicyBuilder | None = None,
) -> None:
    """Body of a colocated replica process (one of its ranks): the policy `build` makes (default:
    a language model's), generating with `rounds`."""
    ColocatedWorker(session, device=device, rounds=rounds, build=build).run()
