"""Weight sync between layouts: policy FSDP2 (dp_shard 2) -> rollout TP 2, slice to slice.

Four processes on this host: two policy ranks (FSDP2 over gloo/NCCL) and the two ranks of one
tensor-parallel rollout replica, all in one weight group, as in a job. Measured, per push:

- reshard: `ShardedSender.push` / `ShardedReceiver.receive`: every policy rank sends each rollout
  rank only the slices it needs, straight into the engine's parameters;
- gather + broadcast (the peer: what a framework without resharding does): the policy gathers
  every parameter whole (`full_tensor`, one at a time), rank 0 broadcasts it to the rollout
  ranks, and each copies out its slice;
- memcpy: one `copy_` of the bytes a rollout rank receives, between two warm buffers.

Goals: reshard moves bytes at least half as fast as memcpy (bytes a rollout rank receives per
second of push), and is faster than gather + broadcast. Also printed: each member's buffer memory.

    python bench/reshard.py [--hidden 512] [--layers 4] [--vocab 8192] [--pushes 5]
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
import torch.distributed as dist

from nebula_rl.weights import Rendezvous, build_group, free_port, serve_store
from nebula_rl.weights.reshard import ShardedReceiver, ShardedSender

TIMEOUT = timedelta(minutes=5)


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=max(2, args.hidden // 64),
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _member(member: int, args: argparse.Namespace, ports: list[int], out) -> None:
    try:
        torch.set_num_threads(1)
        policy = member < 2
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{ports[0 if policy else 1]}",
            rank=member % 2,
            world_size=2,
            timeout=TIMEOUT,
        )
        group = build_group(
            Rendezvous("127.0.0.1", ports[2], "bench-reshard", 4, hosted=True),
            rank=member,
            timeout=TIMEOUT,
        )
        model = _model(args)
        if policy:
            from nebula_rl.policy.parallelize import ParallelDims, parallelize_model

            dims = ParallelDims(pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=1)
            parallelize_model(model, dims, dims.build_mesh("cpu"))
            sender = ShardedSender(group, model.named_parameters(), num_senders=2, checksum="never")
            times = []
            for version in range(args.pushes + 1):
                dist.barrier()
                group.pg.barrier().wait()
                start = time.perf_counter()
                sender.push(model.named_parameters(), version)
                group.pg.barrier().wait()  # every rollout rank holds its slices
                times.append(time.perf_counter() - start)
            gathers = []
            for _ in range(args.pushes + 1):
                group.pg.barrier().wait()
                start = time.perf_counter()
                for _, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
                    full = param.full_tensor()
                    if member == 0:
                        for dst in (2, 3):
                            group.pg.send([full.detach()], dst, 0).wait()
                group.pg.barrier().wait()
                gathers.append(time.perf_counter() - start)
            out.put({"member": member, "push_s": times[1:], "gather_s": gathers[1:],
                     "buffer_bytes": sender.peak_buffer_bytes})  # fmt: skip
        else:
            from nebula_rl.rollout.tensor_parallel import TensorParallel
            from nebula_rl.rollout.torch_engine import TorchEngine

            full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
            engine = TorchEngine(model, max_num_seqs=2, max_model_len=16,
                                 tensor_parallel=TensorParallel.of())  # fmt: skip
            params = dict(engine.model.named_parameters())
            boxes = engine.tp_boxes()
            receiver = ShardedReceiver(group, params, boxes, num_senders=2)
            for _ in range(args.pushes + 1):
                group.pg.barrier().wait()
                engine.update_weights_with(receiver.receive)
                group.pg.barrier().wait()
            scratch: dict[tuple[int, ...], torch.Tensor] = {}
            for _ in range(args.pushes + 1):
                group.pg.barrier().wait()
                for name, (_, box) in sorted(boxes.items()):
                    shape = full_shapes[name]
                    full = scratch.setdefault(shape, torch.empty(shape))
                    group.pg.recv([full], 0, 0).wait()
                    with torch.no_grad():
                        params[name].copy_(full[tuple(slice(a, b) for a, b in box)])
                group.pg.barrier().wait()
            nbytes = sum(p.numel() * p.element_size() for p in params.values())
            src = torch.ones(nbytes, dtype=torch.uint8)
            dst = torch.zeros_like(src)
            copies = []
            for _ in range(args.pushes + 1):
                start = time.perf_counter()
                dst.copy_(src)
                copies.append(time.perf_counter() - start)
            out.put({"member": member, "recv_bytes": nbytes, "copy_s": copies[1:],
                     "buffer_bytes": receiver.peak_buffer_bytes})  # fmt: skip
    except BaseException:
        out.put({"member": member, "error": traceback.format_exc()})
    finally:
        out.close()
        out.join_thread()
        os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--pushes", type=int, default=5)
    args = parser.parse_args()
    ports = [free_port(), free_port(), free_port()]
    store = serve_store("127.0.0.1", ports[2])  # noqa: F841 (the rendezvous lives while it does)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(m, args, ports, out)) for m in range(4)]
    for p in procs:
        p.start()
    reports = {r["member"]: r for r in (out.get(timeout=1800) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
    errors = [r["error"] for r in reports.values() if "error" in r]
    if errors:
        raise SystemExit("\n".join(errors))
    push_s = statistics.median(reports[0]["push_s"])
    gather_s = statistics.median(reports[0]["gather_s"])
    recv = reports[2]["recv_bytes"]
    copy_s = statistics.median(reports[2]["copy_s"])
    gib = recv / 2**30
    print(f"policy FSDP2 x2 -> rollout TP x2, fp32, {gib * 1024:.1f} MiB per rollout rank, gloo")
    print(f"memcpy              {copy_s * 1e3:8.1f} ms  {gib / copy_s:6.2f} GiB/s")
    print(f"reshard push        {push_s * 1e3:8.1f} ms  {gib / push_s:6.2f} GiB/s per rollout rank")
    print(f"gather + broadcast  {gather_s * 1e3:8.1f} ms  {gib / gather_s:6.2f} GiB/s")
    for m in range(4):
        print(f"member {m} buffers   {reports[m]['buffer_bytes'] / 2**20:8.1f} MiB")
    print(f"SUMMARY reshard_push_vs_memcpy {copy_s / push_s:.2f}x goal 0.5x")
    print(f"SUMMARY reshard_vs_gather_broadcast {gather_s / push_s:.2f}x goal 1.0x")


if __name__ == "__main__":
    main()
