"""Step metrics to the console, TensorBoard and Weights & Biases.

Every training loop produces one record per optimiser step: the dict it appends as a line of
`<run>/metrics.jsonl` (`step`, `reward_mean`, `loss`, ...). An RL validation adds its `val/*`
numbers to a step's record, or writes a record of its own with the step's number (step 0: before
training; in a multi-process job, after the step's record): readers merge the records of a
step, and the sinks take each record as it comes (TensorBoard and W&B at `step`). :func:`open_loggers` builds the
sinks that `[logging] logger` names, from the :data:`LOGGERS` registry, and returns one
:class:`MetricsLogger` that hands each record to all of them:

- `console`: a line per step and a rich progress bar (step, reward or loss, tokens/s, ETA);
- `tensorboard`: scalars in event files under `<run>/tensorboard/`;
- `wandb`: a Weights & Biases run whose files go under `<run>/wandb/`, offline unless an API key
  is found (see `logging.wandb_mode`).

Where each sink lives: the single-process loops (`nebula_rl.local`) open all of them; in a
multi-process job the controller, which writes `metrics.jsonl`, opens the file sinks and the
launcher, which owns the terminal, the console. Heavy libraries (torch's TensorBoard writer,
wandb) are imported only when their sink is selected.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import netrc
import os
from collections import deque
from collections.abc import Callable, Collection
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol
from urllib.parse import urlparse

from rich import get_console
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from nebula_rl.config import Config
from nebula_rl.utils.runs import drop_steps_after

__all__ = [
    "FILE_LOGGERS",
    "LOGGERS",
    "ConsoleLogger",
    "MetricsLogger",
    "MetricsWriter",
    "StepLogger",
    "TensorBoardLogger",
    "WandbLogger",
    "check_installed",
    "log_image_file",
    "open_loggers",
    "step_line",
    "wandb_mode",
]

log = logging.getLogger(__name__)


class StepLogger(Protocol):
    """One metrics sink."""

    def log(self, record: dict[str, Any]) -> None:
        """Take the record of one step (it has at least `step`)."""
        ...

    def close(self) -> None:
        """Flush and release what the sink holds."""
        ...


def _number(value: Any) -> float | None:
    """`value` as a float if it is a plain number (bools and containers are not)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _throughput(record: dict[str, Any]) -> float | None:
    """Tokens per second: generated tokens for RL, trained tokens for SFT."""
    if "rollout_tokens_per_s" in record:
        return _number(record["rollout_tokens_per_s"])
    tokens, seconds = _number(record.get("num_tokens")), _number(record.get("step_time"))
    if tokens is None or not seconds:
        return None
    return tokens / seconds


