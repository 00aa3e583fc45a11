"""`nebula-rl controller` serves its API from a process of its own: a real controller, a real
Redis, real HTTP. The API answers while the scheduler's process is stopped, comes back when it
dies, and never outlives the controller."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch

from nebula_rl.controller.client import ControllerClient
from test_cli import CONFIG, running_controller


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # (it exited meanwhile)
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _api_processes(pid: int) -> list[int]:
    """The controller's API processes (its spawned children, not multiprocessing's tracker)."""
    found = []
    for child in _children(pid):
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes() and _alive(child):
                found.append(child)
        except OSError:
            continue
    return sorted(found)


def _api_process(pid: int) -> int:
    """The controller's one API process."""
    found = _api_processes(pid)
    assert len(found) == 1, f"API processes under {pid}: {found}"
    return found[0]


def _nice(pid: int) -> int:
    """The nice value of process `pid`'s main thread (Linux keeps one per thread)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[16])


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _wait(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _healthy(address: str) -> bool:
    try:
        return httpx.get(f"http://{address}/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


ONE_API = "\n[controller]\napi_processes = 1\n"
"""(The default is two API processes; the tests of one process's restarts pin one.)"""


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """A `nebula-rl controller` with one API process waiting for its replicas; yields it and
    its run folder."""
    with running_controller(tmp_path, CONFIG + ONE_API, rollout=1) as running:
        yield running


def _loads_no_torch(process: subprocess.Popen[bytes]) -> None:
    """Neither the scheduler's process nor the API's has loaded torch (whose import maps
    libtorch)."""
    _wait(lambda: bool(_api_processes(process.pid)))
    for pid in (process.pid, *_api_processes(process.pid)):
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "libc.so" in maps or "libc-" in maps  # (the map of a live process was read)
        assert "libtorch" not in maps, f"process {pid} loaded torch"


def test_the_controller_of_a_language_model_job_loads_no_torch(
    controller: tuple[subprocess.Popen[bytes], Path],
) -> None:
    """The scheduler's process (its dataset read, its Redis state) and the API's never load
    torch: the controller stays light wherever it runs."""
    _loads_no_torch(controller[0])


def test_the_controller_package_imports_no_torch() -> None:
    """Every module of `nebula_rl.controller`, and the world-model modules a controller uses to
    list its rows and trajectory files, import in a fresh interpreter without loading torch."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import nebula_rl.controller as c\n"
        "names = [m.name for m in pkgutil.walk_packages(c.__path__, 'nebula_rl.controller.')]\n"
        "names += ['nebula_rl.flow.clips', 'nebula_rl.flow.prompts', 'nebula_rl.flow.trajectories']\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "assert len(names) > 10, names\n"
        "print('torch' in sys.modules, len(names))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded, count = done.stdout.split()
    assert loaded == "False", f"importing the controller's {count} modules loaded torch"


WORLD_MODEL_CONFIG = """
[train]
train_batch_per_replica = 8
max_num_steps = 3
[train.train_policy]
type = "grpo"
trainer_type = "flow_grpo"
reward_function = "brightness"
mini_batch = 4
[train.train_policy.dataset]
name = "builtin:toy_video"
kwargs = { clips_per_prompt = 2 }
[validation]
enable = true
freq = 2
max_num_prompts = 5
[validation.dataset]
name = "builtin:toy_video"
[rollout]
n_generation = 4
[policy]
model_name_or_path = "tiny:dit"
is_diffusers = true
[policy.diffusers]
is_video = true
inference_size = [8, 8]
inference_frames = 2
train_frames = 2
"""


def test_the_controller_of_a_world_model_job_lists_its_clips_without_torch(
    tmp_path: Path,
) -> None:
    """A world-model job's controller writes the toy dataset (and its validation set) for its
    replicas and hands out a row per clip, listed from the files without reading a clip and
    without loading torch; the replicas read the same clips in the same order."""
    from nebula_rl.config import load_config
    from nebula_rl.flow.job import flow_clips

    with running_controller(tmp_path, WORLD_MODEL_CONFIG, rollout=1) as (process, run_dir):
        _loads_no_torch(process)
        address = (run_dir / "controller").read_text().strip()
        client = ControllerClient(address, (run_dir / "token").read_text(), timeout=10.0)
        num_rows = client.meta()["num_rows"]
        client.close()
    cfg = load_config(tmp_path / "job.toml")
    clips = flow_clips(cfg, run_dir, create=False)  # (what a replica reads)
    val_clips = flow_clips(cfg, run_dir, create=False, validation=True)
    assert num_rows == len(clips) == 8 * 2  # (the toy set's 8 captions, 2 clips each)
    assert len(val_clips) == 5  # (validation.max_num_prompts of its 32)
    assert tuple(clips[0].video.shape) == (3, 2, 8, 8)
    assert clips[0].caption == val_clips[0].caption  # (the same captions, other clips)
    assert not torch.equal(clips[0].video, val_clips[0].video)


def test_the_api_answers_while_the_scheduler_is_stopped_and_comes_back_after_dying(
    controller: tuple[subprocess.Popen[bytes], Path],
) -> None:
    process, run_dir = controller
    address = (run_dir / "controller").read_text().strip()
    client = ControllerClient(address, (run_dir / "token").read_text(), timeout=10.0)
    api = _api_process(process.pid)

    os.kill(process.pid, signal.SIGSTOP)  # the scheduler loop cannot run at all
    try:
        assert client.register("rollout-0", role="rollout")["replica_id"] >= 1
        beat = client.heartbeat("rollout-0", policy_version=0, stats={})
        assert beat == {"policy_version": 0, "step": 0, "finished": None}
    finally:
        os.kill(process.pid, signal.SIGCONT)

    os.kill(api, signal.SIGKILL)  # the watcher notices and starts another on the same port
    _wait(lambda: _healthy(address) and _api_process(process.pid) != api)
    assert client.heartbeat("rollout-0", policy_version=0, stats={})["step"] == 0
    assert process.poll() is None


def test_the_scheduler_loop_yields_to_the_api_and_restarts_keep_the_api_priority(
    tmp_path: Path,
) -> None:
    config = CONFIG + ONE_API + "scheduler_niceness = 10\n"
    with running_controller(tmp_path, config, rollout=1) as (process, run_dir):
        address = (run_dir / "controller").read_text().strip()
        base = os.getpriority(os.PRIO_PROCESS, 0)
        _wait(lambda: _nice(process.pid) == min(19, base + 10))  # (the loop's thread: the main one)
        api = _api_process(process.pid)
        assert _nice(api) == base
        os.kill(api, signal.SIGKILL)
        _wait(lambda: _healthy(address) and _api_process(process.pid) != api)
        assert _nice(_api_process(process.pid)) == base  # started by the watcher, not the loop


def test_several_api_processes_share_the_port_and_each_comes_back(tmp_path: Path) -> None:
    with running_controller(tmp_path, CONFIG, rollout=1) as (process, run_dir):  # (2: the default)
        address = (run_dir / "controller").read_text().strip()
        token = (run_dir / "token").read_text()
        _wait(lambda: len(_api_processes(process.pid)) == 2)
        first, second = _api_processes(process.pid)
        # Fresh connections, so that the kernel hands them to both processes over time.
        for i in range(20):
            client = ControllerClient(address, token, timeout=10.0)
            client.register(f"rollout-{i}", role="rollout")
            assert client.heartbeat(f"rollout-{i}", policy_version=0, stats={})["step"] == 0
        os.kill(first, signal.SIGKILL)  # the other one serves while the watcher restarts it
        client = ControllerClient(address, token, timeout=10.0)
        assert client.heartbeat("rollout-19", policy_version=0, stats={})["step"] == 0
        _wait(lambda: len(_api_processes(process.pid)) == 2)
        assert second in _api_processes(process.pid) and first not in _api_processes(process.pid)
        assert _healthy(address) and process.poll() is None
    _wait(lambda: not _alive(second), 10)  # (stopped with the controller)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_the_api_process_ends_with_the_controller(
    controller: tuple[subprocess.Popen[bytes], Path], sig: signal.Signals
) -> None:
    process, run_dir = controller
    address = (run_dir / "controller").read_text().strip()
    api = _api_process(process.pid)
    process.send_signal(sig)
    process.wait(30)
    _wait(lambda: not _alive(api), 10)  # no orphan keeps the port
    assert not _healthy(address)
