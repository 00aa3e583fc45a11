"""Where a world-model job's trajectories travel from the rollout replicas to the policy: files of
tensors in one folder per host and job, never JSON through Redis.

A rollout replica writes each scored group's trajectory (the latents of every denoising step,
the log-prob of each SDE step, the noise levels, which frames were given) as one safetensors
file, written under a temporary name and renamed, so a reader never sees half a file; the group
it pushes to the controller names the file (`RolloutGroup.extra["trajectory"]`). The policy
rank that trains the group reads it from its own host's folder when it is there, else fetches it
from the replica that wrote it (`flow.transfer`: over a gloo group, as the weights travel).
The controller deletes the files of the groups a step trained from its host's folder, the
rollout replicas from theirs, and the folders go when the job ends. A controller snapshot (a
checkpoint of the job) keeps a copy of the files its host holds for its buffered groups, which a
resumed job puts back.

The folder is `/dev/shm/nebula-rl/<job>` (shared memory: a page-cache copy each way) where
`/dev/shm` exists, else under the system's temporary folder, or under `NEBULA_TRAJECTORY_DIR`
(e.g. a shared filesystem every host sees).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nebula_rl.flow.sampler import Trajectory

__all__ = ["TRAJECTORY_DIR_ENV", "TrajectoryStore"]

TRAJECTORY_DIR_ENV = "NEBULA_TRAJECTORY_DIR"
"""A folder every replica of the job sees, instead of the host's shared memory."""


@dataclass(frozen=True, slots=True)
class TrajectoryStore:
    """One job's trajectory folder."""

    root: Path

    @classmethod
    def for_job(cls, run_dir: Path | str) -> TrajectoryStore:
        """The store of the job whose run folder is `run_dir` (the same folder for all of its
        processes on a host)."""
        base = os.environ.get(TRAJECTORY_DIR_ENV)
        if base is None:
            shm = Path("/dev/shm")
            base = str(shm if shm.is_dir() else Path(tempfile.gettempdir()))
            base = os.path.join(base, "nebula-rl")
        run_dir = Path(run_dir).resolve()
        digest = hashlib.sha256(str(run_dir).encode()).hexdigest()[:12]
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", run_dir.name)[:48]
        return cls(Path(base) / f"{name}-{digest}")

    @staticmethod
    def _stem(prompt_id: str) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]", "_", prompt_id)

    def write(self, prompt_id: str, trajectory: Trajectory) -> str:
        """Write the trajectory of the group of `prompt_id`; the file's name (unique per write:
        a group sampled twice after a crash leaves two files, one of which is trained)."""
        from safetensors.torch import save_file

        from nebula_rl.flow.sampler import trajectory_tensors

        self.root.mkdir(parents=True, exist_ok=True)
        name = f"{self._stem(prompt_id)}.{uuid.uuid4().hex[:12]}.safetensors"
        tensors = trajectory_tensors(trajectory)
        partial = self.root / f".{name}.partial"
        save_file(tensors, str(partial))
        partial.rename(self.root / name)
        return name

    def read(self, name: str) -> Trajectory:
        """The trajectory in file `name`."""
        from safetensors.torch import load_file

        from nebula_rl.flow.sampler import tensors_trajectory

        path = self.root / name
        if not path.is_file():
            raise FileNotFoundError(f"trajectory {path} is missing")
        return tensors_trajectory(load_file(str(path)))

    def discard(self, prompt_ids: list[str]) -> int:
        """Delete every file of these prompts' groups; how many."""
        removed = 0
        for prompt_id in prompt_ids:
            for path in self.root.glob(f"{self._stem(prompt_id)}.*.safetensors"):
                path.unlink(missing_ok=True)
                removed += 1
        return removed

    def keep(self, folder: Path) -> None:
        """Copy every trajectory file to `folder` (a controller snapshot's: the buffered groups
        of a checkpointed step must find theirs when the job resumes)."""
        folder.mkdir(parents=True, exist_ok=True)
        for path in self.root.glob("*.safetensors") if self.root.is_dir() else []:
            shutil.copy2(path, folder / path.name)

    def put_back(self, folder: Path) -> None:
        """Copy the files a snapshot kept (`keep`) into the store."""
        if not folder.is_dir():
            return
        self.root.mkdir(parents=True, exist_ok=True)
        for path in folder.glob("*.safetensors"):
            shutil.copy2(path, self.root / path.name)

    def remove(self) -> None:
        """Delete the whole folder (the job ended)."""
        shutil.rmtree(self.root, ignore_errors=True)
