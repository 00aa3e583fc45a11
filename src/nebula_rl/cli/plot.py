"""`nebula-rl plot RUN_DIR`: a run's curves from its `metrics.jsonl`, as one PNG.

An RL run gets two panels, the mean reward (with the validation reward, `val/reward_mean`, as
points) and the mean response length per step; an SFT run, which has neither, gets its training
(and validation) loss. Each panel shows the per-step values
and their moving mean over a window of about a tenth of the run, since one step's value is noisy
and the trend is what shows learning. matplotlib is imported here only, and draws off screen.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["moving_mean", "plot_run", "read_metrics"]

PANELS = (
    ("reward_mean", "mean reward"),
    ("response_length_mean", "mean response length (tokens)"),
)
"""RL panels: metrics.jsonl key -> axis label."""
SFT_PANELS = (("loss", "loss"),)
"""Panels of a run without rewards (SFT); `val_loss` is drawn with `loss`."""


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The step records of a `metrics.jsonl`, one per step in step order: the lines of a step
    (its validation's numbers come in a line of their own; a controller restart may write a step
    again) are merged, the later values winning."""
    if not path.is_file():
        raise ValueError(f"{path} not found: give a run folder (it holds metrics.jsonl)")
    by_step: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = int(record["step"])
            by_step[step] = {**by_step.get(step, {}), **record}
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}:{number}: not a step record ({err})") from None
    if not by_step:
        raise ValueError(f"{path} holds no steps yet")
    return [by_step[step] for step in sorted(by_step)]


def moving_mean(values: list[float], window: int) -> list[float]:
    """Mean of each value and up to `window - 1` values before it (NaNs are skipped)."""
    out = []
    for i in range(len(values)):
        recent = [v for v in values[max(0, i - window + 1) : i + 1] if not math.isnan(v)]
        out.append(sum(recent) / len(recent) if recent else math.nan)
    return out


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that have a number under `key`."""
    pairs = [
        (int(r["step"]), float(r[key]))
        for r in records
        if isinstance(r.get(key), int | float) and not isinstance(r.get(key), bool)
    ]
    return [s for s, _ in pairs], [v for _, v in pairs]


def plot_run(run_dir: Path, *, out: Path | None = None) -> Path:
    """Draw `run_dir/metrics.jsonl` into `out` (default `run_dir/curves.png`); returns `out`."""
    from matplotlib.figure import Figure

    records = read_metrics(run_dir / "metrics.jsonl")
    panels = [(k, label) for k, label in PANELS if _series(records, k)[0]]
    if not panels:
        panels = [(k, label) for k, label in SFT_PANELS if _series(records, k)[0]]
    if not panels:
        keys = ", ".join(k for k, _ in PANELS + SFT_PANELS)
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has none of {keys} to plot")
    window = max(1, len(records) // 10)
    fig = Figure(figsize=(6 * len(panels), 4), dpi=100, layout="constrained")
    fig.suptitle(f"{run_dir.resolve().name}: {len(records)} steps")
    for ax, (key, label) in zip(
        fig.subplots(1, len(panels), squeeze=False)[0], panels, strict=True
    ):
        steps, values = _series(records, key)
        faint = {"alpha": 0.35, "linewidth": 1} if window > 1 else {"linewidth": 1.5}
        line = ax.plot(steps, values, label=key, **faint)[0]
        if window > 1:
            smooth = moving_mean(values, window)
            ax.plot(steps, smooth, color=line.get_color(), linewidth=2, label=f"mean of {window}")
        # Validation runs every few steps only: points, not smoothed.
        val_key = {"loss": "val_loss", "reward_mean": "val/reward_mean"}.get(key)
        if val_key is not None:
            val_steps, val_values = _series(records, val_key)
            if val_steps:
                ax.plot(val_steps, val_values, marker="o", linewidth=1, label=val_key)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    out = out or run_dir / "curves.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out
