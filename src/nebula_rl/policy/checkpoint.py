"""Resumable checkpoints with `torch.distributed.checkpoint` (DCP).

A checkpoint is a DCP folder `<run_dir>/checkpoints/step_<N>/` holding the model and optimiser
(through `get_state_dict`, so FSDP2/TP-sharded parameters are saved as shards and re-sharded on
load to whatever layout the loading job has), the LR schedule, the RNG states (Python `random`,
torch CPU, the current CUDA device, the rollout engine's sampling generator), the data position
and the controller's ledger. `manifest.json` is written after DCP has finished (by rank 0), so a
folder without it is a half-written checkpoint and is never picked as the latest. With
`export_safetensors`, a Hugging Face export is written to `<run_dir>/safetensors/step_<N>/` next
to each checkpoint and rotated with it (with `train.ema_enable`, the averages' export
`step_<N>_ema` too). The weight averages (`policy/ema.py`) are saved as this rank's shards beside
the model, with the count of optimiser steps they have seen.

Non-tensor state (schedule, RNG, data position, ledger) is stored as one pickled leaf per key:
DCP would flatten a dict into one entry per key, and loading would then need a template with
exactly those keys. RNG states differ per rank, so they are saved under a per-rank key (DCP keeps
one copy of a key that every rank writes).

In `async` mode `dcp.async_save` copies the state to CPU memory before it returns (so later
steps cannot change what is written) and writes it from a background thread; the next save, and
`close()`, wait for it. With a process group, the background collectives run on a group of their
own, so they never interleave with the training's collectives.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from nebula_rl.config import CheckpointConfig, TrainingConfig
from nebula_rl.policy.ema import WeightEMA, ema_folder
from nebula_rl.utils.runs import (
    MANIFEST,
    UPLOADED_FOLDERS,
    checkpoint_path,
    complete_checkpoints,
    is_checkpoint,
    latest_checkpoint,
    s3_uploader,
)

__all__ = [
    "MANIFEST",
    "Checkpointer",
    "Restored",
    "SamplingRng",
    "checkpoint_path",
    "complete_checkpoints",
    "is_checkpoint",
    "latest_checkpoint",
    "resume_checkpoint",
]

log = logging.getLogger(__name__)

# DCP warns on every call without a process group; a single process is a supported use here.
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
)

_FORMAT_VERSION = 1


class SamplingRng(Protocol):
    """A rollout engine whose sampling generator a checkpoint saves and restores."""

    def rng_state(self) -> torch.Tensor: ...

    def set_rng_state(self, state: torch.Tensor) -> None: ...


@dataclass(frozen=True, slots=True)
class Restored:
    """What a loaded checkpoint hands back; tensors, schedule and RNGs are restored in place."""

    path: Path
    """The checkpoint folder."""
    step: int
    """Optimiser steps completed when it was saved."""
    data: dict[str, Any]
    """The data position the training loop saved (its own keys)."""
    ledger: dict[str, Any]
    """The controller's ledger, as saved (empty where there is none)."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _rng_states(engine: SamplingRng | None) -> dict[str, Any]:
    states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    if engine is not None:
        states["engine"] = engine.rng_state()
    return states


