"""Sampling a rectified flow with log-probabilities: FlowGRPO's SDE step (Liu et al. 2025,
arXiv 2505.05470), the plain Euler ODE step for evaluation, classifier-free guidance, and the
trajectory record that training replays.

A flow model predicts the velocity `v ~ noise - x0` of `x_sigma = (1 - sigma) x0 + sigma noise`;
sampling runs `sigma` from 1 (noise) down to 0. FlowGRPO replaces the probability-flow ODE by an
SDE with the same marginals, discretised by Euler-Maruyama, so each step is a Gaussian whose
log-density is known. For step `sigma -> sigma'` (`dt = sigma' - sigma < 0`) and noise level `a`:

    std   = a sqrt(sigma / (1 - sigma~))       (sigma~ = sigma, or the next sigma when sigma = 1)
    mean  = x (1 + std^2 dt / (2 sigma)) + v (1 + std^2 (1 - sigma) / (2 sigma)) dt
    x'    = mean + std sqrt(-dt) z,  z ~ N(0, I)

With `a = 0` it is the Euler step `x + v dt`. The log-probability of `x'` is the Gaussian's
per-element log-density (scale `std sqrt(-dt)`), averaged (not summed) over the non-batch
dimensions, as the reference code does. All of it runs in float32.

"Denoising reduction": rollouts take few SDE steps (`num_steps`, e.g. 10) and evaluation many ODE
steps; both use :func:`sigma_schedule`.

Conditioning frames (image/video-to-video, cosmos-rl's Video2World): a sample's first frames may
be given. They are set to the clean frames before the first step and after every step, so the
recorded latents hold them, and the log-probabilities average over the generated elements only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from nebula_rl.algorithms.flow import masked_mean

__all__ = [
    "FlowStep",
    "Trajectory",
    "VelocityFn",
    "context_frames",
    "dpm2_step",
    "guided_velocity",
    "keep_given",
    "sample",
    "sde_step",
    "sigma_schedule",
    "step_log_prob",
    "tensors_trajectory",
    "trajectory_tensors",
]

VelocityFn = Callable[[Tensor, Tensor], Tensor]
"""`v = velocity(x, sigma)`: the (guided) velocity at `x` [B, ...] and noise levels `sigma` [B]."""


def _half_log_snr(sigma: float) -> float:
    """lambda = log((1 - sigma) / sigma): -inf at pure noise, +inf at the data."""
    if sigma <= 0.0:
        return math.inf
    if sigma >= 1.0:
        return -math.inf
    return math.log((1.0 - sigma) / sigma)


def dpm2_step(x: Tensor, x0: Tensor, previous_x0: Tensor | None, sigmas: Tensor, i: int) -> Tensor:
    """One DPM-Solver++(2M) step (Lu et al. 2022, arXiv 2211.01095, the multistep second-order
    data-prediction solver) of the rectified flow from `sigmas[i]` to `sigmas[i + 1]`, written
    for `alpha = 1 - sigma`: `x' = (sigma'/sigma) x + alpha' (1 - e^-h) D`, `h` the step in
    lambda = log(alpha / sigma), and `D` the data prediction `x0`, extrapolated from the previous
    step's (`previous_x0`) with the ratio of the two steps, `D = (1 + 1/2r) x0 - (1/2r) x0_prev`.
    The first step (from pure noise, where lambda is -inf) and the last (to sigma = 0) are first
    order."""
    sigma, nxt = float(sigmas[i]), float(sigmas[i + 1])
    if nxt <= 0.0:
        return x0
    h = _half_log_snr(nxt) - _half_log_snr(sigma)
    data = x0
    if previous_x0 is not None and i > 0:
        h_last = _half_log_snr(sigma) - _half_log_snr(float(sigmas[i - 1]))
        if math.isfinite(h_last) and h_last > 0:
            r = h_last / h
            data = (1 + 0.5 / r) * x0 - (0.5 / r) * previous_x0
    decay = 0.0 if math.isinf(h) else math.exp(-h)
    return (nxt / sigma) * x + (1.0 - nxt) * (1.0 - decay) * data


def sigma_schedule(num_steps: int, *, shift: float = 1.0) -> Tensor:
    """`num_steps + 1` noise levels from 1 down to 0, uniform, then shifted as SD3 does
    (`shift s / (1 + (shift - 1) s)`; 1 keeps them uniform)."""
    if num_steps < 1 or shift <= 0:
        raise ValueError("sigma_schedule: need num_steps >= 1 and shift > 0")
    s = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return (shift * s / (1 + (shift - 1) * s)).float()


@dataclass(frozen=True, slots=True)
class FlowStep:
    """One SDE step: the next sample, the Gaussian's mean and scale, and the sample's
    log-probability (per element, averaged over the non-batch dimensions) [B]."""

    sample: Tensor
    mean: Tensor
    std: float
    """The SDE's `std_t` (the Gaussian's scale is `std * sqrt(-dt)`)."""
    scale: float
    """The Gaussian's scale `std * sqrt(-dt)`."""
    log_prob: Tensor | None
    """None for a deterministic step (noise level 0)."""


