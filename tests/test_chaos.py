"""Chaos: whole jobs as real processes on CPU (`nebula-rl train`), with processes killed
(SIGKILL) or added while they run. Each job must finish and train every prompt of the epoch
exactly once.

The test owns the job's Redis (`redis = <url>` in the config), so it can watch the job's state
and strike at the right moment: a rollout replica while it holds prompts, a policy replica while a
step is in flight. Processes are found among the launcher's descendants by their command line.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from nebula_rl.config import Config
from nebula_rl.controller import JobState, RedisServer, connect
from nebula_rl.controller.client import TOKEN_ENV
from nebula_rl.protocol import GroupHeader, Prompt, from_json
from nebula_rl.weights import free_port

BATCH = 4
N_GENERATION = 4
JOB_TIMEOUT_S = 240.0


def _cfg(
    grpo_job_config: Callable[..., Config],
    redis_url: str,
    *,
    num_rows: int,
    max_response_length: int = 3,
    layout: dict | None = None,
) -> Config:
    """The arithmetic job (conftest) on the test's Redis, with short heartbeats, and `layout`'s
    changes (e.g. `[policy.parallelism]`)."""
    return grpo_job_config(
        {
            "rollout": {"max_response_length": max_response_length},
            "controller": {
                "port": free_port(),
                "heartbeat_timeout": 4.0,
                "collective_timeout": 60.0,
            },
            "redis": redis_url,
        },
        layout or {},
        timestamp="chaos",
        num_rows=num_rows,
        groups=BATCH,
        n_generation=N_GENERATION,
    )


@dataclass
class Job:
    """A running `nebula-rl train` and what the test needs to watch and strike it."""

    cfg: Config
    process: subprocess.Popen[bytes]
    run_dir: Path
    state: JobState
    extra: list[subprocess.Popen[bytes]]
    launcher_log: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.cfg.controller.port}"

    def wait_for(self, what: str, condition: Callable[[], bool], timeout_s: float = 180.0) -> None:
        """Poll `condition` until it holds; fail if the job ends or the time runs out first."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            if self.process.poll() is not None:
                pytest.fail(f"the job ended before {what}:\n{self.stdout[-3000:]}\n{self.logs()}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} within {timeout_s:.0f} s:\n{self.logs()}")
            time.sleep(0.05)

    def steps(self) -> int:
        return self.state.step()

    def pid(self, *needles: str, rank: int | None = None) -> int:
        """The launcher's descendant whose command line has all `needles`; with `rank`, the
        process of that rank of a replica of several (not the process supervising them)."""
        found = [
            pid
            for pid, argv in _descendants(self.process.pid).items()
            if all(n in argv for n in needles) and (rank is None or _rank_of(pid) == rank)
        ]
        assert len(found) == 1, (needles, found)
        return found[0]

    def kill(self, *needles: str, rank: int | None = None) -> int:
        pid = self.pid(*needles, rank=rank)
        os.kill(pid, signal.SIGKILL)
        return pid

    def add_replica(self, role: str, name: str) -> subprocess.Popen[bytes]:
        """Start `nebula-rl replica`, as an operator would, with the job's token."""
        env = {**os.environ, TOKEN_ENV: (self.run_dir / "token").read_text().strip()}
        log_file = (self.run_dir / "logs" / f"{name}.log").open("ab")
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "nebula_rl.cli",
                "replica",
                "--role",
                role,
                "--controller",
                self.address,
                "--name",
                name,
            ],
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.extra.append(process)
        return process

    def logs(self) -> str:
        out = []
        for path in sorted(self.run_dir.glob("logs/*.log")):
            out.append(f"--- {path.name}\n{path.read_text(errors='replace')[-4000:]}")
        return "\n".join(out)

    @property
    def stdout(self) -> str:
        """What the launcher printed."""
        return self.launcher_log.read_text(errors="replace")

    def finish(self) -> dict:
        """Wait for the job to end with 0; its ledger."""
        try:
            self.process.wait(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            pytest.fail(f"the job did not finish:\n{self.stdout[-4000:]}\n{self.logs()}")
        assert self.process.returncode == 0, f"{self.stdout[-4000:]}\n{self.logs()}"
        for process in self.extra:  # replicas started by the test leave once the job ends
            assert process.wait(timeout=60) == 0, self.logs()
        return json.loads((self.run_dir / "ledger.json").read_text())


def _forked_name(pid: int) -> tuple[str, int | None] | None:
    """A process the launcher forked (nebula_rl.launch.forking): its replica's name and rank (None for a
    replica's only or supervising process), from the process's name (`rollout-1`, `policy-1:0`)."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    match = re.fullmatch(r"((?:policy|rollout|teacher)-\d+)(?::(\d+))?", comm)
    if match is None:
        return None
    return match[1], None if match[2] is None else int(match[2])


def _rank_of(pid: int) -> int | None:
    """RANK of a process started by `run_ranks` (None for any other)."""
    forked = _forked_name(pid)
    if forked is not None:
        return forked[1]
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    values = dict(item.split(b"=", 1) for item in environ if b"=" in item)
    if b"NEBULA_RANKS" not in values:
        return None
    return int(values[b"RANK"])


def _descendants(root: int) -> dict[int, str]:
    """pid -> command line (arguments joined by spaces) of every descendant of `root`."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: dict[int, str] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found:
                try:
                    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                forked = _forked_name(pid)  # (its command line is the launcher's)
                if forked is not None:
                    found[pid] = f"replica --name {forked[0]}"
                else:
                    found[pid] = raw.replace(b"\0", b" ").decode(errors="replace")
                frontier.append(pid)
    return found


@pytest.fixture
def start_job(
    tmp_path: Path, redis_server: RedisServer, grpo_job_config: Callable[..., Config]
) -> Iterator[Callable[..., Job]]:
    jobs: list[Job] = []

    def start(*, num_rows: int, policy: int = 1, rollout: int = 1, **kwargs: object) -> Job:
        cfg = _cfg(grpo_job_config, redis_server.url, num_rows=num_rows, **kwargs)  # type: ignore[arg-type]
        config = tmp_path / "job.json"
        config.write_text(cfg.model_dump_json())
        launcher_log = tmp_path / "launcher.log"
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "nebula_rl.cli",
                "train",
                "--config",
                str(config),
                "--policy",
                str(policy),
                "--rollout",
                str(rollout),
            ],
            stdout=launcher_log.open("wb"),
            stderr=subprocess.STDOUT,
            env={**os.environ, "COLUMNS": "200"},
        )
        run_dir = Path(cfg.train.output_dir) / cfg.train.timestamp
        state = JobState(connect(redis_server.url), run_dir.name)
        job = Job(cfg, process, run_dir, state, [], launcher_log)
        jobs.append(job)
        return job

    yield start
    for job in jobs:  # a failed test leaves nothing running
        for process in [job.process, *job.extra]:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()


