"""Where the launcher puts replicas: their ranks and, on GPUs, disjoint devices (or, with
`mode = "colocated_separated"`, the rollouts on the policy replicas' devices)."""

from __future__ import annotations

import pytest

from nebula_rl.config import config_from_dict
from nebula_rl.launch import plan_placement, thread_env


def _cfg(policy: dict, rollout: dict):
    return config_from_dict(
        {
            "rollout": {"backend": "torch", "parallelism": rollout},
            "policy": {"parallelism": policy},
        }
    )


def test_cosmos_single_node_example_places_eight_gpus() -> None:
    # cosmos-rl --config qwen3-8b-p-tp4-r-tp2-pp1-grpo.toml --policy 1 --rollout 2
    cfg = _cfg({"tp_size": 4}, {"tp_size": 2})
    plan = plan_placement(cfg, num_policy=1, num_rollout=2, num_gpus=8)
    assert [(p.name, p.nproc, p.devices) for p in plan] == [
        ("policy-0", 4, (0, 1, 2, 3)),
        ("rollout-0", 2, (4, 5)),
        ("rollout-1", 2, (6, 7)),
    ]


def test_cpu_ranks_are_processes_without_devices() -> None:
    cfg = _cfg({"dp_shard_size": 2}, {"tp_size": 2})
    plan = plan_placement(cfg, num_policy=2, num_rollout=1, num_gpus=0)
    assert [(p.name, p.nproc, p.devices) for p in plan] == [
        ("policy-0", 2, ()),
        ("policy-1", 2, ()),
        ("rollout-0", 2, ()),
    ]


def test_oversubscribed_threads_wait_passively() -> None:
    """Replicas whose torch threads outnumber the cores get OMP_WAIT_POLICY=PASSIVE; not when
    they fit, nor when the user chose a wait policy."""
    cfg = _cfg({}, {})
    plan = plan_placement(cfg, num_policy=1, num_rollout=1, num_gpus=0)
    env = {"OMP_NUM_THREADS": "1"}
    assert thread_env(cfg, plan, env, cores=2) == {}  # 1 + 1 threads on 2 cores
    cfg.policy.cpu_threads = 2
    assert thread_env(cfg, plan, env, cores=2) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert thread_env(cfg, plan, env, cores=3) == {}
    assert thread_env(cfg, plan, {**env, "OMP_WAIT_POLICY": "ACTIVE"}, cores=2) == {}
    wide = _cfg({"dp_shard_size": 2}, {"tp_size": 2})  # 2 + 2 processes of one thread
    plan = plan_placement(wide, num_policy=1, num_rollout=1, num_gpus=0)
    assert thread_env(wide, plan, env, cores=2) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert thread_env(wide, plan, env, cores=4) == {}


def test_dp_shard_minus_one_fills_what_the_rollouts_leave() -> None:
    cfg = _cfg({"dp_shard_size": -1, "tp_size": 2}, {"tp_size": 2})
    plan = plan_placement(cfg, num_policy=1, num_rollout=2, num_gpus=8)
    assert [(p.nproc, p.devices) for p in plan] == [(4, (0, 1, 2, 3)), (2, (4, 5)), (2, (6, 7))]
    with pytest.raises(ValueError, match=r"dp_shard_size = -1: .* leave 3 per policy replica"):
        plan_placement(_cfg({"dp_shard_size": -1, "tp_size": 2}, {}), num_policy=1,
                       num_rollout=1, num_gpus=4)  # fmt: skip


def test_a_layout_larger_than_the_machine_is_refused_naming_the_keys() -> None:
    cfg = _cfg({"dp_shard_size": 2}, {"tp_size": 2})
    with pytest.raises(ValueError, match=r"needs 6 GPUs .*policy.parallelism.*rollout.parallelism"):
        plan_placement(cfg, num_policy=2, num_rollout=1, num_gpus=4)


def _colocated(policy: dict, rollout: dict):
    cfg = _cfg(policy, rollout)
    cfg.mode = "colocated_separated"
    return cfg


def test_colocated_separated_puts_the_rollouts_on_the_policy_gpus() -> None:
    # one GPU: a whole RL job
    plan = plan_placement(_colocated({}, {}), num_policy=1, num_rollout=1, num_gpus=1)
    assert [(p.name, p.nproc, p.devices) for p in plan] == [
        ("policy-0", 1, (0,)),
        ("rollout-0", 1, (0,)),
    ]
    # two GPUs, two policy replicas: rollout replica i on policy replica i mod 2
    plan = plan_placement(_colocated({}, {}), num_policy=2, num_rollout=3, num_gpus=2)
    assert [(p.name, p.devices) for p in plan] == [
        ("policy-0", (0,)),
        ("policy-1", (1,)),
        ("rollout-0", (0,)),
        ("rollout-1", (1,)),
        ("rollout-2", (0,)),
    ]
    # one policy replica of two ranks: rollout replicas of one take its GPUs in turn, one of two
    # takes both; dp_shard_size = -1 takes every GPU
    plan = plan_placement(
        _colocated({"dp_shard_size": 2}, {}), num_policy=1, num_rollout=3, num_gpus=2
    )
    assert [p.devices for p in plan] == [(0, 1), (0,), (1,), (0,)]
    plan = plan_placement(
        _colocated({"dp_shard_size": -1}, {"tp_size": 2}), num_policy=1, num_rollout=1, num_gpus=2
    )
    assert [(p.nproc, p.devices) for p in plan] == [(2, (0, 1)), (2, (0, 1))]


