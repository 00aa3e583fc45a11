"""Exponential moving averages of a flow model's trained weights (`train.ema_enable`, as
cosmos-rl's world-model trainers keep them): after every `ema_update_step_interval`-th optimiser
step (0: every step) each trained parameter's average moves toward it,
`ema <- ema + (1 - d) (param - ema)`, with the warm-up decay `d = min((1 + t) / (10 + t),
ema_decay)` at optimiser step `t` (so the first averages follow the weights closely). The weights
that sample and train stay the live ones; exports hold the averages (`applied`), as cosmos-rl
exports them. Works on FSDP2 shards alike: each rank averages its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["FlowTrainingState", "WeightEMA"]


class WeightEMA:
    """The averages of `model`'s trainable parameters; `step()` after each optimiser step."""

    def __init__(self, model: nn.Module, *, decay: float, interval: int) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"train.ema_decay = {decay}: a decay in [0, 1]")
        if interval < 0:
            raise ValueError(f"train.ema_update_step_interval = {interval}: 0 or more")
        self.decay, self.interval = decay, max(interval, 1)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.averages = [p.detach().clone() for p in self.params]
        self.steps = 0
        """Optimiser steps seen."""

    def current_decay(self, step: int) -> float:
        """The decay at optimiser step `step` (0-based)."""
        return min((1 + step) / (10 + step), self.decay)

    @torch.no_grad()
    def step(self) -> None:
        """Count an optimiser step; move the averages when it is an update step."""
        step, self.steps = self.steps, self.steps + 1
        if (step + 1) % self.interval:
            return
        weight = 1.0 - self.current_decay(step)
        for average, param in zip(self.averages, self.params, strict=True):
            average.lerp_(param.detach(), weight)

    @contextmanager
    def applied(self) -> Iterator[None]:
        """The averages in the model's parameters for the block (e.g. an export); the live
        weights back after."""
        live = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for param, average in zip(self.params, self.averages, strict=True):
                param.copy_(average)
        try:
            yield
        finally:
            with torch.no_grad():
                for param, saved in zip(self.params, live, strict=True):
                    param.copy_(saved)


class FlowTrainingState(nn.Module):
    """What a world-model checkpoint holds besides the optimiser and the schedule: the model,
    DiffusionNFT's old weights, the weight averages (as buffers, FSDP2 shards alike)."""

    def __init__(self, model: nn.Module, old: nn.Module | None, ema: WeightEMA | None) -> None:
        super().__init__()
        self.model = model
        if old is not None:
            self.old = old
        for i, average in enumerate(ema.averages if ema is not None else []):
            self.register_buffer(f"ema_{i}", average)
