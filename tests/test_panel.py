"""The controller's web dashboard (`/panel`) in a real headless Chromium.

A real controller (scheduler, HTTP API, private Redis) runs a job whose replicas join and
heartbeat through the replica client; the rollout side pushes groups to Redis and the policy
side reports steps through the results stream, so the steps reach `metrics.jsonl` and the page
through the same code as in a job. Only the tensors are missing: the policy's metrics are chosen
by the test. Debian's `chromium` is driven by Playwright (no browser download); a screenshot is
kept in `artifacts/panel.png`.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from PIL import Image
from playwright.sync_api import Page, expect, sync_playwright

from nebula_rl.config import Config
from nebula_rl.controller import JobState, connect, create_app, serve, start_redis
from nebula_rl.controller.client import TOKEN_ENV, ReplicaSession
from nebula_rl.controller.panel import MetricsLog, cookie_name, replica_rows, session_value
from nebula_rl.controller.scheduler import Scheduler
from nebula_rl.data import rl_rows
from nebula_rl.protocol import Completion, RolloutGroup

TOKEN = "panel-test-token-0123456789"
BATCH = 4
ARTIFACT = Path(__file__).resolve().parents[1] / "artifacts" / "panel.png"
CHROMIUM_ENV = "NEBULA_CHROMIUM"
REQUIRE_ENV = "NEBULA_REQUIRE_BROWSER"
ROLLOUT_TOKENS_PER_S = 321.5


def _chromium() -> str:
    """Debian's chromium (or `$NEBULA_CHROMIUM`). Without one the test is skipped, saying why;
    where `$NEBULA_REQUIRE_BROWSER=1` (CI sets it) a missing browser fails it instead."""
    found = os.environ.get(CHROMIUM_ENV) or shutil.which("chromium")
    if not found:
        why = (
            "the dashboard's browser test needs a Chromium binary: `apt-get install -y chromium` "
            f"(.ci/run does this) or set {CHROMIUM_ENV} to one"
        )
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    return found


def _cfg(grpo_job_config: Callable[..., Config]) -> Config:
    # Heartbeats every second (a fifth of the timeout), so the table fills quickly; validation
    # of the weights of every second step on 2 held-out rows.
    return grpo_job_config(
        {
            "controller": {"heartbeat_timeout": 5.0},
            "train": {"train_policy": {"dataset": {"test_size": 2}}},
            "validation": {"enable": True, "freq": 2},
        },
        timestamp="panel",
        num_rows=26,
        groups=BATCH,
        n_generation=2,
    )


@dataclass
class _Job:
    """A running controller with a policy and a rollout replica joined."""

    url: str
    scheduler: Scheduler
    policy: ReplicaSession
    rollout: ReplicaSession


@pytest.fixture
def job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, grpo_job_config: Callable[..., Config]
) -> Iterator[_Job]:
    cfg = _cfg(grpo_job_config)
    rows = rl_rows(cfg)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with ExitStack() as stack:
        redis = stack.enter_context(start_redis(data_dir=tmp_path / "redis"))
        state = JobState(connect(redis.url), "panel-job")
        scheduler = Scheduler(
            cfg, state, rows=rows, total_steps=len(rows) // BATCH, num_rollout=1, run_dir=run_dir
        )
        app = create_app(
            state=state,
            config_json=cfg.model_dump(mode="json"),
            token=TOKEN,
            meta_extra={"redis_url": redis.url, "total_steps": scheduler.total_steps},
            metrics_path=scheduler.metrics_path,
            heartbeat_timeout=cfg.controller.heartbeat_timeout,
        )
        server = stack.enter_context(serve(app))
        monkeypatch.setenv(TOKEN_ENV, TOKEN)
        sessions = []
        for name, role in (("policy-0", "policy"), ("rollout-0", "rollout")):
            session = ReplicaSession.join(server.url, name=name, role=role)
            stack.callback(session.leave)
            session.policy_version = session.state.policy_version
            if role == "rollout":
                session.stats = lambda: {"tokens_per_s": ROLLOUT_TOKENS_PER_S, "groups": 3.0}
            session.start_heartbeats()
            sessions.append(session)
        # The policy group forms as the scheduler's sync_groups and the joining worker make it
        # (done by hand here, as in test_runtime.py: the test drives the scheduler step by step).
        record = state.publish_group("policy", ["policy-0"], ids={"policy-0": 1})
        state.confirm_member("policy", record["generation"], "policy-0", {"version": 0})
        yield _Job(server.url, scheduler, *sessions)


def _metrics(step: int) -> dict[str, float]:
    """What the policy replica reports for `step` (chosen by the test, shaped like the trainer's)."""
    return {
        "reward_mean": [0.25, 0.5, 0.875, 0.75][step - 1],
        "reward_std": 0.4,
        "loss": 0.1 / step,
        "kl": 0.01 * step,
        "entropy": 2.0 - 0.1 * step,
        "response_length_mean": 2.5 + step,
        "num_tokens": 40.0,
        "num_sequences": float(BATCH * 2),
    }


def _record_step(job: _Job) -> int:
    """One step through the real paths: the rollout replica answers the released prompts over
    Redis, the scheduler batches them and commands the policy replica, which reports its metrics;
    the scheduler records the step in `metrics.jsonl`. Returns the step."""
    scheduler, rollout, policy = job.scheduler, job.rollout.state, job.policy.state
    scheduler.release_prompts()
    version = rollout.policy_version()
    for msg_id, prompt in rollout.claim_prompts("rollout-0", 100):
        right = Completion([5, 2], [-0.5, -0.1], "7", "stop", [(0, version)], reward=1.0)
        wrong = Completion([6, 2], [-0.5, -0.1], "8", "stop", [(0, version)], reward=0.0)
        rollout.push_group(RolloutGroup(prompt, [1, 2], [right, wrong], "rollout-0"))
        rollout.ack_prompts([msg_id])
    scheduler.judge_groups(block_ms=0)
    scheduler.schedule_step()
    [(msg_id, command)] = policy.read_commands("policy-0", block_ms=5000)
    result = {
        "type": "train",
        "name": "policy-0",
        "generation": command["generation"],
        "rank": 0,
        "step": command["step"],
        "prompt_ids": command["prompt_ids"],
        "metrics": _metrics(command["step"]),
        "train_time": 0.05,
    }
    policy.push_result(result)
    policy.ack_command("policy-0", msg_id)
    scheduler.collect_results()
    assert scheduler.state.step() == command["step"]
    _validate(job)
    return command["step"]


def _validate(job: _Job) -> None:
    """The rollout replica answers the validation the scheduler handed out, if any: reward
    0.1 x the validated step."""
    rollout = job.rollout.state
    for msg_id, prompt in rollout.claim_validation("rollout-0", 100):
        reward = 0.1 * prompt.min_version
        completion = Completion([5], [], "7", "stop", [(0, prompt.min_version)], reward=reward)
        rollout.push_group(RolloutGroup(prompt, [1], [completion] * 2, "rollout-0"))
        rollout.ack_validation([msg_id])
    job.scheduler.judge_groups(block_ms=0)
    assert job.scheduler.state.pending_validations() == []


def _row(page: Page, name: str) -> list[str]:
    return page.locator(f'#replicas tbody tr[data-name="{name}"] td').all_inner_texts()


def test_panel_shows_replicas_and_plots_update_in_chromium(job: _Job) -> None:
    assert _record_step(job) == 1 and _record_step(job) == 2
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=_chromium())
        try:
            # A browser without the cookie is refused.
            stranger = browser.new_page()
            response = stranger.goto(f"{job.url}/panel")
            assert response is not None and response.status == 401
            stranger.close()

            page = browser.new_page(viewport={"width": 1280, "height": 900})
            requests: list[str] = []
            problems: list[str] = []
            page.on("request", lambda r: requests.append(r.url))
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(str(e)))
            response = page.goto(f"{job.url}/panel?token={TOKEN}")
            assert response is not None and response.status == 200
            assert page.url == f"{job.url}/panel"  # the token left the address bar
            [cookie] = page.context.cookies()
            assert cookie["name"] == cookie_name("panel-job") and cookie["value"] != TOKEN
            assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"

            # The replica table: both replicas, with what their heartbeats reported.
            rows = page.locator("#replicas tbody tr")
            expect(rows).to_have_count(2)
            host = socket.gethostname()
            expect(rows.nth(0)).to_contain_text("policy-0")
            expect(rows.nth(1)).to_contain_text(f"{ROLLOUT_TOKENS_PER_S} tok/s")
            policy_row, rollout_row = _row(page, "policy-0"), _row(page, "rollout-0")
            assert policy_row[:4] == ["policy-0", "policy", "alive", host], policy_row
            assert rollout_row[:4] == ["rollout-0", "rollout", "alive", host], rollout_row
            assert policy_row[6] == "–"  # a policy replica reports no generation speed
            expect(page.locator("#step")).to_have_text("2 / 6")
            # Heartbeats carry the version each replica holds: it follows the job.
            version_cell = page.locator('#replicas tr[data-name="rollout-0"] td').nth(5)
            expect(version_cell).to_have_text("2")

            reward = page.locator('svg[data-metric="reward"]')
            expect(reward).to_have_attribute("data-points", "2")
            # The validation of step 2 came in a record of its own: merged into step 2's.
            val_reward = page.locator('svg[data-metric="val_reward"]')
            expect(val_reward).to_have_attribute("data-points", "1")
            expect(val_reward).to_have_attribute("data-last-step", "2")
            assert reward.locator("polyline").count() == 1
            tokens = page.locator('svg[data-metric="tokens_per_s"] polyline')
            expect(tokens).to_have_count(2)  # rollout and train tokens/s
            expect(page.locator('svg[data-metric="staleness"] polyline')).to_have_count(2)

            # A new step reaches the plots without a reload.
            before = reward.locator("polyline").get_attribute("points")
            assert _record_step(job) == 3
            expect(reward).to_have_attribute("data-points", "3")
            expect(reward).to_have_attribute("data-last-step", "3")
            reward_card = page.locator(".card", has=reward)
            expect(reward_card.locator(".value")).to_have_text("0.875")
            for metric in ("loss", "kl", "entropy", "response_length", "tokens_per_s"):
                svg = page.locator(f'svg[data-metric="{metric}"]')
                expect(svg).to_have_attribute("data-points", "3")
            assert reward.locator("polyline").get_attribute("points") != before
            expect(page.locator("#step")).to_have_text("3 / 6")
            expect(version_cell).to_have_text("3")
            assert _record_step(job) == 4  # its validation's record comes after the step's
            expect(val_reward).to_have_attribute("data-points", "2")
            expect(val_reward).to_have_attribute("data-last-step", "4")
            expect(page.locator(".card", has=val_reward).locator(".value")).to_have_text("0.4")
            expect(reward).to_have_attribute("data-points", "4")

            # A video model's grid of step 4: the page plays its animated GIF.
            samples = job.scheduler.run_dir / "samples"
            samples.mkdir(exist_ok=True)
            frames = [Image.new("RGB", (16, 8), (200 * t, 40, 40)) for t in range(2)]
            frames[0].save(samples / "step_4.png")
            frames[0].save(samples / "step_4.gif", save_all=True, append_images=frames[1:])
            grid = page.locator("#samples")
            expect(grid).to_have_attribute("src", "/api/panel/samples?step=4&animated=true")
            expect(page.locator("#samples-title")).to_have_text("Samples (step 4)")
            page.wait_for_function("document.getElementById('samples').naturalWidth === 16")

            ARTIFACT.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACT), full_page=True)
            assert ARTIFACT.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            # Nothing came from elsewhere, and the CSP let the inline script and style run.
            assert requests and all(u.startswith(job.url) for u in requests), requests
            assert problems == [], problems
        finally:
            browser.close()


