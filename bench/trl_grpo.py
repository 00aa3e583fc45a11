"""nebula-rl against TRL's `GRPOTrainer`: wall-clock per step and reward after the same samples.

Both frameworks train the same starting model on the same task with the same GRPO settings,
taken from one nebula-rl config: the config's starting model (its SFT warm start is built first
if missing, outside the timing) and tokenizer, its prompts under the same chat template with its
system prompt, its rewards (`nebula_rl.rewards`, on the decoded text), `train_batch_per_replica`
completions (prompts x `n_generation`) per step with gradients accumulated over `mini_batch`
sequences, `max_response_length` new tokens, the learning rate, AdamW settings, gradient
clipping, clip range (epsilon low/high), token-mean loss, group-std-normalised advantages, no KL
term, no activation checkpointing, and the precision: float32, or with `train.param_dtype =
"bfloat16"` (`--param-dtype bfloat16` sets it) bf16 mixed precision on both sides (nebula-rl:
float32 master weights, the policy's forward under bf16 autocast, the rollout engine's weights in
bf16; TRL: `bf16=True`, accelerate's autocast over float32 weights, for training and
`generate` alike). Each runs `--steps` optimiser steps, so both see the
same number of samples. A setting TRL's side does not map is refused by its key. Configs:
`configs/demo.toml` (the default: arithmetic, at most 4 new tokens, a ~3M-parameter model) and
`configs/bench_gsm8k.toml` (the GSM8K-shaped job: 256 new tokens, a ~14M-parameter model).

nebula-rl is measured two ways (`--modes`), TRL once:

- `runtime`: `nebula-rl train` as `make demo` runs it: Redis, the controller, one policy and one
  rollout replica as processes, asynchronous with the config's `allowed_outdated_steps`, each
  process with `--runtime-threads` torch threads (the launcher's default, 1). This is the
  headline: the system the goals are about.
- `local`: `nebula-rl train --local`: one process, generation (the built-in engine) and training
  take turns, always on-policy: TRL's schedule, with `--local-threads` threads (default: every
  core, as TRL). It separates the framework's own speed from what the disaggregated design costs
  or saves on this machine.
- TRL's `GRPOTrainer` runs in this process on the CPU with `--trl-threads` torch threads
  (default: every core, what torch picks by itself), generating with `model.generate`.

Per-step time is the steady state, steps 2..N: from the end of step 1 to the end of step N,
divided by N - 1 (nebula-rl: the recorded `step_time`; TRL: between `on_step_end` callbacks).
The reward after the same number of samples is the mean training reward of the last `--window`
steps; the curve is printed per window too. The runs are sequential, so a neighbour's load on a
shared machine hits them unequally: rerun when the table looks disturbed.

    python bench/trl_grpo.py [--config configs/demo.toml] [--steps 100] [--window 20]
        [--modes runtime local] [--runtime-threads 1] [--local-threads N] [--trl-threads N]
        [--param-dtype float32|bfloat16] [--name NAME]

`bench/trl_grpo_gsm8k.py` runs it on `configs/bench_gsm8k.toml` (20 steps in bf16: ~25 min on 2
cores).

Needs TRL, a benchmark-only dependency: `pip install -e ".[bench]"` (or `pip install trl`).
Goals (issue 8): nebula-rl at least 2x faster per step; a reward curve no worse (the last
window's mean reward, nebula-rl / TRL, at least 1.0x). One SUMMARY line per goal and mode.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from statistics import mean
from typing import Any

from nebula_rl.config import Config, load_config

SPEED_GOAL = 2.0
REWARD_GOAL = 1.0


def run_nebula(cfg: Config, *, steps: int, mode: str, threads: int, out: Path) -> dict[str, Any]:
    """One `nebula-rl train` job of `steps` steps; its whole-command time and step records."""
    cfg = cfg.model_copy(deep=True)
    cfg.train.max_num_steps = steps
    cfg.train.output_dir = str(out)
    cfg.train.timestamp = f"nebula-{mode}"
    path = out / "nebula.json"
    path.write_text(cfg.model_dump_json())
    command = [sys.executable, "-m", "nebula_rl.cli", "train", "--config", str(path)]
    if mode == "local":
        command.append("--local")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    total = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"nebula-rl train failed ({done.returncode}):\n{done.stderr[-3000:]}")
    run_dir = out / cfg.train.timestamp
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if len(records) != steps:
        raise SystemExit(f"{run_dir}: {len(records)} steps recorded, expected {steps}")
    return {
        "total_s": total,
        "step_s": [r["step_time"] for r in records],
        "rewards": [r["reward_mean"] for r in records],
    }


def run_trl(cfg: Config, *, steps: int, threads: int, out: Path) -> dict[str, Any]:
    """TRL's `GRPOTrainer` on the same model, prompts, reward and settings, in this process."""
    import torch

    torch.set_num_threads(threads)
    start = time.perf_counter()
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from nebula_rl.data import prompt_messages, rl_rows
    from nebula_rl.models import load_model, load_tokenizer
    from nebula_rl.rewards import combine_rewards

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    # TRL 1.16 sets `gradient_checkpointing`, which transformers 5 renamed: not ours to fix.
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    p, t, s = cfg.grpo, cfg.train, cfg.rollout.sampling_config
    refuse_unmapped(cfg)
    completions = cfg.groups_per_replica * cfg.rollout.n_generation
    micro = min(p.mini_batch, completions)
    path = cfg.policy.model_name_or_path
    tokenizer, model = load_tokenizer(path), load_model(path, seed=t.seed or 0)
    rows = rl_rows(cfg)
    dataset = Dataset.from_list(
        [
            {
                "prompt": prompt_messages(r[p.prompt_column_name], p.system_prompt),
                "answer": r[p.response_column_name],
            }
            for r in rows
        ]
    )
    score = combine_rewards(p.reward_function)

    def reward(
        completions: list[list[dict[str, str]]], answer: list[str], **_: Any
    ) -> list[float | None]:
        """nebula-rl's reward on the decoded assistant text, as the rollout replica scores it."""
        return [score(c[0]["content"], str(a)) for c, a in zip(completions, answer, strict=True)]

    ends: list[float] = []

    class StepClock(transformers.TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            ends.append(time.perf_counter())

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            ends.append(time.perf_counter())

    args = GRPOConfig(
        output_dir=str(out / "trl"),
        max_steps=steps,
        # TRL counts completions, per forward/backward: nebula-rl's mini_batch, accumulated
        # over the step's batch (one generation batch per optimiser step)
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=completions // micro,
        num_generations=cfg.rollout.n_generation,
        max_completion_length=cfg.rollout.max_response_length,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=max(s.top_k, 0),
        learning_rate=t.optm_lr,
        lr_scheduler_type="constant" if t.optm_decay_type in (None, "none") else t.optm_decay_type,
        warmup_steps=int(t.optm_warmup_steps),
        weight_decay=t.optm_weight_decay,
        adam_beta1=t.optm_betas[0],
        adam_beta2=t.optm_betas[1],
        adam_epsilon=t.epsilon,
        max_grad_norm=t.optm_grad_norm_clip,
        epsilon=p.epsilon_low,
        epsilon_high=p.epsilon_high,
        beta=0.0,
        loss_type="dapo",  # the token mean over the whole step: nebula-rl's "token-mean"
        scale_rewards="none" if p.unbiased_advantage else "group",
        num_iterations=1,
        gradient_checkpointing=False,
        bf16=t.param_dtype == "bfloat16",
        use_cpu=True,
        seed=t.seed or 0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    trainer.remove_callback(transformers.PrinterCallback)  # a dict per step on stdout otherwise
    trainer.train()
    total = time.perf_counter() - start
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    if len(ends) != steps + 1 or len(rewards) != steps:
        raise SystemExit(
            f"TRL: {len(ends) - 1} steps timed, {len(rewards)} rewards; expected {steps}"
        )
    return {
        "total_s": total,
        "step_s": [b - a for a, b in itertools.pairwise(ends)],
        "rewards": rewards,
        "version": importlib.metadata.version("trl"),
    }


def refuse_unmapped(cfg: Config) -> None:
    """Exit naming each key of `cfg` whose value TRL's side of this benchmark does not map."""
    p, t = cfg.grpo, cfg.train
    completions = cfg.groups_per_replica * cfg.rollout.n_generation
    micro = min(p.mini_batch, completions)
    checks = {
        "train.train_policy.variant": (p.variant, p.variant == "grpo"),
        "train.train_policy.loss_type": (p.loss_type, p.loss_type == "token-mean"),
        "train.train_policy.kl_beta": (p.kl_beta, not p.kl_beta),
        "train.train_policy.mu_iterations": (p.mu_iterations, p.mu_iterations == 1),
        "train.train_policy.dynamic_sampling": (
            p.dynamic_sampling_enabled,
            not p.dynamic_sampling_enabled,
        ),
        "train.train_policy.overlong_reward.enable_overlong_penalty": (
            p.overlong_reward.enable_overlong_penalty,
            not p.overlong_reward.enable_overlong_penalty,
        ),
        "train.train_policy.batch_size_per_optimize": (
            p.batch_size_per_optimize,
            p.batch_size_per_optimize in (None, completions),
        ),
        # (TRL accumulates whole micro-batches of completions per optimiser step)
        "train.train_policy.mini_batch": (p.mini_batch, completions % micro == 0),
        "train.param_dtype": (t.param_dtype, t.param_dtype in ("float32", "bfloat16")),
        "train.master_dtype": (t.master_dtype, t.master_dtype == "float32"),
        "train.optm_decay_type": (t.optm_decay_type, t.optm_decay_type != "sqrt"),
        "policy.model_gradient_checkpointing": (
            cfg.policy.model_gradient_checkpointing,
            not cfg.policy.model_gradient_checkpointing,
        ),
    }
    unmapped = [f"{key} = {value!r}" for key, (value, ok) in checks.items() if not ok]
    if unmapped:
        raise SystemExit(
            "the TRL mapping here does not cover: "
            + "; ".join(unmapped)
            + " (it maps variant grpo, token-mean loss, no KL, one iteration, no dynamic sampling "
            "or overlong penalty, one optimiser step per batch, mini_batch dividing the batch, "
            "float32 master weights computing in float32 or bfloat16, no activation checkpointing)"
        )


def windows(values: list[float], size: int) -> list[float]:
    """Means of consecutive windows of `size` (the last may be shorter)."""
    return [mean(values[i : i + size]) for i in range(0, len(values), size)]


def main() -> None:
    cores = os.cpu_count() or 1
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/demo.toml")
    parser.add_argument("--steps", type=int, default=100, help="optimiser steps of each")
    parser.add_argument("--window", type=int, default=20, help="steps per reward window")
    parser.add_argument(
        "--modes", nargs="+", choices=["runtime", "local"], default=["runtime", "local"]
    )
    parser.add_argument("--runtime-threads", type=int, default=1, help="per process")
    parser.add_argument("--local-threads", type=int, default=cores)
    parser.add_argument("--trl-threads", type=int, default=cores)
    parser.add_argument(
        "--param-dtype",
        choices=["float32", "bfloat16"],
        help="override train.param_dtype on both sides (default: the config's)",
    )
    parser.add_argument("--name", default="", help="suffix of the SUMMARY names (per config)")
    args = parser.parse_args()
    if args.steps < 2 or args.window < 1:
        parser.error("--steps must be >= 2 and --window >= 1")
    if importlib.util.find_spec("trl") is None:
        print(
            "TRL is not installed: it is a benchmark-only dependency. Install it with\n"
            '    .venv/bin/pip install -e ".[bench]"\n'
            "then run this script again.",
            file=sys.stderr,
        )
        raise SystemExit(2)

    from nebula_rl.launch import ensure_model

    cfg = load_config(args.config)
    if args.param_dtype is not None:
        cfg.train.param_dtype = args.param_dtype
    ensure_model(cfg)  # the SFT warm start, built once outside the timing
    threads = {"runtime": args.runtime_threads, "local": args.local_threads}
    rows: dict[str, tuple[dict[str, Any], str]] = {}
    with tempfile.TemporaryDirectory(prefix="nebula-bench-trl-") as tmp:
        for mode in args.modes:
            result = run_nebula(
                cfg, steps=args.steps, mode=mode, threads=threads[mode], out=Path(tmp)
            )
            how = f"{threads[mode]}/process"
            if mode == "runtime" and cfg.policy.cpu_threads is not None:  # (the config's own)
                how = f"{how}, policy {cfg.policy.cpu_threads}"
            rows[f"nebula-rl {mode}"] = (result, how)
        trl = run_trl(cfg, steps=args.steps, threads=args.trl_threads, out=Path(tmp))
    trl_name = f"TRL {trl['version']} GRPOTrainer"
    rows[trl_name] = (trl, str(args.trl_threads))

    steady = {name: sum(r["step_s"][1:]) / (args.steps - 1) for name, (r, _) in rows.items()}
    g = cfg.rollout
    print(
        f"{args.config}: {cfg.policy.model_name_or_path}, {cfg.groups_per_replica} "
        f"prompts x {g.n_generation} completions per step, <= {g.max_response_length} new tokens, "
        f"lr {cfg.train.optm_lr:g}, {cfg.train.param_dtype}, {args.steps} steps each, "
        f"{cores} cores"
    )
    w = min(args.window, args.steps)
    print(
        f"{'framework':28} {'threads':>19} {'total s':>8} {'s/step':>7} {'vs TRL':>7} "
        f"{'reward first ' + str(w):>16} {'last ' + str(w):>8} {'all':>6}"
    )
    for name, (r, how) in rows.items():
        print(
            f"{name:28} {how:>19} {r['total_s']:8.1f} {steady[name]:7.3f} "
            f"{steady[trl_name] / steady[name]:6.2f}x {mean(r['rewards'][:w]):16.3f} "
            f"{mean(r['rewards'][-w:]):8.3f} {mean(r['rewards']):6.3f}"
        )
    print(f"mean reward per {w} steps:")
    for name, (r, _) in rows.items():
        print(f"  {name:28} " + " ".join(f"{v:.2f}" for v in windows(r["rewards"], w)))
    trl_last = max(mean(trl["rewards"][-w:]), 1e-9)
    for mode in args.modes:
        r, _ = rows[f"nebula-rl {mode}"]
        suffix = (f"_{args.name}" if args.name else "") + ("" if mode == "runtime" else f"_{mode}")
        speedup = steady[trl_name] / steady[f"nebula-rl {mode}"]
        reward_ratio = mean(r["rewards"][-w:]) / trl_last
        print(f"SUMMARY trl_step_speedup{suffix} {speedup:.2f}x goal {SPEED_GOAL}x")
        print(f"SUMMARY trl_reward_last_{w}_steps{suffix} {reward_ratio:.2f}x goal {REWARD_GOAL}x")


if __name__ == "__main__":
    main()
