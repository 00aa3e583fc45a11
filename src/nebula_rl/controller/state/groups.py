"""Generations of the elastic groups (policy data parallel, weights) and weight pushes."""

from __future__ import annotations

import json
from typing import Any

from redis.client import Pipeline

from nebula_rl.controller.state._base import KINDS, StateBase

__all__ = ["Groups"]


class Groups(StateBase):
    """`group:<kind>` records, regroup requests and push counters."""

    def group_record(self, kind: str) -> dict[str, Any] | None:
        """The current generation of group `kind` ("policy" or "weights"): {kind, generation,
        members (rank order), ids (their replica ids), sizes (their processes), job (the members
        meet in the job's Redis), confirmed (member -> what it reported on joining)}; None before
        the first."""
        raw = self.redis.get(self.key("group", kind))
        return None if raw is None else json.loads(raw)

    def publish_group(
        self,
        kind: str,
        members: list[str],
        *,
        ids: dict[str, int],
        sizes: dict[str, int] | None = None,
    ) -> dict[str, Any]:
        """Start a new generation of group `kind` with `members` (in rank order; `ids`: their
        replica ids, which tell a member from a new process under the same name); returns its
        record. Generation numbers only grow (also across controller restarts)."""
        if kind not in KINDS:
            raise ValueError(f"group kind must be one of {KINDS}, got {kind!r}")
        record = {
            "kind": kind,
            "generation": self.redis.incr(self.key("group_seq", kind)),
            "members": members,
            "ids": {name: ids[name] for name in members},
            # Processes of each member replica (its torchrun world): a generation's group has
            # one rank per process, the members' ranks in member order.
            "sizes": {name: (sizes or {}).get(name, 1) for name in members},
            "job": self.job,
            "confirmed": {},
        }
        self.redis.set(self.key("group", kind), json.dumps(record))
        return record

    def confirm_member(
        self, kind: str, generation: int, name: str, info: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Member `name` joined generation `generation` of `kind` and reports `info`; returns the
        updated record, or None when that generation is no longer current."""
        group = self.key("group", kind)

        def confirm(pipe: Pipeline) -> dict[str, Any] | None:
            raw = pipe.get(group)
            record = None if raw is None else json.loads(raw)
            if record is None or record["generation"] != generation:
                return None
            record["confirmed"][name] = info
            pipe.multi()
            pipe.set(group, json.dumps(record))
            return record

        return self.redis.transaction(confirm, group, value_from_callable=True)

    def request_regroup(self, kind: str, generation: int) -> None:
        """A member found generation `generation` of `kind` broken (a collective failed or
        timed out); the controller rebuilds the group among the live members."""
        self.redis.eval(
            "local old = tonumber(redis.call('GET', KEYS[1]) or '-1') "
            "if tonumber(ARGV[1]) > old then redis.call('SET', KEYS[1], ARGV[1]) end",
            1,
            self.key("regroup", kind),
            generation,
        )

    def regroup_requested(self, kind: str) -> int:
        """The newest generation of `kind` a member asked to replace (-1: none)."""
        return int(self.redis.get(self.key("regroup", kind)) or -1)

    def announce_push(self, generation: int) -> int:
        """The weight sender is about to push in weight-group generation `generation`; returns
        how many pushes that generation has seen, this one included. Receivers take part in
        exactly that many (:meth:`num_pushes`)."""
        return self.redis.incr(self.key("pushes", generation))

    def num_pushes(self, generation: int) -> int:
        """Pushes announced so far in weight-group generation `generation`."""
        return int(self.redis.get(self.key("pushes", generation)) or 0)
