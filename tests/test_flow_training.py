"""Training options of world models: weight averages (`train.ema_enable`, `flow.ema`) and
activation checkpointing of the flow model's blocks (`policy.model_gradient_checkpointing`)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from flow_configs import tiny_flow_policy, tiny_flow_train_policy
from nebula_rl.config import config_from_dict
from nebula_rl.flow import job
from nebula_rl.flow.dit import TinyDiT, TinyDiTConfig
from nebula_rl.flow.ema import WeightEMA
from nebula_rl.flow.models import load_flow_model
from nebula_rl.flow.parallel import checkpoint_blocks


def test_weight_averages_follow_cosmos_rls_warm_up_decay_and_interval():
    model = nn.Linear(3, 2)
    frozen = model.bias.requires_grad_(False)
    ema = WeightEMA(model, decay=0.5, interval=2)
    assert ema.params == [model.weight]  # (only what trains)
    start = model.weight.detach().clone()
    history = []
    for t in range(4):
        with torch.no_grad():
            model.weight.add_(1.0)
        history.append(model.weight.detach().clone())
        ema.step()
        if t == 0:  # (step 1 of interval 2: no update)
            assert torch.equal(ema.averages[0], start)
    want = start.clone()
    for t in (1, 3):  # the update steps: (t + 1) % 2 == 0
        d = min((1 + t) / (10 + t), 0.5)
        want = want + (1 - d) * (history[t] - want)
    torch.testing.assert_close(ema.averages[0], want)
    live = model.weight.detach().clone()
    with ema.applied():
        torch.testing.assert_close(model.weight.detach(), want)
    assert torch.equal(model.weight.detach(), live)  # the live weights are back
    assert not frozen.requires_grad


def _sft(tmp_path: Path, name: str, **train: object) -> dict:
    return {
        "train": {
            "output_dir": str(tmp_path),
            "timestamp": name,
            "max_num_steps": 4,
            "train_batch_per_replica": 8,
            "optm_lr": 1e-2,
            "optm_warmup_steps": 0,
            "train_policy": {
                "type": "sft",
                "trainer_type": "diffusers_sft",
                "dataset": {"name": "builtin:toy_video", "kwargs": {"clips_per_prompt": 1}},
            },
            **train,
        },
        "policy": tiny_flow_policy(steps=2),
    }


def _exported(tmp_path: Path, raw: dict, run_dir: Path) -> dict[str, torch.Tensor]:
    raw = copy.deepcopy(raw)
    raw["policy"]["model_name_or_path"] = str(run_dir / "safetensors" / "final")
    return load_flow_model(config_from_dict(raw)).state_dict()


def test_an_ema_run_exports_the_averages(tmp_path):
    """The same SFT run with and without `ema_enable` (seeded, CPU: the same live weights):
    at `ema_decay = 0` the averages are the live weights, so the exports are equal; at 0.9 every
    parameter that trained is exported as its average, not as its live value."""
    plain = _sft(tmp_path, "plain")
    live = _exported(tmp_path, plain, job.run(config_from_dict(plain)))
    start = load_flow_model(config_from_dict(plain)).state_dict()
    moved = [n for n in start if not torch.equal(live[n], start[n])]
    assert moved
    for decay in (0.0, 0.9):
        raw = _sft(tmp_path, f"ema{decay}", ema_enable=True, ema_decay=decay)
        averaged = _exported(tmp_path, raw, job.run(config_from_dict(raw)))
        for name in moved:
            assert torch.equal(averaged[name], live[name]) == (decay == 0.0), (decay, name)


def test_checkpointed_blocks_give_the_same_gradients():
    """`policy.model_gradient_checkpointing`: each block recomputed in backward, the gradients
    as without (and the parameter names unchanged, for the weight push)."""
    torch.manual_seed(0)
    plain = TinyDiT(TinyDiTConfig(frames=2, size=8, patch=4, width=32, depth=2, heads=2))
    with torch.no_grad():
        plain.out.weight.normal_(std=0.1)  # (a fresh DiT's output layer is zero)
    checkpointed = copy.deepcopy(plain)
    assert checkpoint_blocks(checkpointed) == 2
    assert [n for n, _ in checkpointed.named_parameters()] == [
        n for n, _ in plain.named_parameters()
    ]
    g = torch.Generator().manual_seed(1)
    x, text = torch.randn(3, 3, 2, 8, 8, generator=g), torch.randn(3, 4, 32, generator=g)
    sigma, mask = torch.tensor([0.2, 0.5, 0.9]), torch.ones(3, 4)
    for model in (plain, checkpointed):
        model(x, sigma, text, mask).square().mean().backward()
    for (name, a), (_, b) in zip(
        plain.named_parameters(), checkpointed.named_parameters(), strict=True
    ):
        assert a.grad is not None and b.grad is not None, name
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-7, msg=name)


def test_bf16_param_dtype_computes_the_velocity_in_bf16(tmp_path):
    """`train.param_dtype = "bfloat16"`: the model's layers compute in bf16 (autocast) on fp32
    weights, the velocity comes back in fp32 within 2% of the fp32 model's, and a FlowGRPO run
    trains with it."""
    raw = _sft(tmp_path, "bf16")
    full = load_flow_model(config_from_dict(raw))
    with torch.no_grad():
        full.out.weight.normal_(std=0.05, generator=torch.Generator().manual_seed(3))
    raw["train"]["param_dtype"] = "bfloat16"
    half = load_flow_model(config_from_dict(raw))
    half.load_state_dict(full.state_dict())
    assert all(p.dtype == torch.float32 for p in half.parameters())  # (the master weights)
    seen: list[torch.dtype] = []
    for module in half.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    g = torch.Generator().manual_seed(1)
    x, text = torch.randn(3, 3, 2, 8, 8, generator=g), torch.randn(3, 4, 32, generator=g)
    sigma, mask = torch.tensor([0.2, 0.5, 0.9]), torch.ones(3, 4)
    with torch.no_grad():
        want, got = full(x, sigma, text, mask), half(x, sigma, text, mask)
    assert set(seen) == {torch.bfloat16} and got.dtype == torch.float32
    assert float((got - want).abs().max()) < 0.02 * float(want.abs().max())

    rl = _sft(tmp_path, "bf16_rl", param_dtype="bfloat16")
    rl["train"]["train_policy"] = tiny_flow_train_policy(mini_batch=8, clips_per_prompt=1)
    rl["train"]["max_num_steps"] = 2
    rl["rollout"] = {"n_generation": 4}
    import json

    run_dir = job.run(config_from_dict(rl))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(0 <= r["reward_mean"] <= 1 for r in records)


def test_a_resumed_run_ends_where_the_uninterrupted_one_does(tmp_path):
    """DiffusionNFT with weight averages, checkpointed every 2 of 4 steps (the model, its old
    weights, the averages, the optimiser, the noise generator): a new run resumed from step 2
    exports the same weights as the run that went through, and records steps 3 and 4 only."""
    import json

    def cfg(name: str, **train: object) -> dict:
        raw = _sft(tmp_path, name, ema_enable=True, ema_decay=0.9, **train)
        raw["train"]["train_policy"] = {
            "type": "grpo",
            "trainer_type": "diffusion_nft",
            "reward_function": "brightness",
            "mini_batch": 4,
            "dataset": {"name": "builtin:toy_video", "kwargs": {"clips_per_prompt": 1}},
        }
        raw["train"]["epoch"] = 4
        raw["policy"]["diffusers"]["weight_copy_decay_type"] = 1
        raw["policy"]["diffusers"]["sample"]["deterministic_sampling"] = True
        raw["rollout"] = {"n_generation": 4}
        return raw

    ckpt = {"enable_checkpoint": True, "save_freq": 2, "export_safetensors": False}
    through = cfg("through", ckpt=ckpt)
    first = job.run(config_from_dict(through))
    assert (first / "checkpoints" / "step_2").is_dir()
    resumed = cfg("resumed", resume=str(first / "checkpoints" / "step_2"))
    second = job.run(config_from_dict(resumed))
    want, got = _exported(tmp_path, through, first), _exported(tmp_path, resumed, second)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, msg=name)
    steps = [
        json.loads(line)["step"] for line in (second / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [3, 4]
