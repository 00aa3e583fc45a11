"""Rectified-flow sampling with log-probabilities (`nebula_rl.flow`) and the world-model RL
losses (`nebula_rl.algorithms.flow`) against their formulas and invariants."""

from __future__ import annotations

import math

import pytest
import torch

from nebula_rl.algorithms.flow import (
    ddrl_loss,
    exp_advantages,
    flow_grpo_kl,
    flow_grpo_loss,
    flow_matching_loss,
    nft_loss,
    nft_old_decay,
    soft_update,
)
from nebula_rl.flow.dit import TinyDiT, TinyDiTConfig
from nebula_rl.flow.sampler import guided_velocity, sample, sde_step, sigma_schedule


def test_noise_level_zero_is_the_euler_ode_step():
    x, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    sigmas = sigma_schedule(10, shift=3.0)
    step = sde_step(x, v, sigmas, 4, noise_level=0.0)
    assert torch.equal(step.sample, x + v * (sigmas[5] - sigmas[4]))
    assert step.log_prob is None


def test_step_log_prob_is_the_gaussian_density_averaged_over_elements():
    torch.manual_seed(0)
    x, v = torch.randn(4, 3, 2, 5, 5), torch.randn(4, 3, 2, 5, 5)
    sigmas = sigma_schedule(10)
    for index in (0, 5, 9):  # sigma = 1 uses the next sigma in the std's denominator
        step = sde_step(x, v, sigmas, index, noise_level=0.7)
        sigma, dt = float(sigmas[index]), float(sigmas[index + 1] - sigmas[index])
        safe = float(sigmas[1]) if index == 0 else sigma
        std = 0.7 * math.sqrt(sigma / (1 - safe))
        mean = (
            x * (1 + std**2 * dt / (2 * sigma)) + v * (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt
        )
        want = torch.distributions.Normal(mean, std * math.sqrt(-dt)).log_prob(step.sample)
        torch.testing.assert_close(step.mean, mean)
        torch.testing.assert_close(step.log_prob, want.flatten(1).mean(1))
        replay = sde_step(x, v, sigmas, index, noise_level=0.7, sample=step.sample)
        torch.testing.assert_close(replay.log_prob, step.log_prob, rtol=0, atol=0)


def _exact_velocity(mu: float, s: float):
    """The velocity field of x0 ~ N(mu, s^2): E[noise - x0 | x_t]."""

    def velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        t = sigma.view(-1, *[1] * (x.dim() - 1))
        d = (1 - t) ** 2 * s**2 + t**2
        u = x - (1 - t) * mu
        return u * (t - (1 - t) * s**2) / d - mu

    return velocity


def _chain_moments(mu: float, s: float, num_steps: int, noise_level: float) -> tuple[float, float]:
    """Exact mean and std after the discretised chain: each step is linear-Gaussian in x."""
    sigmas = sigma_schedule(num_steps).double()
    mean, var = 0.0, 1.0
    for i in range(num_steps):
        sigma, dt = float(sigmas[i]), float(sigmas[i + 1] - sigmas[i])
        safe = float(sigmas[1]) if i == 0 else sigma
        std = noise_level * math.sqrt(sigma / (1 - safe))
        d = (1 - sigma) ** 2 * s**2 + sigma**2
        slope = (sigma - (1 - sigma) * s**2) / d  # v = slope (x - (1 - sigma) mu) - mu
        a = 1 + std**2 * dt / (2 * sigma)
        b = (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt
        c1, c0 = a + b * slope, b * (-slope * (1 - sigma) * mu - mu)
        mean, var = c1 * mean + c0, c1**2 * var + std**2 * -dt
    return mean, math.sqrt(var)


def test_the_sde_keeps_the_marginals_of_gaussian_data():
    """x0 ~ N(1.5, 0.5^2) with the exact velocity: 10 SDE steps give the discretised chain's
    exact moments (Euler-Maruyama's own bias, -4 % on the std), and 200 steps give the data's
    std within 1 %."""
    mu, s = 1.5, 0.5
    generator = torch.Generator().manual_seed(0)
    noise = torch.randn(20_000, 1, generator=generator)
    for num_steps, tolerance in ((10, 0.02), (200, 0.02)):
        trajectory = sample(
            _exact_velocity(mu, s),
            noise,
            num_steps=num_steps,
            noise_level=0.7,
            generator=generator,
        )
        x0 = trajectory.final
        mean, std = _chain_moments(mu, s, num_steps, 0.7)
        assert float(x0.mean()) == pytest.approx(mean, rel=tolerance)
        assert float(x0.std()) == pytest.approx(std, rel=tolerance)
        assert float(x0.mean()) == pytest.approx(mu, rel=0.02)
    assert float(x0.std()) == pytest.approx(s, rel=0.015)
    assert _chain_moments(mu, s, 10, 0.7)[1] == pytest.approx(s * 0.96, rel=0.01)


def _tiny(frames: int = 2) -> TinyDiT:
    torch.manual_seed(0)
    model = TinyDiT(TinyDiTConfig(frames=frames, size=8, patch=4, width=32, depth=2, heads=2))
    for p in model.parameters():  # (zero-initialised outputs would make every test trivial)
        torch.nn.init.normal_(p, std=0.05)
    return model


def test_a_replayed_trajectory_has_ratio_one_and_the_reinforce_gradient():
    """With the sampling weights, each recorded step's log-probability recomputes exactly:
    the ratio is 1 and the clipped loss's gradient is REINFORCE's."""
    model = _tiny()
    text, mask = torch.randn(4, 3, 32), torch.ones(4, 3)

    def velocity(x, sigma):
        return guided_velocity(model, x, sigma, text, mask, guidance_scale=2.0)

    trajectory = sample(velocity, torch.randn(4, 3, 2, 8, 8), num_steps=5, noise_level=0.7)
    assert trajectory.latents.shape == (4, 6, 3, 2, 8, 8) and trajectory.log_probs.shape == (4, 5)
    advantages = torch.tensor([1.0, -0.5, 2.0, -2.5])
    for j in range(5):
        x = trajectory.latents[:, j]
        sigma = torch.full((4,), float(trajectory.sigmas[j]))
        step = sde_step(
            x,
            velocity(x, sigma),
            trajectory.sigmas,
            j,
            noise_level=0.7,
            sample=trajectory.latents[:, j + 1],
        )
        assert step.log_prob is not None
        torch.testing.assert_close(step.log_prob, trajectory.log_probs[:, j], rtol=0, atol=1e-5)
        log_prob = step.log_prob.detach().requires_grad_()
        flow_grpo_loss(log_prob, trajectory.log_probs[:, j], advantages, clip_range=1e-4).backward()
        assert log_prob.grad is not None
        torch.testing.assert_close(log_prob.grad, -advantages / 4, rtol=1e-3, atol=1e-4)


def test_the_clip_stops_the_gradient_on_both_sides():
    old = torch.zeros(4)
    log_prob = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5])).requires_grad_()
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    flow_grpo_loss(log_prob, old, advantages, clip_range=0.2).backward()
    assert log_prob.grad is not None
    # ratio above 1 + eps with A > 0, and below 1 - eps with A < 0: clipped, no gradient;
    # the other two keep the unclipped (pessimistic) term.
    assert log_prob.grad[0] == 0 and log_prob.grad[3] == 0
    assert log_prob.grad[1] == pytest.approx(1.5 / 4) and log_prob.grad[2] == pytest.approx(
        -0.5 / 4
    )


