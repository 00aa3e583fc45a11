"""`train.save_ckpt_at_exit`: save a checkpoint when the job is told it will be stopped.

SLURM (and other schedulers) send a signal (`train.signal_to_handle`, SIGUSR1 by default) some
time before they kill a job. With `save_ckpt_at_exit`, the handler only notes the signal; the
training loop asks :meth:`CheckpointSignal.take` after each step and, if one came, saves a
checkpoint (whether or not `train.ckpt.enable_checkpoint` is on, as in cosmos-rl). The SFT loop then
stops; RL goes on, as cosmos-rl does. The original handlers come back after the first signal, so
a second one has its usual effect (for SIGUSR1: the process ends).

In a multi-process job the launcher and every replica process take the signal the same way, by
asking the controller for a checkpoint after the next step (:func:`forward_checkpoint_signals`);
the job goes on.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from nebula_rl.config import TrainingConfig

__all__ = ["CheckpointSignal", "forward_checkpoint_signals"]

log = logging.getLogger(__name__)


class CheckpointSignal:
    """Notes the first of `train.signal_to_handle` this process receives (main thread only)."""

    def __init__(self, train: TrainingConfig) -> None:
        self._received: int | None = None
        self._previous: dict[int, Any] = {}
        if not train.save_ckpt_at_exit or threading.current_thread() is not threading.main_thread():
            return
        for name in train.signal_to_handle:
            number = getattr(signal, name)
            self._previous[number] = signal.signal(number, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._received = signum
        self.release()
        log.warning(
            "signal %s: a checkpoint will be saved after the current step",
            signal.Signals(signum).name,
        )

    def take(self) -> bool:
        """Whether a signal came since the last call (then the loop saves a checkpoint)."""
        received, self._received = self._received, None
        return received is not None

    def release(self) -> None:
        """Give the signals their previous handlers back."""
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}


def forward_checkpoint_signals(train: TrainingConfig, ask: Callable[[], Any]) -> None:
    """With `save_ckpt_at_exit`, make the first of `train.signal_to_handle` call `ask()` (e.g.
    `ControllerClient.request_checkpoint`) in a thread of its own, then give the signals their
    previous handlers back."""
    if not train.save_ckpt_at_exit or threading.current_thread() is not threading.main_thread():
        return
    previous: dict[int, Any] = {}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        for number, handler in previous.items():
            signal.signal(number, handler)
        log.warning(
            "signal %s: asking the controller for a checkpoint after the next step",
            signal.Signals(signum).name,
        )
        threading.Thread(target=ask, name="nebula-checkpoint-request", daemon=True).start()

    for name in train.signal_to_handle:
        number = getattr(signal, name)
        previous[number] = signal.signal(number, on_signal)
