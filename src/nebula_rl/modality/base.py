"""The :class:`Modality` interface: what a role needs from the kind of model a job trains."""

from __future__ import annotations

import abc
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from nebula_rl.config import Config

if TYPE_CHECKING:
    import torch

    from nebula_rl.controller.client import ReplicaSession
    from nebula_rl.controller.run import JobRows

__all__ = ["Modality", "Report"]


class Report(Protocol):
    """Where `nebula-rl check` collects what it finds (`launch.preflight.Preflight`)."""

    errors: list[str]
    notes: list[str]


class Modality(abc.ABC):
    """One kind of model, as the roles see it."""

    name: str
    """`text` or `world`."""

    def fetched_datasets(self) -> frozenset[str]:
        """Dataset names the modality fetches itself at launch (neither paths nor Hub ids)."""
        return frozenset()

    @abc.abstractmethod
    def check_single(self, cfg: Config) -> None:
        """Raise, before any rank starts, for a split of the model a single job does not make."""

    @abc.abstractmethod
    def run_single(self, cfg: Config) -> Path:
        """Train in this job's own processes (SFT, `--local`, uncentralized colocated RL); the
        run folder."""

    @abc.abstractmethod
    def check_job(self, cfg: Config) -> None:
        """Raise, before the launcher starts a process, what a replica would otherwise hit only
        once the job runs (models, backends, parallel sizes)."""

    @abc.abstractmethod
    def run_policy(self, session: ReplicaSession, *, device: torch.device) -> None:
        """A policy replica's work, to the job's end."""

    @abc.abstractmethod
    def run_rollout(self, session: ReplicaSession, *, device: torch.device) -> None:
        """A rollout replica's work, to the job's end."""

    @abc.abstractmethod
    def job_rows(self, cfg: Config, run_dir: Path) -> JobRows:
        """What the controller hands out: rows, validation rows, files outside Redis."""

    @abc.abstractmethod
    def check_layout(
        self, cfg: Config, report: Report, *, num_policy: int, num_rollout: int
    ) -> None:
        """`nebula-rl check`: the model and the layout of its replicas on this machine."""