def _step_std(sigmas: Tensor, index: int, noise_level: float) -> float:
    sigma = float(sigmas[index])
    safe = float(sigmas[1]) if sigma >= 1.0 else sigma  # (1 - sigma) would be 0 at sigma = 1
    return noise_level * math.sqrt(sigma / (1.0 - safe))


def step_log_prob(
    sample: Tensor, mean: Tensor, scale: float, *, free: Tensor | None = None
) -> Tensor:
    """Per-element Gaussian log-density of `sample` around `mean` with scale `scale`, averaged
    over all but the first dimension [B] (with `free`, over the generated elements only)."""
    log_density = (
        -((sample.float() - mean.float()) ** 2) / (2 * scale**2)
        - math.log(scale)
        - 0.5 * math.log(2 * math.pi)
    )
    return masked_mean(log_density, free)


def context_frames(given: Tensor | None) -> Tensor | None:
    """The `free` weights [B, 1, T, 1, 1] (1: generated) of samples [B, C, T, H, W] whose frames
    `given` [B, T] (True: a conditioning frame) are given; None when none is."""
    if given is None or not bool(given.any()):
        return None
    return (~given).float()[:, None, :, None, None]


def keep_given(x: Tensor, clean: Tensor, free: Tensor | None) -> Tensor:
    """`x` with its given frames (0 in `free`, :func:`context_frames`) set to `clean`'s."""
    return x if free is None else free * x + (1 - free) * clean.float()