def _mean_record(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The last record, its numbers replaced by their means over `records`."""
    out = dict(records[-1])
    for key, value in out.items():
        numbers = [n for r in records if (n := _number(r.get(key))) is not None]
        if key != "step" and _number(value) is not None and numbers:
            out[key] = sum(numbers) / len(numbers)
    return out


def step_line(record: dict[str, Any], *, total_steps: int, recent_reward: float | None) -> str:
    """The console's one-line summary of a step; keys a record lacks are left out."""
    parts = [f"step {record['step']}/{total_steps}"]
    reward = _number(record.get("reward_mean"))
    if reward is not None:
        mean = "" if recent_reward is None else f" (recent mean {recent_reward:.3f})"
        parts.append(f"reward {reward:.3f}{mean}")
    for key, fmt in (
        ("loss", "+.4f"),
        ("val_loss", ".4f"),
        ("val/reward_mean", ".3f"),
        ("staleness_mean", ".1f"),
    ):
        value = _number(record.get(key))
        if value is not None:
            name = "val reward" if key == "val/reward_mean" else key.removesuffix("_mean")
            parts.append(f"{name} {value:{fmt}}")
    seconds = _number(record.get("step_time"))
    if seconds is not None:
        parts.append(f"{seconds:.2f} s/step")
    tokens_per_s = _throughput(record)
    if tokens_per_s is not None:
        parts.append(f"{tokens_per_s:.0f} tok/s")
    return "  ".join(parts)


class ConsoleLogger:
    """A log line every `interval` steps (`logging.log_interval`; also for the first and the
    last step) with the means of the steps since the previous line, and a progress bar (step,
    reward or loss, tokens/s, elapsed, ETA) at the bottom of an interactive terminal, moved at
    every step; the bar is left out when output is not a terminal (a log file), the lines are
    not."""

    def __init__(
        self,
        *,
        total_steps: int,
        window: int = 20,
        console: Console | None = None,
        interval: int = 1,
    ) -> None:
        self.total_steps = total_steps
        self.interval = interval
        self._pending: list[dict[str, Any]] = []
        self.rewards: deque[float] = deque(maxlen=window)
        # The global console by default: rich's log handler writes there too, so log lines
        # appear above the bar instead of through it.
        console = console if console is not None else get_console()
        self.progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("{task.fields[score]}"),
            TextColumn("{task.fields[speed]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            disable=not console.is_interactive,
            refresh_per_second=2,
        )
        self.task = self.progress.add_task("train", total=total_steps, score="", speed="")
        self._started = False

    def log(self, record: dict[str, Any]) -> None:
        """Print the step's line and move the bar to it."""
        reward = _number(record.get("reward_mean"))
        if reward is not None and not math.isnan(reward):
            self.rewards.append(reward)
        recent = sum(self.rewards) / len(self.rewards) if self.rewards else None
        self._pending.append(record)
        step = int(record["step"])
        if step % self.interval == 0 or step == self.total_steps or not self._started:
            line = step_line(
                _mean_record(self._pending), total_steps=self.total_steps, recent_reward=recent
            )
            if len(self._pending) > 1:
                line += f"  (means of steps {self._pending[0]['step']}-{step})"
            log.info(line)
            self._pending = []
        if not self._started:  # the first step sets the start, so a resumed run's ETA is right
            self.progress.update(self.task, completed=max(record["step"] - 1, 0))
            self.progress.start()
            self._started = True
        loss = _number(record.get("loss"))
        if recent is not None:
            score = f"reward {recent:.3f}"
        else:
            score = "" if loss is None else f"loss {loss:.4f}"
        tokens_per_s = _throughput(record)
        speed = "" if tokens_per_s is None else f"{tokens_per_s:.0f} tok/s"
        self.progress.update(self.task, completed=record["step"], score=score, speed=speed)

    def close(self) -> None:
        """Leave the bar's last state on screen."""
        if self._started:
            self.progress.stop()


class TensorBoardLogger:
    """Every number of a record as a scalar of the same name at `global_step = step`, in event
    files under `log_dir`. The writer opens at the first record: a run that resumed at step N
    purges the events of steps >= N an earlier attempt wrote, so the curves do not fold back.

    Written with the `tensorboard` package's own event writer and protos (torch's
    `SummaryWriter` wraps the same), so the controller process, which logs too, needs no torch.
    """

    def __init__(self, log_dir: Path) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter  # noqa: F401

        self.log_dir = log_dir
        self.writer: Any = None

    def log(self, record: dict[str, Any]) -> None:
        """Write the record's numbers and flush, so a running TensorBoard sees the step."""
        import time

        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        step = int(record["step"])
        if self.writer is None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self.writer = EventFileWriter(str(self.log_dir))
            if step > 1:  # TensorBoard drops the events of steps >= step written before
                start = SessionLog(status=SessionLog.START)
                self.writer.add_event(Event(wall_time=time.time(), step=step, session_log=start))
        values = [
            Summary.Value(tag=key, simple_value=number)
            for key, value in record.items()
            if key != "step" and (number := _number(value)) is not None
        ]
        self.writer.add_event(
            Event(wall_time=time.time(), step=step, summary=Summary(value=values))
        )
        self.writer.flush()

    def log_image(self, tag: str, step: int, png: bytes, *, height: int, width: int) -> None:
        """A PNG image at `step` (TensorBoard's Images tab)."""
        import time

        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        if self.writer is None:
            self.log({"step": step})
        image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=png)
        summary = Summary(value=[Summary.Value(tag=tag, image=image)])
        self.writer.add_event(Event(wall_time=time.time(), step=step, summary=summary))
        self.writer.flush()

    def log_video(self, tag: str, step: int, path: Path, *, height: int, width: int) -> None:
        """The animated GIF at `path` at `step`: TensorBoard's Images tab plays it (torch's
        `add_video` writes the same summary)."""
        self.log_image(tag, step, path.read_bytes(), height=height, width=width)

    def close(self) -> None:
        """Close the event file."""
        if self.writer is not None:
            self.writer.close()