def test_colocated_separated_refuses_what_does_not_fit() -> None:
    with pytest.raises(ValueError, match=r"rollout.parallelism.tp_size \* pp_size = 2\) must fit"):
        plan_placement(_colocated({}, {"tp_size": 2}), num_policy=1, num_rollout=1, num_gpus=2)
    with pytest.raises(ValueError, match=r"needs 4 GPUs .*policy.parallelism.*has 2"):
        plan_placement(
            _colocated({"dp_shard_size": 2}, {}), num_policy=2, num_rollout=2, num_gpus=2
        )
    # on CPU the ranks are processes, as in the other modes
    plan = plan_placement(_colocated({}, {"tp_size": 2}), num_policy=1, num_rollout=1, num_gpus=0)
    assert [(p.nproc, p.devices) for p in plan] == [(1, ()), (2, ())]


RANK_BODY = """
import os, signal, sys, time
from pathlib import Path
folder = Path(sys.argv[1])
(folder / f"rank{os.environ['RANK']}").write_text(str(os.getpid()))
if os.environ["RANK"] == "1":
    time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)
"""


def test_a_rank_killed_takes_its_siblings_down(tmp_path) -> None:
    """`run_ranks`: when rank 1 of 3 dies (SIGKILL), ranks 0 and 2 are stopped at once (not when
    they exit by themselves, 120 s later), and the exit code says which signal."""
    import os
    import sys
    import time

    from nebula_rl.launch import run_ranks

    script = tmp_path / "rank.py"
    script.write_text(RANK_BODY)
    start = time.monotonic()
    code = run_ranks([sys.executable, str(script), str(tmp_path)], 3, grace_s=5.0)
    assert code == 128 + 9
    assert time.monotonic() - start < 30
    for rank in (0, 2):
        pid = int((tmp_path / f"rank{rank}").read_text())
        assert not os.path.exists(f"/proc/{pid}")  # stopped and reaped


FORK_BODY = """
import os, sys

import torch  # (what makes a fork worth it: loaded once, here)

from nebula_rl.launch.forking import fork_command, why_not_fork

config, out_path = sys.argv[1], sys.argv[2]
env = dict(os.environ)
assert why_not_fork(env) is None, why_not_fork(env)
out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
cli = [sys.executable, "-m", "nebula_rl.cli", "check", "--config"]
good = fork_command([*cli, config], env=env, name="check-good", output=out)
bad = fork_command([*cli, "absent.toml"], env=env, name="check-bad", output=out)
print(good.wait(120), bad.wait(120), good.pid != bad.pid != os.getpid())
"""


def test_a_forked_command_runs_as_an_executed_one_would(tmp_path) -> None:
    """`fork_command` (how the launcher starts replicas where it is safe): the forked `nebula-rl
    check` writes to the given file and exits with its own code, 0 for a valid config and 2 for
    a missing one, as `nebula-rl check` executed would."""
    import subprocess
    import sys

    config = tmp_path / "job.toml"
    config.write_text('[policy]\nmodel_name_or_path = "tiny:qwen2"\n')
    script = tmp_path / "fork.py"
    script.write_text(FORK_BODY)
    out = tmp_path / "out.txt"
    done = subprocess.run(
        [sys.executable, str(script), str(config), str(out)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["0", "2", "True"]
    written = out.read_text()
    assert '"model_name_or_path": "tiny:qwen2"' in written  # the good check's values in force
    assert "absent.toml" in written  # the bad one's error


def test_forking_is_refused_where_it_is_not_safe(monkeypatch) -> None:
    """A process with another thread, a child whose OpenMP settings differ from this process's
    (OpenMP read them when torch loaded), or `NEBULA_FORK=0`: the command is executed instead."""
    import os
    import threading

    import torch

    from nebula_rl.launch.forking import why_not_fork

    env = dict(os.environ)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    gpu_build = torch.version.cuda is not None or getattr(torch.version, "hip", None)
    assert why_not_fork({**env, "NEBULA_FORK": "0"}) == "NEBULA_FORK=0"
    if gpu_build:
        assert why_not_fork(env) == "a GPU build of torch"
        return
    reason = why_not_fork({**env, "OMP_WAIT_POLICY": "PASSIVE"})
    assert reason is not None and ("OMP_WAIT_POLICY" in reason or "threads" in reason)
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        reason = why_not_fork(env)
        assert reason is not None and "threads run here" in reason
    finally:
        stop.set()
        thread.join()


def test_a_run_folder_of_an_earlier_job_is_refused_unless_resumed(tmp_path) -> None:
    """Launching into a run folder an earlier job of that name left (its Redis state) would
    reopen that job's state, and a finished job's replicas would stop at once while the
    controller waited: it is refused by name before anything starts; `train.resume` goes on."""
    from nebula_rl.launch import launch

    run_dir = tmp_path / "same"
    (run_dir / "redis").mkdir(parents=True)
    cfg = config_from_dict({"train": {"output_dir": str(tmp_path), "timestamp": "same"}})
    with pytest.raises(ValueError, match=r"train\.timestamp = 'same': .* holds an earlier job"):
        launch(cfg, run_dir=run_dir)
    assert sorted(p.name for p in run_dir.iterdir()) == ["redis"]  # (nothing written)
