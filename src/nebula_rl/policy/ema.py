"""Exponential moving averages of a policy's trained weights (`train.ema_enable`), as cosmos-rl
keeps them: after every `ema_update_step_interval`-th optimiser step (0: every step) each trained
parameter's average moves toward it, `ema <- ema + (1 - d) (param - ema)`, with the warm-up decay
`d = min((1 + t) / (10 + t), ema_decay)` at optimiser step `t` (so the first averages follow the
weights closely).

The weights that sample and train stay the live ones. The averages are kept in float32 (the
weights' dtype when wider) on each rank for the parameters it holds (FSDP2/TP DTensor shards, a
pipeline stage's layers), so they cost one more copy of this rank's share of the weights and no
communication; they are gathered only when an export puts them in the model for a moment
(:meth:`WeightEMA.applied`). Language models export them beside the weights
(`safetensors/final_ema`, `safetensors/step_<N>_ema`: :func:`with_ema_export`); world models
export them in place of the weights, as cosmos-rl's diffusers trainers do (`nebula_rl.flow`).
Checkpoints hold the averages and the count of steps they have seen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor, nn

__all__ = ["EMA_SUFFIX", "WeightEMA", "ema_folder", "with_ema_export"]

EMA_SUFFIX = "_ema"
"""What an export folder of the averages adds to the name of the weights' folder."""


class WeightEMA:
    """The averages of `model`'s trainable parameters; `step()` after each optimiser step."""

    def __init__(self, model: nn.Module, *, decay: float, interval: int) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"train.ema_decay = {decay}: a decay in [0, 1]")
        if interval < 0:
            raise ValueError(f"train.ema_update_step_interval = {interval}: 0 or more")
        self.decay, self.interval = decay, max(interval, 1)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        """The parameters' names in `model` (a checkpoint's keys)."""
        self.params = [p for _, p in named]
        # (float32 at least: in bfloat16 a step of weight 1 - d = 1e-4 would mostly round away)
        self.averages = [p.detach().clone().to(_average_dtype(p.dtype)) for p in self.params]
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
            average.lerp_(param.detach().to(average.dtype), weight)

    def state(self) -> dict[str, Tensor]:
        """The averages by parameter name (this rank's shards: a DCP checkpoint's entries)."""
        return dict(zip(self.names, self.averages, strict=True))

    @torch.no_grad()
    def restart(self) -> None:
        """Start the averages again from the current weights (a checkpoint without any)."""
        for average, param in zip(self.averages, self.params, strict=True):
            average.copy_(param.detach())
        self.steps = 0

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


def _average_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def ema_folder(folder: Path) -> Path:
    """Where the averages of the export `folder` go: beside it, `<name>_ema`."""
    return folder.with_name(folder.name + EMA_SUFFIX)


def with_ema_export(
    export: Callable[[Path], object], ema: WeightEMA | None
) -> Callable[[Path], None]:
    """`export` (writes a Hugging Face folder of the live weights, on every rank that must take
    part), followed, with `ema`, by the same export of the averages into :func:`ema_folder`."""

    def both(folder: Path) -> None:
        export(folder)
        if ema is not None:
            with ema.applied():
                export(ema_folder(folder))

    return both