def _wandb_api_key_known() -> bool:
    """Whether wandb will find an API key: `WANDB_API_KEY`, or a `wandb login` in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc().authenticators(host or "api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode(setting: str) -> str | None:
    """The `mode` to give `wandb.init` for `logging.wandb_mode` (None: wandb reads
    `WANDB_MODE` itself)."""
    if setting != "auto":
        return setting
    if os.environ.get("WANDB_MODE"):
        return None
    return "online" if _wandb_api_key_known() else "offline"


class WandbLogger:
    """A Weights & Biases run under `<run>/wandb/`: the resolved config as its config, each
    record as one history row at `step`. Its id derives from the run folder, so a resumed run
    continues the same W&B run when online (W&B ignores steps it has already seen)."""

    def __init__(self, cfg: Config, run_dir: Path) -> None:
        import hashlib

        import wandb

        run_dir.mkdir(parents=True, exist_ok=True)
        mode = wandb_mode(cfg.logging.wandb_mode)
        digest = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:8]
        # (cosmos-rl's configs write experiment_name = "None" for "unset")
        name = cfg.logging.experiment_name
        self.run = wandb.init(
            project=cfg.logging.project_name,
            group=cfg.logging.group_name,
            name=name if name not in (None, "None", "") else run_dir.name,
            id=f"{run_dir.name}-{digest}".replace("/", "_")[:64],
            resume="allow",
            dir=str(run_dir),
            config=cfg.model_dump(mode="json"),
            mode=mode,  # type: ignore[arg-type]
            # Console capture would wrap stdout under the progress bar; metrics.jsonl and the
            # logs folder hold the text anyway.
            settings=wandb.Settings(console="off"),
        )
        log.info("wandb run %s (%s) in %s", self.run.id, mode or "WANDB_MODE", run_dir / "wandb")

    def log(self, record: dict[str, Any]) -> None:
        """One history row."""
        payload = {k: v for k, v in record.items() if k != "step"}
        self.run.log(payload, step=int(record["step"]))

    def log_image(self, tag: str, step: int, png: bytes, *, height: int, width: int) -> None:
        """A PNG image at `step` (a `wandb.Image`)."""
        import io

        import wandb
        from PIL import Image

        self.run.log({tag: wandb.Image(Image.open(io.BytesIO(png)))}, step=step)

    def log_video(self, tag: str, step: int, path: Path, *, height: int, width: int) -> None:
        """The animated GIF at `path` at `step` (a `wandb.Video`)."""
        import wandb

        self.run.log({tag: wandb.Video(str(path), format="gif")}, step=step)

    def close(self) -> None:
        """Finish the run and wait until W&B's service process has written all of it (the
        run file is completed after `finish` returns otherwise)."""
        import wandb

        self.run.finish()
        wandb.teardown()


LoggerFactory = Callable[[Config, Path, int], StepLogger]
"""Builds a sink from the job's config, the run folder and the total number of steps."""

LOGGERS: dict[str, LoggerFactory] = {
    "console": lambda cfg, run_dir, total: ConsoleLogger(
        total_steps=total, interval=cfg.logging.log_interval
    ),
    "tensorboard": lambda cfg, run_dir, total: TensorBoardLogger(run_dir / "tensorboard"),
    "wandb": lambda cfg, run_dir, total: WandbLogger(cfg, run_dir),
}
"""`[logging] logger` name -> sink factory."""

