"""`nebula-rl eval` / `generate` (`nebula_rl.eval`): the config forms, pass@k, engine shards as
real processes (2 shards give 1 shard's results), a shard killed mid-run restarted with no row
lost or doubled. The trained demo scoring above its warm start is in `test_recipes.py` (slow)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nebula_rl.config import ConfigError
from nebula_rl.eval import (
    _done_rows,
    eval_config_from_dict,
    evaluate,
    load_eval_config,
    pass_at_k,
)

ROOT = Path(__file__).parents[1]


def _config(tmp_path: Path, **over) -> dict:
    data = {
        "num_gpus": 1,
        "model": {"model_name": "tiny:qwen2", "max_length": 64},
        "dataset": {"name": "builtin:arithmetic", "kwargs": {"num_samples": 12, "seed": 3}},
        "generation": {"n": 3, "temperature": 1.0, "max_tokens": 4, "seed": 5, "batch_size": 4},
        "evaluation": {"reward_function": "arithmetic", "k": [1, 3],
                       "output_dir": str(tmp_path / "out")},
    }  # fmt: skip
    for key, value in over.items():
        section, _, name = key.rpartition(".")
        (data[section] if section else data)[name] = value
    return data


def test_the_seed_forms_load_and_bad_ones_name_the_key_and_file(tmp_path):
    ec = load_eval_config(ROOT / "configs" / "reason_eval.toml")
    assert (ec.num_gpus, ec.model.tp_size, ec.shards()) == (8, 4, 2)
    assert ec.model.model_name == "nvidia/Cosmos-Reason1-7B"
    assert load_eval_config(ROOT / "configs" / "reason_eval.toml", num_gpus=4).shards() == 1
    assert load_eval_config(ROOT / "configs" / "eval_demo.toml").shards() == 2
    path = tmp_path / "bad.toml"
    for text, message in (
        ('num_gpus = 8\ntotal_shard = 4\n[model]\nmodel_name = "m"\ntp_size = 4\n'
         '[dataset]\nname = "d"\n', r"total_shard \(4\) must equal num_gpus / model.tp_size"),
        ('num_gpus = 6\n[model]\nmodel_name = "m"\ntp_size = 4\n[dataset]\nname = "d"\n',
         r"num_gpus \(6\) must be a multiple of model.tp_size \(4\)"),
        ('[model]\nmodel_name = "m"\n[dataset]\nname = "d"\n[evaluation]\nk = [2]\n',
         r"evaluation.k \[2\]: each k must be between 1 and generation.n \(1\)"),
        ('[model]\nmodel_name = "m"\nmodel_nam = "x"\n[dataset]\nname = "d"\n',
         r"model.model_nam"),
    ):  # fmt: skip
        path.write_text(text)
        with pytest.raises(ConfigError, match=rf"{path}.*{message}"):
            load_eval_config(path)
    total = 'num_gpus = 8\ntotal_shard = 2\n[model]\nmodel_name = "m"\ntp_size = 4\n'
    path.write_text(total + '[dataset]\nname = "d"\n')
    assert load_eval_config(path).shards() == 2


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 2) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(5, 3, 3) == 1.0  # fewer failures than k: a pass is certain


def test_two_shards_give_one_shards_results(tmp_path):
    """The same rows, completions, rewards and metrics from 1 and from 2 engine processes; the
    metrics are those of the samples written."""
    one = evaluate(eval_config_from_dict(_config(tmp_path)), output_dir=tmp_path / "one",
                   progress=False)  # fmt: skip
    two = evaluate(eval_config_from_dict(_config(tmp_path, num_gpus=2)),
                   output_dir=tmp_path / "two", progress=False)  # fmt: skip
    samples = [(tmp_path / d / "samples.jsonl").read_text() for d in ("one", "two")]
    assert samples[0] == samples[1]
    records = [json.loads(line) for line in samples[0].splitlines()]
    assert [r["index"] for r in records] == list(range(12))
    assert all(len(r["completions"]) == 3 for r in records)
    assert {k: one[k] for k in ("reward_mean", "pass@1", "pass@3")} == {
        k: two[k] for k in ("reward_mean", "pass@1", "pass@3")
    }
    rewards = [c["reward"] for r in records for c in r["completions"]]
    assert one["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
    assert one["pass@1"] == pytest.approx(one["reward_mean"])  # (arithmetic rewards are 0 / 1)
    # Two shards wrote two files of interleaved rows.
    shard_1 = (tmp_path / "two" / "shard-1.jsonl").read_text().splitlines()
    assert [json.loads(line)["index"] for line in shard_1] == list(range(1, 12, 2))
    assert json.loads((tmp_path / "two" / "results.json").read_text())["rows"] == 12


def _shard_pids(shard: int) -> list[int]:
    """Processes running shard `shard` of an eval (found by their command line)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"nebula_rl.eval" in argv and argv[argv.index(b"nebula_rl.eval") + 3 :][:1] == [
                str(shard).encode()
            ]:
                pids.append(int(entry))
    return pids


