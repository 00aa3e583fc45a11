"""A run's folder on disk: where it is, its checkpoints, its metrics file (no torch here).

`<train.output_dir>/<train.timestamp>/` holds everything a run writes: `config.json`,
`metrics.jsonl`, `checkpoints/step_<N>/` (complete once their `manifest.json` is written),
`safetensors/`, `logs/`. The controller, the launcher and both training loops share these
helpers, so the controller process needs neither torch nor transformers for them.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from nebula_rl.config import CheckpointConfig, TrainingConfig

if TYPE_CHECKING:
    from nebula_rl.utils.object_store import ObjectStore

__all__ = [
    "MANIFEST",
    "TIMESTAMP_FORMAT",
    "checkpoint_path",
    "complete_checkpoints",
    "drop_steps_after",
    "fetch_s3_checkpoint",
    "is_checkpoint",
    "latest_checkpoint",
    "resolve_run_dir",
    "s3_store",
    "write_private",
]

MANIFEST = "manifest.json"
"""Written last into a checkpoint folder: a folder without it is a half-written checkpoint."""
TIMESTAMP_FORMAT = "%Y%m%d%H%M%S"
"""cosmos-rl's run-folder name format."""


def checkpoint_path(run_dir: Path, step: int) -> Path:
    """`<run_dir>/checkpoints/step_<step>`."""
    return run_dir / "checkpoints" / f"step_{step}"


def is_checkpoint(path: Path) -> bool:
    """Whether `path` is a complete checkpoint (its manifest was written)."""
    return (path / MANIFEST).is_file()


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of the complete checkpoints under `run_dir`, oldest first."""
    found = []
    for path in (run_dir / "checkpoints").glob("step_*"):
        step = path.name.removeprefix("step_")
        if step.isdigit() and is_checkpoint(path):
            found.append((int(step), path))
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The complete checkpoint of the highest step under `run_dir`, or None."""
    found = complete_checkpoints(run_dir)
    return found[-1][1] if found else None


def resolve_run_dir(t: TrainingConfig) -> Path:
    """`train.output_dir/train.timestamp`, fixing `train.timestamp` in `t` when it is empty
    (so that every later call, and every process given the resolved config, agrees): with
    `train.resume = true`, the newest run folder under `output_dir` that has a complete
    checkpoint (a new one if none has); otherwise the start time."""
    if not t.timestamp:
        resumable = _resumable_runs(Path(t.output_dir))
        if t.resume is True and resumable:
            t.timestamp = resumable[-1].name
        else:
            t.timestamp = datetime.now().strftime(TIMESTAMP_FORMAT)
    return Path(t.output_dir) / t.timestamp


def _resumable_runs(output: Path) -> list[Path]:
    """The run folders under `output` with a complete checkpoint, oldest first."""
    runs = sorted(p for p in output.glob("*") if p.is_dir()) if output.is_dir() else []
    return [p for p in runs if complete_checkpoints(p)]


def drop_steps_after(path: Path, step: int) -> None:
    """Keep only the `metrics.jsonl` lines of steps up to `step` (later ones came from an earlier
    attempt of this run that got past the checkpoint it resumes from; a last line cut short by a
    crash is dropped too)."""
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    kept = [
        line
        for line in lines
        if line.strip() and line.endswith("\n") and json.loads(line)["step"] <= step
    ]
    path.write_text("".join(kept))


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path`, readable and writable by this user only (also if it existed)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)
        f.write(text)


def s3_store(ckpt: CheckpointConfig) -> ObjectStore | None:
    """`train.ckpt`'s object storage (`upload_s3`: `s3://<s3_bucket>/<s3_prefix>/`, a run's
    uploads under `<run folder name>/`), None without `upload_s3`."""
    if not ckpt.upload_s3:
        return None
    from nebula_rl.utils.object_store import ObjectStore

    assert ckpt.s3_bucket is not None  # (the config requires it with upload_s3)
    return ObjectStore(ckpt.s3_bucket, ckpt.s3_prefix, key="train.ckpt.s3_bucket")


def fetch_s3_checkpoint(t: TrainingConfig) -> Path | None:
    """With `upload_s3`: check that the bucket answers these credentials (a StorageError names
    it otherwise); with `resume = true` too and no run under `output_dir` to resume, download
    the newest committed checkpoint of the storage into `output_dir/<its run>/` and fix
    `train.timestamp` to that run, so that the job resumes from it as from a local one (and
    goes on uploading under the same name); that checkpoint's folder, or None."""
    store = s3_store(t.ckpt)
    if store is None:
        return None
    store.check()
    output = Path(t.output_dir)
    if t.resume is not True or t.timestamp or _resumable_runs(output):
        return None
    found = []
    for name in store.committed():
        run, _, number = name.rpartition("/checkpoints/step_")
        if run and "/" not in run and number.isdigit():
            found.append((run, int(number)))
    if not found:
        return None
    run, step = max(found)
    folder = checkpoint_path(output / run, step)
    store.download_folder(f"{run}/checkpoints/step_{step}", folder)
    t.timestamp = run
    return folder
