"""Judging pushed groups by their headers, a poll at a time, on a real Redis: exactly-once
acceptance, the buffer keeping each group's JSON as it was pushed, staleness found by versions."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from nebula_rl.controller import JobState, connect, start_redis
from nebula_rl.controller.state import PushedGroup
from nebula_rl.protocol import Completion, GroupHeader, Prompt, RolloutGroup, to_json


@pytest.fixture
def state(tmp_path: Path) -> Iterator[JobState]:
    with start_redis(data_dir=tmp_path / "redis") as server:
        yield JobState(connect(server.url), "job-1")


def _group(
    prompt: Prompt, version: int, *, rewards: tuple[float, ...] = (1.0, 0.0)
) -> RolloutGroup:
    completions = [
        Completion([1, 2, 3], [-0.1, -0.2, -0.3], "abc", "stop", [(0, version)], reward=r)
        for r in rewards
    ]
    return RolloutGroup(prompt, [7, 8], completions, replica="rollout-0")


def _handed_out(state: JobState, n: int) -> list[Prompt]:
    """`n` prompts enqueued and claimed by one rollout replica."""
    prompts = [Prompt(f"0:{i}", 0, i, f"{i}+1=", str(i + 1)) for i in range(n)]
    state.enqueue_prompts(prompts)
    claimed = state.claim_prompts("rollout-0", n)
    state.ack_prompts([msg_id for msg_id, _ in claimed])
    return [p for _, p in claimed]


def _push_raw(state: JobState, group: RolloutGroup, body: str) -> None:
    """Push `group`'s header with `body` in place of its JSON (what the controller must never
    need to read)."""
    state.redis.xadd(state.key("groups"), {"header": to_json(GroupHeader.of(group)), "group": body})


def test_a_poll_is_judged_at_once_and_each_prompt_accepted_once(state: JobState) -> None:
    p0, p1, p2, p3 = _handed_out(state, 4)
    state.bump_policy_version()
    state.bump_policy_version()  # version 2, one step of staleness allowed: version 1 is the oldest
    pushed = [
        _group(p0, 2),
        _group(p0, 2),  # redelivered: the same poll holds both copies
        _group(p1, 0),  # stale
        _group(p2, 1, rewards=(1.0, 1.0)),
        _group(p3, 2),
    ]
    filtered = RolloutGroup(p2, [7, 8], pushed[3].completions, extra={"filtered": True})
    pushed[3] = filtered
    for g in pushed:
        state.push_group(g)

    polled = state.read_groups(100)
    assert [g.header.prompt.prompt_id for g in polled] == ["0:0", "0:0", "0:1", "0:2", "0:3"]
    verdicts = state.judge_groups(polled, current_version=2, allowed_outdated_steps=1)
    assert verdicts == ["accepted", "duplicate", "stale", "filtered", "accepted"]
    # Judged again (a controller that died before its transaction returned): nothing is accepted
    # twice; a stale group does not resolve its prompt, so it counts as stale again.
    again = state.judge_groups(polled, current_version=2, allowed_outdated_steps=1)
    assert again == ["duplicate", "duplicate", "stale", "duplicate", "duplicate"]
    assert state.read_groups(100) == []  # acknowledged with the verdicts

    # The buffer holds the pushed JSON byte for byte, in order.
    assert state.redis.lrange(state.key("buffer"), 0, -1) == ["0:0", "0:3"]
    assert state.redis.hget(state.key("bodies"), "0:3") == to_json(pushed[4])
    summary = state.ledger_summary(0)
    assert summary["completed"] == 2 and summary["filtered"] == 1 and summary["requeued"] == 1
    assert summary["duplicates_dropped"] == 5 and summary["stale_dropped"] == 2
    assert state.filtered_total() == 1
    # A step's record reads the same two numbers from counters (judged twice: counted once).
    assert state.step_counters(0) == {"stale_dropped": 2, "groups_filtered": 1}
    requeued = state.claim_prompts("rollout-1", 10)
    assert [(p.prompt_id, p.min_version) for _, p in requeued] == [("0:1", 2), ("0:1", 2)]

    batch = state.next_batch(2, current_version=2, allowed_outdated_steps=1)
    assert batch is not None and [h.prompt.prompt_id for h in batch] == ["0:0", "0:3"]
    assert [g.prompt.prompt_id for g in state.inflight_batch()] == ["0:0", "0:3"]
    assert state.inflight_batch()[1] == pushed[4]
    state.mark_trained(["0:0", "0:3"], step=1)
    assert (
        state.redis.hlen(state.key("bodies")) == 0 and state.redis.hlen(state.key("headers")) == 0
    )


def test_stale_buffered_groups_are_dropped_by_version_without_reading_their_json(
    state: JobState,
) -> None:
    p0, p1, p2 = _handed_out(state, 3)
    # Bodies that are not JSON at all: judging, batching and the staleness filter never decode
    # them (only the policy does, from the batch in flight).
    for p, version in ((p0, 0), (p1, 1), (p2, 1)):
        _push_raw(state, _group(p, version), body=f"opaque body of {p.prompt_id}")
    verdicts = state.judge_groups(
        state.read_groups(10), current_version=1, allowed_outdated_steps=1
    )
    assert verdicts == ["accepted"] * 3
    assert state.buffer_size() == 3

    # Version 2 now: the group of version 0 is too stale to train; its prompt goes back.
    batch = state.next_batch(2, current_version=2, allowed_outdated_steps=1)
    assert batch is not None and [h.prompt.prompt_id for h in batch] == ["0:1", "0:2"]
    assert state.buffer_size() == 0
    assert state.redis.hget(state.key("bodies"), "0:0") is None
    summary = state.ledger_summary(0)
    assert summary["stale_dropped"] == 1 and summary["requeued"] == 1
    assert [p.prompt_id for _, p in state.claim_prompts("rollout-1", 10)] == ["0:0"]
    # Its prompt may be accepted again: the drop took it off the accepted set.
    state.push_group(_group(p0, 2))
    assert state.judge_groups(
        state.read_groups(10), current_version=2, allowed_outdated_steps=1
    ) == ["accepted"]


def test_validation_answers_are_kept_once_per_row(state: JobState) -> None:
    prompts = [
        Prompt(f"val1:{i}", 0, i, "q", "a", min_version=1, validation_step=1) for i in range(2)
    ]
    assert state.enqueue_validation(1, prompts)
    claimed = state.claim_validation("rollout-0", 10)
    failed = RolloutGroup(prompts[1], [], _group(prompts[1], 1).completions, extra={"error": "x"})
    for g in (_group(prompts[0], 1), _group(prompts[0], 1), failed):
        state.push_group(g)
    state.ack_validation([msg_id for msg_id, _ in claimed])
    assert state.record_answers(state.read_groups(10)) == 2
    results = state.validation_results(1)
    assert results is not None
    assert sorted(results, key=lambda r: len(r["rewards"])) == [
        {"rewards": [], "lengths": [], "versions": []},
        {"rewards": [1.0, 0.0], "lengths": [3, 3], "versions": [1, 1]},
    ]
    assert state.read_groups(10) == []


def test_an_entry_without_a_readable_header_is_dropped(state: JobState) -> None:
    (p0,) = _handed_out(state, 1)
    state.redis.xadd(state.key("groups"), {"group": to_json(_group(p0, 0))})  # no header
    state.redis.xadd(state.key("groups"), {"header": "{", "group": "{}"})
    empty = RolloutGroup(p0, [], [])
    state.redis.xadd(
        state.key("groups"),
        {"header": json.dumps({**json.loads(to_json(GroupHeader.of(_group(p0, 0)))), "rewards": []}),
         "group": to_json(empty)},
    )  # fmt: skip
    assert state.read_groups(10) == []
    assert state.redis.xlen(state.key("groups")) == 0


def test_pushed_group_of_matches_what_push_group_sends(state: JobState) -> None:
    (p0,) = _handed_out(state, 1)
    group = _group(p0, 0)
    state.push_group(group)
    (read,) = state.read_groups(1)
    assert PushedGroup.of(group, read.msg_id) == read