def _assert_exactly_once(ledger: dict, num_rows: int) -> None:
    assert list(ledger) == ["0"]
    assert ledger["0"]["trained"] == {str(i): 1 for i in range(num_rows)}
    summary = ledger["0"]["summary"]
    assert summary["trained"] == num_rows and summary["trained_more_than_once"] == 0


def _pushed_prompt_ids(job: Job) -> set[str]:
    """The prompts of the groups pushed and not yet taken by the controller."""
    entries = job.state.redis.xrange(job.state.key("groups"))
    return {from_json(GroupHeader, fields["header"]).prompt.prompt_id for _, fields in entries}


def _metrics(job: Job) -> list[dict]:
    return [json.loads(line) for line in (job.run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_rollout_killed_mid_generation(start_job):
    """kill -9 one of two rollout replicas while it holds prompts: its prompts go back to the
    queue, the weight group is rebuilt without it, and the job finishes on the other one."""
    num_rows = 72
    job = start_job(num_rows=num_rows, rollout=2)
    pending = job.state.key("prompts")
    job.wait_for("step 1", lambda: job.steps() >= 1)
    replica = job.pid("replica", "--name rollout-1")

    def rollout_1_worked() -> bool:  # (on a loaded machine it may start after the first steps)
        info = job.state.replicas().get("rollout-1")
        return info is not None and info["stats"].get("groups", 0) >= 1

    job.wait_for("a group from rollout-1", rollout_1_worked)

    def frozen_holding_prompts() -> bool:
        # (frozen before the look: a running replica could hand its prompts in between the look
        # and the kill, and then none would go back to the queue)
        try:
            os.kill(replica, signal.SIGSTOP)
        except ProcessLookupError:
            pytest.fail(f"rollout-1 exited before the test killed it:\n{job.stdout[-3000:]}\n"
                        f"{job.logs()}")  # fmt: skip
        if job.state.redis.xpending_range(pending, "rollout", "-", "+", 100, "rollout-1"):
            return True
        os.kill(replica, signal.SIGCONT)
        return False

    job.wait_for("rollout-1 holding prompts after step 1", frozen_holding_prompts)
    os.kill(replica, signal.SIGKILL)
    ledger = job.finish()
    _assert_exactly_once(ledger, num_rows)
    steps = _metrics(job)
    assert [m["step"] for m in steps] == list(range(1, num_rows // BATCH + 1))
    controller = (job.run_dir / "logs" / "controller.log").read_text()
    assert "replica rollout-1 missed heartbeats" in controller
    assert "rollout-1 exited with" in job.stdout  # the launcher went on without it
    assert ledger["0"]["summary"]["requeue_events"] >= 1


@pytest.mark.slow
def test_rollout_joins_mid_run(start_job):
    """A rollout replica started by hand while the job runs registers, receives the current
    weights and takes work: here all of it. The job's own rollout replica is frozen (SIGSTOP)
    after step 2, so the job cannot end before the newcomer is up, then killed."""
    num_rows = 48
    job = start_job(num_rows=num_rows, rollout=1)
    job.wait_for("step 2", lambda: job.steps() >= 2)
    frozen = job.pid("replica", "--name rollout-0")
    os.kill(frozen, signal.SIGSTOP)
    job.add_replica("rollout", "rollout-new")
    job.wait_for("rollout-new to register", lambda: "rollout-new" in job.state.replicas())
    os.kill(frozen, signal.SIGKILL)

    def new_one_worked() -> bool:
        info = job.state.replicas().get("rollout-new")
        return info is not None and info["stats"].get("groups", 0) >= 1

    job.wait_for("a group from rollout-new", new_one_worked)
    ledger = job.finish()
    _assert_exactly_once(ledger, num_rows)
    assert [m["step"] for m in _metrics(job)] == list(range(1, num_rows // BATCH + 1))
    log = (job.run_dir / "logs" / "rollout-new.log").read_text()
    assert "joined weight group generation" in log
    versions = [
        int(line.split("weights of version ")[1].split()[0])
        for line in log.splitlines()
        if "weights of version" in line
    ]
    # It started from the running job's weights (not the initial ones), then kept up.
    assert versions[0] >= 2 and versions == sorted(versions), versions
    assert "rollout-0 exited with" in job.stdout


@pytest.mark.slow
def test_policy_replica_killed_mid_step(start_job):
    """kill -9 one of two data-parallel policy replicas while a step is in flight: the survivor's
    gradient sum fails, the controller rebuilds the policy group without the dead replica and
    sends the step again, whole, to the survivor; the weight group follows."""
    num_rows = 64
    job = start_job(num_rows=num_rows, policy=2, rollout=1)

    def step_in_flight() -> bool:
        plan = job.state.step_plan()
        return job.steps() >= 1 and plan is not None and "policy-1" not in plan["results"]

    job.wait_for("a step in flight after step 1", step_in_flight)
    job.kill("replica", "--name policy-1")
    ledger = job.finish()
    _assert_exactly_once(ledger, num_rows)
    steps = _metrics(job)
    assert [m["step"] for m in steps] == list(range(1, num_rows // (2 * BATCH) + 1))
    assert [m["policy_version"] for m in steps] == [m["step"] for m in steps]
    # Every step trained the whole global batch, split in two and then not at all.
    for m in steps:
        if not m.get("metrics_lost"):
            assert m["num_sequences"] == 2 * BATCH * N_GENERATION, m
    assert steps[0]["num_policy_replicas"] == 2 and steps[-1]["num_policy_replicas"] == 1
    controller = (job.run_dir / "logs" / "controller.log").read_text()
    assert "policy group generation 2: policy-0" in controller
    assert "policy-1 exited with" in job.stdout


@pytest.mark.slow
def test_controller_killed_and_restarted(start_job):
    """kill -9 the controller mid-run: the launcher restarts it on the same port, it continues
    from Redis (the step in flight included), the replicas reach it again, and every step is
    recorded exactly once."""
    num_rows = 64
    job = start_job(num_rows=num_rows, rollout=1)
    job.wait_for("step 2", lambda: job.steps() >= 2)
    first = job.kill("nebula_rl.cli controller")
    ledger = job.finish()
    _assert_exactly_once(ledger, num_rows)
    steps = _metrics(job)
    assert [m["step"] for m in steps] == list(range(1, num_rows // BATCH + 1))
    assert "the controller was killed by signal 9: restarting it" in job.stdout
    controller = (job.run_dir / "logs" / "controller.log").read_text()
    assert "controller restarted: continuing job chaos from Redis" in controller
    assert f"started controller (pid {first})" in job.stdout
    assert job.stdout.count("started controller") == 2


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2], ids=["one_rank", "two_ranks"])
def test_policy_replica_joins_mid_run(start_job, ranks):
    """A policy replica started by hand while the job runs receives the weights and optimiser
    state of the live one and trains data parallel with it (with two FSDP2 ranks per replica:
    each rank takes the shards of the live replica's rank of the same place). The rollout
    replica is frozen (SIGSTOP) meanwhile, so the job waits for the newcomer; frozen past the
    heartbeat timeout it is removed, and when it thaws it registers again and goes on."""
    num_rows = 48
    layout = {"policy": {"parallelism": {"dp_shard_size": ranks}}}
    job = start_job(num_rows=num_rows, policy=1, rollout=1, layout=layout)
    job.wait_for("step 2", lambda: job.steps() >= 2)
    frozen = job.pid("replica", "--name rollout-0")
    os.kill(frozen, signal.SIGSTOP)
    try:
        job.add_replica("policy", "policy-new")

        def joined() -> bool:
            record = job.state.group_record("policy")
            members = {"policy-0", "policy-new"}
            return record is not None and set(record["confirmed"]) == members == set(
                record["members"]
            )

        job.wait_for("a policy group of policy-0 and policy-new", joined)
        at_join = job.steps()
        # (frozen past the heartbeat timeout: removed, whichever came first)
        job.wait_for("rollout-0 removed", lambda: "rollout-0" not in job.state.replicas())
    finally:
        os.kill(frozen, signal.SIGCONT)
    ledger = job.finish()
    _assert_exactly_once(ledger, num_rows)
    steps = _metrics(job)
    assert [m["step"] for m in steps] == list(range(1, num_rows // BATCH + 1))
    assert {m["num_policy_replicas"] for m in steps[at_join:]} == {2}
    log = (job.run_dir / "logs" / "policy-new.log").read_text()
    joined_at = [line for line in log.splitlines() if "rank 1 of 2 at version" in line]
    assert len(joined_at) >= ranks  # (every rank of the newcomer joined)
    for line in joined_at[:ranks]:
        assert int(line.split("at version ")[1].split()[0]) == at_join
    rollout = (job.run_dir / "logs" / "rollout-0.log").read_text()
    assert "registering again" in rollout


TWO_RANKS = {
    "policy": {"parallelism": {"dp_shard_size": 2}},
    "rollout": {"parallelism": {"tp_size": 2}},
}
"""Replicas of two ranks: FSDP2 policy replicas, tensor-parallel rollout replicas."""


@pytest.mark.slow
def test_rank_of_a_two_rank_policy_replica_killed_mid_step(start_job):
    """Two policy replicas of two FSDP2 ranks, a rollout replica of two TP ranks; kill -9 rank 1
    of policy-1 while a step is in flight: its rank 0 goes down with it, the survivor's ranks
    fail their data-parallel sums together, and the step is trained again by the survivor
    alone; every prompt is trained once."""
    num_rows = 64
    job = start_job(num_rows=num_rows, policy=2, rollout=1, layout=TWO_RANKS)

    def step_in_flight() -> bool:
        plan = job.state.step_plan()
        return job.steps() >= 1 and plan is not None and "policy-1" not in plan["results"]

    job.wait_for("a step in flight after step 1", step_in_flight)
    job.kill("replica", "--name policy-1", rank=1)
    ledger = job.finish()
    _assert_exactly_once(ledger, num_rows)
    steps = _metrics(job)
    assert [m["step"] for m in steps] == list(range(1, num_rows // (2 * BATCH) + 1))
    assert steps[0]["num_policy_replicas"] == 2 and steps[-1]["num_policy_replicas"] == 1
    assert "policy-1 exited with" in job.stdout
    log = (job.run_dir / "logs" / "policy-0.log").read_text()
    assert "[rank 1] policy group generation 2: rank 0 of 1" in log


@pytest.mark.slow
def test_rank_of_a_two_rank_rollout_replica_killed(start_job):
    """The same layout with two rollout replicas; kill -9 rank 1 of rollout-1 while it holds
    prompts: the replica goes down whole, its prompts go back to the queue (or, a group its rank
    0 already had complete, are delivered first), the weight group is rebuilt with rollout-0's
    two ranks, and the job finishes."""
    num_rows = 48
    # One prompt per replica at a time, so that rollout-1 shares the work (with room for
    # several, rollout-0 could claim each step's prompts alone and the window be missed).
    layout = {**TWO_RANKS, "rollout": {"parallelism": {"tp_size": 2}, "max_num_seqs": N_GENERATION}}
    job = start_job(num_rows=num_rows, policy=1, rollout=2, layout=layout)
    pending = job.state.key("prompts")

    def unanswered() -> list[Prompt]:
        """The prompts rollout-1 holds whose group the controller has not got yet (a held prompt
        can be one whose group was pushed, then accepted, before its acknowledgement)."""
        redis = job.state.redis
        held = redis.xpending_range(pending, "rollout", "-", "+", 100, "rollout-1")
        if job.steps() < 1 or not held:
            return []
        entries = [redis.xrange(pending, h["message_id"], h["message_id"]) for h in held]
        prompts = [from_json(Prompt, e[0][1]["prompt"]) for e in entries if e]
        prompts = [p for p in prompts if p.prompt_id not in _pushed_prompt_ids(job)]
        states = job.state.prompt_states(prompts)
        return [p for p, s in zip(prompts, states, strict=True) if s in ("outstanding", "requeued")]

    # Rank 0 (which claims, pushes and acknowledges) frozen while it holds such a prompt, so that
    # the kill finds it held, not raced by the replica finishing it.
    while True:
        job.wait_for("rollout-1 holding prompts after step 1", lambda: bool(unanswered()))
        frozen = job.pid("replica", "--name rollout-1", rank=0)
        os.kill(frozen, signal.SIGSTOP)
        if held := unanswered():
            break
        os.kill(frozen, signal.SIGCONT)
    job.kill("replica", "--name rollout-1", rank=1)
    os.kill(frozen, signal.SIGCONT)  # (its supervisor's SIGTERM then stops it)
    job.wait_for("rollout-1 gone", lambda: "rollout-1" not in job.state.replicas())
    states = job.state.prompt_states(held)
    ledger = job.finish()
    _assert_exactly_once(ledger, num_rows)
    assert [m["step"] for m in _metrics(job)] == list(range(1, num_rows // BATCH + 1))
    assert "rollout-1 exited with" in job.stdout
    # What rollout-1 held went back to the queue, or, where its rank 0 had the group complete
    # when it was frozen (generated, being scored), was delivered before it stopped; never left
    # outstanding.
    delivered = all(state in ("completed", "trained") for state in states)
    assert ledger["0"]["summary"]["requeue_events"] >= 1 or delivered, states
