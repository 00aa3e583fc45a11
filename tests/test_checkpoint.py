"""Checkpoints: an interrupted and resumed run repeats an uninterrupted one bit for bit (SFT and
GRPO; the weight averages of `train.ema_enable` and their export too); rotation; half-written
checkpoints are ignored; async saves a snapshot; a checkpoint of an FSDP2-sharded model (two gloo
processes), its weight averages too, loads into one unsharded process."""

import json
import os
import queue
import shutil
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import get_state_dict
from transformers import AutoModelForCausalLM

from conftest import rank_context
from nebula_rl import local
from nebula_rl.config import CheckpointConfig, config_from_dict
from nebula_rl.models import load_model
from nebula_rl.policy.checkpoint import (
    MANIFEST,
    Checkpointer,
    checkpoint_path,
    is_checkpoint,
    latest_checkpoint,
)
from nebula_rl.policy.ema import WeightEMA
from nebula_rl.utils.runs import drop_steps_after
from nebula_rl.weights import free_port

# DCP notes each save/load without a process group; that is the single-process case tested here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# Timing metrics differ between runs; everything else in a metrics line must repeat exactly.
TIMINGS = (
    "step_time",
    "generate_time",
    "train_time",
    "weight_update_time",
    "rollout_tokens_per_s",
)


def parity_reward(completion: str, reference: str) -> float:
    """A reward that varies within groups even for an untrained model, so that dynamic sampling
    drops some groups and a step consumes a varying number of prompts."""
    return float(sum(map(ord, completion)) % 2)


def _cfg(tmp_path: Path, policy: dict, **train):
    data = {
        "train": {
            "output_dir": str(tmp_path),
            "timestamp": "run",
            "optm_lr": 1e-3,
            "optm_warmup_steps": 2,
            "optm_decay_type": "cosine",
            "train_batch_per_replica": 16 if policy["type"] == "grpo" else 4,
            **train,
            "train_policy": policy,
        },
        "policy": {"model_name_or_path": "tiny:qwen2"},
    }
    if policy["type"] == "grpo":
        data["rollout"] = {"backend": "torch", "n_generation": 4, "max_response_length": 3}
    return config_from_dict(data)


SFT = {
    "type": "sft",
    "prompt_column_name": "prompt",
    "response_column_name": "answer",
    "mini_batch": 4,
    "dataset": {"name": "builtin:arithmetic", "kwargs": {"num_samples": 12}},
}
GRPO = {
    "type": "grpo",
    "variant": "dapo",
    "reward_function": "test_checkpoint:parity_reward",
    "kl_beta": 0.01,
    "mini_batch": 16,
    "dataset": {"name": "builtin:arithmetic", "kwargs": {"num_samples": 40}},
}


def _records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMINGS} for line in lines]


def _final_weights(run_dir: Path, folder: str = "final") -> dict[str, torch.Tensor]:
    return load_file(run_dir / "safetensors" / folder / "model.safetensors")


