"""The training loop of a run inside one job (`--local`, SFT, colocated world-model RL), for
language and world models alike: steps, validation when due, one metrics record per step,
checkpoints when due or asked for by a signal. What a step is comes from a :class:`Steps`.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

from nebula_rl.config import Config
from nebula_rl.policy.checkpoint import Checkpointer
from nebula_rl.utils.metrics_log import MetricsWriter
from nebula_rl.utils.profiling import StepProfiler
from nebula_rl.utils.signals import CheckpointSignal
from nebula_rl.utils.validation import validation_due

__all__ = ["Steps", "train_steps"]

log = logging.getLogger(__name__)


class Steps(Protocol):
    """What one kind of run does at each step (every rank of the job calls these)."""

    total: int
    """The last step's number."""
    steps_per_epoch: int
    """For epoch-based checkpoints."""
    on_signal: Literal["stop", "continue"] | None
    """After a signal of `train.signal_to_handle` and its checkpoint: stop (SFT, as cosmos-rl)
    or go on (RL); None: this run does not handle them."""

    def step(self, step: int) -> dict[str, Any] | None:
        """Take step `step`; its metrics record, or None when the data ran out before it."""
        ...

    def validate(self, step: int) -> dict[str, float]:
        """Validation's metrics for the weights after `step` (0: the initial weights)."""
        ...

    def recorded(self, step: int) -> None:
        """After the step's record is written (e.g. sample images)."""
        ...

    def state(self) -> dict[str, Any]:
        """The data position a checkpoint keeps (may be collective)."""
        ...


def train_steps(
    steps: Steps,
    cfg: Config,
    *,
    start: int,
    checkpointer: Checkpointer,
    writer: MetricsWriter | None,
    profiler: StepProfiler | None = None,
) -> int:
    """Steps `start + 1`..`steps.total`; the last step taken. `writer`: None on the ranks that
    do not write. Closes the checkpointer, the writer and the profiler."""
    total = steps.total
    signal = CheckpointSignal(cfg.train) if steps.on_signal is not None else None

    def write(record: dict[str, Any]) -> None:
        if writer is not None:
            writer.write(record)

    try:
        if start == 0 and validation_due(cfg.validation, 0, total_steps=total):
            write({"step": 0, **steps.validate(0)})
        step = validated = start
        ran_out = False
        for step in range(start + 1, total + 1):
            record = steps.step(step)
            if record is None:
                step, ran_out = step - 1, True
                break
            if profiler is not None:
                profiler.step()
            if validation_due(cfg.validation, step, total_steps=total):
                record |= steps.validate(step)
                validated = step
            write(record)
            steps.recorded(step)
            signalled = signal is not None and _any_rank(signal.take())
            if signalled or checkpointer.due(
                step, last=step == total, steps_per_epoch=steps.steps_per_epoch
            ):
                checkpointer.save(step, data=steps.state())
            if signalled and steps.on_signal == "stop":
                log.warning("stopping after step %d: a checkpoint is saved", step)
                break
        if ran_out and cfg.validation.enable and validated < step:
            write({"step": step, **steps.validate(step)})
    finally:
        if profiler is not None:
            profiler.close()
        if signal is not None:
            signal.release()
        checkpointer.close()
        if writer is not None:
            writer.close()
    return step


def _any_rank(flag: bool) -> bool:
    """Whether any rank's `flag` is set (every rank must take the same branch after it)."""
    if not dist.is_initialized():
        return flag
    value = torch.tensor([int(flag)], device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())
