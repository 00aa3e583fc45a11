"""Trajectories between hosts (`nebula_rl.flow.transfer`): a policy rank fetches the files it
lacks from the rollout replica that wrote them, over a two-rank gloo group that meets in the
job's Redis; a holder that is gone gives nothing, at once; a holder deletes what was trained.
Here the two "hosts" are two trajectory folders on this machine (tests/test_multinode.py runs
a world-model job across network namespaces, each with its own /dev/shm)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from nebula_rl.controller import JobState, RedisServer, connect
from nebula_rl.flow.sampler import Trajectory
from nebula_rl.flow.trajectories import TrajectoryStore
from nebula_rl.flow.transfer import TrajectoryServer, fetch_trajectories
from nebula_rl.protocol import Completion, Prompt, RolloutGroup


@pytest.fixture
def state(redis_server: RedisServer) -> JobState:
    return JobState(connect(redis_server.url), "job-t")


def _trajectory(seed: int, *, given: bool = False) -> Trajectory:
    g = torch.Generator().manual_seed(seed)
    return Trajectory(
        latents=torch.randn(4, 5, 3, 2, 8, 8, generator=g),
        log_probs=torch.randn(4, 4, generator=g, dtype=torch.float64),
        sigmas=torch.linspace(1, 0, 5),
        noise_level=0.7,
        given=torch.tensor([[True, False]] * 4) if given else None,
    )


def _prompt(index: int) -> Prompt:
    return Prompt(f"0:{index}", 0, index, f"caption {index}", "")


def _hand_in(state: JobState, claimed: list[tuple[str, Prompt]], replica: str) -> None:
    """What a rollout replica and the controller do with `claimed` prompts: push a group of
    each (rewards by index), acknowledge the prompts, accept the groups."""
    for _, prompt in claimed:
        completion = Completion([], [], "", "stop", [(0, 0)], reward=float(prompt.index))
        state.push_group(RolloutGroup(prompt, [], [completion] * 2, replica))
    state.ack_prompts([m for m, _ in claimed])
    for msg_id, group in state.poll_groups(8):
        assert state.accept_group(group, 0, 1, msg_id=msg_id)


def _server(state: JobState, tmp_path: Path, name: str) -> TrajectoryServer:
    state.register_replica(name, role="rollout", host="node-2", world_size=1)
    server = TrajectoryServer(state, name, TrajectoryStore(tmp_path / name), timeout=20.0)
    server.start()
    return server


def test_a_policy_rank_fetches_another_hosts_trajectories_bit_for_bit(state, tmp_path):
    servers = [_server(state, tmp_path, f"rollout-{i}") for i in range(2)]
    try:
        written: dict[str, tuple[str, Trajectory]] = {}
        for i in range(5):
            server = servers[i % 2]
            t = _trajectory(i, given=i == 3)
            file = server.store.write(f"0:{i}", t)
            server.wrote(file, _prompt(i))
            written[file] = (server.name, t)
        wanted: dict[str, list[str]] = {}
        for file, (holder, _) in written.items():
            wanted.setdefault(holder, []).append(file)
        wanted["rollout-0"].append("0_9.000000000000.safetensors")  # (never written)

        got = fetch_trajectories(state, wanted, timeout=20.0)

        assert got.pop("0_9.000000000000.safetensors") is None
        assert set(got) == set(written)
        for file, (_, t) in written.items():
            back = got[file]
            assert back is not None
            assert torch.equal(back.latents, t.latents) and back.latents.dtype == torch.float32
            assert (
                torch.equal(back.log_probs, t.log_probs) and back.log_probs.dtype == torch.float64
            )
            assert torch.equal(back.sigmas, t.sigmas) and back.noise_level == t.noise_level
            assert (back.given is None) == (t.given is None)
            if t.given is not None:
                assert back.given is not None and torch.equal(back.given, t.given)
        assert sum(s.served for s in servers) == 5
        # (a request nobody takes is not left behind)
        assert not state.redis.keys(state.key("trajectory_requests", "*"))
    finally:
        for server in servers:
            server.stop(job_ended=True)
    assert not list((tmp_path / "rollout-0").glob("*.safetensors"))  # (the job ended)


def test_a_holder_that_is_gone_gives_nothing_without_waiting(state, tmp_path):
    # Never registered (or reaped): no request at all.
    start = time.monotonic()
    got = fetch_trajectories(state, {"rollout-9": ["0_1.abc.safetensors"]}, timeout=30.0)
    assert got == {"0_1.abc.safetensors": None} and time.monotonic() - start < 2.0
    # Registered but not answering (a dead process the controller has not reaped yet): the
    # fetch waits until the holder leaves the registry, not for its whole timeout.
    state.register_replica("rollout-8", role="rollout", host="node-3", world_size=1)
    start = time.monotonic()
    threading.Timer(1.5, state.unregister_replica, args=("rollout-8",)).start()
    got = fetch_trajectories(state, {"rollout-8": ["0_2.abc.safetensors"]}, timeout=30.0)
    assert got == {"0_2.abc.safetensors": None}
    assert 1.4 < time.monotonic() - start < 10.0


def test_a_holder_deletes_the_files_of_trained_prompts(state, tmp_path):
    server = TrajectoryServer(state, "rollout-0", TrajectoryStore(tmp_path / "r0"), timeout=5.0)
    state.enqueue_prompts([_prompt(i) for i in range(3)])
    claimed = state.claim_prompts("rollout-0", 3)
    files = {}
    for _, prompt in claimed:
        files[prompt.index] = server.store.write(prompt.prompt_id, _trajectory(prompt.index))
        server.wrote(files[prompt.index], prompt)
    _hand_in(state, claimed, "rollout-0")
    assert server.cleanup() == 0  # (accepted, not trained)
    batch = state.next_batch(2)
    assert batch is not None
    state.mark_trained([g.prompt.prompt_id for g in batch], step=1)
    assert server.cleanup() == 2
    left = {p.name for p in server.store.root.glob("*.safetensors")}
    trained = {g.prompt.index for g in batch}
    assert left == {f for i, f in files.items() if i not in trained}


def test_a_lost_batch_goes_back_and_its_lost_prompts_are_sampled_again(state):
    state.enqueue_prompts([_prompt(i) for i in range(4)])
    _hand_in(state, state.claim_prompts("rollout-0", 4), "rollout-0")
    batch = state.next_batch(3)
    assert batch is not None
    lost = [batch[0].prompt.prompt_id, batch[2].prompt.prompt_id]

    assert state.release_inflight(lost) == 2

    assert state.inflight_batch() == [] and state.buffer_size() == 2
    again = state.claim_prompts("rollout-1", 10)
    assert sorted(p.prompt_id for _, p in again) == sorted(lost)
    _hand_in(state, again, "rollout-1")  # (accepted again, though their ids were accepted)
    final = state.next_batch(4)
    assert final is not None
    # (the kept groups first, in their order, then the new ones)
    assert [g.prompt.prompt_id for g in final[:1]] == [batch[1].prompt.prompt_id]
    state.mark_trained([g.prompt.prompt_id for g in final], step=1)
    summary = state.ledger_summary(0)
    assert summary["trained"] == 4 and summary["trained_more_than_once"] == 0
    assert summary["trajectories_lost"] == 2