def _assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize(
    ("policy", "save_mode", "epochs"), [(SFT, "sync", 2), (GRPO, "async", 1)], ids=["sft", "grpo"]
)
def test_resumed_run_repeats_the_uninterrupted_run(tmp_path, policy, save_mode, epochs):
    ckpt = {"enable_checkpoint": True, "save_freq": 2, "max_keep": -1, "save_mode": save_mode}
    # (with weight averages: they are saved, restored and exported beside the weights)
    ema = {"ema_enable": True, "ema_decay": 0.5, "ema_update_step_interval": 2}
    cfg = _cfg(tmp_path, policy, epoch=epochs, max_num_steps=5, ckpt=ckpt, **ema)
    run_dir = local.run(cfg)
    full = _records(run_dir)
    assert [r["step"] for r in full] == [1, 2, 3, 4, 5]
    assert len({r["loss"] for r in full}) == 5  # the steps differ, so a replay is a real check
    if policy is GRPO:
        assert sum(r["groups_dropped"] for r in full) > 0  # steps consume varying prompt counts
    full_weights = _final_weights(run_dir)
    full_ema = _final_weights(run_dir, "final_ema")
    averaged = AutoModelForCausalLM.from_pretrained(run_dir / "safetensors" / "final_ema")
    loaded = averaged.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in full_ema.items())
    assert not any(torch.equal(full_ema[k], v) for k, v in full_weights.items() if "norm" not in k)
    trained = run_dir / "trained_prompts.json"  # GRPO only
    full_trained = trained.read_text() if policy is GRPO else None
    done = [p.name for p in sorted((run_dir / "checkpoints").iterdir()) if is_checkpoint(p)]
    assert done == ["step_2", "step_4", "step_5"]  # every save_freq steps, and after the last
    assert (run_dir / "safetensors" / "step_4" / "model.safetensors").is_file()
    assert (run_dir / "safetensors" / "step_4_ema" / "model.safetensors").is_file()

    # An interrupted run: step 4's checkpoint half-written, metrics already past it.
    (checkpoint_path(run_dir, 4) / MANIFEST).unlink()
    shutil.rmtree(checkpoint_path(run_dir, 5))
    (run_dir / "safetensors" / "final").rename(run_dir / "full_final")
    (run_dir / "safetensors" / "final_ema").rename(run_dir / "full_final_ema")
    cfg.train.resume = True
    assert local.run(cfg) == run_dir
    assert _records(run_dir) == full  # steps 3-5 replayed exactly, no duplicate lines
    _assert_same_weights(_final_weights(run_dir), full_weights)
    _assert_same_weights(_final_weights(run_dir, "final_ema"), full_ema)
    if policy is GRPO:
        assert trained.read_text() == full_trained
    assert is_checkpoint(checkpoint_path(run_dir, 4))
    assert local.run(cfg) == run_dir  # resuming a finished run trains nothing more
    assert _records(run_dir) == full
    _assert_same_weights(_final_weights(run_dir), full_weights)

    # Resuming from a path into a new run folder continues the metrics from the next step.
    cfg.train.resume = str(checkpoint_path(run_dir, 2))
    cfg.train.timestamp = "from_path"
    other = local.run(cfg)
    assert _records(other) == full[2:]
    _assert_same_weights(_final_weights(other), full_weights)
    _assert_same_weights(_final_weights(other, "final_ema"), full_ema)
    if policy is GRPO:  # the prompts of the checkpoint's steps, then those trained here
        assert (other / "trained_prompts.json").read_text() == full_trained


def test_resume_true_without_a_timestamp_takes_the_newest_resumable_run(tmp_path):
    from nebula_rl.utils.runs import resolve_run_dir

    cfg = _cfg(tmp_path, SFT, max_num_steps=1, resume=True, timestamp="")
    fresh = resolve_run_dir(cfg.train)
    assert fresh.parent == tmp_path and not fresh.exists()  # nothing to resume: a new folder
    for run, complete in (("20260101000000", True), ("20260102000000", True), ("20260103", False)):
        folder = checkpoint_path(tmp_path / run, 1)
        folder.mkdir(parents=True)
        if complete:
            (folder / MANIFEST).write_text("{}")
    cfg = _cfg(tmp_path, SFT, max_num_steps=1, resume=True, timestamp="")
    assert (
        resolve_run_dir(cfg.train) == tmp_path / "20260102000000"
    )  # (the newest one is half-written)
    assert cfg.train.timestamp == "20260102000000"


def test_resume_errors_name_the_key(tmp_path):
    half = checkpoint_path(tmp_path / "old", 3)
    half.mkdir(parents=True)
    cfg = _cfg(tmp_path, SFT, max_num_steps=1, resume=str(half))
    with pytest.raises(ValueError, match=r"train\.resume: .* not a complete checkpoint"):
        local.run(cfg)


