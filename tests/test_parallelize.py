"""Policy parallelism: every layout takes the same optimiser steps as one process.

Each case spawns 2 or 4 gloo processes that train tiny:qwen2 (fp32, tied embeddings) for a few
AdamW steps of next-token cross-entropy on fixed random tokens, then report the loss of each step
and every parameter, gathered to full tensors. One process without any parallelism is the
reference.

Tolerances: the layouts compute the same sums in another order (sharded matmuls, reduce-scatter
instead of local accumulation, per-micro-batch backward), so fp32 round-off (~1e-7 relative per
op) differs. Measured: losses within 2e-7 relative, parameters within 7e-6 absolute (TP, after
3 steps); `LOSS_RTOL` and `PARAM_ATOL` leave a margin of 10x and 3x. One AdamW step moves an
element by about `LR` = 1e-3, 50x `PARAM_ATOL`, so one wrong update is caught (by hand: averaging
instead of summing DP gradients, skipping the tied-embedding gradient sum under PP, or leaving the
tied head untied under TP each fail). `ADAM_EPS` = 1e-6 instead of 1e-8: Adam scales every
gradient to a step of about `LR`, including gradients that are round-off (e.g. attention's key
bias and of one MLP weight here), which would turn noise into 1e-3 differences; an eps far above
round-off and far below the real gradients (1e-4 to 1e-1 here) damps only those.
"""

import functools
import os
import queue
import sys
import traceback

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import rank_context
from nebula_rl.config import ParallelismConfig
from nebula_rl.models import TINY_PRESETS, load_model
from nebula_rl.policy.parallelize import ParallelDims
from nebula_rl.policy.parallelize.model import shard_logits
from nebula_rl.weights import free_port

SEED = 3
STEPS = 3
BATCH, LENGTH = 4, 16
LR = 1e-3
ADAM_EPS = 1e-6
LOSS_RTOL = 2e-6
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
    return torch.optim.AdamW(params, lr=LR, eps=ADAM_EPS, weight_decay=0.1, foreach=False)


def _model(arch: str, device: str = "cpu") -> torch.nn.Module:
    """tiny:qwen2, or a Qwen3 of the same shape (Qwen3 adds per-head q/k norms) for its TP plan."""
    if arch == "qwen2":
        return load_model("tiny:qwen2", seed=SEED, device=device)
    settings = dict(TINY_PRESETS["qwen2"], model_type=arch, head_dim=64)
    config = AutoConfig.for_model(settings.pop("model_type"), vocab_size=128, **settings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)


