"""Training options of world models: weight averages (`train.ema_enable`, `flow.ema`) and
activation checkpointing of the flow model's blocks (`policy.model_gradient_checkpointing`)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch
from torch import nn

from flow_configs import tiny_flow_policy, tiny_flow_train_policy
from nebula_rl.config import config_from_dict
from nebula_rl.flow import job
from nebula_rl.flow.dit import TinyDiT, TinyDiTConfig
from nebula_rl.flow.ema import WeightEMA
from nebula_rl.flow.local import FlowRLSettings, run_flow_rl
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


def _toy_rl(tmp_path: Path) -> tuple[TinyDiT, list]:
    from nebula_rl.flow.data import make_toy_dataset, read_local_dataset

    clips = read_local_dataset(
        make_toy_dataset(tmp_path / "data", clips_per_prompt=1, size=8), num_frames=2
    )
    torch.manual_seed(0)
    model = TinyDiT(TinyDiTConfig(size=8, frames=2, width=32, depth=1, heads=2, patch=4))
    return model, clips


def test_train_on_trains_the_named_steps_and_draws_the_rest(tmp_path):
    """`policy.diffusers.train_on`: only the named steps of each trajectory are replayed (NaN
    everywhere else in the trajectory leaves the update finite; the first steps, the
    `timesteps_fraction` way, would read them), and each -1 adds a step drawn every iteration
    from those not named."""
    from nebula_rl.flow.local import FlowBatch, _trained_steps, roll_out, train_on_batch

    s = FlowRLSettings(sample_steps=6, group_size=4, train_on=(0, 2, -1, -1))
    generator = torch.Generator().manual_seed(0)
    draws = [_trained_steps(s, generator) for _ in range(20)]
    assert all(len(set(d)) == 4 and {0, 2} <= set(d) and d == sorted(d) for d in draws)
    assert len({tuple(d) for d in draws}) > 1  # (drawn afresh)
    assert _trained_steps(FlowRLSettings(sample_steps=6, timestep_fraction=0.5), generator) == [
        0, 1, 2,
    ]  # fmt: skip

    model, clips = _toy_rl(tmp_path)
    s = FlowRLSettings(sample_steps=6, group_size=4, num_minibatches=1, train_on=(3,))
    real = [clips[0]] * 4
    _, text, mask, trajectory = roll_out(model, real, s, generator)
    poisoned = trajectory.latents.clone()
    poisoned[:, [0, 1, 2, 5, 6]] = float("nan")  # (step 3 reads latents 3 and 4)
    log_probs = trajectory.log_probs.clone()
    log_probs[:, [0, 1, 2, 4, 5]] = float("nan")
    trajectory = dataclasses.replace(trajectory, latents=poisoned, log_probs=log_probs)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    batch = FlowBatch([c.caption for c in real], None, text, mask, trajectory, advantages)
    for train_on, finite in (((3,), True), (None, False)):
        trained = copy.deepcopy(model)
        optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-3)
        picked = dataclasses.replace(s, train_on=train_on)
        train_on_batch(trained, optimizer, batch, picked, generator, iteration=1)
        weights = torch.cat([p.detach().flatten() for p in trained.parameters()])
        assert bool(weights.isfinite().all()) == finite
        if finite:
            assert not torch.equal(weights, torch.cat([p.flatten() for p in model.parameters()]))


def test_same_group_noise_starts_each_group_from_one_noise(tmp_path):
    """`policy.diffusers.sample.same_group_noise`: the samples of a group start from the same
    noise and part ways through the SDE's noise; groups start apart. Off, every sample starts
    from its own noise."""
    from nebula_rl.flow.local import roll_out

    model, clips = _toy_rl(tmp_path)
    real = [clips[0]] * 3 + [clips[1]] * 3
    for same in (True, False):
        s = FlowRLSettings(sample_steps=4, group_size=3, same_group_noise=same)
        *_, trajectory = roll_out(model, real, s, torch.Generator().manual_seed(0))
        start, final = trajectory.latents[:, 0], trajectory.final
        assert torch.equal(start[0], start[1]) == same and torch.equal(start[3], start[5]) == same
        assert not torch.equal(start[0], start[3])
        assert not torch.equal(final[0], final[1])


def test_the_kl_reference_takes_the_weights_every_reset_interval(tmp_path):
    """`train.train_policy.reference_reset_interval = 2`: before iterations 3, 5, ... the KL's
    reference becomes the current weights (those after iteration 2, 4, ...); with
    `reset_optimizer_with_reference` the optimiser's moments start again then."""
    model, clips = _toy_rl(tmp_path)
    for reset_optimizer in (True, False):
        trained = copy.deepcopy(model)
        reference = copy.deepcopy(model).requires_grad_(False)
        s = FlowRLSettings(
            num_iterations=3, prompts_per_iteration=1, group_size=4, sample_steps=4,
            num_minibatches=2, kl_beta=0.5, reference_reset_interval=2,
            reset_optimizer_with_reference=reset_optimizer,
        )  # fmt: skip
        after: list[dict[str, torch.Tensor]] = []
        optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-3)

        def snapshot(record: dict, into: list = after, m: torch.nn.Module = trained) -> None:
            into.append({k: v.clone() for k, v in m.state_dict().items()})

        run_flow_rl(
            trained, clips, s, score=lambda x, _: x.mean(dim=(1, 2, 3, 4)).tolist(),
            on_iteration=snapshot, optimizer=optimizer, reference=reference,
        )  # fmt: skip
        for name, value in reference.state_dict().items():
            assert torch.equal(value, after[1][name]), name  # (iteration 2's weights)
        assert not torch.equal(after[1]["blocks.0.qkv.weight"], after[2]["blocks.0.qkv.weight"])
        steps = {int(state["step"]) for state in optimizer.state.values()}
        assert steps == ({2} if reset_optimizer else {6})  # (2 updates per iteration)


def test_a_resumed_run_keeps_the_reset_kl_reference(tmp_path):
    """FlowGRPO with a KL whose reference is reset every 2 iterations (so before iteration 3),
    checkpointed at step 3: the checkpoint holds that reference, so iteration 4 of the resumed
    run pulls towards it, not the starting weights, and both runs export the same weights."""

    def cfg(name: str, **train: object) -> dict:
        raw = _sft(tmp_path, name, **train)
        raw["train"]["train_policy"] = {
            "type": "grpo",
            "trainer_type": "flow_grpo",
            "reward_function": "brightness",
            "mini_batch": 4,
            "kl_beta": 1.0,
            "epsilon_low": 0.2,
            "epsilon_high": 0.2,
            "reference_reset_interval": 2,
            "dataset": {"name": "builtin:toy_video", "kwargs": {"clips_per_prompt": 1}},
        }
        raw["train"]["epoch"] = 4
        raw["rollout"] = {"n_generation": 4}
        return raw

    ckpt = {"enable_checkpoint": True, "save_freq": 3, "export_safetensors": False}
    through = cfg("through", ckpt=ckpt)
    first = job.run(config_from_dict(through))
    resumed = cfg("resumed", resume=str(first / "checkpoints" / "step_3"))
    second = job.run(config_from_dict(resumed))
    want, got = _exported(tmp_path, through, first), _exported(tmp_path, resumed, second)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, msg=name)
