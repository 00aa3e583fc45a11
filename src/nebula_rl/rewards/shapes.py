"""The toy world-model task's vocabulary, torch-free: the colour words a prompt may name, the
shapes, and a shape's mask. The toy dataset's writer (`nebula_rl.flow.clips`, run by a
controller that loads no torch) draws with these masks, and the visual rewards
(`nebula_rl.rewards.visual`) score with the same ones."""

from __future__ import annotations

import numpy as np

__all__ = ["COLOURS", "SHAPES", "shape_mask"]

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (1, 0, 0),
    "green": (0, 1, 0),
    "blue": (0, 0, 1),
    "yellow": (1, 1, 0),
    "cyan": (0, 1, 1),
    "magenta": (1, 0, 1),
}
"""Colour words a prompt may name, as the RGB channels they light."""
SHAPES = ("square", "circle", "bar")


def shape_mask(shape: str, size: int, *, centre: tuple[float, float] = (0.5, 0.5)) -> np.ndarray:
    """A boolean [size, size] mask of the toy dataset's `shape` ("square", "circle", "bar")
    centred at `centre` (fractions of the frame), a third of the frame across. (Pixel centres
    in float32, as torch's default dtype computed them before this module existed.)"""
    grid = (np.arange(size, dtype=np.float32) + np.float32(0.5)) / np.float32(size)
    ys, xs = np.meshgrid(grid, grid, indexing="ij")
    cy, cx = centre
    if shape == "square":
        return (np.abs(ys - cy) <= 1 / 6) & (np.abs(xs - cx) <= 1 / 6)
    if shape == "circle":
        return (ys - cy) ** 2 + (xs - cx) ** 2 <= (1 / 6) ** 2
    if shape == "bar":
        return (np.abs(ys - cy) <= 1 / 12) & (np.abs(xs - cx) <= 1 / 3)
    raise ValueError(f"shape {shape!r}: one of {SHAPES}")
