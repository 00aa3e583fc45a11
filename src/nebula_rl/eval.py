"""Evaluation and batch inference: `nebula-rl eval` and `nebula-rl generate`.

An eval config names a model (`[model] model_name`: a Hub id, a local folder such as a run's
`safetensors/step_N` or `final` export, or a preset), a dataset read as RL training reads it, the
sampling settings and the rewards. `num_gpus` devices (processes on CPU) hold `total_shard =
num_gpus / tp_size` engine instances of `tp_size` ranks each (tensor parallel over NCCL on GPUs,
over gloo on CPU). Dataset row i goes to shard `i % total_shard`, and its request is seeded with
`seed + i * n`, so its completions do not depend on how many shards there are.

Each shard appends one JSON line per finished row to `shard-<k>.jsonl` and flushes it. The parent
supervises the shards: one that dies is started again and skips the rows its file already holds
(a torn last line is dropped and redone), so no row is lost or counted twice. At the end the lines
are merged by row into `samples.jsonl`, and `eval` writes `results.json`: the mean reward and
pass@k (the unbiased estimator of Chen et al., 2021: a completion passes when its reward reaches
`evaluation.pass_reward`). `generate` writes the completions without rewards.

`eval --run RUN_DIR` evaluates each export of a training run (`safetensors/step_N`, then `final`)
and writes `scores.csv` and `scores.png`, the scores against the step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError

from nebula_rl.config import Config, ConfigError, DatasetConfig, config_from_dict
from nebula_rl.config.base import RewardSpec, Section
from nebula_rl.config.errors import format_errors

__all__ = [
    "EvalConfig",
    "checkpoints",
    "evaluate",
    "load_eval_config",
    "pass_at_k",
    "run_checkpoints",
    "summarize",
]


class EvalModelConfig(Section):
    """The model evaluated (`[model]`)."""

    model_name: str
    """A Hub id, a local Hugging Face folder (e.g. a run's `safetensors/step_N` or `final`), or
    a preset `tiny:<name>`."""
    model_revision: str | None = None
    """Hub revision of the model: a branch, tag or commit hash."""
    tp_size: int = Field(default=1, ge=1)
    """Tensor-parallel ranks of each engine instance."""
    backend: Literal["torch", "vllm"] = "torch"
    """nebula-rl: the engine, as `rollout.backend` (`vllm` needs `make setup-vllm`'s
    environment; it starts its own `tp_size` workers, so a shard is one process)."""
    max_length: int = Field(default=4096, ge=8)
    """Longest prompt + completion in tokens."""
    dtype: str = "float32"
    """Weights' dtype (`bfloat16` on GPUs)."""


class EvalGenerationConfig(Section):
    """Sampling (`[generation]`)."""

    n: int = Field(default=1, ge=1)
    """Completions per prompt."""
    temperature: float = Field(default=0.0, ge=0.0)
    """Sampling temperature; 0 is greedy."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling."""
    top_k: int = -1
    """Top-k sampling; -1 or 0: off."""
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    """Repetition penalty."""
    max_tokens: int = Field(default=512, ge=1)
    """Longest completion in tokens."""
    seed: int = 0
    """Row i's completions are seeded with `seed + i * n` (+ the completion's index)."""
    batch_size: int = Field(default=32, ge=1)
    """Rows an engine instance generates at once (and then writes)."""


class EvaluationConfig(Section):
    """What is read and how it is scored (`[evaluation]`)."""

    prompt_column_name: str = "prompt"
    """Dataset column of the prompt (a string or chat messages)."""
    response_column_name: str = "answer"
    """Dataset column of the reference answer (`eval` only)."""
    system_prompt: str = ""
    """A system turn before each prompt."""
    reward_function: RewardSpec = "gsm8k"
    """Rewards, as `train.train_policy.reward_function` takes them."""
    pass_reward: float = 1.0
    """A completion passes (for pass@k) when its reward is at least this."""
    k: list[int] = Field(default_factory=lambda: [1])
    """The k of pass@k (each at most `generation.n`)."""
    limit: int | None = Field(default=None, ge=1)
    """Evaluate only the first `limit` rows."""
    output_dir: str = "outputs/eval"
    """Where `samples.jsonl`, `results.json` and the shards' files go."""
    max_restarts: int = Field(default=2, ge=0)
    """Times a shard that died is started again before the evaluation fails."""


class EvalConfig(Section):
    """An eval / generate config (TOML)."""

    num_gpus: int = Field(default=1, ge=1)
    """Devices (processes on CPU) in all; `total_shard = num_gpus / tp_size` engine instances."""
    total_shard: int | None = Field(default=None, ge=1)
    """Engine instances (derived from `num_gpus / model.tp_size`; when given, it must match)."""
    model: EvalModelConfig
    """The model."""
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    """The dataset, as `train.train_policy.dataset` takes it."""
    generation: EvalGenerationConfig = Field(default_factory=EvalGenerationConfig)
    """Sampling."""
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    """Columns, rewards and outputs."""

    def shards(self) -> int:
        """The number of engine instances, `num_gpus / tp_size`."""
        return self.num_gpus // self.model.tp_size


def load_eval_config(path: str | Path, *, num_gpus: int | None = None) -> EvalConfig:
    """Read an eval config; `num_gpus` (`--num-gpus`) overrides the file's. Errors name the
    file and the key."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as err:
        raise ConfigError(f"{path}: cannot read config: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: invalid TOML: {err}") from None
    if num_gpus is not None:
        data["num_gpus"] = num_gpus
    return eval_config_from_dict(data, source=str(path))


def eval_config_from_dict(data: dict[str, Any], *, source: str = "<dict>") -> EvalConfig:
    """Validate a parsed eval config (see :func:`load_eval_config`)."""
    try:
        ec = EvalConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_errors(err, source)) from None
    problems = []
    tp = ec.model.tp_size
    if ec.num_gpus % tp:
        problems.append(f"num_gpus ({ec.num_gpus}) must be a multiple of model.tp_size ({tp})")
    elif ec.total_shard is not None and ec.total_shard != ec.shards():
        problems.append(
            f"total_shard ({ec.total_shard}) must equal num_gpus / model.tp_size "
            f"({ec.num_gpus} / {tp} = {ec.shards()}); leave it out to derive it"
        )
    too_big = [k for k in ec.evaluation.k if not 1 <= k <= ec.generation.n]
    if too_big:
        problems.append(
            f"evaluation.k {too_big}: each k must be between 1 and generation.n ({ec.generation.n})"
        )
    if not ec.dataset.name:
        problems.append("dataset.name: no dataset named")
    if problems:
        raise ConfigError("\n".join(f"{source}: {p}" for p in problems))
    return ec


def training_config(ec: EvalConfig, *, model: str | None = None) -> Config:
    """The training config whose rollout side does what `ec` asks (model, dataset, columns,
    rewards, engine), so that evaluation reads rows, renders prompts, generates and scores as
    training does. (Sampling is `[generation]`'s, which may be greedy: see `_sampling`.)"""
    e, g = ec.evaluation, ec.generation
    return config_from_dict(
        {
            "train": {
                "seed": g.seed,
                "param_dtype": ec.model.dtype,
                "train_policy": {
                    "type": "grpo",
                    "dataset": ec.dataset.model_dump(exclude_defaults=True),
                    "prompt_column_name": e.prompt_column_name,
                    "response_column_name": e.response_column_name,
                    "system_prompt": e.system_prompt,
                    "reward_function": e.reward_function,
                },
            },
            "policy": {
                "model_name_or_path": model or ec.model.model_name,
                "model_revision": ec.model.model_revision,
                "model_max_length": ec.model.max_length,
            },
            "rollout": {
                "backend": ec.model.backend,
                "parallelism": {"tp_size": ec.model.tp_size if ec.model.backend == "vllm" else 1},
                "n_generation": g.n,
                "max_response_length": g.max_tokens,
                "max_num_seqs": max(g.batch_size * g.n, 1),
            },
        },
        source="<eval config>",
    )


def shard_ranks(ec: EvalConfig) -> int:
    """Processes of one engine shard: `tp_size` ranks of the built-in engine, or one that runs
    vLLM (which starts its own tensor-parallel workers)."""
    return 1 if ec.model.backend == "vllm" else ec.model.tp_size


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of a prompt with `c` passing completions out of `n`:
    1 - C(n - c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarize(records: Sequence[dict[str, Any]], ec: EvalConfig) -> dict[str, float]:
    """`eval`'s metrics over the merged records: rows, completions, mean reward, mean completion
    length and pass@k for each k."""
    rewards = [c["reward"] for r in records for c in r["completions"]]
    lengths = [c["num_tokens"] for r in records for c in r["completions"]]
    out: dict[str, float] = {
        "rows": float(len(records)),
        "completions": float(len(rewards)),
        "reward_mean": sum(rewards) / max(len(rewards), 1),
        "length_mean": sum(lengths) / max(len(lengths), 1),
    }
    for k in ec.evaluation.k:
        scores = [
            pass_at_k(
                len(r["completions"]),
                sum(c["reward"] >= ec.evaluation.pass_reward for c in r["completions"]),
                k,
            )
            for r in records
        ]
        out[f"pass@{k}"] = sum(scores) / max(len(scores), 1)
    return out


# ---------------------------------------------------------------------------------------------
# One shard (a process per rank; rank 0 generates, the others follow)


def _done_rows(path: Path) -> set[int]:
    """The rows a shard's file already holds; a torn last line (the shard died while writing
    it) is cut off, so its row is redone."""
    if not path.exists():
        return set()
    done, keep = set(), 0
    with path.open("rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break
            try:
                done.add(int(json.loads(line)["index"]))
            except (ValueError, KeyError):
                break
            keep += len(line)
    with path.open("r+b") as f:
        f.truncate(keep)
    return done


def run_shard(
    ec: EvalConfig, *, model: str, shard: int, out: Path, score: bool, rank: int = 0
) -> None:
    """Generate (and with `score`, score) this shard's rows of the dataset, appending a line per
    row to `out`; ranks > 0 of a tensor-parallel instance follow rank 0's engine."""
    import torch
    import torch.distributed as dist

    from nebula_rl.data import rl_dataset
    from nebula_rl.data.vision import VisionProcessor
    from nebula_rl.models import is_vision_language, load_model, load_tokenizer, resolve_dtype
    from nebula_rl.rewards import Scorer, scorer
    from nebula_rl.rollout.build import build_engine
    from nebula_rl.rollout.engine import GenerationRequest
    from nebula_rl.rollout.tensor_parallel import TensorParallel
    from nebula_rl.rollout.text import completion_text, prompt_inputs

    cfg = training_config(ec, model=model)
    tp = shard_ranks(ec)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(1)
    if tp > 1:  # (the shard's ranks meet in a file of the parent's private folder: no port)
        store = dist.FileStore(os.environ[_SHARD_STORE_ENV], tp)
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=tp)
    revision = ec.model.model_revision
    tokenizer = load_tokenizer(model, revision=revision)
    weights = load_model(
        model, dtype=resolve_dtype(ec.model.dtype), device=device, seed=ec.generation.seed,
        revision=revision,
    )  # fmt: skip
    engine: Any = build_engine(
        cfg, model=weights, tokenizer=tokenizer, seed=ec.generation.seed,
        tensor_parallel=TensorParallel.of() if tp > 1 else None,
    )  # fmt: skip
    if rank > 0:
        engine.follow(lambda note: None)
        dist.barrier()
        dist.destroy_process_group()
        return
    vision = VisionProcessor.from_pretrained(model) if is_vision_language(weights.config) else None
    rows = rl_dataset(cfg)[0][: ec.evaluation.limit]
    done = _done_rows(out)
    mine = [i for i in range(shard, len(rows), ec.shards()) if i not in done]
    rule = scorer(cfg) if score else None
    assert rule is None or isinstance(rule, Scorer)  # (an eval config has no remote rewards)
    score_one = rule.score if rule is not None else None
    e, g = ec.evaluation, ec.generation
    base = _sampling(g, tokenizer.eos_token_id)
    with out.open("a") as f:
        for start in range(0, len(mine), g.batch_size):
            requests, refs = [], {}
            for i in mine[start : start + g.batch_size]:
                prompt = rows[i][e.prompt_column_name]
                ids, media = prompt_inputs(tokenizer, vision, prompt, system_prompt=e.system_prompt)
                sampling = dataclasses.replace(base, seed=g.seed + i * g.n)
                requests.append(
                    GenerationRequest(ids, n=g.n, sampling=sampling, media=media, request_id=str(i))
                )
                refs[str(i)] = (prompt, str(rows[i].get(e.response_column_name, "")))
            for output in engine.generate(requests):
                prompt, reference = refs[output.request_id]
                completions = []
                for c in output.completions:
                    text = completion_text(tokenizer, c.token_ids, c.finish_reason,
                                           include_stop=False)  # fmt: skip
                    item: dict[str, Any] = {"text": text, "num_tokens": len(c.token_ids),
                                            "finish_reason": c.finish_reason}  # fmt: skip
                    if score_one is not None:
                        scored = score_one(text, len(c.token_ids), reference)
                        item.update(reward=scored.reward, rewards=scored.terms)
                    completions.append(item)
                record = {"index": int(output.request_id), "prompt": prompt,
                          "reference": reference, "completions": completions}  # fmt: skip
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())
    if tp > 1:
        engine.stop_followers()
        dist.barrier()
        dist.destroy_process_group()


def _sampling(g: EvalGenerationConfig, eos_token_id: int | None) -> Any:
    """The engine's sampling parameters of `[generation]` (temperature 0: greedy)."""
    from nebula_rl.rollout.engine import SamplingParams

    return SamplingParams(
        temperature=g.temperature, top_p=g.top_p, top_k=max(g.top_k, 0),
        repetition_penalty=g.repetition_penalty, max_tokens=g.max_tokens,
        stop_token_ids=() if eos_token_id is None else (eos_token_id,),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The parent: start, supervise and restart the shards, merge their files


_SHARD_STORE_ENV = "NEBULA_EVAL_STORE"
"""The file a TP shard's ranks meet in (a `FileStore`), in a folder only this user can open:
unlike torch's env:// rendezvous (a TCPStore listening on every interface, unauthenticated)."""


def _start_shard(
    config_json: Path, model: str, shard: int, out: Path, ec: EvalConfig, score: bool, folder: Path
) -> list[subprocess.Popen[bytes]]:
    """The processes of shard `shard`'s ranks (`shard_ranks`); on GPUs, they see the shard's
    `tp_size` devices of those visible (`CUDA_VISIBLE_DEVICES`, else all), rank r using the
    r-th. The ranks meet in a new file of `folder` (the parent's private folder) at every
    start."""
    tp = ec.model.tp_size
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range((shard + 1) * tp)]
    store = tempfile.mkstemp(prefix=f"shard-{shard}-", dir=folder)
    os.close(store[0])
    os.unlink(store[1])  # (FileStore creates it: a leftover file would hold a stale rendezvous)
    env = {**os.environ, "OMP_NUM_THREADS": "1", _SHARD_STORE_ENV: store[1],
           "CUDA_VISIBLE_DEVICES": ",".join(devices[shard * tp : (shard + 1) * tp])}  # fmt: skip
    mode = "score" if score else "generate"
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "nebula_rl.eval",
                str(config_json),
                model,
                str(shard),
                str(out),
                str(rank),
                mode,
            ],
            env=env,
        )
        for rank in range(shard_ranks(ec))
    ]


