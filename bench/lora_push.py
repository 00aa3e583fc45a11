"""A LoRA policy's weight push: merged dense weights against the adapter merged on the rollout.

Two processes on this host, one policy rank and one rollout rank in one weight group, as a job
builds it (shared memory, a zero-copy receiver). The model is `--model` (default the demo's
tiny Qwen2) with `configs/demo_lora.toml`'s `[policy.lora]` (rank 8 on every linear layer of the
decoder), in float32 as the demo trains and samples. Each way pushes `--pushes` times, the
adapter moved between pushes, every push after the first trainable-only (what a policy replica
does; a zero-copy receiver's first two pushes carry every tensor):

- merged: the policy pushes `merged_parameters` (every adapted weight W + scale * B @ A under its
  plain name, marked trainable) into the engine's parameters (how LoRA pushed before);
- adapter: the policy pushes `adapter_parameters` (A, scale * B, the frozen base and the rest);
  the rollout receives them into `LoraMerge`'s buffers and merges, in the same write.

Printed per way: the bytes of each push (`PushStats.num_bytes`), the policy's time to prepare
and snapshot a push (merging or scaling, and copying into the set) and the rollout's merge (what
the adapter adds to the engine's pause), medians over the trainable-only pushes.

    python bench/lora_push.py [--model tiny:qwen2] [--pushes 6]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
import tomllib
import traceback
from datetime import timedelta
from pathlib import Path

import torch

from nebula_rl.config import config_from_dict
from nebula_rl.weights import Rendezvous, build_group, free_port
from nebula_rl.weights.reshard import ShardedReceiver, ShardedSender

TIMEOUT = timedelta(minutes=5)
DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo_lora.toml"


def _config(model: str):
    lora = tomllib.loads(DEMO.read_text())["policy"]["lora"]
    return config_from_dict(
        {"policy": {"model_name_or_path": model, "lora": lora}}, source=str(DEMO)
    )


def _policy(args: argparse.Namespace, way: str, rdzv: Rendezvous) -> dict:
    from nebula_rl.models.lora import adapter_parameters, merged_parameters
    from nebula_rl.policy.setup import load_policy_model

    cfg = _config(args.model)
    model = load_policy_model(cfg, device="cpu", seed=0)
    weights = merged_parameters if way == "merged" else adapter_parameters
    group = build_group(rdzv, rank=0, timeout=TIMEOUT)
    sender = ShardedSender(group, weights(model), num_senders=1)
    num_bytes, snapshot_s = [], []
    g = torch.Generator().manual_seed(0)
    for version in range(1, args.pushes + 1):
        with torch.no_grad():  # (a training step's change to the adapter)
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn(p.shape, generator=g) * 1e-3)
        start = time.perf_counter()
        handle = sender.push(weights(model), version, trainable_only=version > 1)
        snapshot_s.append(time.perf_counter() - start)
        num_bytes.append(handle.wait().num_bytes)
    sender.close()
    group.close()
    return {"num_bytes": num_bytes, "snapshot_s": snapshot_s}


def _rollout(args: argparse.Namespace, way: str, rdzv: Rendezvous) -> dict:
    from nebula_rl.models import load_model
    from nebula_rl.rollout.lora_merge import LoraMerge
    from nebula_rl.rollout.torch_engine import TorchEngine

    cfg = _config(args.model)
    engine = TorchEngine(load_model(args.model, seed=1), max_num_seqs=4, max_model_len=32)
    merge = LoraMerge(engine.model, engine.tp_boxes(), cfg.policy.lora) if way != "merged" else None
    tensors = dict(engine.model.named_parameters()) if merge is None else merge.tensors
    boxes = engine.tp_boxes() if merge is None else merge.boxes
    group = build_group(rdzv, rank=1, timeout=TIMEOUT)
    receiver = ShardedReceiver(group, tensors, boxes, num_senders=1, zero_copy=True)
    merge_s = []

    def write() -> int | None:
        version = receiver.receive()
        if merge is not None:
            start = time.perf_counter()
            merge.after(version)
            merge_s.append(time.perf_counter() - start)
        return version

    for _ in range(args.pushes):
        engine.update_weights_with(write)
    receiver.close()
    group.close()
    return {"merge_s": merge_s or [0.0] * args.pushes}


def _member(member: int, args: argparse.Namespace, way: str, port: int, out) -> None:
    torch.set_num_threads(1)
    try:
        rdzv = Rendezvous("127.0.0.1", port, f"lora-push-{way}", 2)
        body = _policy if member == 0 else _rollout
        out.put((member, body(args, way, rdzv)))
    except BaseException:
        out.put((member, traceback.format_exc()))


def _run(args: argparse.Namespace, way: str) -> tuple[dict, dict]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_member, args=(m, args, way, port, out)) for m in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    for member, result in results.items():
        if isinstance(result, str):
            raise RuntimeError(f"member {member} failed:\n{result}")
    return results[0], results[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny:qwen2")
    parser.add_argument("--pushes", type=int, default=6)
    args = parser.parse_args()
    assert args.pushes >= 3, "pushes 1 and 2 carry every tensor (zero-copy): push 3 on measures"
    for way in ("merged", "adapter"):
        policy, rollout = _run(args, way)
        sizes = policy["num_bytes"]
        later = slice(2, None)  # (the trainable-only pushes)
        print(
            f"{way:8s} push bytes: first {sizes[0] / 1e6:.3f} MB, then "
            f"{statistics.median(sizes[later]) / 1e6:.3f} MB; policy snapshot "
            f"{statistics.median(policy['snapshot_s'][later]) * 1e3:.2f} ms, rollout merge "
            f"{statistics.median(rollout['merge_s'][later]) * 1e3:.2f} ms"
        )


if __name__ == "__main__":
    main()
