"""Replicas forked from the launcher against replicas started as new interpreters, in one run.

Runs the same short `nebula-rl train` job (configs/bench_async.toml cut to `--steps` steps) with
`NEBULA_FORK=1` (the default on a CPU build of torch: replicas and their ranks are forks of the
launcher, which has loaded torch and transformers: nebula_rl/launch/forking.py) and with
`NEBULA_FORK=0` (each a new interpreter, as on GPUs), alternating, `--rounds` times each, in two
layouts: one policy and one rollout replica; a policy replica of two FSDP ranks and a rollout
replica. It measures each whole command's wall time and the CPU time of all its processes
(`RUSAGE_CHILDREN`: the launcher and every descendant it or they waited for), and reports the
medians.

    python bench/replica_start.py [--steps 3] [--rounds 3]

SUMMARY lines: the CPU seconds of the executed replicas' jobs over the forked ones' (goal 1.2x:
the start-up is a large share of a short job's CPU on few cores), and the same for wall time.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nebula_rl.config import load_config

LAYOUTS = {"1+1": {}, "fsdp2+1": {"dp_shard_size": 2}}


def run_job(cfg_path: Path, *, fork: bool) -> tuple[float, float]:
    """One `nebula-rl train`: (wall seconds, CPU seconds of it and its descendants)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "nebula_rl.cli", "train", "--config", str(cfg_path)],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1", "NEBULA_FORK": "1" if fork else "0"},
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/bench_async.toml")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    ratios_cpu, ratios_wall = [], []
    with tempfile.TemporaryDirectory(prefix="nebula-bench-start-") as tmp:
        for layout, parallelism in LAYOUTS.items():
            cfg = load_config(args.config)
            cfg.train.max_num_steps = args.steps
            cfg.train.output_dir = str(Path(tmp) / layout)
            for key, value in parallelism.items():
                setattr(cfg.policy.parallelism, key, value)
            times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
            for round_ in range(args.rounds):
                for fork in (True, False) if round_ % 2 == 0 else (False, True):
                    cfg.train.timestamp = f"{'fork' if fork else 'exec'}-{round_}"
                    path = Path(tmp) / f"{layout}-{cfg.train.timestamp}.json"
                    path.write_text(cfg.model_dump_json())
                    times[fork].append(run_job(path, fork=fork))
            med = {
                fork: (statistics.median(w for w, _ in t), statistics.median(c for _, c in t))
                for fork, t in times.items()
            }
            print(
                f"{layout:8} forked: {med[True][0]:6.1f} s wall {med[True][1]:6.1f} s CPU | "
                f"executed: {med[False][0]:6.1f} s wall {med[False][1]:6.1f} s CPU "
                f"({args.steps} steps, median of {args.rounds})"
            )
            ratios_wall.append(med[False][0] / med[True][0])
            ratios_cpu.append(med[False][1] / med[True][1])
    for (layout, _), cpu, wall in zip(LAYOUTS.items(), ratios_cpu, ratios_wall, strict=True):
        name = layout.replace("+", "_")
        print(f"SUMMARY replica_start_cpu_exec_vs_fork_{name} {cpu:.2f}x goal 1.2x")
        print(f"SUMMARY replica_start_wall_exec_vs_fork_{name} {wall:.2f}x goal 1.0x")


if __name__ == "__main__":
    main()