FILE_LOGGERS = frozenset({"tensorboard", "wandb"})
"""The sinks that write files rather than to the terminal (a job's controller opens these)."""

_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""Sinks that need an optional package: name -> the module to import."""


def check_installed(names: Collection[str]) -> None:
    """Raise a ValueError naming the fix if a selected sink's package is not installed (checked
    without importing it, so a launcher can fail before it starts anything)."""
    for name in names:
        module = _PACKAGES.get(name)
        if module is not None and importlib.util.find_spec(module) is None:
            extra = (
                f"pip install 'nebula-rl[{name}]'" if name == "wandb" else f"pip install {module}"
            )
            raise ValueError(
                f'logging.logger selects "{name}" but the {module} package is not installed: '
                f"{extra}"
            )


class MetricsLogger:
    """The sinks of a run, fed together; a context manager that closes them."""

    def __init__(self, sinks: list[StepLogger]) -> None:
        self.sinks = sinks

    def log(self, record: dict[str, Any]) -> None:
        """Hand one step's record (as written to `metrics.jsonl`) to every sink."""
        for sink in self.sinks:
            sink.log(record)

    def log_image(self, tag: str, step: int, png: bytes, *, height: int, width: int) -> None:
        """Hand a PNG image of `step` to the sinks that show images (TensorBoard, W&B)."""
        for sink in self.sinks:
            show = getattr(sink, "log_image", None)
            if show is not None:
                show(tag, step, png, height=height, width=width)

    def log_video(self, tag: str, step: int, path: Path, *, height: int, width: int) -> None:
        """Hand the animated GIF at `path` of `step` to the sinks that show videos."""
        for sink in self.sinks:
            show = getattr(sink, "log_video", None)
            if show is not None:
                show(tag, step, path, height=height, width=width)

    def close(self) -> None:
        """Close every sink (all of them, even if one fails)."""
        errors = []
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as err:  # a sink's flush failing must not keep the others open
                errors.append(err)
        self.sinks = []
        if errors:
            raise errors[0]

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def open_loggers(
    cfg: Config, run_dir: Path, *, total_steps: int, only: Collection[str] | None = None
) -> MetricsLogger:
    """The sinks `cfg.logging.logger` selects, limited to `only` when given (e.g. the
    controller takes the file sinks, the launcher the console)."""
    names = [n for n in cfg.logging.logger if only is None or n in only]
    check_installed(names)
    return MetricsLogger([LOGGERS[name](cfg, run_dir, total_steps) for name in names])


def log_image_file(sinks: MetricsLogger, tag: str, step: int, path: Path) -> None:
    """The PNG at `path` to the sinks that show images (TensorBoard, W&B) at `step`; an
    animated GIF of the same name beside it (a grid of video samples, frame by frame) to those
    that show videos, as `<tag>_video`."""
    from PIL import Image

    with Image.open(path) as image:
        width, height = image.size
    sinks.log_image(tag, step, path.read_bytes(), height=height, width=width)
    video = path.with_suffix(".gif")
    if video.is_file():
        with Image.open(video) as image:
            width, height = image.size
        sinks.log_video(f"{tag}_video", step, video, height=height, width=width)


class MetricsWriter:
    """A run's `metrics.jsonl`, one JSON line per step, each record also handed to the
    `[logging]` sinks (console, TensorBoard, W&B). `after_step`: a resumed run's step; the lines
    of later steps (an earlier attempt got past the checkpoint) are dropped first."""

    def __init__(
        self, cfg: Config, run_dir: Path, *, total_steps: int, after_step: int | None = None
    ) -> None:
        path = run_dir / "metrics.jsonl"
        if after_step is not None:
            drop_steps_after(path, after_step)
        self.loggers = open_loggers(cfg, run_dir, total_steps=total_steps)
        self.file = path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        self.loggers.log(record)

    def close(self) -> None:
        self.file.close()
        self.loggers.close()
