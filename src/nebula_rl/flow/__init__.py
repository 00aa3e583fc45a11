"""World-model (flow) RL: rectified-flow image and video models, and their samplers with
log-probabilities.

- `dit`: a tiny pixel-space diffusion transformer for CPU tests and demos.
- `sampler`: FlowGRPO's SDE step with its log-probability, the Euler ODE step, classifier-free
  guidance and the trajectory record.

The losses are in `nebula_rl.algorithms.flow`. Jobs do not run world-model RL yet.
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