def evaluate(
    ec: EvalConfig,
    *,
    model: str | None = None,
    output_dir: str | Path | None = None,
    score: bool = True,
    progress: bool = True,
) -> dict[str, float]:
    """Run the shards of `ec` (on `model`, default `[model] model_name`) into `output_dir`
    (default `evaluation.output_dir`), restarting any that dies; merge their rows into
    `samples.jsonl`; with `score`, write and return :func:`summarize`'s metrics
    (`results.json`)."""
    model = model or ec.model.model_name
    out = Path(output_dir or ec.evaluation.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    config_json = out / "eval_config.json"
    config_json.write_text(ec.model_dump_json(indent=2))
    total = _num_rows(ec, model)
    files = [out / f"shard-{k}.jsonl" for k in range(ec.shards())]
    stores = Path(tempfile.mkdtemp(prefix="nebula-eval-"))  # (mode 0700)
    running = {
        k: _start_shard(config_json, model, k, files[k], ec, score, stores)
        for k in range(ec.shards())
    }
    restarts = dict.fromkeys(running, 0)
    started = time.monotonic()
    bar = _Progress(total, enabled=progress)
    try:
        while running:
            time.sleep(0.2)
            bar.update(sum(_count_lines(f) for f in files), time.monotonic() - started)
            for k, procs in list(running.items()):
                codes = [p.poll() for p in procs]
                if all(c == 0 for c in codes):
                    del running[k]
                elif any(c not in (None, 0) for c in codes):
                    for p in procs:
                        p.kill()
                        p.wait()
                    if restarts[k] >= ec.evaluation.max_restarts:
                        raise RuntimeError(
                            f"eval shard {k} failed {restarts[k] + 1} times (exit codes {codes}); "
                            f"evaluation.max_restarts = {ec.evaluation.max_restarts}"
                        )
                    restarts[k] += 1
                    running[k] = _start_shard(config_json, model, k, files[k], ec, score,
                                              stores)  # fmt: skip
    finally:
        for procs in running.values():
            for p in procs:
                p.kill()
        shutil.rmtree(stores, ignore_errors=True)
        bar.close()
    records = sorted(
        (json.loads(line) for f in files for line in f.read_text().splitlines()),
        key=lambda r: r["index"],
    )
    indices = [r["index"] for r in records]
    if indices != sorted(set(indices)) or len(indices) != total:
        raise RuntimeError(f"eval: {len(indices)} rows written for {total} (lost or doubled)")
    with (out / "samples.jsonl").open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    if not score:
        return {"rows": float(len(records))}
    metrics = summarize(records, ec)
    metrics["restarts"] = float(sum(restarts.values()))
    metrics["seconds"] = time.monotonic() - started
    (out / "results.json").write_text(json.dumps({"model": model, **metrics}, indent=2))
    return metrics


def _num_rows(ec: EvalConfig, model: str) -> int:
    from nebula_rl.data import rl_dataset

    rows = rl_dataset(training_config(ec, model=model))[0]
    return len(rows[: ec.evaluation.limit])


def _count_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0


class _Progress:
    """A rich progress bar of rows done, with rows per second."""

    def __init__(self, total: int, *, enabled: bool) -> None:
        self._bar: Any = None
        if enabled:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._bar = Progress(
                TextColumn("eval"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
            )  # fmt: skip
            self._task = self._bar.add_task("rows", total=total, rate="")
            self._bar.start()

    def update(self, done: int, seconds: float) -> None:
        if self._bar is not None:
            rate = f"{done / seconds:.1f} rows/s" if seconds > 0 else ""
            self._bar.update(self._task, completed=done, rate=rate)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


# ---------------------------------------------------------------------------------------------
# A training run's checkpoints


def checkpoints(run_dir: str | Path) -> list[tuple[str, Path]]:
    """A run's exports in training order: (`step_N`, folder) by N, then (`final`, folder)."""
    root = Path(run_dir) / "safetensors"
    steps = sorted(
        (p for p in root.glob("step_*") if p.name[5:].isdigit()), key=lambda p: int(p.name[5:])
    )
    found = [(p.name, p) for p in steps]
    if (root / "final").is_dir():
        found.append(("final", root / "final"))
    if not found:
        raise ValueError(f"--run {run_dir}: no safetensors/step_N or final export in it")
    return found


def run_checkpoints(
    ec: EvalConfig, run_dir: str | Path, *, progress: bool = True
) -> list[dict[str, Any]]:
    """`evaluate` each export of the training run `run_dir` into `<output_dir>/<name>`; write
    `scores.csv` and `scores.png` (each metric against the step; `final` at the run's last step)
    into `output_dir`; the rows of the table."""
    out = Path(ec.evaluation.output_dir)
    table = []
    found = checkpoints(run_dir)
    last = max((int(n[5:]) for n, _ in found if n != "final"), default=0)
    log = Path(run_dir) / "metrics.jsonl"
    if log.exists():  # (the last step trained, where `final` was exported)
        steps = [json.loads(line).get("step", 0) for line in log.read_text().splitlines()]
        last = max([last, *steps])
    for name, folder in found:
        metrics = evaluate(ec, model=str(folder), output_dir=out / name, progress=progress)
        step = last if name == "final" else int(name[5:])
        table.append({"checkpoint": name, "step": step, **metrics})
    keys = ["checkpoint", "step", "reward_mean", *(f"pass@{k}" for k in ec.evaluation.k)]
    lines = [",".join(keys)] + [",".join(str(row[k]) for k in keys) for row in table]
    (out / "scores.csv").write_text("\n".join(lines) + "\n")
    _plot(table, keys[2:], out / "scores.png")
    return table


def _plot(table: list[dict[str, Any]], metrics: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    steps = [row for row in table if row["checkpoint"] != "final"]
    for metric in metrics:
        ax.plot([r["step"] for r in steps], [r[metric] for r in steps], marker="o", label=metric)
    ax.set_xlabel("step")
    ax.set_ylabel("score")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _main(argv: Sequence[str]) -> None:
    """A shard rank's process: `python -m nebula_rl.eval CONFIG_JSON MODEL SHARD OUT RANK MODE`."""
    config_json, model, shard, out, rank, mode = argv
    ec = EvalConfig.model_validate_json(Path(config_json).read_text())
    run_shard(ec, model=model, shard=int(shard), out=Path(out), score=mode == "score",
              rank=int(rank))  # fmt: skip


if __name__ == "__main__":
    _main(sys.argv[1:])