def test_panel_auth_cookie_is_scoped_to_the_dashboard(job: _Job) -> None:
    with httpx.Client(base_url=job.url, timeout=10.0) as client:
        for path in ("/panel", "/api/panel"):
            reply = client.get(path)
            assert reply.status_code == 401 and "panel?token=" in reply.json()["detail"]
        queries = ["token=wrong", f"token={TOKEN}x", "token=", "token=%ff%00", "token"]
        for query in [*queries, f"token={TOKEN}&token={TOKEN}"]:
            reply = client.get(f"/panel?{query}")
            assert reply.status_code == 401 and "set-cookie" not in reply.headers, query

        login = client.get(f"/panel?token={TOKEN}")
        assert login.status_code == 303 and login.headers["location"] == "/panel"
        set_cookie = login.headers["set-cookie"]
        assert TOKEN not in set_cookie and "HttpOnly" in set_cookie
        assert "SameSite=Strict" in set_cookie
        cookie = {"Cookie": f"{cookie_name('panel-job')}={session_value(TOKEN)}"}

        page = client.get("/panel", headers=cookie)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "unsafe-inline" not in csp
        data = client.get("/api/panel", headers=cookie).json()
        assert [r["name"] for r in data["replicas"]] == ["policy-0", "rollout-0"]
        assert data["metrics"] == [] and data["step"] == 0
        assert client.get("/api/panel?since=-1", headers=cookie).status_code == 422
        # The bearer header works as everywhere else.
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        assert client.get("/api/panel", headers=bearer).status_code == 200

        # The cookie opens the dashboard only: no other endpoint, no writes.
        for path in ("/api/meta", "/api/status"):
            assert client.get(path, headers=cookie).status_code == 401
        body = {"name": "intruder", "role": "rollout", "host": "h", "world_size": 1}
        assert client.post("/api/replica/register", json=body, headers=cookie).status_code == 401
        wrong = {"Cookie": f"{cookie_name('panel-job')}={session_value('other')}"}
        assert client.get("/api/panel", headers=wrong).status_code == 401

    _record_step(job)
    with httpx.Client(base_url=job.url, timeout=10.0, headers=bearer) as client:
        data = client.get("/api/panel").json()
        [record] = data["metrics"]
        assert record["step"] == 1 and record["reward_mean"] == 0.25 and data["cursor"] == 1
        assert client.get("/api/panel?since=1").json()["metrics"] == []
        _record_step(job)  # step 2 and, in a record of its own, its validation
        data = client.get("/api/panel?since=1").json()
        [record] = data["metrics"]
        assert record["step"] == 2 and record["reward_mean"] == 0.5 and data["cursor"] == 3
        assert record["val/reward_mean"] == pytest.approx(0.2) and record["val/rollout_count"] == 4
        # A cursor from before a controller restart (ahead of the new one's) gets everything.
        assert [r["step"] for r in client.get("/api/panel?since=99").json()["metrics"]] == [1, 2]


