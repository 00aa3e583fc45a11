"""`make wfm-demo`: world-model RL on 2 CPU cores in about two minutes.

The brief's demo: a tiny pixel-space DiT, warm-started by flow matching on the toy video dataset
(coloured shapes, 2 frames of 16 x 16), then trained from that same warm start twice with the
brightness reward scored by the reward service (`nebula-rl reward-service`, started here as its
own process, reached over HTTP with a token):

- FlowGRPO (`data_beta = 0`) raises the reward by drifting to white frames (reward hacking);
- DDRL (`data_beta > 0`) is anchored by the flow-matching loss on real clips: its samples stay
  close to the data (the RMS distance to the nearest clip of the same caption).

It prints the mean reward and data distance of the first and last 20 iterations of each run and
writes `metrics_<run>.jsonl` and sample grids (`samples_<run>.png`) to `--output-dir`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

import torch
from torch import Tensor

from nebula_rl.flow.data import Clip, make_toy_dataset, read_local_dataset
from nebula_rl.flow.dit import TinyDiT, TinyDiTConfig
from nebula_rl.flow.job import sample_grid, visual_scorer
from nebula_rl.flow.local import FlowRLSettings, RewardFn, pretrain, run_flow_rl

log = logging.getLogger("nebula_rl.wfm_demo")

FRAMES, SIZE = 2, 16


@contextmanager
def served_rewards(
    workdir: Path, reward: str = "brightness", model_path: str = ""
) -> Iterator[tuple[str, str]]:
    """Start `nebula-rl reward-service` scoring with `reward` (a model-based one: of the model
    `model_path`) on a free local port (its log in `workdir`); yield (its `/api/reward`
    address, its token) once it answers; stop it after."""
    from nebula_rl.rewards.remote import RemoteRewardClient
    from nebula_rl.weights import free_port

    port, token = free_port(), secrets.token_urlsafe(24)
    config = workdir / "rewards.toml"
    model = f"model_path = {json.dumps(model_path)}\n" if model_path else ""
    config.write_text(
        f'host = "127.0.0.1"\nport = {port}\n\n[[reward_args]]\nreward_type = "{reward}"\n' + model
    )
    env = {**os.environ, "NEBULA_REWARD_TOKEN": token, "OMP_NUM_THREADS": "1"}
    logfile = (workdir / "reward_service.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "nebula_rl.cli", "reward-service", "--config", str(config)],
        env=env,
        stdout=logfile,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}/api/reward"
    try:
        RemoteRewardClient(f"{base}/enqueue", f"{base}/pull", token).wait_ready(timeout_s=60.0)
        yield base, token
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        logfile.close()


@contextmanager
def reward_service(workdir: Path) -> Iterator[RewardFn]:
    """The brightness reward of the reward service (:func:`served_rewards`) as a scorer that
    goes through it with the service's client."""
    from nebula_rl.rewards.remote import RemoteRewardClient

    with served_rewards(workdir) as (base, token):
        client = RemoteRewardClient(f"{base}/enqueue", f"{base}/pull", token, deadline_s=60.0)

        def score(samples: Tensor, prompts: Sequence[str]) -> list[float] | None:
            return client.score(samples, list(prompts), {"brightness": 1.0})

        yield score


def _save_grid(model: TinyDiT, clips: list[Clip], path: Path) -> None:
    """The job's sample grid (20 ODE steps), scaled up four times to be seen."""
    grid = sample_grid(model, clips, num_steps=20, seed=1)
    grid.resize((grid.width * 4, grid.height * 4), 0).save(path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nebula_rl.flow.demo", description=__doc__)
    parser.add_argument("--output-dir", default="outputs/wfm-demo")
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--data-beta", type=float, default=0.01)
    parser.add_argument(
        "--local-rewards", action="store_true", help="score in this process, not the service"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # (one line per request otherwise)
    torch.set_num_threads(1)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    clips = read_local_dataset(
        make_toy_dataset(out / "toy", frames=FRAMES, size=SIZE), num_frames=FRAMES
    )
    torch.manual_seed(0)
    model = TinyDiT(TinyDiTConfig(frames=FRAMES, size=SIZE, patch=4, width=64, depth=3, heads=4))
    start = time.monotonic()
    losses = pretrain(model, clips, steps=args.pretrain_steps)
    log.info(
        "warm start: flow matching %d steps, loss %.3f -> %.3f (%.0f s)",
        args.pretrain_steps, sum(losses[:20]) / 20, sum(losses[-20:]) / 20,
        time.monotonic() - start,
    )  # fmt: skip
    warm = {k: v.clone() for k, v in model.state_dict().items()}
    runs = {
        "flow_grpo": FlowRLSettings(num_iterations=args.iterations),
        "ddrl": FlowRLSettings(
            algorithm="ddrl", num_iterations=args.iterations, data_beta=args.data_beta
        ),
    }
    summary = {}
    scorer: AbstractContextManager[RewardFn] = (
        nullcontext(visual_scorer({"brightness": 1.0}))
        if args.local_rewards
        else reward_service(out)
    )
    with scorer as score:
        _save_grid(model, clips, out / "samples_warmstart.png")
        for name, settings in runs.items():
            model.load_state_dict(warm)
            metrics = (out / f"metrics_{name}.jsonl").open("w")

            def report(record: dict[str, float], name: str = name, metrics=metrics) -> None:
                metrics.write(json.dumps(record) + "\n")
                if int(record["iteration"]) % 10 == 0:
                    log.info(
                        "%s iteration %d: reward %.3f, data distance %.3f",
                        name, record["iteration"], record["reward_mean"], record["data_distance"],
                    )  # fmt: skip

            start = time.monotonic()
            records = run_flow_rl(model, clips, settings, score=score, on_iteration=report)
            metrics.close()
            seconds = time.monotonic() - start
            _save_grid(model, clips, out / f"samples_{name}.png")
            n = min(20, len(records) // 2)

            def mean(part: list[dict[str, float]], key: str) -> float:
                return sum(r[key] for r in part) / len(part)

            summary[name] = {
                "reward_first": mean(records[:n], "reward_mean"),
                "reward_last": mean(records[-n:], "reward_mean"),
                "distance_first": mean(records[:n], "data_distance"),
                "distance_last": mean(records[-n:], "data_distance"),
                "seconds": seconds,
                "rewards_lost": sum(r["rewards_lost"] for r in records),
            }
    for name, s in summary.items():
        print(
            f"SUMMARY {name}: reward (first {n} -> last {n} iterations) {s['reward_first']:.3f} -> "
            f"{s['reward_last']:.3f}; data distance {s['distance_first']:.3f} -> "
            f"{s['distance_last']:.3f}; {s['seconds']:.0f} s; rewards lost {s['rewards_lost']:.0f}"
        )
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