def test_a_killed_shard_is_restarted_and_no_row_is_lost_or_doubled(tmp_path):
    """SIGKILL shard 0 after it wrote some rows: the parent starts it again, it skips the rows
    its file holds, and the samples equal an undisturbed run's."""
    over = {"num_gpus": 2, "generation.batch_size": 1}
    data = _config(tmp_path, **over)
    data["dataset"]["kwargs"]["num_samples"] = 60
    ec = eval_config_from_dict(data)
    result: dict = {}
    thread = threading.Thread(
        target=lambda: result.update(evaluate(ec, output_dir=tmp_path / "hit", progress=False))
    )
    thread.start()
    shard_file = tmp_path / "hit" / "shard-0.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if shard_file.exists() and shard_file.read_bytes().count(b"\n") >= 3:
            break
        time.sleep(0.01)
    before = shard_file.read_bytes().count(b"\n")
    pids = _shard_pids(0)
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    thread.join(timeout=240)
    assert result["restarts"] == 1, result
    assert before < 30  # killed mid-way: shard 0 holds 30 rows
    clean = evaluate(ec, output_dir=tmp_path / "clean", progress=False)
    assert (tmp_path / "hit" / "samples.jsonl").read_text() == (
        tmp_path / "clean" / "samples.jsonl"
    ).read_text()
    assert result["pass@1"] == clean["pass@1"]


def test_a_torn_last_line_is_cut_and_its_row_redone(tmp_path):
    path = tmp_path / "shard-0.jsonl"
    path.write_text('{"index": 0}\n{"index": 2}\n{"index": 4, "compl')
    assert _done_rows(path) == {0, 2}
    assert path.read_text() == '{"index": 0}\n{"index": 2}\n'


def test_generate_writes_completions_without_rewards(tmp_path):
    """`nebula-rl generate` as a user runs it, with the seed's `--num_gpus` spelling (2 engine
    shards here): prompts from the dataset (its first `evaluation.limit` rows), completions to
    samples.jsonl, no rewards."""
    config = tmp_path / "gen.toml"
    config.write_text(
        'num_gpus = 1\n[model]\nmodel_name = "tiny:qwen2"\nmax_length = 64\n'
        '[dataset]\nname = "builtin:arithmetic"\nkwargs = { num_samples = 9 }\n'
        "[generation]\nmax_tokens = 3\n"
        f'[evaluation]\nlimit = 5\noutput_dir = "{tmp_path / "gen"}"\n'
    )
    run = subprocess.run(
        [sys.executable, "-m", "nebula_rl.cli", "generate", "--config", str(config),
         "--num_gpus", "2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "gen" / "shard-1.jsonl").is_file()  # (two shards ran)
    records = [json.loads(line) for line in (tmp_path / "gen" / "samples.jsonl").open()]
    assert [r["index"] for r in records] == list(range(5))
    for r in records:
        (completion,) = r["completions"]
        assert "reward" not in completion and 1 <= completion["num_tokens"] <= 3
    assert not (tmp_path / "gen" / "results.json").exists()
    bad = subprocess.run(
        [sys.executable, "-m", "nebula_rl.cli", "eval", "--config", str(tmp_path / "none.toml")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "none.toml: cannot read config" in bad.stderr


def test_a_tensor_parallel_shard_of_a_vision_language_model_samples_like_one_process(tmp_path):
    """`tp_size = 2`: one shard of two gloo ranks (the language model split, the vision tower
    whole on each) on image prompts writes the samples of one unsplit process."""
    data = _config(tmp_path)
    data["model"] = {"model_name": "tiny:qwen3_vl", "max_length": 160}
    data["dataset"] = {"name": "builtin:squares", "kwargs": {"num_samples": 3, "seed": 5}}
    data["generation"]["max_tokens"] = 6
    data["evaluation"] = {"reward_function": ["single_choice", "format"], "pass_reward": 2.0,
                          "k": [1], "output_dir": str(tmp_path / "out")}  # fmt: skip
    one = evaluate(eval_config_from_dict(data), output_dir=tmp_path / "one", progress=False)
    data["num_gpus"] = 2
    data["model"]["tp_size"] = 2
    split = eval_config_from_dict(data)
    assert split.shards() == 1
    two = evaluate(split, output_dir=tmp_path / "tp", progress=False)
    samples = [(tmp_path / d / "samples.jsonl").read_text() for d in ("one", "tp")]
    assert samples[0] == samples[1]
    assert "data:image/png" in samples[0] and one["completions"] == two["completions"] == 9
