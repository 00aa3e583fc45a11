"""The controller's snapshots: the job's Redis state at each policy checkpoint, written beside it
(`<run>/checkpoints/controller/step_<N>.json`), uploaded beside it with `train.ckpt.upload_s3`,
and put back by `train.resume`."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from nebula_rl.config import TrainingConfig
from nebula_rl.controller.state import JobState
from nebula_rl.utils.runs import (
    complete_checkpoints,
    drop_steps_after,
    is_checkpoint,
    snapshot_path,
    snapshot_upload,
)

if TYPE_CHECKING:
    from nebula_rl.utils.object_store import Uploader

__all__ = ["SideFiles", "Snapshots"]

log = logging.getLogger(__name__)


class SideFiles(Protocol):
    """Files outside Redis that the job's groups refer to (a world model's trajectory files):
    those of a recorded step's groups are deleted, a snapshot keeps a copy, a restore puts it
    back."""

    def discard(self, prompt_ids: list[str]) -> int: ...

    def keep(self, folder: Path) -> None: ...

    def put_back(self, folder: Path) -> None: ...

    def remove(self) -> None: ...


class Snapshots:
    """The snapshots of job `state` in `run_dir`, with its `side_files`; `uploader`: where each
    goes with `train.ckpt.upload_s3 = "all"` (with `"final"`, :meth:`upload_last` at the end)."""

    def __init__(
        self,
        t: TrainingConfig,
        state: JobState,
        run_dir: Path,
        *,
        side_files: SideFiles | None = None,
        uploader: Uploader | None = None,
    ) -> None:
        self.resume, self.state, self.run_dir = t.resume, state, run_dir
        self.side_files = side_files
        self.folder = run_dir / "checkpoints" / "controller"
        self.uploader = uploader
        self.upload_each = t.ckpt.upload_s3 in (True, "all")

    def save(self, step: int) -> None:
        """The job's Redis state after `step`, next to the policy's checkpoint of that step;
        snapshots older than every complete policy checkpoint are deleted."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = snapshot_path(self.run_dir, step)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"step": step, "keys": self.state.snapshot()}))
        if self.side_files is not None:  # (after the state: its groups' files exist now)
            self.side_files.keep(path.with_suffix(".files"))
        tmp.replace(path)
        uploader = self.uploader if self.upload_each else None
        if uploader is not None:
            uploader.upload(*snapshot_upload(self.run_dir, step))
        kept = [s for s, _ in complete_checkpoints(self.run_dir)]
        for old_step in self.steps():
            if kept and old_step < min(kept):
                old = snapshot_path(self.run_dir, old_step)
                old.unlink()
                shutil.rmtree(old.with_suffix(".files"), ignore_errors=True)
                if uploader is not None:
                    uploader.delete(snapshot_upload(self.run_dir, old_step)[1])

    def steps(self) -> list[int]:
        """The steps of the snapshots on disk, in order."""
        found = (p.stem.removeprefix("step_") for p in self.folder.glob("step_*.json"))
        return sorted(int(step) for step in found if step.isdigit())

    def upload_last(self) -> None:
        """Queue the newest snapshot for the storage (`upload_s3 = "final"`, at the end)."""
        steps = self.steps()
        if self.uploader is not None and steps:
            self.uploader.upload(*snapshot_upload(self.run_dir, steps[-1]))

    def restore(self) -> Path | None:
        """Put the job back at the checkpoint `train.resume` names; returns the policy's
        checkpoint folder (None: nothing to resume, the job starts at step 1)."""
        if self.resume is False:
            return None
        if self.resume is True:
            found = [
                (step, path)
                for step, path in complete_checkpoints(self.run_dir)
                if snapshot_path(self.run_dir, step).exists()
            ]
            if not found:
                log.info(
                    "train.resume: no checkpoint under %s yet: starting at step 1", self.run_dir
                )
                return None
            step, path = found[-1]
            snapshot = snapshot_path(self.run_dir, step)
        else:
            path = Path(self.resume)
            snapshot = path.parent / "controller" / f"{path.name}.json"
            if not is_checkpoint(path) or not snapshot.exists():
                raise ValueError(
                    f"train.resume: {path} is not a complete checkpoint of a multi-process job "
                    f"(needs its manifest.json and {snapshot})"
                )
        data = json.loads(snapshot.read_text())
        self.state.restore(data["keys"])
        if self.side_files is not None:
            self.side_files.put_back(snapshot.with_suffix(".files"))
        # (later steps are trained again)
        drop_steps_after(self.run_dir / "metrics.jsonl", data["step"])
        log.info("resumed the job at step %d from %s", data["step"], path)
        return path