def _set_rng_states(states: dict[str, Any], engine: SamplingRng | None) -> None:
    random.setstate(states["python"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    if engine is not None:
        if "engine" not in states:
            raise ValueError("the checkpoint holds no rollout engine RNG state to restore")
        engine.set_rng_state(states["engine"])


class Checkpointer:
    """Saves a run's training state under `<run_dir>/checkpoints/` and restores it.

    With a process group every rank constructs it and calls `save`/`load`/`close` together;
    rank 0 writes the manifest and rotates old checkpoints.

    Args:
        cfg: `train.ckpt`.
        run_dir: the run folder.
        model: the trained model (plain, or FSDP2/TP-sharded).
        optimizer: its optimiser.
        scheduler: its LR schedule.
        engine: a rollout engine in this process whose sampling RNG is part of the state.
        ema: the averages of `model`'s weights (`train.ema_enable`), saved and restored with it.
        export: writes a Hugging Face export of `model` to the folder it is given
            (`safetensors/step_<N>`); called before each checkpoint when
            `cfg.export_safetensors`, on the ranks it is given to.
        trainable_only: save and load only the parameters that train (and their optimiser
            state): a LoRA policy's adapter; the frozen rest is loaded from the model again.
        sync_logs: with `upload_s3`, copy the rest of the run folder (metrics, logs) to the
            storage too; off in a policy replica, whose controller writes and copies them.
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        run_dir: Path,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        engine: SamplingRng | None = None,
        ema: WeightEMA | None = None,
        export: Callable[[Path], None] | None = None,
        trainable_only: bool = False,
        sync_logs: bool = True,
    ) -> None:
        self.cfg, self.run_dir = cfg, run_dir
        self.sync_logs = sync_logs
        # (loading fills the template get_state_dict made: without the frozen names, which a
        # strict load would call missing)
        self._options = StateDictOptions(
            ignore_frozen_params=trainable_only, strict=not trainable_only
        )
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.engine, self.ema = engine, ema
        self.export = export if cfg.export_safetensors else None
        self.rank = _rank()
        self._async_group = (
            dist.new_group(backend="gloo")
            if dist.is_initialized() and cfg.enable_checkpoint and cfg.save_mode == "async"
            else None
        )
        self._pending: tuple[Future, threading.Event] | None = None
        self._error: BaseException | None = None
        # `upload_s3`: rank 0 uploads each checkpoint (`all`) or the last (`final`) with its
        # export, in the background, and removes what rotation removes here.
        self._uploader = s3_uploader(cfg, run_dir, logs=sync_logs) if self.rank == 0 else None
        self._upload_each = cfg.upload_s3 in (True, "all")

    def _state_dicts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model's and the optimiser's state dicts as DCP saves and loads them."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._options)
        if self._options.ignore_frozen_params:  # (torch keeps the second name of a tied weight)
            trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
            model_sd = {k: v for k, v in model_sd.items() if k in trainable}
        return model_sd, optim_sd

    def due(self, step: int, *, last: bool, steps_per_epoch: int) -> bool:
        """Whether to save after `step` (`CheckpointConfig.due`)."""
        return self.cfg.due(step, last=last, steps_per_epoch=steps_per_epoch)

    def save(
        self, step: int, *, data: dict[str, Any], ledger: dict[str, Any] | None = None
    ) -> Path:
        """Checkpoint the state after `step` optimiser steps; `data` is the loop's data position.

        Returns the folder. In `async` mode the write continues in the background; the state it
        writes is the state at this call.
        """
        self.wait()
        path = checkpoint_path(self.run_dir, step)
        if self.rank == 0 and path.exists():
            # A leftover of an interrupted run, or of a run resumed from an earlier step.
            shutil.rmtree(path)
        if dist.is_initialized():
            dist.barrier()
        if self.export is not None:
            self.export(self.run_dir / "safetensors" / f"step_{step}")
        model_sd, optim_sd = self._state_dicts()
        state = {
            "model": model_sd,
            "optimizer": optim_sd,
            "scheduler": pickle.dumps(self.scheduler.state_dict()),
            "train": pickle.dumps({"step": step, "data": data, "ledger": ledger or {}}),
            f"rng_rank{self.rank}": pickle.dumps(_rng_states(self.engine)),
        }
        if self.ema is not None:
            state["ema"] = self.ema.state()
            state["ema_steps"] = pickle.dumps(self.ema.steps)
        if self.cfg.save_mode == "sync":
            dcp.save(state, checkpoint_id=path, no_dist=not dist.is_initialized())
            self._finish(step)
            return path
        future = dcp.async_save(
            state,
            checkpoint_id=path,
            process_group=self._async_group,
            no_dist=not dist.is_initialized(),
        )
        # The default stager copies synchronously, so this is a plain Future (no staging one).
        assert isinstance(future, Future)
        finished = threading.Event()

        def on_done(f: Future) -> None:
            try:
                if f.exception() is None:
                    self._finish(step)
            except BaseException as err:  # re-raised by wait() in the training thread
                self._error = err
            finally:
                finished.set()

        future.add_done_callback(on_done)
        self._pending = (future, finished)
        return path

    def _finish(self, step: int) -> None:
        """After DCP has written everything: the manifest, then rotation (rank 0)."""
        if self.rank != 0:
            return
        path = checkpoint_path(self.run_dir, step)
        manifest = {
            "format_version": _FORMAT_VERSION,
            "step": step,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "saved_at": time.time(),
        }
        tmp = path / f"{MANIFEST}.tmp"
        tmp.write_text(json.dumps(manifest))
        os.replace(tmp, path / MANIFEST)
        log.info("checkpoint saved: %s", path)
        if self._uploader is not None and self._upload_each:
            self._upload(step)
        if self.cfg.max_keep < 0:
            return
        for old_step, old in complete_checkpoints(self.run_dir)[: -self.cfg.max_keep]:
            (old / MANIFEST).unlink()  # first, so a half-deleted folder is never "complete"
            shutil.rmtree(old)
            export = self.run_dir / "safetensors" / f"step_{old_step}"
            for folder in (export, ema_folder(export)):
                if folder.exists():
                    shutil.rmtree(folder)
            if self._uploader is not None and self._upload_each:
                for name in self._uploads(old_step):
                    self._uploader.delete(name)

    def _uploads(self, step: int) -> dict[str, Path]:
        """The storage names of step `step`'s checkpoint and exports, with their folders."""
        run = self.run_dir.name
        export = self.run_dir / "safetensors" / f"step_{step}"
        folders = {
            f"{run}/checkpoints/step_{step}": checkpoint_path(self.run_dir, step),
            f"{run}/safetensors/step_{step}": export,
            f"{run}/safetensors/{ema_folder(export).name}": ema_folder(export),
        }
        return {name: folder for name, folder in folders.items() if folder.exists()}

    def _upload(self, step: int) -> None:
        """Queue step `step`'s exports, then its checkpoint (committed last, so a committed
        checkpoint's exports are there)."""
        assert self._uploader is not None
        for name, folder in reversed(self._uploads(step).items()):
            self._uploader.upload(folder, name)
        self._sync_logs()

    def _sync_logs(self) -> None:
        """Queue a copy of the rest of the run folder (config, metrics.jsonl, logs, TensorBoard
        events, samples) as it is now, as plain objects beside the uploads."""
        assert self._uploader is not None
        if self.sync_logs:
            self._uploader.sync(self.run_dir, self.run_dir.name, skip=UPLOADED_FOLDERS)

    def wait(self) -> None:
        """Block until the pending async save is written, its manifest included."""
        if self._pending is None:
            return
        future, finished = self._pending
        self._pending = None
        future.result()
        finished.wait()
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def close(self) -> None:
        """Wait for the pending save and the uploads (`upload_s3 = "final"`: the last
        checkpoint's); call once training is over."""
        self.wait()
        if self._uploader is None:
            return
        latest = complete_checkpoints(self.run_dir)
        if self.cfg.upload_s3 == "final" and latest:
            self._upload(latest[-1][0])
        else:  # (the logs as they are at the end)
            self._sync_logs()
        self._uploader.close()
        self._uploader = None

    def load(self, path: Path) -> Restored:
        """Restore model, optimiser, schedule and RNGs from the checkpoint at `path` in place."""
        if not is_checkpoint(path):
            raise ValueError(f"{path} is not a complete checkpoint (no {MANIFEST})")
        model_sd, optim_sd = self._state_dicts()
        rng_key = f"rng_rank{self.rank}"
        state: dict[str, Any] = {
            "model": model_sd,
            "optimizer": optim_sd,
            "scheduler": b"",
            "train": b"",
            rng_key: b"",
        }
        ema = self.ema is not None and self._holds_ema(path)
        if ema:
            assert self.ema is not None
            state["ema"] = self.ema.state()  # (loaded in place into the averages)
            state["ema_steps"] = b""
        dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=self._options,
        )
        self.scheduler.load_state_dict(pickle.loads(state["scheduler"]))
        _set_rng_states(pickle.loads(state[rng_key]), self.engine)
        if self.ema is not None:
            if ema:
                self.ema.steps = pickle.loads(state["ema_steps"])
            else:
                log.warning(
                    "train.ema_enable: %s holds no weight averages (saved without EMA); they "
                    "start again from its weights",
                    path,
                )
                self.ema.restart()
        train = pickle.loads(state["train"])
        log.info("resumed from %s (step %d)", path, train["step"])
        return Restored(path, train["step"], train["data"], train["ledger"])

    @staticmethod
    def _holds_ema(path: Path) -> bool:
        """Whether the checkpoint at `path` was saved with weight averages."""
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
        return "ema_steps" in metadata.state_dict_metadata


def resume_checkpoint(
    train: TrainingConfig, run_dir: Path, checkpointer: Checkpointer
) -> Restored | None:
    """Load the checkpoint `train.resume` names, if any."""
    resume = train.resume
    if resume is False:
        return None
    if resume is True:
        path = latest_checkpoint(run_dir)
        if path is None:
            log.info("train.resume: no checkpoint under %s yet: starting at step 1", run_dir)
            return None
    else:
        path = Path(resume)
        if not is_checkpoint(path):
            raise ValueError(
                f"train.resume: {path} is not a complete checkpoint folder "
                "(expected <run>/checkpoints/step_<N> with a manifest.json)"
            )
    return checkpointer.load(path)
