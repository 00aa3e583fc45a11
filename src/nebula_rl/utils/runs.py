"""A run's folder on disk: where it is, its checkpoints, its metrics file (no torch here).

`<train.output_dir>/<train.timestamp>/` holds everything a run writes: `config.json`,
`metrics.jsonl`, `checkpoints/step_<N>/` (complete once their `manifest.json` is written),
`safetensors/`, `logs/`. The controller, the launcher and both training loops share these
helpers, so the controller process needs neither torch nor transformers for them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from nebula_rl.config import CheckpointConfig, TrainingConfig

if TYPE_CHECKING:
    from nebula_rl.utils.object_store import ObjectStore, Uploader

log = logging.getLogger(__name__)

__all__ = [
    "MANIFEST",
    "TIMESTAMP_FORMAT",
    "UPLOADED_FOLDERS",
    "checkpoint_path",
    "complete_checkpoints",
    "drop_steps_after",
    "fetch_missing_checkpoint",
    "fetch_s3_checkpoint",
    "is_checkpoint",
    "latest_checkpoint",
    "resolve_run_dir",
    "s3_store",
    "s3_uploader",
    "snapshot_path",
    "snapshot_upload",
    "write_private",
]

UPLOADED_FOLDERS = ("checkpoints", "safetensors")
"""The run folder's folders uploaded as committed folders (`train.ckpt.upload_s3`), not copied
with the logs."""
MANIFEST = "manifest.json"
"""Written last into a checkpoint folder: a folder without it is a half-written checkpoint."""
TIMESTAMP_FORMAT = "%Y%m%d%H%M%S"
"""cosmos-rl's run-folder name format."""


def checkpoint_path(run_dir: Path, step: int) -> Path:
    """`<run_dir>/checkpoints/step_<step>`."""
    return run_dir / "checkpoints" / f"step_{step}"


def snapshot_path(run_dir: Path, step: int) -> Path:
    """`<run_dir>/checkpoints/controller/step_<step>.json`: a multi-process job's controller
    state at the checkpoint of `step` (its side files, a world model's trajectories, in
    `step_<step>.files/` beside it)."""
    return run_dir / "checkpoints" / "controller" / f"step_{step}.json"


def snapshot_upload(run_dir: Path, step: int) -> tuple[dict[str, Path], str]:
    """The files of the controller's snapshot of `step` (with its side files) and the name of
    their committed folder in the object storage, beside the policy's checkpoint of that step
    (what `fetch_s3_checkpoint` resumes a controller from)."""
    path = snapshot_path(run_dir, step)
    files = {path.name: path}
    if path.with_suffix(".files").exists():
        files[path.with_suffix(".files").name] = path.with_suffix(".files")
    return files, f"{run_dir.name}/checkpoints/controller/step_{step}"


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


def s3_uploader(ckpt: CheckpointConfig, run_dir: Path, *, logs: bool) -> Uploader | None:
    """`train.ckpt.upload_s3`'s background uploader, None without it (or without
    checkpointing), the bucket asked first (a wrong key fails now, naming it); with `logs`, it
    copies the run folder's other files (metrics, logs) now and on `s3_log_interval_s`'s
    clock."""
    store = s3_store(ckpt) if ckpt.enable_checkpoint else None
    if store is None:
        return None
    from nebula_rl.utils.object_store import Uploader

    store.check()
    uploader = Uploader(store)
    if logs and ckpt.s3_log_interval_s > 0:
        uploader.sync_every(ckpt.s3_log_interval_s, run_dir, run_dir.name, skip=UPLOADED_FOLDERS)
    return uploader


def fetch_s3_checkpoint(t: TrainingConfig, *, controller: bool = False) -> Path | None:
    """With `upload_s3`: check that the bucket answers these credentials (a StorageError names
    it otherwise); with `resume = true` too and no run under `output_dir` to resume, download
    the newest committed checkpoint of the storage into `output_dir/<its run>/`, with the run's
    `metrics.jsonl` (its steps up to the checkpoint are kept), and fix `train.timestamp` to that
    run, so that the job resumes from it as from a local one (and goes on uploading under the
    same name); that checkpoint's folder, or None. With `train.timestamp` set: that run's
    newest, when this machine holds no complete checkpoint of it. `controller`: a multi-process
    job, whose controller resumes from its snapshot of the same step: only steps whose snapshot
    is committed too are taken, and it is downloaded beside the checkpoint."""
    store = s3_store(t.ckpt)
    if store is None:
        return None
    store.check()
    output = Path(t.output_dir)
    if t.resume is not True:
        return None
    if t.timestamp:  # (that run only, when this machine holds none of its checkpoints)
        if complete_checkpoints(output / t.timestamp):
            return None
    elif _resumable_runs(output):
        return None
    checkpoints: set[tuple[str, int]] = set()
    snapshots: set[tuple[str, int]] = set()
    for name in store.committed(t.timestamp or ""):
        for kind, found in (("checkpoints", checkpoints), ("checkpoints/controller", snapshots)):
            run, _, number = name.rpartition(f"/{kind}/step_")
            if run and "/" not in run and number.isdigit():
                found.add((run, int(number)))
    usable = checkpoints & snapshots if controller else checkpoints
    if not usable:
        if checkpoints:
            log.warning(
                "train.resume: %s holds checkpoints but none with its controller's snapshot (a "
                "--local run's, or a job's whose snapshot upload did not complete): starting at "
                "step 1",
                store,
            )
        return None
    run, step = max(usable)
    folder = checkpoint_path(output / run, step)
    store.download_folder(f"{run}/checkpoints/step_{step}", folder)
    if controller:
        snapshot = snapshot_path(output / run, step)
        name = snapshot_upload(output / run, step)[1]
        fetched = store.download_folder(name, snapshot.with_suffix(".download"))
        side = fetched / snapshot.with_suffix(".files").name
        if side.exists():
            side.rename(snapshot.with_suffix(".files"))
        (fetched / snapshot.name).rename(snapshot)  # (last: the controller looks for it)
        fetched.rmdir()
    store.download_file(f"{run}/metrics.jsonl", output / run / "metrics.jsonl")
    t.timestamp = run
    return folder


def fetch_missing_checkpoint(ckpt: CheckpointConfig, folder: Path) -> bool:
    """The checkpoint `folder` (`<output_dir>/<run>/checkpoints/step_<N>`), which the job
    resumes from but this node lacks (its run folder is on another node, not on shared
    storage), downloaded from `train.ckpt`'s object storage; whether it was."""
    store = s3_store(ckpt)
    if store is None or is_checkpoint(folder):
        return False
    name = f"{folder.parent.parent.name}/checkpoints/{folder.name}"
    shutil.rmtree(folder, ignore_errors=True)  # (a half-written one of an earlier attempt)
    store.download_folder(name, folder)
    log.info("downloaded the checkpoint %s from %s", name, store)
    return True