def sde_step(
    x: Tensor,
    v: Tensor,
    sigmas: Tensor,
    index: int,
    *,
    noise_level: float,
    noise: Tensor | None = None,
    sample: Tensor | None = None,
    free: Tensor | None = None,
) -> FlowStep:
    """Step `index` (`sigmas[index] -> sigmas[index + 1]`) from `x` with velocity `v`.

    `sample` given (a recorded next sample, as training replays it): its log-probability under
    this step's Gaussian, which is differentiable through `v`. Otherwise the next sample is drawn
    with `noise` (default: fresh standard normal noise). `free` (:func:`context_frames`) limits
    the log-probability to the generated elements."""
    sigma, sigma_next = float(sigmas[index]), float(sigmas[index + 1])
    dt = sigma_next - sigma
    if sigma <= 0 or dt >= 0:
        raise ValueError(f"sde_step: step {index} must lower a positive sigma ({sigmas.tolist()})")
    x, v = x.float(), v.float()
    std = _step_std(sigmas, index, noise_level)
    mean = x * (1 + std**2 * dt / (2 * sigma)) + v * (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt
    scale = std * math.sqrt(-dt)
    if noise_level == 0:
        return FlowStep(mean, mean, 0.0, 0.0, None)
    if sample is None:
        z = torch.randn_like(mean) if noise is None else noise.float()
        sample = (mean + scale * z).detach()
    return FlowStep(sample, mean, std, scale, step_log_prob(sample, mean, scale, free=free))


def _pad_tokens(t: Tensor, n: int) -> Tensor:
    """`t` [B, L, ...] zero-padded to `n` tokens (zero rows: no token, masked out)."""
    pad = [0, 0] * (t.dim() - 2) + [0, n - t.shape[1]]
    return torch.nn.functional.pad(t, pad)


def guided_velocity(
    model: Callable[..., Tensor],
    x: Tensor,
    sigma: Tensor,
    text: Tensor,
    text_mask: Tensor,
    *,
    guidance_scale: float = 1.0,
    null_text: Tensor | None = None,
    null_mask: Tensor | None = None,
    detach_unconditional: bool = False,
    condition: Tensor | None = None,
) -> Tensor:
    """The model's velocity, with classifier-free guidance `v_u + g (v_c - v_u)` when
    `guidance_scale` != 1 (the unconditional branch on `null_text`, zeros by default, in the same
    batched forward; gradients flow through both branches, as in flow_grpo and cosmos-rl, unless
    `detach_unconditional`). `condition` [B, T] marks given conditioning frames (both branches
    see them)."""
    extra = () if condition is None else (condition,)
    if guidance_scale == 1.0:
        return model(x, sigma, text, text_mask, *extra)
    if null_text is None:
        null_text = torch.zeros_like(text)
        null_mask = torch.zeros_like(text_mask)
    assert null_mask is not None
    if text.shape[1] != null_text.shape[1]:  # (Cosmos 3's prompt ids: rows of any length)
        n = max(text.shape[1], null_text.shape[1])
        text, text_mask, null_text, null_mask = (
            _pad_tokens(t, n) for t in (text, text_mask, null_text, null_mask)
        )
    both = model(
        torch.cat([x, x]),
        torch.cat([sigma, sigma]),
        torch.cat([text, null_text]),
        torch.cat([text_mask, null_mask]),
        *(torch.cat([c, c]) for c in extra),
    )
    conditional, unconditional = both.chunk(2)
    if detach_unconditional:
        unconditional = unconditional.detach()
    return unconditional + guidance_scale * (conditional - unconditional)


@dataclass(frozen=True, slots=True)
class Trajectory:
    """A batch's denoising path, as training needs it."""

    latents: Tensor
    """[B, num_steps + 1, ...]: the start noise, then each step's sample; the last is x0 (given
    conditioning frames are clean in every one)."""
    log_probs: Tensor
    """[B, num_steps]: each step's log-probability at sampling (zeros for deterministic steps)."""
    sigmas: Tensor
    """[num_steps + 1]: the noise levels, from 1 to 0."""
    noise_level: float
    """The SDE's `a` (0: the ODE)."""
    given: Tensor | None = None
    """[B, T] bool: the conditioning frames of each sample (None: all frames generated)."""

    @property
    def final(self) -> Tensor:
        """The generated samples [B, ...]."""
        return self.latents[:, -1]


def trajectory_tensors(trajectory: Trajectory) -> dict[str, Tensor]:
    """`trajectory` as named CPU tensors (a file's, or a transfer's)."""
    tensors = {
        "latents": trajectory.latents,
        "log_probs": trajectory.log_probs,
        "sigmas": trajectory.sigmas,
        "noise_level": torch.tensor(float(trajectory.noise_level), dtype=torch.float64),
    }
    if trajectory.given is not None:  # (conditioning frames)
        tensors["given"] = trajectory.given
    return {k: v.detach().cpu().contiguous() for k, v in tensors.items()}


def tensors_trajectory(t: dict[str, Tensor]) -> Trajectory:
    """The trajectory of :func:`trajectory_tensors`' tensors."""
    return Trajectory(
        latents=t["latents"],
        log_probs=t["log_probs"],
        sigmas=t["sigmas"],
        noise_level=float(t["noise_level"]),
        given=t.get("given"),
    )


@torch.no_grad()
def sample(
    velocity: VelocityFn,
    noise: Tensor,
    *,
    num_steps: int,
    noise_level: float,
    shift: float = 1.0,
    generator: torch.Generator | None = None,
    solver: str = "euler",
    given: Tensor | None = None,
    clean: Tensor | None = None,
) -> Trajectory:
    """Denoise `noise` [B, ...] in `num_steps` steps (SDE steps at `noise_level`, ODE steps at
    0), recording the trajectory; the SDE's noise comes from `generator`. `solver = "dpm2"`
    takes the ODE with DPM-Solver++(2M) steps instead (deterministic only; see
    :func:`dpm2_step`). With `given` [B, T] and `clean` (samples [B, C, T, H, W]), the given
    frames are `clean`'s throughout (conditioning frames)."""
    sigmas = sigma_schedule(num_steps, shift=shift)
    free = context_frames(given)
    if free is not None and clean is None:
        raise ValueError("sample: conditioning frames (`given`) need their `clean` frames")

    def keep(x: Tensor) -> Tensor:  # (the given frames clean)
        return x if clean is None else keep_given(x, clean, free)

    x = keep(noise.float())
    latents, log_probs = [x], []
    if solver == "dpm2":
        if noise_level != 0:
            raise ValueError("the dpm2 solver takes the ODE: it needs noise_level 0")
        previous: Tensor | None = None
        for i in range(num_steps):
            sigma = torch.full((x.shape[0],), float(sigmas[i]), device=x.device)
            x0 = x - float(sigmas[i]) * velocity(x, sigma)  # (the data prediction)
            x = keep(dpm2_step(x, x0, previous, sigmas, i))
            previous = x0
            latents.append(x)
            log_probs.append(x.new_zeros(x.shape[0]))
        return Trajectory(torch.stack(latents, 1), torch.stack(log_probs, 1), sigmas, 0.0, given)
    if solver != "euler":
        raise ValueError(f"solver {solver!r}: 'euler' (with the SDE) or 'dpm2'")
    for i in range(num_steps):
        sigma = torch.full((x.shape[0],), float(sigmas[i]), device=x.device)
        v = velocity(x, sigma)
        # (drawn where the generator lives: a CPU generator gives the same noise on any device)
        where = x.device if generator is None else generator.device
        z = torch.randn(x.shape, generator=generator, device=where).to(x.device)
        step = sde_step(x, v, sigmas, i, noise_level=noise_level, noise=z, free=free)
        x = keep(step.sample)
        latents.append(x)
        log_probs.append(step.log_prob if step.log_prob is not None else x.new_zeros(x.shape[0]))
    return Trajectory(
        torch.stack(latents, 1), torch.stack(log_probs, 1), sigmas, noise_level, given
    )