@functools.cache
def _reference(arch: str, device: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the whole batch, no parallelism."""
    model = _model(arch, device)
    optimizer = _optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        tokens = _tokens(step).to(device)
        loss = _loss_fn(model(input_ids=tokens[:, :-1], use_cache=False).logits, tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    params = {n: p.detach().cpu() for n, p in model.named_parameters(remove_duplicate=False)}
    return losses, params


def _worker(rank: int, world_size: int, port: int, settings: dict, out) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from nebula_rl.policy.parallelize import parallelize_model

    try:
        torch.set_num_threads(1)
        options = dict(settings)
        ac = options.pop("activation_checkpointing", False)
        device = options.pop("device", "cpu")
        arch = options.pop("arch", "qwen2")
        if device == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl" if device == "cuda" else "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
        )
        cfg = ParallelismConfig(**{"dp_shard_size": -1, "pp_schedule": "1F1B", **options})
        dims = ParallelDims.from_config(cfg, world_size=world_size)
        mesh = dims.build_mesh(device)
        model = parallelize_model(
            _model(arch, device),
            dims,
            mesh,
            pp_micro_batch_size=cfg.pp_micro_batch_size,
            pp_schedule=cfg.pp_schedule,
            pp_layers_per_stage=cfg.pp_layers_per_stage,
            activation_checkpointing=ac,
        )
        optimizer = _optimizer(model.parameters())
        rows = BATCH // dims.dp
        losses = []
        for step in range(STEPS):
            tokens = _tokens(step)[model.dp_rank * rows : (model.dp_rank + 1) * rows].to(device)
            loss = model.forward_backward(tokens[:, :-1], tokens[:, 1:], _loss_fn)
            model.reduce_tied_grads()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        params = {}
        for name, p in model.module.named_parameters(remove_duplicate=False):
            full = p.full_tensor() if isinstance(p, DTensor) else p
            params[name] = (
                full.detach().cpu().numpy().copy()
            )  # numpy: plain pickling, no shared memory
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
    ctx = rank_context()
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


INTERLEAVED = dict(pp_schedule="Interleaved1F1B", pp_layers_per_stage=1)

CASES = {
    "ddp": (2, dict(dp_replicate_size=2, dp_shard_size=1)),
    "fsdp": (2, dict()),
    "hsdp": (4, dict(dp_replicate_size=2, dp_shard_size=2)),
    "tp": (2, dict(tp_size=2, dp_shard_size=1)),
    "pp": (2, dict(pp_size=2, dp_shard_size=1)),  # 1F1B, 4 micro-batches
    "pp_gpipe": (2, dict(pp_size=2, dp_shard_size=1, pp_micro_batch_size=4, pp_schedule="GPipe")),
    # 4 stages of one layer, two per rank
    "pp_interleaved": (2, dict(pp_size=2, dp_shard_size=1, **INTERLEAVED)),
    "fsdp_ac": (2, dict(activation_checkpointing=True)),
    "fsdp_x_tp": (4, dict(tp_size=2)),
    "pp_x_fsdp": (4, dict(pp_size=2, pp_micro_batch_size=1)),
    "pp_x_tp": (4, dict(pp_size=2, tp_size=2, dp_shard_size=1)),
    "pp_interleaved_x_fsdp": (4, dict(pp_size=2, **INTERLEAVED)),
    "tp_qwen3": (2, dict(tp_size=2, dp_shard_size=1, arch="qwen3")),
    # CPU: every attention call all-gathers the keys and values (sequence_split)
    "cp": (2, dict(cp_size=2, dp_shard_size=1)),
    "fsdp_x_cp": (4, dict(cp_size=2)),
}


def _check_against_reference(world_size: int, settings: dict) -> None:
    arch = settings.get("arch", "qwen2")
    want_losses, want_params = _reference(arch, settings.get("device", "cpu"))
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
    initial = {n: p.detach() for n, p in _model(arch).named_parameters()}
    moved = max(float((want_params[n] - p).abs().max()) for n, p in initial.items())
    assert moved > 50 * PARAM_ATOL


@pytest.mark.parametrize("case", list(CASES))
def test_layout_steps_like_one_process(case):
    _check_against_reference(*CASES[case])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")
def test_context_parallel_steps_like_one_process():
    """CP on CUDA: torch's ring attention replaces the flash / memory-efficient / cuDNN SDPA
    kernels (on CPU, whose SDPA kernel has no DTensor sharding rule, keys and values are
    all-gathered instead: the `cp` cases above)."""
    _check_against_reference(2, dict(cp_size=2, dp_shard_size=1, device="cuda"))


class _SdpaCalls(TorchFunctionMode):
    """Records the mask arguments of every `scaled_dot_product_attention` call."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[object, object]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.calls.append((kwargs.get("attn_mask"), kwargs.get("is_causal")))
        return func(*args, **kwargs)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_a_cp_share_attends_causally_without_a_mask(arch):
    """A CP rank's share of a sequence (head and tail chunks: positions that jump) reaches
    attention as SDPA's `is_causal` with no mask, the only form torch's ring attention shards
    (it refuses a mask), and still gives the logits of those positions."""
    model = _model(arch).eval()
    ids = _tokens(0)[:, :LENGTH]
    positions = torch.arange(LENGTH).repeat(BATCH, 1)
    share = torch.cat([torch.arange(4), torch.arange(12, 16)])  # (rank 0 of CP 2)
    spy = _SdpaCalls()
    with spy, torch.no_grad():
        logits = shard_logits(model, ids[:, share], positions[:, share])
    assert spy.calls and all(mask is None and causal for mask, causal in spy.calls)
    with torch.no_grad():
        whole = shard_logits(model, ids, positions)
    # The head chunk sees only itself under causality: its logits are the whole sequence's.
    torch.testing.assert_close(logits[:, :4], whole[:, :4])


def _dims(world_size: int = 8, **sizes) -> ParallelDims:
    sizes = {"dp_shard_size": -1, **sizes}  # (inferred unless given)
    return ParallelDims.from_config(ParallelismConfig(**sizes), world_size=world_size)


def test_dp_shard_is_inferred():
    assert _dims(8, tp_size=2, pp_size=2) == ParallelDims(
        pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=2
    )
    assert _dims(8, dp_replicate_size=2, cp_size=2).dp_shard == 2


@pytest.mark.parametrize(
    ("world_size", "sizes", "message"),
    [
        (8, dict(tp_size=3), r"tp_size \(3\) must divide the world size \(8\)"),
        (8, dict(tp_size=2, dp_shard_size=2), r"= 4 must equal the world size \(8\)"),
        (4, dict(dp_replicate_size=2, dp_shard_size=4), r"dp_shard_size \(4\).* = 8 must equal"),
    ],
)
def test_sizes_must_fill_the_world(world_size, sizes, message):
    with pytest.raises(ValueError, match=r"policy\.parallelism.*" + message):
        _dims(world_size, **sizes)


@pytest.mark.parametrize(
    ("world_size", "sizes", "overrides", "message"),
    [
        (3, dict(tp_size=3), {}, r"tp_size \(3\) must divide num_attention_heads \(4\)"),
        (4, dict(tp_size=4), {}, r"tp_size \(4\) must divide num_key_value_heads \(2\)"),
        (8, dict(pp_size=8), {}, r"pp_size \(8\) must not exceed num_hidden_layers \(4\)"),
        (2, dict(tp_size=2), {"model_type": "gpt2"}, r"no plan for model_type 'gpt2'"),
        (4, dict(cp_size=2, pp_size=2), {}, r"cp_size > 1 together with pp_size > 1"),
    ],
)
def test_sizes_must_fit_the_model(world_size, sizes, overrides, message):
    config = load_model("tiny:qwen2").config
    for key, value in overrides.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=r"policy\.parallelism.*" + message):
        _dims(world_size, **sizes).check_model(config)


def test_context_parallel_needs_sdpa_and_full_attention():
    config = load_model("tiny:qwen2").config
    _dims(2, cp_size=2).check_model(config)
    config._attn_implementation = "eager"
    with pytest.raises(ValueError, match=r"policy\.parallelism\.cp_size > 1 needs SDPA"):
        _dims(2, cp_size=2).check_model(config)
    windowed = AutoConfig.for_model("mistral", sliding_window=64)
    windowed._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match=r"cp_size > 1 .* sliding-window attention layers"):
        _dims(2, cp_size=2).check_model(windowed)