def test_the_kl_is_the_mean_difference_over_the_steps_variance():
    mean, ref = torch.zeros(2, 3, 4), torch.full((2, 3, 4), 0.5)
    assert float(flow_grpo_kl(mean, ref, 0.5)) == pytest.approx(0.25 / (2 * 0.25))


def test_ddrl_with_zero_advantages_is_the_sft_flow_loss_and_exp_advantages_saturate():
    torch.manual_seed(1)
    v, x0, noise = (
        torch.randn(3, 3, 2, 4, 4),
        torch.randn(3, 3, 2, 4, 4),
        torch.randn(3, 3, 2, 4, 4),
    )
    sigma = torch.rand(3)
    data = flow_matching_loss(v, x0, noise, sigma, weighting="edm")
    policy = flow_grpo_loss(torch.zeros(3), torch.zeros(3), torch.zeros(3), clip_range=1e-4)
    assert float(ddrl_loss(policy, data, data_beta=1.0)) == pytest.approx(float(data))
    uniform = float(((v - (noise - x0)) ** 2).mean())
    assert float(flow_matching_loss(v, x0, noise, sigma)) == pytest.approx(uniform, rel=1e-6)
    mapped = exp_advantages(torch.tensor([0.0, 1.0, -math.log(5) - 0.1, -3.0]))
    assert mapped.tolist() == pytest.approx([-1.0, -math.exp(-1), -5.0, -5.0])


