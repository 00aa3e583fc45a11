"""Policy -> rollout weight push: bandwidth against a plain memcpy, and what it costs a step.

Two processes on this host play the policy (rank 0, the `WeightSender`) and one rollout replica
(rank 1, a `WeightReceiver` that copies every push into its model) over the same kind of group a
job builds: gloo on CPU, NCCL on GPU, meeting at a TCPStore this process serves. The model is a
randomly initialised Qwen2-architecture model (`--hidden`, `--layers`, `--vocab`).

1. Push bandwidth. The policy pushes `--pushes` times; a push is timed from `push()` until the
   rollout holds the new bytes (its `receive` returned them) and said so; "push+apply" goes on
   until the rollout also copied them into its model (what an engine does at a token boundary).
   The peer is a plain `copy_` of the same bytes between two preallocated buffers in the policy
   process (the floor any transport has to pay to move the bytes once). Goal: the push reaches at
   least half of memcpy's bytes/s. On one host over gloo the push goes through shared memory;
   `--no-shared-memory` measures the TCP broadcast instead.
2. Step time with a push in flight. The policy times `--steps` pairs of training steps (forward,
   backward, AdamW on a `--seq`-token batch): one with no push, one that starts with a push
   whose transfer and the rollout's copy run while the step computes. Goal: at most 5% slower, printed as the speed
   ratio (without / with) against 0.95.

    python bench/weight_sync.py [--hidden 768] [--layers 6] [--vocab 16384] [--pushes 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
import traceback
from datetime import timedelta

import torch

from nebula_rl.weights import (
    Rendezvous,
    WeightReceiver,
    WeightSender,
    build_group,
    free_port,
    serve_store,
)

TIMEOUT = timedelta(minutes=5)


def build_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """A random Qwen2-architecture model of the requested size (nothing is downloaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 256),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)


def _ack(group, device: torch.device) -> None:
    """Rank 1 tells rank 0 it has applied a push (a one-element broadcast from rank 1)."""
    group.pg.broadcast(torch.ones(1, device=device), 1, TIMEOUT).wait()


def _join(args: argparse.Namespace, port: int, *, rank: int):
    """This process's device, its member of the two-rank group, and the model."""
    torch.set_num_threads(args.threads)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    group = build_group(
        Rendezvous("127.0.0.1", port, "bench", 2, hosted=True), rank=rank, backend=backend
    )
    return device, group, build_model(args, device)


def policy(args: argparse.Namespace, port: int, out) -> None:
    """Rank 0: memcpy peer, pushes, then training steps without and with a push in flight."""
    device, group, model = _join(args, port, rank=0)
    sender = WeightSender(
        group, model.named_parameters(), checksum="never", shared_memory=args.shared_memory
    )
    num_bytes = sender.layout.num_bytes

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # Peer: the same bytes copied once between two warm buffers.
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src).fill_(2)
    copies = []
    for _ in range(args.pushes + 1):
        sync()
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        copies.append(time.perf_counter() - start)
    del src, dst

    pushes, applied, snapshots = [], [], []
    for version in range(args.pushes + 1):  # the first push touches fresh memory: not counted
        start = time.perf_counter()
        stats = sender.push(model.named_parameters(), version).wait()
        snapshots.append(stats.snapshot_s)
        _ack(group, group.device)  # the rollout holds the bytes
        pushes.append(time.perf_counter() - start)
        _ack(group, group.device)  # ... and copied them into its model
        applied.append(time.perf_counter() - start)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = torch.randint(0, args.vocab, (1, args.seq), device=device)

    def step() -> None:
        loss = model(batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()

    step()  # warm-up: optimizer state, allocator
    plain, with_push = [], []
    version = args.pushes + 1
    for _ in range(args.steps):  # alternating, so drift on a shared machine hits both alike
        start = time.perf_counter()
        step()
        plain.append(time.perf_counter() - start)
        start = time.perf_counter()
        handle = sender.push(model.named_parameters(), version)
        step()
        with_push.append(time.perf_counter() - start)
        handle.wait()
        _ack(group, group.device)
        _ack(group, group.device)
        version += 1
    sender.close()
    out.put(
        {
            "num_bytes": num_bytes,
            "copy_s": statistics.median(copies[1:]),
            "push_s": statistics.median(pushes[1:]),
            "apply_s": statistics.median(applied[1:]),
            "snapshot_s": statistics.median(snapshots[1:]),
            "shared_memory": sender.shared_memory,
            "step_s": statistics.median(plain),
            "step_push_s": statistics.median(with_push),
            "device": str(device),
        }
    )


def rollout(args: argparse.Namespace, port: int, out) -> None:
    """Rank 1: receive every push into a model of the same layout, then acknowledge it."""
    device, group, model = _join(args, port, rank=1)
    receiver = WeightReceiver(group, model.named_parameters(), shared_memory=args.shared_memory)
    params = dict(model.named_parameters())
    for _ in range(args.pushes + 1 + args.steps):
        _, received = receiver.receive(timeout=TIMEOUT)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        _ack(group, group.device)
        with torch.no_grad():
            for name, tensor in received.items():
                params[name].copy_(tensor)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        _ack(group, group.device)
    out.put({"rollout": "done"})


def _child(role: str, args: argparse.Namespace, port: int, out) -> None:
    try:
        {"policy": policy, "rollout": rollout}[role](args, port, out)
    except BaseException:
        out.put({"error": traceback.format_exc()})
    finally:
        out.close()
        out.join_thread()  # flush the report, then leave without interpreter teardown
        os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument(
        "--no-shared-memory",
        dest="shared_memory",
        action="store_false",
        help="broadcast over the group even on one host",
    )
    args = parser.parse_args()

    port = free_port()
    store = serve_store("127.0.0.1", port)  # noqa: F841 (the rendezvous lives while it does)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_child, args=(role, args, port, out)) for role in ("policy", "rollout")
    ]
    for p in procs:
        p.start()
    reports = [out.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    for r in reports:
        if "error" in r:
            raise SystemExit(r["error"])
    r = next(r for r in reports if "num_bytes" in r)
    gib = r["num_bytes"] / 2**30
    copy_bw, push_bw, apply_bw = (gib / r[k] for k in ("copy_s", "push_s", "apply_s"))
    via = "shared memory" if r["shared_memory"] else "broadcast"
    print(f"device {r['device']}, {gib:.3f} GiB of fp32 weights, {args.threads} thread(s)/process")
    print(f"memcpy       {r['copy_s'] * 1e3:8.1f} ms  {copy_bw:6.2f} GiB/s")
    print(f"push         {r['push_s'] * 1e3:8.1f} ms  {push_bw:6.2f} GiB/s ({via})")
    print(f"  of which the snapshot copy {r['snapshot_s'] * 1e3:.1f} ms")
    print(f"push+apply   {r['apply_s'] * 1e3:8.1f} ms  {apply_bw:6.2f} GiB/s")
    print(f"step         {r['step_s'] * 1e3:8.1f} ms without a push")
    print(f"step         {r['step_push_s'] * 1e3:8.1f} ms with a push in flight")
    print(f"SUMMARY weight_push_vs_memcpy {push_bw / copy_bw:.2f}x goal 0.5x")
    speed = r["step_s"] / r["step_push_s"]
    print(f"SUMMARY policy_step_speed_with_push_in_flight {speed:.2f}x goal 0.95x")


if __name__ == "__main__":
    main()
