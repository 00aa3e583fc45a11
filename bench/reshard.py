"""Weight sync between layouts: policy FSDP2 (dp_shard 2) -> rollout TP 2, slice to slice.

Four processes on this host: two policy ranks (FSDP2 over gloo) and the two ranks of one
tensor-parallel rollout replica, all in one weight group, as in a job. Measured, per push, in one
run:

- reshard, shared memory (the default on one host, as a job runs it): `ShardedSender.push`
  copies each policy rank's pieces into a shared-memory set laid out like the rollout engine's
  own tensors, only a header crosses the group, and each rollout rank, once every policy rank's
  header is in, takes its parameters as views of that set (`zero_copy`: one copy per push);
- reshard, send/recv (the fallback, `shared_memory=False`; what NCCL uses on GPUs): every policy
  rank sends each rollout rank only the slices it needs over gloo point-to-point;
- gather + broadcast (the peer: what a framework without resharding does): the policy gathers
  every parameter whole (`full_tensor`, one at a time), rank 0 sends it to the rollout ranks,
  and each copies out its slice;
- memcpy: one `copy_` of the bytes a rollout rank receives, between two warm buffers.

A push is timed from the policy ranks' `push()` (both called at one agreed instant) until the
last rollout rank's `receive` returned with its slices in the engine's parameters, on the host's
monotonic clock (which the processes share), so no barrier is counted; the memcpy is timed by
rollout rank 0 before each push while the others wait. Goals: the shared-memory push moves at
least half as many bytes per second as memcpy (bytes a rollout rank receives per second of
push), and resharding beats gather + broadcast (both over gloo's TCP, so the comparison is of
the algorithms).

Then training steps of the FSDP2 policy (forward, backward, AdamW on a `--seq`-token batch),
alternately without a push and starting with one (`push()` then the step, while the header and
the rollout's copies run): goal, a step with a push in flight at least 0.95x as fast. Also
printed: the same for the send/recv fallback, each member's buffers and the shared footprint.

    python bench/reshard.py [--hidden 512] [--layers 4] [--vocab 8192] [--pushes 5] [--steps 10]
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
WARMUP = 2  # pushes not counted: the first use of each shared-memory set


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


def _together(delay_s: float = 0.02) -> float:
    """Return on every policy rank at the same instant of the host's monotonic clock (rank 0
    picks it, `delay_s` ahead), as the ranks would after the same training step: a barrier's
    release is a few ms apart on a busy 2-core host, which would count as push time."""
    at = torch.tensor([time.monotonic() + delay_s], dtype=torch.float64)
    dist.broadcast(at, 0)
    deadline = float(at)
    time.sleep(max(0.0, deadline - time.monotonic() - 0.002))
    while time.monotonic() < deadline:
        pass
    return time.monotonic()


def _policy(member: int, args: argparse.Namespace, groups: dict, model: torch.nn.Module) -> dict:
    from nebula_rl.policy.parallelize import ParallelDims, parallelize_model

    dims = ParallelDims(pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=1)
    parallelize_model(model, dims, dims.build_mesh("cpu"))
    senders = {
        shm: ShardedSender(
            groups[shm],
            model.named_parameters(),
            num_senders=2,
            checksum="never",
            shared_memory=shm,
        )
        for shm in (True, False)
    }
    assert senders[True].shared_memory and not senders[False].shared_memory
    report: dict = {"buffer_bytes": senders[False].peak_buffer_bytes,
                    "shm_bytes": senders[True].shared_memory_bytes}  # fmt: skip
    version = 0
    for shm in (True, False):
        group, sender = groups[shm], senders[shm]
        starts, packed, done = [], [], []
        for _ in range(args.pushes + WARMUP):
            group.pg.barrier().wait()  # (rollout rank 0 timed a memcpy meanwhile)
            start = _together()
            handle = sender.push(model.named_parameters(), version)
            stats = handle.wait()
            done.append(time.monotonic())
            starts.append(start)
            packed.append(start + stats.snapshot_s)
            group.pg.barrier().wait()
            version += 1
        report[f"start_{shm}"] = starts[WARMUP:]
        report[f"packed_{shm}"] = packed[WARMUP:]
        report[f"done_{shm}"] = done[WARMUP:]

    group = groups[False]
    starts = []
    for _ in range(args.pushes + 1):
        group.pg.barrier().wait()
        starts.append(time.monotonic())
        for _, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            full = param.full_tensor()
            if member == 0:
                for dst in (2, 3):
                    group.pg.send([full.detach()], dst, 0).wait()
        group.pg.barrier().wait()
    report["start_gather"] = starts[1:]

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = torch.randint(0, args.vocab, (1, args.seq))

    def step() -> None:
        loss = model(batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up: optimizer state, allocator
    for shm in (True, False):
        group, sender = groups[shm], senders[shm]
        plain, with_push = [], []
        for _ in range(args.steps):  # alternating, so drift on a shared machine hits both alike
            dist.barrier()
            start = time.perf_counter()
            step()
            plain.append(time.perf_counter() - start)
            dist.barrier()
            start = time.perf_counter()
            handle = sender.push(model.named_parameters(), version)
            step()
            with_push.append(time.perf_counter() - start)
            handle.wait()
            group.pg.barrier().wait()  # the rollout ranks copied it: the next plain step is alone
            version += 1
        report[f"step_s_{shm}"] = plain
        report[f"step_push_s_{shm}"] = with_push
    for sender in senders.values():
        sender.close()
    return report


def _rollout(args: argparse.Namespace, groups: dict, model: torch.nn.Module) -> dict:
    from nebula_rl.rollout.tensor_parallel import TensorParallel
    from nebula_rl.rollout.torch_engine import TorchEngine

    full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    engine = TorchEngine(model, max_num_seqs=2, max_model_len=16,
                         tensor_parallel=TensorParallel.of())  # fmt: skip
    params = dict(engine.model.named_parameters())
    boxes = engine.tp_boxes()
    receivers = {
        shm: ShardedReceiver(
            groups[shm], params, boxes, num_senders=2, shared_memory=shm, zero_copy=shm
        )
        for shm in (True, False)
    }
    report: dict = {"buffer_bytes": receivers[False].peak_buffer_bytes}
    # Profile of the shared-memory receive: per push, when the first policy rank's header was
    # in and when the last one's was checked.
    calls: list[tuple[float, float]] = []
    taken: list[tuple[float, float]] = []
    take = receivers[True]._take

    def timed_take(*args: object) -> None:
        start = time.monotonic()
        take(*args)  # type: ignore[arg-type]
        calls.append((start, time.monotonic()))

    receivers[True]._take = timed_take  # type: ignore[method-assign]
    # The peer: memcpy of the bytes this rank receives, by rollout rank 0 before each push
    # while every other member waits (so it has a core and the memory to itself).
    nbytes = sum(p.numel() * p.element_size() for p in params.values())
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    memcpy = []
    for shm in (True, False):
        group, receiver = groups[shm], receivers[shm]
        ends = []
        for _ in range(args.pushes + WARMUP):
            if dist.get_rank() == 0:
                start = time.perf_counter()
                dst.copy_(src)
                memcpy.append(time.perf_counter() - start)
            group.pg.barrier().wait()
            engine.update_weights_with(receiver.receive)
            ends.append(time.monotonic())
            if shm:
                taken.append((calls[0][0], calls[-1][1]))
                calls.clear()
            group.pg.barrier().wait()
        report[f"end_{shm}"] = ends[WARMUP:]
    report["taken"] = taken[WARMUP:]
    report.update(recv_bytes=nbytes, copy_s=memcpy[WARMUP:])

    group = groups[False]
    scratch: dict[tuple[int, ...], torch.Tensor] = {}
    ends = []
    for _ in range(args.pushes + 1):
        group.pg.barrier().wait()
        for name, (_, box) in sorted(boxes.items()):
            shape = full_shapes[name]
            full = scratch.setdefault(shape, torch.empty(shape))
            group.pg.recv([full], 0, 0).wait()
            with torch.no_grad():
                params[name].copy_(full[tuple(slice(a, b) for a, b in box)])
        ends.append(time.monotonic())
        group.pg.barrier().wait()
    report["end_gather"] = ends[1:]

    for shm in (True, False):
        group, receiver = groups[shm], receivers[shm]
        for _ in range(args.steps):
            engine.update_weights_with(receiver.receive)
            group.pg.barrier().wait()
        receiver.close()
    return report


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
        groups = {  # one weight group per transport, both with all four members
            shm: build_group(
                Rendezvous("127.0.0.1", ports[2], f"bench-reshard-{shm}", 4, hosted=True),
                rank=member,
                timeout=TIMEOUT,
            )
            for shm in (True, False)
        }
        model = _model(args)
        report = _policy(member, args, groups, model) if policy else _rollout(args, groups, model)
        out.put({"member": member, **report})
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
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seq", type=int, default=128)
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
    med = statistics.median
    policy, rollout = reports[0], reports[2]
    policies, rollouts = (reports[0], reports[1]), (reports[2], reports[3])

    def spans(start: str, end: str) -> list[float]:
        """Per push: from the first policy rank's start to the last rollout rank's end (the
        processes share the host's monotonic clock)."""
        firsts = [min(t) for t in zip(*(r[start] for r in policies), strict=True)]
        lasts = [max(t) for t in zip(*(r[end] for r in rollouts), strict=True)]
        return [b - a for a, b in zip(firsts, lasts, strict=True)]

    gib = rollout["recv_bytes"] / 2**30
    copy_s = med(rollout["copy_s"])
    push_shm = med(spans("start_True", "end_True"))
    push_tcp = med(spans("start_False", "end_False"))
    gather_s = med(spans("start_gather", "end_gather"))
    # Shared-memory profile: when (ms after the push started, median over pushes) the slower
    # member of each side reached each point.
    starts = [min(t) for t in zip(*(r["start_True"] for r in policies), strict=True)]

    def last(key: str, index: int | None = None) -> float:
        sides = policies if key in ("packed_True", "done_True") else rollouts
        per_push = zip(*(r[key] for r in sides), strict=True)
        ends = [max(t if index is None else t[index] for t in ts) for ts in per_push]
        return med([b - a for a, b in zip(starts, ends, strict=True)])

    profile = {
        "push() returned on both policy ranks": last("packed_True"),
        "both rollout ranks have a header": last("taken", 0),
        "both rollout ranks have every header": last("taken", 1),
        "receive() returned on both (engine relinked)": last("end_True"),
        "the policy ranks' handles are done": last("done_True"),
    }
    print(f"policy FSDP2 x2 -> rollout TP x2, fp32, {gib * 1024:.1f} MiB per rollout rank, gloo")
    print(f"memcpy                  {copy_s * 1e3:8.1f} ms  {gib / copy_s:6.2f} GiB/s")
    print(f"reshard, shared memory  {push_shm * 1e3:8.1f} ms  {gib / push_shm:6.2f} GiB/s "
          f"per rollout rank ({copy_s / push_shm:.2f}x memcpy)")  # fmt: skip
    for what, seconds in profile.items():
        print(f"  {what:<46} at {seconds * 1e3:5.1f} ms")
    print(f"reshard, send/recv      {push_tcp * 1e3:8.1f} ms  {gib / push_tcp:6.2f} GiB/s "
          f"per rollout rank ({copy_s / push_tcp:.2f}x memcpy)")  # fmt: skip
    print(f"gather + broadcast      {gather_s * 1e3:8.1f} ms  {gib / gather_s:6.2f} GiB/s")
    for shm, label in ((True, "shared memory"), (False, "send/recv")):
        plain, pushed = med(policy[f"step_s_{shm}"]), med(policy[f"step_push_s_{shm}"])
        print(f"step {plain * 1e3:7.1f} ms without a push, {pushed * 1e3:7.1f} ms with one "
              f"({label}): {plain / pushed:.2f}x")  # fmt: skip
    print(f"shared memory (both sets, whole group) {policy['shm_bytes'] / 2**20:8.1f} MiB")
    for m in range(4):
        print(f"member {m} send/recv buffers         {reports[m]['buffer_bytes'] / 2**20:8.1f} MiB")
    print(f"SUMMARY reshard_push_vs_memcpy {copy_s / push_shm:.2f}x goal 0.5x")
    print(f"SUMMARY reshard_vs_gather_broadcast {gather_s / push_tcp:.2f}x goal 1.0x")
    speed = med(policy["step_s_True"]) / med(policy["step_push_s_True"])
    print(f"SUMMARY reshard_step_speed_with_push {speed:.2f}x goal 0.95x")


if __name__ == "__main__":
    main()
