"""Remote rewards for language models (`use_remote_reward`): the reward service (served for real,
spawned workers, real HTTP) scores completions' text with the rule rewards; the scores equal the
local ones; a group whose scores do not come back is sent again, not lost; a `--local` job with
remote training and validation rewards runs end to end. The rollout replica's side (generation
goes on while scores are pending) is in test_rollout_worker.py."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest

from conftest import arithmetic_grpo_config
from nebula_rl import local
from nebula_rl.config import ConfigError
from nebula_rl.rewards import RemoteScorer, Scorer, scorer
from nebula_rl.rewards.remote import RemoteRewardClient
from nebula_rl.rewards.service import (
    RequestError,
    RunningService,
    parse_enqueue,
    service_config_from_dict,
    start_service,
)
from nebula_rl.utils.net import free_port

TOKEN = "remote-text-test-token"
TEXT_REWARDS = ["arithmetic", "gsm8k"]


def _service(port: int = 0) -> RunningService:
    rewards = [{"reward_type": r} for r in (*TEXT_REWARDS, "brightness")]
    rewards.append({"reward_type": "reward_helpers:gated_length", "text": True})
    rewards.append({"reward_type": "reward_helpers:text_parts", "text": True})
    cfg = service_config_from_dict({"port": port, "reward_args": rewards}, source="test")
    return start_service(cfg, token=TOKEN)


@pytest.fixture(scope="module")
def svc() -> Iterator[RunningService]:
    running = _service()
    yield running
    running.stop()


def point_client_at(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    """The REMOTE_REWARD_* variables a job reads, for the service at `url`."""
    monkeypatch.setenv("REMOTE_REWARD_ENQUEUE_URL", f"{url}/api/reward/enqueue")
    monkeypatch.setenv("REMOTE_REWARD_FETCH_URL", f"{url}/api/reward/pull")
    monkeypatch.setenv("REMOTE_REWARD_TOKEN", TOKEN)


def remote_changes(*fns: dict[str, Any], **remote: Any) -> dict[str, Any]:
    """A change of the arithmetic job: remote rewards `fns` instead of `reward_function`."""
    table = {"reward_fns": list(fns), **remote}
    return {
        "train": {
            "train_policy": {
                "reward_function": None,
                "use_remote_reward": True,
                "remote_reward": table,
            }
        }
    }


TEXTS = ["12", " 12\n", "13", "#### 12", "so 12", "x", "-12"]


def test_remote_scores_equal_the_local_rule_scores(svc, tmp_path, monkeypatch):
    point_client_at(monkeypatch, svc.url)
    local_cfg = arithmetic_grpo_config(
        tmp_path,
        {"train": {"train_policy": {"reward_function": {"arithmetic": 1.0, "gsm8k": 0.5}}}},
    )
    remote_cfg = arithmetic_grpo_config(
        tmp_path,
        remote_changes(
            {"name": "arithmetic"}, {"name": "gsm8k", "weight": 0.5}, batch_size=3, scale=2.0
        ),
    )
    rule, remote = scorer(local_cfg), scorer(remote_cfg)
    assert isinstance(rule, Scorer) and isinstance(remote, RemoteScorer)
    try:
        lengths = [1] * len(TEXTS)
        want = rule.score_group(TEXTS, lengths, "12")
        got = remote.submit(TEXTS, lengths, "12", group="0:0").result(timeout=60)
    finally:
        remote.close()
    assert [s.terms for s in got] == [s.terms for s in want]  # each function's own value
    assert [s.reward for s in got] == [2.0 * s.reward for s in want]  # (scale 2)
    assert {s.terms["arithmetic"] for s in got} == {0.0, 1.0}  # (a real check: they vary)
    # 7 completions in requests of at most 3: 3 tasks per reward
    assert svc.service.stats()["calls"]["arithmetic"] >= 1


def test_a_text_reward_of_several_scores_counts_its_score_key(svc, tmp_path, monkeypatch):
    """`reward_fns[].score_key` picks one of the scores a text reward answers per completion
    (`a+b`: their sum)."""
    point_client_at(monkeypatch, svc.url)
    parts = "reward_helpers:text_parts"
    for key in ("exact", "exact+chars"):
        cfg = arithmetic_grpo_config(tmp_path, remote_changes({"name": parts, "score_key": key}))
        remote = scorer(cfg)
        try:
            got = remote.submit(TEXTS, [1] * len(TEXTS), "12", group="0:0").result(timeout=60)
        finally:
            remote.close()
        exact = [float(t.strip() == "12") for t in TEXTS]
        chars = [len(t) / 10 for t in TEXTS]
        want = exact if key == "exact" else [e + c for e, c in zip(exact, chars, strict=True)]
        assert [s.terms[parts] for s in got] == pytest.approx(want), key


def test_a_group_is_sent_again_until_the_service_answers(tmp_path, monkeypatch, caplog):
    port = free_port()
    point_client_at(monkeypatch, f"http://127.0.0.1:{port}")  # nothing listens there yet
    cfg = arithmetic_grpo_config(tmp_path, remote_changes({"name": "arithmetic"}))
    client = RemoteRewardClient.from_env(deadline_s=0.3, backoff_base_s=0.05)
    remote = RemoteScorer(cfg.grpo.remote_reward, client, retry_s=0.05)
    caplog.set_level(logging.WARNING, logger="nebula_rl.rewards.scoring")
    try:
        future = remote.submit(["12", "3"], [1, 1], "12", group="7:0")
        deadline = time.monotonic() + 30
        while "sending it again" not in caplog.text:
            assert time.monotonic() < deadline and not future.done()
            time.sleep(0.02)
        assert "group 7:0" in caplog.text and "prompt stays unacknowledged" in caplog.text
        with _service(port):  # the service comes up: the group's scores arrive
            scored = future.result(timeout=60)
    finally:
        remote.close()
    assert [s.reward for s in scored] == [1.0, 0.0]


def test_local_job_trains_and_validates_with_remote_rewards(svc, tmp_path, monkeypatch):
    """A `--local` job scored by the service takes the same steps as one scored in process
    (by a reward that varies: the completion's length)."""
    point_client_at(monkeypatch, svc.url)
    length = "reward_helpers:gated_length"  # (no gate here: it scores at once)
    before = svc.service.stats()["calls"].get(length, 0)
    common = {
        "train": {"max_num_steps": 2, "train_policy": {"dataset": {"test_size": 2}}},
        "validation": {"enable": True, "freq": 2, "n_generation": 2},
    }
    fn = {"name": length, "clip_max": 100.0}
    remote = arithmetic_grpo_config(
        tmp_path,
        remote_changes(fn, batch_size=4, reward_clip_max=100.0),
        common,
        timestamp="remote",
    )
    assert remote.validation.use_remote_reward is None  # inherits training's
    here = arithmetic_grpo_config(
        tmp_path,
        {"train": {"train_policy": {"reward_function": length}}},
        common,
        timestamp="here",
    )
    runs = {}
    for cfg in (remote, here):
        run_dir = local.run(cfg)
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        runs[cfg.train.timestamp] = [json.loads(line) for line in lines]
    assert [r["step"] for r in runs["remote"]] == [1, 2]
    assert runs["remote"][-1]["val/rollout_count"] == 2 * 2
    # (a real check: the rewards spread, so the step has a gradient; the GRPO loss itself is
    # 0 up to rounding at ratio 1, whatever the rewards)
    assert all(r["reward_std"] > 0 and r["grad_norm"] > 0 for r in runs["remote"])
    for got, want in zip(runs["remote"], runs["here"], strict=True):
        for key in ("reward_mean", "reward_std", "loss", "grad_norm", "val/reward_mean"):
            assert got.get(key) == want.get(key), key
    # 2 steps of 4 groups (a request of 4 each) and 2 validation groups, scored remotely
    assert svc.service.stats()["calls"][length] - before >= 2


def test_text_and_pixel_rewards_each_take_their_own_media_type():
    header = {"prompts": [""], "reward_fn": {"arithmetic": 1.0}, "media_type": "text"}
    body = json.dumps({**header, "completions": ["1"], "references": ["1"]}).encode() + b"\n"
    parsed = parse_enqueue(body, ["arithmetic", "brightness"], ["arithmetic"])
    assert parsed.input_info == {"media_type": "text", "count": 1}
    with pytest.raises(RequestError, match="'brightness' for text"):
        wrong = {
            **header,
            "reward_fn": {"brightness": 1.0},
            "completions": ["1"],
            "references": ["1"],
        }
        parse_enqueue(
            json.dumps(wrong).encode() + b"\n", ["arithmetic", "brightness"], ["arithmetic"]
        )
    with pytest.raises(ConfigError, match=r"reward_args\[0\]\.text: brightness is known by name"):
        service_config_from_dict({"reward_args": [{"reward_type": "brightness", "text": True}]})
    with pytest.raises(RequestError, match="2 references but 1 prompts"):
        bad = {**header, "completions": ["1"], "references": ["1", "2"]}
        parse_enqueue(json.dumps(bad).encode() + b"\n", ["arithmetic"], ["arithmetic"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"train": {"train_policy": {"use_remote_reward": True}}},
            "train.train_policy.reward_function: with use_remote_reward",
        ),
        ({"train": {"train_policy": {"remote_reward": {"scale": 2.0}}}}, "read only with"),
        (
            remote_changes({"name": "a"}) | {"validation": {"use_remote_reward": False}},
            "validation.use_remote_reward = false",
        ),
        (
            remote_changes({"name": "a"}) | {"validation": {"reward_function": "gsm8k"}},
            "validation.reward_function",
        ),
        (
            {
                "train": {
                    "train_policy": {
                        "reward_function": None,
                        "use_remote_reward": True,
                        "bypass_reward": True,
                        "remote_reward": {"reward_fns": [{"name": "a"}]},
                    }
                }
            },
            "bypass_reward",
        ),
        (
            {
                "train": {
                    "train_policy": {
                        "reward_function": None,
                        "use_remote_reward": True,
                        "filter_reward_metric": "gsm8k",
                        "remote_reward": {"reward_fns": [{"name": "a"}]},
                    }
                }
            },
            "filter_reward_metric",
        ),
    ],
    ids=["both", "unused", "validation", "val_functions", "bypass", "filter"],
)
def test_remote_reward_keys_that_cannot_run_are_refused_by_name(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        arithmetic_grpo_config(tmp_path, change)
