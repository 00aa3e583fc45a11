"""Synchronous vs asynchronous RL: wall-clock for the same number of steps, measured in one run.

Runs `nebula-rl train` twice on the same config (1 policy + 1 rollout replica), once with
`allowed_outdated_steps = 0` (rollouts wait for the newest weights: generation and training take
turns) and once with `allowed_outdated_steps = 1` (rollouts generate the next batch with the
previous weights while the policy trains). The ratio compares the steady state, from the end of
step 1 to the end of the last step, so the start-up (process launch, model load, the first batch)
which both modes share does not dilute it; the whole-command times are printed too.

    python bench/async.py [--config configs/bench_async.toml] [--steps 30]

The default config is generation-heavy (64-token responses decoded 8 sequences at a time), the
regime of RL on accelerators where decoding is memory-bound; on `configs/demo.toml` generation is
only ~12% of a step, so overlapping it can save at most that (see BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean

from nebula_rl.config import load_config


def run_mode(config: str, *, allowed: int, steps: int, out: Path) -> dict[str, float]:
    """One job; its timings and rewards."""
    cfg = load_config(config)
    cfg.grpo.allowed_outdated_steps = allowed
    cfg.grpo.on_policy = False
    cfg.train.max_num_steps = steps
    cfg.train.output_dir = str(out)
    cfg.train.timestamp = f"allowed{allowed}"
    path = out / f"allowed{allowed}.json"
    path.write_text(cfg.model_dump_json())
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "nebula_rl.cli", "train", "--config", str(path)],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    total = time.perf_counter() - start
    run_dir = out / cfg.train.timestamp
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if len(metrics) != steps:
        raise RuntimeError(f"{run_dir}: {len(metrics)} steps recorded, expected {steps}")
    rewards = [m["reward_mean"] for m in metrics]
    return {
        "total_s": total,
        "steady_s": sum(m["step_time"] for m in metrics[1:]),
        "train_s": mean(m["train_time"] for m in metrics[1:]),
        "wait_s": mean(m["wait_for_batch_time"] for m in metrics[1:]),
        "staleness_max": max(m["staleness_max"] for m in metrics),
        "reward_first": mean(rewards[:10]),
        "reward_last": mean(rewards[-10:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/bench_async.toml")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    from nebula_rl.launch import ensure_model

    ensure_model(load_config(args.config))  # the warm start, if any, is built outside the timing
    with tempfile.TemporaryDirectory(prefix="nebula-bench-async-") as tmp:
        results = {
            name: run_mode(args.config, allowed=allowed, steps=args.steps, out=Path(tmp))
            for name, allowed in (("sync", 0), ("async", 1))
        }
    print(f"config {args.config}, {args.steps} steps, 1 policy + 1 rollout replica")
    print(
        f"{'mode':6} {'total s':>8} {'steps 2..N s':>13} {'s/step':>7} {'train s':>8} "
        f"{'wait s':>7} {'stale max':>9} {'reward first10':>15} {'last10':>7}"
    )
    for name, r in results.items():
        print(
            f"{name:6} {r['total_s']:8.1f} {r['steady_s']:13.1f} "
            f"{r['steady_s'] / (args.steps - 1):7.3f} {r['train_s']:8.3f} {r['wait_s']:7.3f} "
            f"{r['staleness_max']:9.0f} {r['reward_first']:15.3f} {r['reward_last']:7.3f}"
        )
    steady = results["sync"]["steady_s"] / results["async"]["steady_s"]
    total = results["sync"]["total_s"] / results["async"]["total_s"]
    print(f"sync/async wall-clock: steady state {steady:.2f}x, whole command {total:.2f}x")
    print(f"SUMMARY async_speedup {steady:.2f}x goal 1.6x")


if __name__ == "__main__":
    main()