def test_nft_with_full_weight_and_old_equal_to_theta_is_weighted_flow_matching():
    """r = 1 (A at the clip), beta = 1, v_old = v_theta: only the positive policy remains, and it
    is the flow-matching error scaled by t^2 over the adaptive weight, times the clip."""
    torch.manual_seed(2)
    x0, noise, v = (
        torch.randn(3, 3, 2, 4, 4),
        torch.randn(3, 3, 2, 4, 4),
        torch.randn(3, 3, 2, 4, 4),
    )
    t = torch.tensor([0.2, 0.5, 0.9])
    tb = t.view(-1, 1, 1, 1, 1)
    x_t = (1 - tb) * x0 + tb * noise
    got = nft_loss(v, v, x_t, x0, t, torch.full((3,), 5.0), beta=1.0, adv_clip=5.0)
    error = tb * (noise - x0 - v)  # x0^ - x0 with x0^ = x_t - t v
    weight = error.abs().flatten(1).mean(1)
    want = ((error**2).flatten(1).mean(1) / weight * 5.0).mean()
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    # r = 0 (A at -clip) scores the negative policy, which with old = theta is the same one
    assert float(nft_loss(v, v, x_t, x0, t, torch.full((3,), -5.0), beta=1.0)) == pytest.approx(
        float(want), rel=1e-5
    )


def test_soft_update_of_the_old_weights():
    old, new = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    before = old.weight.detach().clone()
    soft_update(old, new, decay=nft_old_decay(300))
    torch.testing.assert_close(old.weight, 0.3 * before + 0.7 * new.weight.detach())
    assert nft_old_decay(10_000) == 0.5


def test_tiny_dit_learns_a_flow_and_guidance_trains_through_both_branches():
    """A fresh TinyDiT predicts zero; a few steps of flow matching on two text-conditioned
    images lower the loss; with guidance `v_u + g (v_c - v_u)`, gradients reach the model
    through both branches (as in flow_grpo and cosmos-rl), or only through the conditional one
    with `detach_unconditional`; a row without text is finite."""
    torch.manual_seed(0)
    model = TinyDiT(TinyDiTConfig(frames=1, size=8, patch=4, width=32, depth=2, heads=2))
    x0 = torch.stack([torch.full((3, 1, 8, 8), 0.8), torch.full((3, 1, 8, 8), -0.8)])
    text, mask = torch.randn(2, 3, 32), torch.ones(2, 3)
    assert torch.equal(model(x0, torch.rand(2), text, mask), torch.zeros_like(x0))
    batch, words, marks = x0.repeat(8, 1, 1, 1, 1), text.repeat(8, 1, 1), mask.repeat(8, 1)

    def loss_at(noise, sigma):
        s = sigma.view(-1, 1, 1, 1, 1)
        v = model((1 - s) * batch + s * noise, sigma, words, marks)
        return flow_matching_loss(v, batch, noise, sigma)

    generator = torch.Generator().manual_seed(3)
    held_out = torch.randn(batch.shape, generator=generator), torch.rand(16, generator=generator)
    with torch.no_grad():
        before = loss_at(*held_out).item()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(100):
        loss = loss_at(torch.randn_like(batch), torch.rand(16))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        assert loss_at(*held_out).item() < 0.5 * before  # measured: 1.64 -> 0.65
    x, sigma = torch.randn_like(x0), torch.rand(2)
    null_text, null_mask = torch.zeros_like(text), torch.zeros_like(mask)
    for detach in (False, True):
        model.zero_grad()
        guided = guided_velocity(
            model, x, sigma, text, mask, guidance_scale=3.0, detach_unconditional=detach
        )
        conditional = model(x, sigma, text, mask)
        unconditional = model(x, sigma, null_text, null_mask)
        assert torch.isfinite(unconditional).all()
        torch.testing.assert_close(guided, unconditional + 3.0 * (conditional - unconditional))
        guided.sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        # the gradient of g v_c, plus (1 - g) v_u's unless that branch is detached
        expected = 3.0 * model(x, sigma, text, mask)
        if not detach:
            expected = expected - 2.0 * model(x, sigma, null_text, null_mask)
        expected.sum().backward()
        for name, p in model.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(grads[name], p.grad, rtol=1e-3, atol=1e-4)


def test_dpm2_solves_the_ode_to_second_order():
    """x0 ~ N(1.5, 0.5^2) with the exact velocity: the ODE takes noise z to 1.5 + 0.5 z. In 10
    steps DPM-Solver++(2M) lands 20x closer than Euler does (Euler: 0.28, dpm2: 0.013, the
    largest error over 1000 samples), closer than Euler in 20 steps; it records no log-probs
    and refuses the SDE."""
    mu, s = 1.5, 0.5
    z = torch.randn(1000, 1, generator=torch.Generator().manual_seed(0))
    want = mu + s * z

    def error(solver: str, steps: int) -> float:
        x = sample(_exact_velocity(mu, s), z, num_steps=steps, noise_level=0.0, solver=solver)
        assert solver == "euler" or not x.log_probs.any()
        return float((x.final - want).abs().max())

    assert error("dpm2", 10) < error("euler", 10) / 10
    assert error("dpm2", 10) < error("euler", 20)
    with pytest.raises(ValueError, match="needs noise_level 0"):
        sample(_exact_velocity(mu, s), z, num_steps=4, noise_level=0.7, solver="dpm2")
