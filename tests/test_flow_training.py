"""Training options of world models: weight averages (`train.ema_enable`, `flow.ema`) and
activation checkpointing of the flow model's blocks (`policy.model_gradient_checkpointing`)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
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


def test_group_advantages_never_nan_and_take_either_std():
    """A group of one sample has advantage 0, not NaN (its own mean; today's n - 1 std of one
    reward was NaN, and one such update turned every weight NaN). The std is over n - 1
    (cosmos-rl's torch std) or, with `population_std`, over n (flow_grpo's numpy std)."""
    import numpy as np

    from nebula_rl.algorithms.flow import group_advantages
    from nebula_rl.flow.local import flow_advantages, pooled_std

    lone = flow_advantages(torch.tensor([0.3, 0.9, -0.2]), 1, FlowRLSettings())
    assert torch.equal(lone, torch.zeros(3))
    assert torch.equal(
        flow_advantages(torch.tensor([0.4]), 1, FlowRLSettings(global_std=True)), torch.zeros(1)
    )
    rewards = torch.tensor([0.1, 0.5, 0.2, 0.9, -1.0, 0.3, 0.3, 0.8])
    groups = rewards.view(2, 4).numpy().astype(np.float64)
    for population in (False, True):
        got = group_advantages(rewards, 4, population_std=population)
        std = groups.std(axis=1, ddof=0 if population else 1, keepdims=True)
        want = (groups - groups.mean(axis=1, keepdims=True)) / (std + 1e-4)
        np.testing.assert_allclose(got.numpy(), want.flatten(), rtol=1e-5)
        batch = group_advantages(rewards, 4, global_std=True, population_std=population)
        whole = float(rewards.double().std(correction=0 if population else 1))
        assert pooled_std(
            float(rewards.sum()), float(rewards.square().sum()), 8, population=population
        ) == pytest.approx(whole, rel=1e-6)
        want = (groups - groups.mean(axis=1, keepdims=True)) / (whole + 1e-4)
        np.testing.assert_allclose(batch.numpy(), want.flatten(), rtol=1e-5)


def test_a_wfm_mode_config_trains_on_cosmos_rls_objective(tmp_path):
    """A cosmos-rl `--wfm-mode` config, translated: one FlowGRPO step's loss is the one
    cosmos-rl's `wfm_trainer.rl_training_step` computes on the same rollout, from its formulas:
    advantages `(r - mean) / (std + 1e-4)` per prompt's group (torch's n - 1 std), clamped to
    +-5; ratio `exp(mean(-(x' - mu)^2 + (x' - mu_old)^2))`, no 1 / (2 sigma^2); the clipped
    policy term; plus `kl_beta mean((mu_ref - mu)^2)`. The policy trains from other weights than
    the rollout's (so the ratio is not 1) and the reference is a third model. With flow_grpo's
    Gaussian forms (nebula-rl's defaults) the same step's loss differs."""
    from nebula_rl.config.compat.wfm import translate_wfm
    from nebula_rl.flow.job import flow_settings
    from nebula_rl.flow.local import (
        FlowBatch,
        flow_advantages,
        roll_out,
        rollout_velocity,
        train_on_batch,
    )
    from nebula_rl.flow.sampler import sde_step

    wfm = {
        "model": {
            "rl": {
                "sample_steps": 4, "num_rollout": 4, "train_on": [1], "kl_beta": 0.3,
                "clip_ratio": 0.2, "max_num_conditional_frames": 0, "use_same_seed": False,
                "update_ref_every_iter": 0,
            },
        },
        "policy": {"model_name_or_path": "tiny:dit"},
        "trainer": {"max_iter": 1},
    }  # fmt: skip
    _, problems = translate_wfm(wfm)
    assert problems == []
    cfg = config_from_dict(wfm, source="wfm.toml")
    s = flow_settings(cfg, num_iterations=1, prompts=2)
    s = dataclasses.replace(s, num_minibatches=1)  # (cosmos-rl trains the batch in one update)
    assert (s.ratio_form, s.kl_form, s.global_std) == ("squared_error", "squared_error", False)

    rollout_model, clips = _toy_rl(tmp_path)
    policy, reference = copy.deepcopy(rollout_model), copy.deepcopy(rollout_model)
    with torch.no_grad():  # (other weights than the rollout's, and a third reference)
        for k, (p, r) in enumerate(zip(policy.parameters(), reference.parameters(), strict=True)):
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(k)))
            r.add_(0.02 * torch.randn(r.shape, generator=torch.Generator().manual_seed(99 + k)))
    real = [clips[0]] * 4 + [clips[1]] * 4
    _, text, mask, trajectory = roll_out(rollout_model, real, s, torch.Generator().manual_seed(1))
    rewards = torch.tensor([0.1, 0.5, 0.2, 0.9, -1.0, 0.3, 0.3, 0.8])
    advantages = flow_advantages(rewards, s.group_size, s)
    groups = rewards.view(2, 4)
    cosmos_advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True)
        + 1e-4)).clamp(-5, 5).flatten()  # fmt: skip
    torch.testing.assert_close(advantages, cosmos_advantages)

    j = 1  # (train_on)
    x, after = trajectory.latents[:, j], trajectory.latents[:, j + 1]
    sigma = torch.full((8,), float(trajectory.sigmas[j]))

    def mean_of(model: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            v = rollout_velocity(model, text, mask, s, given=None)(x, sigma)
            return sde_step(x, v, trajectory.sigmas, j, noise_level=s.noise_level).mean

    mu, mu_old, mu_ref = mean_of(policy), mean_of(rollout_model), mean_of(reference)
    ratio = torch.exp((-((after - mu) ** 2) + (after - mu_old) ** 2).mean(dim=[1, 2, 3, 4]))
    assert float((ratio - 1).abs().max()) > 1e-6  # (not on-policy: the ratio matters)
    unclipped = -cosmos_advantages * ratio
    clipped = -torch.clamp(ratio, 1 - 0.2, 1 + 0.2) * cosmos_advantages
    expected = torch.maximum(unclipped, clipped).mean() + 0.3 * ((mu_ref - mu) ** 2).mean()

    batch = FlowBatch([c.caption for c in real], None, text, mask, trajectory, advantages)
    losses = {}
    for forms in (("squared_error", "squared_error"), ("gaussian", "gaussian")):
        trained = copy.deepcopy(policy)
        settings = dataclasses.replace(s, ratio_form=forms[0], kl_form=forms[1])
        optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-3)
        [loss], _ = train_on_batch(
            trained, optimizer, batch, settings, torch.Generator().manual_seed(2), iteration=1,
            reference=reference,
        )  # fmt: skip
        losses[forms[0]] = loss
    # (float32 forward passes on two code paths)
    assert losses["squared_error"] == pytest.approx(float(expected), rel=1e-5, abs=1e-7)
    assert abs(losses["gaussian"] - float(expected)) > 1e-3 * abs(float(expected))


def test_nft_old_weights_follow_each_update_or_once_an_iteration(tmp_path):
    """DiffusionNFT's old weights: cosmos-rl's three decay schedules (`weight_copy_decay_type`),
    applied after each optimiser step (nebula-rl's default) or once an iteration after all of
    them (`nft_old_update = "iteration"`, cosmos-rl's: old <- d old + (1 - d) final)."""
    from nebula_rl.algorithms.flow import nft_old_decay
    from nebula_rl.flow.local import FlowBatch, roll_out, train_on_batch

    assert [nft_old_decay(s, 0) for s in (0, 10, 1000)] == [0.0, 0.0, 0.0]
    assert [nft_old_decay(s, 1) for s in (0, 10, 1000)] == pytest.approx([0.0, 0.01, 0.5])
    assert [nft_old_decay(s, 2) for s in (10, 75, 85, 10**5)] == pytest.approx(
        [0.0, 0.0, 0.075, 0.999]
    )
    with pytest.raises(ValueError, match="decay type 3"):
        nft_old_decay(1, 3)

    model, clips = _toy_rl(tmp_path)
    real = [clips[0]] * 4
    base = FlowRLSettings(algorithm="nft", sample_steps=4, group_size=4, num_minibatches=2)
    _, text, mask, trajectory = roll_out(model, real, base, torch.Generator().manual_seed(0))
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    batch = FlowBatch([c.caption for c in real], None, text, mask, trajectory, advantages)
    start = [p.detach().clone() for p in model.parameters()]
    decay = nft_old_decay(100, 1)  # (0.1)
    for when in ("iteration", "minibatch"):
        trained, old = copy.deepcopy(model), copy.deepcopy(model).requires_grad_(False)
        s = dataclasses.replace(base, nft_old_update=when)
        optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-2)
        train_on_batch(
            trained, optimizer, batch, s, torch.Generator().manual_seed(1), iteration=100, old=old
        )
        once = [
            decay * s0 + (1 - decay) * p.detach()
            for s0, p in zip(start, trained.parameters(), strict=True)
        ]
        matches = all(
            torch.allclose(o, w, atol=1e-7) for o, w in zip(old.parameters(), once, strict=True)
        )
        assert matches == (when == "iteration"), when


def test_the_convention_keys_reach_the_loop(tmp_path):
    """Each key that picks a convention (docs/world-models.md, "Conventions") reaches the
    loop's settings; by default the loop has flow_grpo's forms, the n - 1 std, guidance trained
    through both branches and the NFT old weights following each optimiser step."""
    from flow_configs import tiny_flow_config

    default = job.flow_settings(
        config_from_dict(tiny_flow_config(tmp_path, tiny_flow_policy())), num_iterations=1,
        prompts=2,
    )  # fmt: skip
    assert (default.ratio_form, default.kl_form) == ("gaussian", "gaussian")
    assert not default.population_std and not default.detach_unconditional
    assert default.nft_old_update == "minibatch" and default.nft_decay_type == 0
    policy = tiny_flow_policy(
        ratio_form="squared_error", kl_form="squared_error", detach_unconditional=True,
        nft_old_update="iteration", weight_copy_decay_type=2,
    )  # fmt: skip
    policy["diffusers"]["sample"]["population_std"] = True
    data = tiny_flow_config(tmp_path, policy, trainer="diffusion_nft")
    s = job.flow_settings(config_from_dict(data), num_iterations=1, prompts=2)
    assert (s.ratio_form, s.kl_form) == ("squared_error", "squared_error")
    assert s.population_std and s.detach_unconditional
    assert (s.nft_old_update, s.nft_decay_type) == ("iteration", 2)
