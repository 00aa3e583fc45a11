"""World-model (flow) RL: rectified-flow image and video models, and their samplers with
log-probabilities.

- `dit`: a tiny pixel-space diffusion transformer for CPU tests and demos.
- `diffusers_models`, `vae`: diffusers transformers, in pixel space or in the latent space of
  their pipeline's frozen VAE.
- `sampler`: FlowGRPO's SDE step with its log-probability, the Euler ODE step, classifier-free
  guidance and the trajectory record.
- `local`, `job`, `colocated`, `runtime`: the loops (one process, colocated ranks, replicas).

The losses are in `nebula_rl.algorithms.flow`.
"""

from __future__ import annotations

from nebula_rl.flow.dit import TinyDiT, TinyDiTConfig
from nebula_rl.flow.sampler import (
    FlowStep,
    Trajectory,
    guided_velocity,
    sample,
    sde_step,
    sigma_schedule,
    step_log_prob,
)

__all__ = [
    "FlowStep",
    "TinyDiT",
    "TinyDiTConfig",
    "Trajectory",
    "guided_velocity",
    "sample",
    "sde_step",
    "sigma_schedule",
    "step_log_prob",
]
