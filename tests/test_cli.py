"""`nebula-rl status`, `replica ls`, `replica show` against a real controller process (real
Redis, real HTTP), found through the files it leaves in its run folder; `nebula-rl plot`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from PIL import Image

from nebula_rl.cli import build_parser, main
from nebula_rl.controller import start_redis
from nebula_rl.controller.client import ControllerClient

CONFIG = """
[train]
train_batch_per_replica = 16
max_num_steps = 5
[train.train_policy]
type = "grpo"
reward_function = "arithmetic"
allowed_outdated_steps = 1
[train.train_policy.dataset]
name = "builtin:arithmetic"
kwargs = { num_samples = 40 }
[policy]
model_name_or_path = "tiny:qwen2"
[rollout]
backend = "torch"
n_generation = 4
"""


@contextmanager
def running_controller(
    tmp_path: Path, config: str, *, rollout: int
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """`nebula-rl controller` for job `config` (1 policy, `rollout` rollout replicas) on its own
    Redis, once it answers `/health`; yields the process and its run folder, where it wrote its
    address and token; stops it (resumed first, if a test stopped it) after."""
    (tmp_path / "job.toml").write_text(config)
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEBULA_")}
    with start_redis(data_dir=tmp_path / "redis") as redis:
        env["NEBULA_REDIS_URL"] = redis.url
        argv = [sys.executable, "-m", "nebula_rl.cli", "controller", "--config", "job.toml"]
        argv += ["--run-dir", str(run_dir), "--policy", "1", "--rollout", str(rollout)]
        log = (tmp_path / "controller.log").open("wb")
        process = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log, stderr=log)
        try:
            _wait_until_up(run_dir, process)
            yield process, run_dir
        finally:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
                process.send_signal(signal.SIGTERM)
                process.wait(30)
            log.close()


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[Path]:
    """A `nebula-rl controller` process for a job waiting for its replicas; yields its run
    folder, where it wrote its address and token."""
    with running_controller(tmp_path, CONFIG, rollout=2) as (_, run_dir):
        yield run_dir


def _wait_until_up(run_dir: Path, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, "the controller exited; see controller.log"
        address = run_dir / "controller"
        if address.exists():
            try:
                url = f"http://{address.read_text().strip()}/health"
                if httpx.get(url, timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
        time.sleep(0.1)
    raise AssertionError("the controller did not come up")


def _client(run_dir: Path) -> ControllerClient:
    return ControllerClient(
        (run_dir / "controller").read_text().strip(), (run_dir / "token").read_text()
    )


def _check_replica_routes(run_dir: Path) -> None:
    """The replica routes need the token, validate the name, and 404 an unknown one."""
    address = (run_dir / "controller").read_text().strip()
    token = (run_dir / "token").read_text()
    with httpx.Client(base_url=f"http://{address}", timeout=10.0) as http:
        assert http.get("/api/replicas").status_code == 401
        assert http.get("/api/replicas/policy-0").status_code == 401
        auth = {"Authorization": f"Bearer {token}"}
        assert http.get("/api/replicas", headers=auth).json() == {"replicas": []}
        assert http.get("/api/replicas/policy-0", headers=auth).status_code == 404
        assert http.get("/api/replicas/bad%20name", headers=auth).status_code == 422
        assert http.get(f"/api/replicas/{'x' * 200}", headers=auth).status_code == 422


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_status_and_replicas_of_a_running_job(
    controller: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    for name in ("NEBULA_CONTROLLER", "NEBULA_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    assert (controller / "token").stat().st_mode & 0o777 == 0o600
    _check_replica_routes(controller)
    client = _client(controller)
    client.register("policy-0", role="policy")
    client.register("rollout-0", role="rollout", world_size=2)
    client.heartbeat("rollout-0", policy_version=0, stats={"tokens_per_s": 1234.5, "groups": 7})
    run_dir = ["--run-dir", str(controller)]

    # (the API answers once its first process is up; the scheduler releases the first prompts
    # once every API process is)
    deadline = time.monotonic() + 60
    while True:
        code, out, _ = _run(["status", *run_dir, "--json"], capsys)
        assert code == 0
        status = json.loads(out)
        if status["ledger"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert status["step"] == 0 and status["total_steps"] == 5
    # Released so far: the prompts of steps 1 and 2 (allowed_outdated_steps = 1), 4 per step.
    assert status["ledger"]["0"]["total"] == 8
    assert [r["name"] for r in status["replicas"]] == ["policy-0", "rollout-0"]

    code, out, _ = _run(["status", *run_dir], capsys)
    assert code == 0
    assert "step" in out and "0 / 5" in out and "running" in out
    assert "prompt ledger" in out and re.search(r"│ total\s+│\s+8 │", out)
    assert "policy-0" in out and "rollout-0" in out and "1234" in out

    code, out, _ = _run(["replica", "ls", *run_dir], capsys)
    assert code == 0
    rows = [line for line in out.splitlines() if "-0 " in line]
    assert len(rows) == 2
    assert "policy-0" in rows[0] and "none yet" in rows[0]  # no heartbeat, no weights yet
    assert "rollout-0" in rows[1] and " 2 " in rows[1] and "1234" in rows[1]

    # Address and token from flags and the environment instead of the run folder.
    address, token = (controller / "controller").read_text().strip(), client.http.headers
    monkeypatch.setenv("NEBULA_TOKEN", token["Authorization"].removeprefix("Bearer "))
    code, out, _ = _run(["replica", "show", "rollout-0", "--controller", address], capsys)
    assert code == 0
    assert "replica rollout-0" in out and "stats.tokens_per_s" in out and "1234.5" in out
    assert "stats.groups" in out and "s ago" in out
    code, out, _ = _run(["replica", "--controller", address, "show", "rollout-0", "--json"], capsys)
    shown = json.loads(out)
    assert (shown["role"], shown["world_size"], shown["policy_version"]) == ("rollout", 2, 0)
    assert shown["stats"] == {"tokens_per_s": 1234.5, "groups": 7}

    code, _, err = _run(["replica", "show", "rollout-9", "--controller", address], capsys)
    assert code == 1 and "no replica named 'rollout-9'" in err and "404" in err
    code, _, err = _run(["status", "--controller", address, "--token", "wrong"], capsys)
    assert code == 1 and "refused the token" in err
    client.close()


def test_inspection_without_an_address_or_token_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("NEBULA_CONTROLLER", "NEBULA_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    code, _, err = _run(["status"], capsys)
    assert code == 2 and "--controller HOST:PORT, NEBULA_CONTROLLER, or --run-dir" in err
    code, _, err = _run(["replica", "ls", "--controller", "127.0.0.1:1"], capsys)
    assert code == 2 and "token" in err
    code, _, err = _run(["replica", "ls", "--controller", "127.0.0.1:1", "--token", "t"], capsys)
    assert code == 1 and "cannot reach the controller at 127.0.0.1:1" in err


def test_replica_keeps_starting_replicas_beside_ls_and_show() -> None:
    parser = build_parser()
    start = parser.parse_args(
        ["replica", "--role", "rollout", "--controller", "h:1", "--name", "r"]
    )
    assert (start.role, start.controller, start.name, start.replica_command) == (
        "rollout",
        "h:1",
        "r",
        None,
    )
    ls = parser.parse_args(["replica", "ls", "--controller", "h:2"])
    assert (ls.replica_command, ls.controller) == ("ls", "h:2")
    show = parser.parse_args(["replica", "--controller", "h:3", "show", "policy-0"])
    assert (show.replica_command, show.controller, show.name) == ("show", "h:3", "policy-0")
    with pytest.raises(SystemExit) as exit_info:
        main(["replica", "--controller", "h:1"])  # neither --role nor ls/show
    assert exit_info.value.code == 2


def test_plot_writes_a_png_of_the_curves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [
        {"step": s, "reward_mean": s / 40, "response_length_mean": 10 + s % 7, "loss": 0.1}
        for s in range(1, 41)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    code, out, _ = _run(["plot", str(tmp_path)], capsys)
    assert code == 0 and out.strip() == str(tmp_path / "curves.png")
    with Image.open(tmp_path / "curves.png") as image:
        assert image.format == "PNG"
        assert image.size == (1200, 400)  # two panels of 6 x 4 inches at 100 dpi
        pixels = image.convert("RGB")
        colours = pixels.getcolors(maxcolors=1 << 16)
        assert colours is not None and len(colours) > 50  # curves and text, not a blank page
    assert (tmp_path / "curves.png").stat().st_size > 20_000

    sft = tmp_path / "sft"
    sft.mkdir()
    (sft / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "loss": 2.0}) + "\n" + json.dumps({"step": 2, "loss": 1.5}) + "\n"
    )
    code, _, _ = _run(["plot", str(sft), "--out", str(tmp_path / "out" / "sft.png")], capsys)
    assert code == 0
    with Image.open(tmp_path / "out" / "sft.png") as image:
        assert image.size == (600, 400)  # one panel: the loss


def test_plot_of_a_folder_without_metrics_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run(["plot", str(tmp_path)], capsys)
    assert code == 2 and "metrics.jsonl not found" in err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n')
    code, _, err = _run(["plot", str(tmp_path)], capsys)
    assert code == 2 and "metrics.jsonl:2: not a step record" in err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "lr": 0.1}\n')
    code, _, err = _run(["plot", str(tmp_path)], capsys)
    assert code == 2 and "has none of reward_mean" in err


def test_plot_merges_the_records_of_a_step(tmp_path: Path) -> None:
    from nebula_rl.cli.plot import read_metrics

    lines = [
        {"step": 0, "val/reward_mean": 0.1},
        {"step": 1, "reward_mean": 0.2, "loss": 0.5},
        {"step": 1, "val/reward_mean": 0.3},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert read_metrics(tmp_path / "metrics.jsonl") == [
        {"step": 0, "val/reward_mean": 0.1},
        {"step": 1, "reward_mean": 0.2, "loss": 0.5, "val/reward_mean": 0.3},
    ]
