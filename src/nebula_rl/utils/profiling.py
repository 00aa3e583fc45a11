"""torch.profiler traces of training steps (`[profiler]`).

With `profiler.enable_profiler`, the ranks of `sub_profiler_config.rank_filter` (rank 0 when it is
empty, as in cosmos-rl) profile the training steps on torch.profiler's schedule: `wait_steps`
skipped, `warmup_steps` traced and discarded, `active_steps` recorded, once. The trace is written
as gzipped Chrome-trace JSON (Perfetto, chrome://tracing, TensorBoard's profiler plugin read it)
to `<run>/profile_trace/<replica>_<rank>/`. cosmos-rl starts GRPO profiling only through its CLI
(`cosmos-rl profile set`); here both loops profile from their first step.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from nebula_rl.config import ProfilerConfig

__all__ = ["StepProfiler"]

log = logging.getLogger(__name__)


class StepProfiler:
    """Call :meth:`step` after each training step and :meth:`close` at the end; does nothing
    unless this rank profiles."""

    def __init__(self, cfg: ProfilerConfig, run_dir: Path, *, name: str, rank: int = 0) -> None:
        sub = cfg.sub_profiler_config
        ranks = sub.rank_filter or [0]
        self.folder = run_dir / "profile_trace" / f"{name}_{rank}"
        self._profile: torch.profiler.profile | None = None
        if not cfg.enable_profiler or rank not in ranks:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=sub.wait_steps, warmup=sub.warmup_steps, active=sub.active_steps, repeat=1
            ),
            on_trace_ready=self._write,
            record_shapes=sub.record_shape,
            profile_memory=sub.profile_memory,
            with_stack=sub.with_stack,
            with_modules=sub.with_modules,
        )
        self._profile.start()
        self._steps = sub.wait_steps + sub.warmup_steps + sub.active_steps

    def _write(self, prof: torch.profiler.profile) -> None:
        handler = torch.profiler.tensorboard_trace_handler(
            str(self.folder), worker_name=self.folder.name, use_gzip=True
        )
        handler(prof)
        log.info("profiler trace written to %s", self.folder)

    def step(self) -> None:
        """One training step is done."""
        if self._profile is None:
            return
        self._profile.step()
        self._steps -= 1
        if self._steps <= 0:  # recorded: stop tracing the rest of the run
            self.close()

    def close(self) -> None:
        """Stop profiling (writes the trace if the recorded steps were reached)."""
        if self._profile is not None:
            profile, self._profile = self._profile, None
            profile.stop()
