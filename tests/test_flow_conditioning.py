"""Conditioning frames of world-model RL (image/video-to-video, cosmos-rl's Video2World): a
sample's first frames are given, clean, from its prompt's real clip. The sampler keeps them clean
in every recorded step, log-probabilities and losses average over the generated elements only,
the models mark the given frames, and each part of the loop (one process, the trajectory files,
the runtime's replicas) carries which frames were given."""

from __future__ import annotations

import json
import math

import pytest
import torch

from flow_configs import tiny_flow_config, tiny_flow_policy
from nebula_rl.algorithms.flow import flow_grpo_kl, flow_matching_loss, masked_mean, nft_loss
from nebula_rl.config import ConfigError, config_from_dict
from nebula_rl.flow.data import make_toy_dataset, read_local_dataset
from nebula_rl.flow.diffusers_models import tiny_diffusers_flow_model
from nebula_rl.flow.dit import TinyDiT, TinyDiTConfig
from nebula_rl.flow.local import (
    FlowBatch,
    FlowRLSettings,
    flow_advantages,
    pretrain,
    roll_out,
    train_on_batch,
)
from nebula_rl.flow.models import check_flow_model, load_flow_model, save_flow_model
from nebula_rl.flow.sampler import context_frames, sample, sde_step, sigma_schedule
from nebula_rl.flow.trajectories import TrajectoryStore


def _given(batch: int, frames: int, counts: list[int]) -> torch.Tensor:
    return torch.arange(frames)[None] < torch.tensor(counts)[:, None]