def test_metrics_log_reads_complete_lines_and_restarts_on_rewrite(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    metrics = MetricsLog(path)
    assert metrics.since(0) == []  # no file yet
    path.write_text(json.dumps({"step": 1, "loss": 0.5, "note": "x"}) + "\n" + '{"step": 2, "lo')
    assert metrics.since(0) == [{"step": 1, "loss": 0.5}]  # the half-written line waits
    with path.open("a") as f:
        f.write('ss": NaN}\n')
    assert metrics.since(0) == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": None}]
    assert metrics.since(1) == [{"step": 2, "loss": None}]
    with path.open("a") as f:  # lines that are not step records are skipped
        f.write('{"step": 3, "lo{"step": 3, "loss": 1.0}\n[1]\n{"loss": 2.0}\n{"step": 4}\n')
    assert [r["step"] for r in metrics.since(0)] == [1, 2, 4]
    # The lines of a step merge; a step changed by a later line comes again, whole.
    records, cursor = metrics.read(0)
    assert cursor == 3 and [r["step"] for r in records] == [1, 2, 4]
    with path.open("a") as f:
        f.write(json.dumps({"step": 2, "val/reward_mean": 0.5}) + "\n")
    assert metrics.read(cursor) == ([{"step": 2, "loss": None, "val/reward_mean": 0.5}], 4)
    assert metrics.read(4) == ([], 4)
    # A resume rewrites the file without the steps after its checkpoint.
    replaced = tmp_path / "new.jsonl"
    replaced.write_text(json.dumps({"step": 1, "loss": 0.25}) + "\n")
    replaced.replace(path)
    assert metrics.since(0) == [{"step": 1, "loss": 0.25}]
    assert metrics.read(4) == ([{"step": 1, "loss": 0.25}], 5)  # the cursor goes on


def test_replica_states_follow_heartbeat_age() -> None:
    def info(role: str, last: float) -> dict[str, object]:
        return {
            "role": role,
            "host": "h",
            "world_size": 1,
            "last_heartbeat": last,
            "policy_version": 0,
            "stats": {},
        }

    replicas = {"r-late": info("rollout", 94.0), "r-ok": info("rollout", 99.0)}
    replicas |= {"p-lost": info("policy", 60.0)}
    rows = replica_rows(replicas, now=100.0, heartbeat_timeout=30.0)
    assert [(r["name"], r["state"]) for r in rows] == [
        ("p-lost", "lost"),
        ("r-late", "alive"),
        ("r-ok", "alive"),
    ]
    rows = replica_rows(replicas, now=100.0, heartbeat_timeout=15.0)
    assert [r["state"] for r in rows] == ["lost", "late", "alive"]
    assert rows[0]["heartbeat_age_s"] == 40.0 and rows[0]["tokens_per_s"] is None


def test_panel_serves_a_world_models_sample_grids(job: _Job) -> None:
    """A world-model run's grids (`<run>/samples/step_<N>.png`): `/api/panel` names the latest
    step with one, `/api/panel/samples?step=N` serves it to the signed-in browser (the page
    shows it; a video model's animated grid with `animated=true`), and nothing else: no other
    step, no path, no stranger."""
    samples = job.scheduler.run_dir / "samples"
    samples.mkdir()
    grids = {}
    for step in (2, 4):
        png = io.BytesIO()
        Image.new("RGB", (8, 4), (40 * step, 0, 0)).save(png, format="PNG")
        grids[step] = png.getvalue()
        (samples / f"step_{step}.png").write_bytes(grids[step])
    cookie = {"Cookie": f"{cookie_name('panel-job')}={session_value(TOKEN)}"}
    with httpx.Client(base_url=job.url, timeout=10.0) as client:
        answer = client.get("/api/panel", headers=cookie).json()
        assert answer["samples_step"] == 4 and answer["samples_animated"] is False
        reply = client.get("/api/panel/samples?step=4", headers=cookie)
        assert reply.status_code == 200 and reply.headers["content-type"] == "image/png"
        assert reply.content == grids[4]
        assert (
            client.get("/api/panel/samples?step=4&animated=true", headers=cookie).status_code == 404
        )
        (samples / "step_4.gif").write_bytes(b"GIF89a-frames")  # (a video model's, beside it)
        assert client.get("/api/panel", headers=cookie).json()["samples_animated"] is True
        reply = client.get("/api/panel/samples?step=4&animated=true", headers=cookie)
        assert reply.status_code == 200 and reply.headers["content-type"] == "image/gif"
        assert reply.content == b"GIF89a-frames"
        assert client.get("/api/panel/samples?step=3", headers=cookie).status_code == 404
        for query in ("step=-1", "step=../token", "step="):
            assert client.get(f"/api/panel/samples?{query}", headers=cookie).status_code == 422
        assert client.get("/api/panel/samples?step=4").status_code == 401
        page = client.get("/panel", headers=cookie)
        assert "img-src data: 'self'" in page.headers["content-security-policy"]
