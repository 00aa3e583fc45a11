"""The controller process: its rows (a language job's dataset, or what the CLI hands it for a
world model), its Redis state and its API processes, and the scheduler loop
(:class:`~nebula_rl.controller.scheduler.Scheduler`) run to the job's end."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from nebula_rl.config import Config
from nebula_rl.controller.scheduler import Scheduler
from nebula_rl.controller.snapshots import SideFiles
from nebula_rl.controller.state import JobState
from nebula_rl.utils.runs import UPLOADED_FOLDERS, s3_uploader

__all__ = ["JobRows", "run_controller", "text_rows"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class JobRows:
    """What a job hands out: its rows, its validation rows, and the files outside Redis its
    groups leave (a world model's trajectories: `nebula_rl.flow.trajectories`), which the
    scheduler deletes as steps record them and removes at the end."""

    rows: list[dict[str, Any]]
    val_rows: list[dict[str, Any]]
    side_files: SideFiles | None = None
    with_text: bool = True
    """Whether prompts carry their row's text to the rollouts (false where every replica reads
    the rows from its own copy, as a world model's clips)."""
    sample_lengths: bool = True
    """Whether samples have a length to report (a world model's clips have none)."""


def text_rows(cfg: Config, run_dir: Path) -> JobRows:
    """A language or vision-language job's rows: its RL dataset (the rows it could not use are
    left out, counted, and reported in `dataset.json` and the log, not fatal) and validation
    rows."""
    from nebula_rl.data import rl_dataset, rl_validation_rows

    rows, report = rl_dataset(cfg)
    (run_dir / "dataset.json").write_text(json.dumps(dataclasses.asdict(report), indent=1))
    return JobRows(rows, rl_validation_rows(cfg) if cfg.validation.enable else [])


def run_controller(
    cfg: Config,
    *,
    run_dir: Path,
    redis_url: str,
    token: str,
    host: str,
    port: int,
    num_rollout: int,
    num_policy: int = 1,
    job_rows: JobRows | None = None,
) -> None:
    """The controller: serve the API at `host:port` from a process of its own
    (:mod:`~nebula_rl.controller.api_process`) and schedule the job to its end in this one.
    (The replicas' process groups meet in Redis, so no replica has to run on its host.)
    `job_rows`: what the job hands out (default: a language model's, :func:`text_rows`)."""
    import re

    from nebula_rl.controller.api_process import ApiProcess, ApiSpec, lower_thread_priority
    from nebula_rl.controller.client import RESTART_ENV
    from nebula_rl.controller.redis_server import connect
    from nebula_rl.data import num_train_steps

    job_rows = job_rows or text_rows(cfg, run_dir)
    rows, store = job_rows.rows, job_rows.side_files
    total_steps = num_train_steps(
        cfg.train, len(rows), items_per_step=cfg.groups_per_replica * num_policy
    )
    job = re.sub(r"[^A-Za-z0-9_.-]", "_", run_dir.name)[:64] or "job"
    state = JobState(connect(redis_url), job)
    # (`upload_s3`: its snapshots; the run's metrics and logs, which it writes)
    uploader = s3_uploader(cfg.train.ckpt, run_dir, logs=True)
    scheduler = Scheduler(
        cfg,
        state,
        rows=rows,
        total_steps=total_steps,
        num_rollout=num_rollout,
        num_policy=num_policy,
        run_dir=run_dir,
        val_rows=job_rows.val_rows,
        side_files=store,
        with_text=job_rows.with_text,
        sample_lengths=job_rows.sample_lengths,
        uploader=uploader,
    )
    restarted = os.environ.get(RESTART_ENV) == "1"
    # A restart continues from Redis, which is newer than any checkpoint.
    resume_from = None if restarted else scheduler.snapshots.restore()
    if restarted:
        log.info("controller restarted: continuing job %s from Redis at step %d", job, state.step())
    # Replicas could not reach a dead controller: they get a full heartbeat timeout from now.
    state.refresh_heartbeats()
    meta = {
        "redis_url": redis_url,
        "run_dir": str(run_dir),
        "total_steps": total_steps,
        "num_rows": len(rows),
        "resume_from": None if resume_from is None else str(resume_from),
    }
    api = ApiSpec(
        redis_url=redis_url,
        job=job,
        token=token,
        host=host,
        port=port,
        config_json=cfg.model_dump(mode="json"),
        meta_extra=meta,
        metrics_path=scheduler.metrics_path,
        heartbeat_timeout=cfg.controller.heartbeat_timeout,
        log_level=logging.getLogger().getEffectiveLevel(),
    )
    try:
        with ApiProcess(api, processes=cfg.controller.api_processes) as server:
            log.info("controller of job %s at %s: %d steps", job, server.url, total_steps)
            scheduler.resume_in_flight()
            # (after the API process and its watcher started: they keep the normal priority)
            lower_thread_priority(cfg.controller.scheduler_niceness)
            scheduler.run()
            _wait_for_replicas(state, timeout_s=30.0)
    finally:
        if uploader is not None:  # (the last snapshot, with `"final"`; the logs as they end)
            if cfg.train.ckpt.upload_s3 == "final":
                scheduler.snapshots.upload_last()
            uploader.sync(run_dir, run_dir.name, skip=UPLOADED_FOLDERS)
            uploader.close()
    if store is not None:
        store.remove()


def _wait_for_replicas(state: JobState, *, timeout_s: float) -> None:
    """Give replicas time to see the end and unregister before the API goes away."""
    deadline = time.monotonic() + timeout_s
    while state.replicas() and time.monotonic() < deadline:
        time.sleep(0.1)