def test_masked_means_average_the_generated_elements_only():
    """With every element free they are the plain means; with some given, the mean over the
    rest (checked against a hand-written mean for each loss)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 3, 2, 4, 4, generator=g), torch.randn(4, 3, 2, 4, 4, generator=g)
    every = torch.ones(4, 1, 2, 1, 1)
    assert torch.allclose(masked_mean(a, every), a.flatten(1).mean(1))
    free = context_frames(_given(4, 2, [1, 0, 1, 0]))
    assert free is not None and free.shape == (4, 1, 2, 1, 1)
    by_hand = torch.stack(
        [(a[i, :, 1:] if i in (0, 2) else a[i]).mean() for i in range(4)]
    )  # (samples 0 and 2: their first frame given)
    assert torch.allclose(masked_mean(a, free), by_hand)
    sigma = torch.rand(4, generator=g)
    assert torch.allclose(
        flow_matching_loss(a, b, torch.zeros_like(b), sigma, free=free),
        masked_mean((a + b) ** 2, free).mean(),
    )
    assert torch.allclose(
        flow_grpo_kl(a, b, 0.5, free=free), (masked_mean((a - b) ** 2, free) / 0.5).mean()
    )
    # NFT: a change on the given frames alone leaves the loss as it was
    x_t, x0, adv = torch.randn_like(a), torch.randn_like(a), torch.randn(4, generator=g)
    base = nft_loss(a, b, x_t, x0, sigma, adv, beta=1.0, free=free)
    moved = a.clone()
    moved[0, :, 0] += 3.0
    assert torch.allclose(nft_loss(moved, b, x_t, x0, sigma, adv, beta=1.0, free=free), base)
    assert not torch.allclose(nft_loss(moved, b, x_t, x0, sigma, adv, beta=1.0), base)


def test_given_frames_stay_clean_and_only_generated_frames_have_log_probs():
    """Every recorded latent holds the clean frames where they are given; each step's
    log-probability is the Gaussian density averaged over the generated elements, which a
    velocity that differs only on the given frames leaves unchanged."""
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(3, 2, 3, 4, 4, generator=g)
    clean = torch.randn(3, 2, 3, 4, 4, generator=g)
    given = _given(3, 3, [1, 2, 0])

    def velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return -x * 0.5

    t = sample(velocity, noise, num_steps=4, noise_level=0.7, generator=g, given=given, clean=clean)
    assert torch.equal(t.given, given)
    for i, k in enumerate([1, 2, 0]):
        assert torch.equal(t.latents[i, :, :, :k], clean[i, :, :k].expand(5, -1, -1, -1, -1))
        assert not torch.equal(t.latents[i, -1, :, k:], clean[i, :, k:])
    free = context_frames(given)
    sigmas = sigma_schedule(4)
    for j in range(4):
        x, nxt = t.latents[:, j], t.latents[:, j + 1]
        step = sde_step(x, velocity(x, None), sigmas, j, noise_level=0.7, sample=nxt, free=free)
        assert torch.allclose(step.log_prob, t.log_probs[:, j], atol=1e-5)
        scale = step.scale
        density = -((nxt - step.mean) ** 2) / (2 * scale**2) - math.log(scale)
        density = density - 0.5 * math.log(2 * math.pi)
        assert torch.allclose(step.log_prob[0], density[0, :, 1:].mean(), atol=1e-5)
        off = velocity(x, None).clone()
        off[:, :, 0] += 1.0  # (only where sample 0 and 1 are given ... and 2 is not)
        other = sde_step(x, off, sigmas, j, noise_level=0.7, sample=nxt, free=free)
        assert torch.allclose(other.log_prob[:2], step.log_prob[:2], atol=1e-6)
        assert not torch.allclose(other.log_prob[2], step.log_prob[2])
    with pytest.raises(ValueError, match="need their `clean` frames"):
        sample(velocity, noise, num_steps=2, noise_level=0.7, given=given)


def test_the_dit_marks_given_frames_and_gains_the_embedding_from_an_export(tmp_path):
    """A DiT built for conditioning adds its frame embedding to the tokens of given frames (the
    velocity changes once it is non-zero); one built without refuses them; an export made
    without conditioning loads into a run that asks for it, its velocity unchanged."""
    cfg = dict(frames=2, size=8, patch=4, width=32, depth=1, heads=2)
    torch.manual_seed(0)
    plain = TinyDiT(TinyDiTConfig(**cfg))
    x, sigma = torch.randn(2, 3, 2, 8, 8), torch.rand(2)
    text, mask = torch.randn(2, 4, 32), torch.ones(2, 4)
    condition = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    with pytest.raises(ValueError, match="built without them"):
        plain(x, sigma, text, mask, condition)
    with torch.no_grad():
        plain.out.weight.normal_(std=0.1)
    folder = save_flow_model(plain, tmp_path / "plain")
    policy = tiny_flow_policy(str(folder), max_num_conditional_frames=1)
    gained = load_flow_model(config_from_dict(tiny_flow_config(tmp_path, policy)))
    assert isinstance(gained, TinyDiT) and gained.config.conditioning
    with torch.no_grad():
        assert torch.equal(gained(x, sigma, text, mask), plain(x, sigma, text, mask))
        assert torch.equal(gained(x, sigma, text, mask, condition), plain(x, sigma, text, mask))
        gained.cond_embed.normal_()
        moved = gained(x, sigma, text, mask, condition)
        still = gained(x, sigma, text, mask, torch.zeros(2, 2))
    assert not torch.allclose(moved[0], still[0])
    assert torch.allclose(moved[1], still[1])


def test_models_without_a_condition_channel_are_refused_by_name(tmp_path):
    def raw(model: str, frames: int = 1, **more: object) -> dict:
        policy = tiny_flow_policy(model, max_num_conditional_frames=frames, **more)
        return tiny_flow_config(tmp_path, policy)

    with pytest.raises(ValueError, match="WanTransformer3DModel with 3 input channels"):
        check_flow_model(config_from_dict(raw("tiny:wan_transformer3d")))
    with pytest.raises(ValueError, match="CosmosTransformer3DModel with 3 input channels"):
        check_flow_model(config_from_dict(raw("tiny:cosmos_transformer3d")))  # (pixels: no mask)
    with pytest.raises(ValueError, match=r"must be below the frames of a sample \(2\)"):
        check_flow_model(config_from_dict(raw("tiny:dit", frames=2)))
    with pytest.raises(ConfigError, match="must not exceed max_num_conditional_frames"):
        config_from_dict(raw("tiny:dit", min_num_conditional_frames=2))
    check_flow_model(config_from_dict(raw("tiny:dit")))
    model = tiny_diffusers_flow_model(
        "tiny:cosmos_transformer3d_latent", frames=5, size=16, text_dim=32
    )
    assert model.condition_channel
    x = torch.randn(1, *model.vae.latent_shape((3, 5, 16, 16)))  # type: ignore[union-attr]
    text, mask, sigma = torch.randn(1, 4, 32), torch.ones(1, 4), torch.rand(1)
    with torch.no_grad():
        none = model(x, sigma, text, mask)
        first = model(x, sigma, text, mask, (torch.arange(x.shape[2]) < 1).float()[None])
    assert not torch.allclose(none, first)  # (the mask channel reaches the transformer)


def test_a_wan_ti2v_transformer_takes_given_frames_as_tokens_at_timestep_zero(tmp_path):
    """Wan 2.2 TI2V (its pipeline's `expand_timesteps`; the latent Wan preset): with given
    frames the transformer gets a timestep per token, 0 on the given frames' tokens and
    1000 sigma on the others, here built as diffusers' WanPipeline builds it (a mask at latent
    resolution, subsampled by the 2 x 2 patch); without any, one per sample. The flag goes into
    an export's model_index.json and comes back; a pipeline without it is refused conditioning
    frames, and a two-expert Wan 2.2 A14B pipeline is refused by name."""
    model = tiny_diffusers_flow_model(
        "tiny:wan_transformer3d_latent", frames=5, size=16, text_dim=32
    )
    assert model.expand_timesteps and model.takes_conditioning
    x = torch.randn(2, *model.vae.latent_shape((3, 5, 16, 16)))  # type: ignore[union-attr]
    frames, height, width = x.shape[2:]
    text, mask, sigma = torch.randn(2, 4, 32), torch.ones(2, 4), torch.rand(2)
    condition = torch.zeros(2, frames)
    condition[0, 0] = condition[1, :2] = 1
    with torch.no_grad():
        got = model(x, sigma, text, mask, condition)
        keep = (1 - condition)[:, :, None, None].expand(-1, -1, height, width)
        timestep = (keep[:, :, ::2, ::2] * (1000 * sigma)[:, None, None, None]).flatten(1)
        want = model.transformer(x, timestep, text, return_dict=False)[0]
        plain = model(x, sigma, text, mask)
        none_given = model(x, sigma, text, mask, torch.zeros(2, frames))
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, plain)
    torch.testing.assert_close(none_given, plain)

    def raw(name: str) -> dict:
        policy = tiny_flow_policy(name, frames=5, size=16, max_num_conditional_frames=1)
        return tiny_flow_config(tmp_path, policy)

    check_flow_model(config_from_dict(raw("tiny:wan_transformer3d_latent")))
    folder = save_flow_model(
        load_flow_model(config_from_dict(raw("tiny:wan_transformer3d_latent"))), tmp_path / "export"
    )
    index = json.loads((folder / "model_index.json").read_text())
    assert index["expand_timesteps"] is True
    back = load_flow_model(config_from_dict(raw(str(folder))))
    assert back.expand_timesteps  # type: ignore[union-attr]
    (folder / "model_index.json").write_text(json.dumps({**index, "expand_timesteps": False}))
    with pytest.raises(ValueError, match=r"WanTransformer3DModel with 4 input channels .* nor"):
        check_flow_model(config_from_dict(raw(str(folder))))
    two = {**index, "transformer_2": ["diffusers", "WanTransformer3DModel"], "boundary_ratio": 0.9}
    (folder / "model_index.json").write_text(json.dumps(two))
    with pytest.raises(ValueError, match=r"two-expert pipeline \(transformer_2, .* 0\.9: Wan 2\.2"):
        check_flow_model(config_from_dict(raw(str(folder))))


def _conditioned_dit(tmp_path) -> tuple[list, TinyDiTConfig, TinyDiT]:
    """The toy clips (2 frames of 8 x 8) and a small DiT taking conditioning frames, its output
    layer randomised (a fresh DiT predicts zero)."""
    clips = read_local_dataset(make_toy_dataset(tmp_path, clips_per_prompt=1, size=8), num_frames=2)
    config = TinyDiTConfig(frames=2, size=8, patch=4, width=32, depth=1, heads=2, conditioning=True)
    torch.manual_seed(0)
    model = TinyDiT(config)
    with torch.no_grad():
        model.out.weight.normal_(std=0.05)
    return clips, config, model


def test_sft_gives_conditioning_frames_clean_and_trains_on_the_others(tmp_path):
    """Flow-matching SFT with `conditional_frames = (0, 1)`: each clip draws its given frames;
    the model gets them clean and is told which they are (the mask passed even when a batch
    has none given); the loss is the flow-matching loss over the other frames, computed here
    by hand from what the model was given."""
    clips, _, model = _conditioned_dit(tmp_path)
    calls: list[tuple[tuple[torch.Tensor, ...], torch.Tensor]] = []
    model.register_forward_hook(lambda module, args, out: calls.append((args, out.detach())))
    batch = clips[:8]
    x0 = torch.stack([c.samples() for c in batch])
    losses = pretrain(
        model, clips, steps=3, batches=lambda step: batch, conditional_frames=(0, 1), seed=1,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
    )  # fmt: skip
    counts = set()
    for (args, velocity), loss in zip(calls, losses, strict=True):
        noised, sigma, _, _, given = args
        given = given.bool()
        assert given.shape == (8, 2) and not given[:, 1].any()
        counts |= set(given.sum(dim=1).tolist())
        clean = given[:, None, :, None, None].expand_as(x0)
        assert torch.equal(noised[clean], x0[clean])  # (given frames clean)
        s = sigma.view(-1, 1, 1, 1, 1)
        noise = (noised - (1 - s) * x0) / s  # (the noise of the generated frames)
        free = ~clean
        error = (velocity - (noise - x0)) ** 2
        per_clip = (error * free).sum(dim=(1, 2, 3, 4)) / free.sum(dim=(1, 2, 3, 4))
        assert loss == pytest.approx(float(per_clip.mean()), rel=1e-4)
    assert counts == {0, 1}


def test_a_video2world_sft_run_trains_from_its_config(tmp_path):
    """`diffusers_sft` with `max_num_conditional_frames = 1` (cosmos-rl's Video2World
    post-training) runs from its config: its loss falls, and its export has the built-in DiT's
    conditioning embedding, so an RL run with conditioning frames starts from it."""
    from nebula_rl.flow import job

    policy = tiny_flow_policy("tiny:dit", max_num_conditional_frames=1)
    raw = tiny_flow_config(tmp_path, policy, timestamp="sft", max_num_steps=20)
    raw["train"]["train_policy"] = {
        "type": "sft",
        "trainer_type": "diffusers_sft",
        "dataset": {"name": "builtin:toy_video", "kwargs": {"clips_per_prompt": 2}},
    }
    raw["train"].update(epoch=20, optm_lr=2e-3)
    run = job.run(config_from_dict(raw))
    lines = (run / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in lines]
    assert len(losses) == 20 and sum(losses[-5:]) < sum(losses[:5])
    rl = tiny_flow_config(
        tmp_path, {**policy, "model_name_or_path": str(run / "safetensors" / "final")}
    )
    model = load_flow_model(config_from_dict(rl))
    assert isinstance(model, TinyDiT) and model.config.conditioning
    assert float(model.cond_embed.detach().abs().sum()) > 0  # (trained: it starts at zero)


@pytest.mark.parametrize("algorithm", ["flow_grpo", "ddrl", "nft"])
def test_a_conditioned_rollout_trains_and_its_file_keeps_the_given_frames(tmp_path, algorithm):
    """Groups draw their given frames (0 or 1 of 2 here, the same within a group); a sampled
    trajectory's given frames are the clip's own, the trajectory file keeps which were given,
    and each algorithm trains on it with finite losses and moved weights."""
    clips, config, model = _conditioned_dit(tmp_path)
    s = FlowRLSettings(
        algorithm=algorithm, group_size=4, sample_steps=4, num_minibatches=2,
        data_beta=0.5 if algorithm == "ddrl" else 0.0, conditional_frames=(0, 1),
    )  # fmt: skip
    real = [c for c in clips[:4] for _ in range(4)]
    generator = torch.Generator().manual_seed(3)
    x0, text, mask, trajectory = roll_out(model, real, s, generator)
    assert trajectory.given is not None and trajectory.given.shape == (16, 2)
    counts = trajectory.given.sum(dim=1).view(4, 4)
    assert (counts == counts[:, :1]).all() and set(counts[:, 0].tolist()) == {0, 1}
    for i, clip in enumerate(real):
        if trajectory.given[i, 0]:
            frame = clip.samples()[:, 0]
            assert torch.allclose(trajectory.latents[i, :, :, 0], frame.expand(5, -1, -1, -1))
    store = TrajectoryStore(tmp_path / "trajectories")
    back = store.read(store.write("0:1", trajectory))
    assert torch.equal(back.given, trajectory.given)
    assert torch.equal(back.latents, trajectory.latents)
    rewards = trajectory.final.mean(dim=(1, 2, 3, 4))
    batch = FlowBatch(
        [c.caption for c in real], x0, text, mask, back, flow_advantages(rewards, 4, s)
    )
    before = [p.detach().clone() for p in model.parameters()]
    old = TinyDiT(config).requires_grad_(False) if algorithm == "nft" else None
    if old is not None:
        old.load_state_dict(model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, _ = train_on_batch(model, optimizer, batch, s, generator, iteration=1, old=old)
    assert all(math.isfinite(v) for v in losses)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