def _small_state(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    return model, optimizer, scheduler


def _train_step(model, optimizer, scheduler) -> None:
    model(torch.randn(4, 8)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def _checkpointer(run_dir: Path, state, **cfg) -> Checkpointer:
    model, optimizer, scheduler = state
    return Checkpointer(
        CheckpointConfig(enable_checkpoint=True, **cfg),
        run_dir,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        export=lambda path: path.mkdir(parents=True),
    )


def _tensors(model, optimizer) -> dict[str, torch.Tensor]:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    out = {f"model.{k}": v.detach().clone() for k, v in model_sd.items()}
    for fqn, state in optim_sd["state"].items():
        out |= {f"optim.{fqn}.{k}": v.clone() for k, v in state.items()}
    return out


@pytest.mark.parametrize("save_mode", ["sync", "async"])
def test_max_keep_rotates_checkpoints_and_exports(tmp_path, save_mode):
    state = _small_state(0)
    checkpointer = _checkpointer(tmp_path, state, max_keep=2, save_mode=save_mode)
    for step in range(1, 6):
        _train_step(*state)
        checkpointer.save(step, data={"position": step})
    checkpointer.close()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_4", "step_5"]
    assert sorted(p.name for p in (tmp_path / "safetensors").iterdir()) == ["step_4", "step_5"]
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 5)
    restored = _checkpointer(tmp_path, _small_state(1)).load(checkpoint_path(tmp_path, 4))
    assert (restored.step, restored.data) == (4, {"position": 4})


def test_half_written_checkpoint_is_ignored(tmp_path):
    state = _small_state(0)
    checkpointer = _checkpointer(tmp_path, state, save_mode="sync", max_keep=-1)
    _train_step(*state)
    checkpointer.save(3, data={})
    _train_step(*state)
    checkpointer.save(5, data={})
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 5)
    (checkpoint_path(tmp_path, 5) / MANIFEST).unlink()  # as if killed before the manifest
    (tmp_path / "checkpoints" / "step_7").mkdir()  # as if killed right after starting
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 3)
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        checkpointer.load(checkpoint_path(tmp_path, 5))
    assert latest_checkpoint(tmp_path / "nothing_here") is None


def test_async_save_writes_the_state_at_the_call(tmp_path):
    state = _small_state(0)
    _train_step(*state)
    saved = _tensors(state[0], state[1])
    sync = _checkpointer(tmp_path / "sync", state, save_mode="sync")
    sync.save(1, data={})
    background = _checkpointer(tmp_path / "async", state, save_mode="async")
    background.save(1, data={})
    # Change every tensor in place while the background write may still be running.
    _train_step(*state)
    with torch.no_grad():
        for p in state[0].parameters():
            p.add_(1.0)
    background.close()
    changed = _tensors(state[0], state[1])
    for run in ("sync", "async"):
        fresh = _small_state(1)
        _checkpointer(tmp_path / run, fresh).load(checkpoint_path(tmp_path / run, 1))
        loaded = _tensors(fresh[0], fresh[1])
        assert loaded.keys() == saved.keys()
        for name, tensor in saved.items():
            assert torch.equal(loaded[name], tensor), (run, name)
            if tensor.numel() > 1:
                assert not torch.equal(loaded[name], changed[name]), (run, name)
        assert fresh[2].last_epoch == 1


def _fsdp_rank(rank: int, port: int, run_dir: str, out) -> None:
    try:
        from torch.distributed.checkpoint.state_dict import StateDictOptions
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
        )
        mesh = init_device_mesh("cpu", (2,))
        model = load_model("tiny:qwen2", seed=1)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5**s)
        ema = WeightEMA(model, decay=0.5, interval=1)  # (averages of this rank's shards)
        ids = torch.arange(1, 9).view(2, 4) + rank
        model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
        optimizer.step()
        ema.step()
        scheduler.step()
        checkpointer = Checkpointer(
            CheckpointConfig(enable_checkpoint=True, save_mode="async"),
            Path(run_dir),
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            ema=ema,
        )
        checkpointer.save(1, data={"position": 8}, ledger={"policy_version": 1})
        checkpointer.close()
        full = get_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        averages = {name: a.full_tensor() for name, a in ema.state().items()}
        if rank == 0:
            torch.save(full, Path(run_dir) / "full.pt")
            torch.save(averages, Path(run_dir) / "ema.pt")
        dist.barrier()
        dist.destroy_process_group()
        out.put((rank, None))
    except BaseException:
        out.put((rank, traceback.format_exc()))
    finally:
        out.close()
        out.join_thread()
        os._exit(0)


