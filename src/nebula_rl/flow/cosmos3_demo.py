"""`make cosmos3-demo`'s generator half: FlowGRPO of the tiny Cosmos 3 generator in the
asynchronous runtime, scored by the reward service.

It starts `nebula-rl reward-service` with the brightness reward (its own process, on a free
local port, with a token), runs `nebula-rl train --config configs/cosmos3/gen_flow_grpo_cpu.toml`
(a controller, one policy replica, one rollout replica) with the `REMOTE_REWARD_*` variables
that reach it, and prints the mean reward of the first and last 20 steps from the run's
metrics.

With `--judge` (`make cosmos3-judge-demo`) a Cosmos 3 reasoner judges the clips instead: it
trains the tiny reasoner of configs/cosmos3/judge_sft_cpu.toml (`builtin:brightness_judge`) when
its export is missing, starts the service with the `reasoner_judge` reward of that model, and
runs configs/cosmos3/gen_judge_cpu.toml.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from nebula_rl.flow.demo import served_rewards

CONFIG = "configs/cosmos3/gen_flow_grpo_cpu.toml"
JUDGE_CONFIG = "configs/cosmos3/gen_judge_cpu.toml"
JUDGE_SFT_CONFIG = "configs/cosmos3/judge_sft_cpu.toml"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nebula_rl.flow.cosmos3_demo", description=__doc__
    )
    parser.add_argument("--config", help=f"default: {CONFIG} ({JUDGE_CONFIG} with --judge)")
    parser.add_argument("--output-dir", default="outputs/cosmos3_demo")
    parser.add_argument("--steps", type=int, help="train.max_num_steps (default: the config's)")
    parser.add_argument(
        "--judge", action="store_true", help="reward: a Cosmos 3 reasoner's judgement"
    )
    args = parser.parse_args(argv)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = args.config or (JUDGE_CONFIG if args.judge else CONFIG)
    command = [
        sys.executable, "-m", "nebula_rl.cli", "train", "--config", config,
        "--output-dir", str(out),
    ]  # fmt: skip
    if args.steps:
        command += ["--max-num-steps", str(args.steps)]
    reward, model = "brightness", ""
    if args.judge:
        reward, model = "reasoner_judge", str(_judge(out))
    with served_rewards(out, reward, model) as (base, token):
        env = {
            **os.environ,
            "REMOTE_REWARD_TOKEN": token,
            "REMOTE_REWARD_ENQUEUE_URL": f"{base}/enqueue",
            "REMOTE_REWARD_FETCH_URL": f"{base}/pull",
        }
        code = subprocess.call(command, env=env)
    if code:
        return code
    runs = sorted((p for p in out.glob("*/metrics.jsonl")), key=lambda p: p.stat().st_mtime)
    rewards = [
        r["reward_mean"]
        for r in map(json.loads, runs[-1].read_text().splitlines())
        if "reward_mean" in r
    ]
    n = min(20, len(rewards) // 2)
    first, last = sum(rewards[:n]) / n, sum(rewards[-n:]) / n
    judged = ", judged by a Cosmos 3 reasoner" if args.judge else ""
    print(
        f"SUMMARY cosmos3 generator flow_grpo{judged} ({runs[-1].parent}): reward (first {n} "
        f"-> last {n} steps) {first:.3f} -> {last:.3f}"
    )
    return 0


def _judge(out: Path) -> Path:
    """The judge's export under `out` (`<out>/judge/safetensors/final`), trained by
    :data:`JUDGE_SFT_CONFIG` first when missing."""
    export = out / "judge" / "safetensors" / "final"
    if not (export / "config.json").is_file():
        command = [
            sys.executable, "-m", "nebula_rl.cli", "train", "--config", JUDGE_SFT_CONFIG,
            "--output-dir", str(out), "--timestamp", "judge",
        ]  # fmt: skip
        if subprocess.call(command):
            raise SystemExit(f"training the judge ({JUDGE_SFT_CONFIG}) failed")
    return export


if __name__ == "__main__":
    raise SystemExit(main())
