"""Policy parallelism: every layout takes the same optimiser steps as one process.

Each case spawns 2 or 4 gloo processes that train tiny:qwen2 (fp32, tied embeddings) for a few
AdamW steps of next-token cross-entropy on fixed random tokens, then report the loss of each step
and every parameter, gathered to full tensors. One process without any parallelism is the
reference.

Tolerance: the layouts compute the same sums in a different order (sharded matmuls, reduce-scatter
vs. local accumulation, per-micro-batch backward), so fp32 round-off of ~1e-7 relative per op
accumulates to ~1e-6 in the loss. AdamW turns a gradient into an update of about `LR` per element
almost regardless of its size, so parameters may differ by round-off times the step count, far
below one step's change (LR = 1e-3): `PARAM_ATOL` = 2e-5 would still catch a single wrong update.
"""

import multiprocessing as mp
import os
import queue
import sys
import traceback

import pytest
import torch
import torch.nn.functional as F

from nebula_rl.config import ParallelismConfig
from nebula_rl.models import load_model
from nebula_rl.policy.parallelize import ParallelDims
from nebula_rl.weights import free_port

SEED = 3
STEPS = 3
BATCH, LENGTH = 4, 16
LR = 1e-3
LOSS_RTOL = 1e-5
PARAM_ATOL = 2e-5


def _tokens(step: int) -> torch.Tensor:
    """[BATCH, LENGTH + 1] fixed random token ids (inputs are [:, :-1], labels [:, 1:])."""
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 90, (BATCH, LENGTH + 1), generator=generator)


def _loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the tokens seen, divided by the global batch's token count."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / (
        BATCH * LENGTH
    )


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, foreach=False)


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the whole batch, no parallelism."""
    model = load_model("tiny:qwen2", seed=SEED)
    optimizer = _optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        tokens = _tokens(step)
        loss = _loss_fn(model(input_ids=tokens[:, :-1], use_cache=False).logits, tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return losses, params


def _worker(rank: int, world_size: int, port: int, settings: dict, out) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from nebula_rl.policy.parallelize import parallelize_model

    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        options = dict(settings)
        ac = options.pop("activation_checkpointing", False)
        cfg = ParallelismConfig(**options)
        dims = ParallelDims.from_config(cfg, world_size=world_size)
        mesh = dims.build_mesh("cpu")
        model = parallelize_model(
            load_model("tiny:qwen2", seed=SEED),
            dims,
            mesh,
            pp_micro_batch_size=cfg.pp_micro_batch_size,
            activation_checkpointing=ac,
        )
        optimizer = _optimizer(model.parameters())
        rows = BATCH // dims.dp
        losses = []
        for step in range(STEPS):
            tokens = _tokens(step)[model.dp_rank * rows : (model.dp_rank + 1) * rows]
            loss = model.forward_backward(tokens[:, :-1], tokens[:, 1:], _loss_fn)
            model.reduce_tied_grads()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        params = {}
        for name, p in model.module.named_parameters(remove_duplicate=False):
            full = p.full_tensor() if isinstance(p, DTensor) else p
            params[name] = full.detach().numpy().copy()  # numpy: plain pickling, no shared memory
        dist.barrier()
        dist.destroy_process_group()
        out.put((rank, (losses, params)))
    except BaseException:
        out.put((rank, traceback.format_exc()))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        out.close()
        out.join_thread()  # flush the report before leaving without interpreter teardown
        os._exit(0)


def _spawn(world_size: int, settings: dict) -> dict[int, tuple[list[float], dict]]:
    """Run `_worker` on `world_size` gloo ranks; their reports by rank."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, settings, out), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    reports = {}
    try:
        while len(reports) < world_size:
            rank, report = out.get(timeout=300)
            reports[rank] = report
    except queue.Empty:
        pytest.fail(f"rank(s) {sorted(set(range(world_size)) - set(reports))} did not report")
    finally:
        for p in procs:
            p.join(timeout=30)
    for rank, report in sorted(reports.items()):
        assert not isinstance(report, str), f"rank {rank} failed:\n{report}"
    return reports


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    return _reference()


CASES = {
    "ddp": (2, dict(dp_replicate_size=2, dp_shard_size=1)),
    "fsdp": (2, dict()),
    "hsdp": (4, dict(dp_replicate_size=2, dp_shard_size=2)),
    "tp": (2, dict(tp_size=2, dp_shard_size=1)),
    "pp": (2, dict(pp_size=2, dp_shard_size=1)),
    "fsdp_ac": (2, dict(activation_checkpointing=True)),
    "fsdp_x_tp": (4, dict(tp_size=2)),
    "pp_x_fsdp": (4, dict(pp_size=2, pp_micro_batch_size=1)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_layout_steps_like_one_process(case, reference):
    world_size, settings = CASES[case]
    want_losses, want_params = reference
    reports = _spawn(world_size, settings)
    seen: set[str] = set()
    for rank, (losses, params) in sorted(reports.items()):
        assert losses == pytest.approx(want_losses, rel=LOSS_RTOL), f"rank {rank}"
        for name, value in params.items():
            torch.testing.assert_close(
                torch.from_numpy(value), want_params[name], rtol=0, atol=PARAM_ATOL,
                msg=lambda m, name=name, rank=rank: f"rank {rank}, {name}: {m}",
            )  # fmt: skip
        seen |= params.keys()
    # Under PP every stage holds part of the model: together they hold all of it.
    assert seen == set(want_params)
    # The steps moved the parameters well beyond the tolerance, so a wrong update would show.
    initial = {n: p.detach() for n, p in load_model("tiny:qwen2", seed=SEED).named_parameters()}
    moved = max(float((want_params[n] - p).abs().max()) for n, p in initial.items())
    assert moved > 50 * PARAM_ATOL