def test_fsdp_sharded_checkpoint_loads_unsharded(tmp_path):
    port = free_port()
    ctx = rank_context()
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_fsdp_rank, args=(r, port, str(tmp_path), out), daemon=True)
        for r in range(2)
    ]
    for p in procs:
        p.start()
    reports = {}
    try:
        while len(reports) < 2:
            rank, report = out.get(timeout=240)
            reports[rank] = report
    except queue.Empty:
        pytest.fail(f"rank(s) {sorted({0, 1} - set(reports))} did not report")
    for p in procs:
        p.join(timeout=30)
    for rank, report in reports.items():
        assert report is None, f"rank {rank} failed:\n{report}"

    path = checkpoint_path(tmp_path, 1)
    assert json.loads((path / MANIFEST).read_text())["world_size"] == 2
    assert sorted(p.name for p in path.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    model = load_model("tiny:qwen2", seed=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5**s)
    ema = WeightEMA(model, decay=0.5, interval=1)
    restored = Checkpointer(
        CheckpointConfig(),
        tmp_path,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        ema=ema,
    ).load(path)
    assert (restored.step, restored.data, restored.ledger) == (
        1,
        {"position": 8},
        {"policy_version": 1},
    )
    assert scheduler.last_epoch == 1 and optimizer.param_groups[0]["lr"] == 0.5e-3
    want_model, want_optim = torch.load(tmp_path / "full.pt", weights_only=False)
    got_model, got_optim = get_state_dict(model, optimizer)
    assert got_model.keys() == want_model.keys()
    for name, tensor in want_model.items():
        assert torch.equal(got_model[name], tensor), name
    assert got_optim["state"].keys() == want_optim["state"].keys()
    for fqn, state in want_optim["state"].items():
        for key, tensor in state.items():
            assert torch.equal(got_optim["state"][fqn][key], tensor), (fqn, key)
    # The weight averages, saved as shards, load whole; they lag the weights.
    assert ema.steps == 1
    want_ema = torch.load(tmp_path / "ema.pt", weights_only=True)
    assert ema.state().keys() == want_ema.keys()
    for name, tensor in want_ema.items():
        assert torch.equal(ema.state()[name], tensor), name
        if "norm" not in name:
            assert not torch.equal(tensor, got_model[name]), name


def test_epoch_checkpoints_come_after_every_nth_epoch(tmp_path):
    """`save_freq_in_epoch = 2` saves after the last step of epochs 2, 4, ... (and after the
    run's last step) in place of every `save_freq` steps: SFT on 12 rows, 4 a step, is 3 steps
    an epoch."""
    from nebula_rl.config import CheckpointConfig

    ckpt = {
        "enable_checkpoint": True,
        "save_freq": 1,
        "save_freq_in_epoch": 2,
        "max_keep": -1,
        "export_safetensors": False,
    }
    run_dir = local.run(_cfg(tmp_path, SFT, epoch=3, ckpt=ckpt))
    done = [p.name for p in sorted((run_dir / "checkpoints").iterdir()) if is_checkpoint(p)]
    assert done == ["step_6", "step_9"]
    every = CheckpointConfig(**ckpt)  # (what the runtime's controller asks the policy for)
    assert [s for s in range(1, 14) if every.due(s, last=s == 13, steps_per_epoch=3)] == [6, 12, 13]
    every.save_freq_in_epoch = 0
    assert [s for s in range(1, 4) if every.due(s, last=False, steps_per_epoch=3)] == [1, 2, 3]


def test_a_resumed_run_keeps_the_metrics_of_its_steps_up_to_the_checkpoint(tmp_path):
    """Lines of later steps (an earlier attempt got past the checkpoint) and a last line a crash
    cut short are dropped; the others stay as written."""
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3)]
    path.write_text("".join(lines) + '{"step": 4, "lo')
    drop_steps_after(path, 2)
    assert path.read_text() == "".join(lines[:2])
    drop_steps_after(path, 5)  # (nothing later: unchanged)
    assert path.read_text() == "".join(lines[:2])
