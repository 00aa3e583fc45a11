"""Trajectories between hosts: a policy rank fetches the trajectory files it lacks from the rollout
replica that wrote them, as tensors over a group built like the weight group's.

A rollout replica writes each group's trajectory into its host's trajectory folder
(`flow.trajectories`), where a policy rank on the same host (or one sharing the folder through
`NEBULA_TRAJECTORY_DIR`) reads it directly. A policy rank on another host asks the replica
named in the group (`RolloutGroup.replica`, the file's holder) for it:

1. The policy rank pushes a request (a fresh group name and the files it wants) onto the holder's
   request list in the job's Redis.
2. The holder's :class:`TrajectoryServer` (a thread of the rollout replica) pops it, and both
   build a two-rank gloo group under that name, meeting in the job's Redis exactly as the weight
   group does (`weights.group.build_group`: the job's password guards the rendezvous; the
   sockets listen on the address that reaches Redis).
3. The holder broadcasts a JSON header (each file's tensors: name, dtype, shape; or "missing")
   and then every tensor; both leave the group.

Requests to several holders run at once. A holder that is not registered, or that leaves the
registry while the group is built (it died: the controller reaped it after
`controller.heartbeat_timeout`), gives nothing: :func:`fetch_trajectories` returns None for its
files, and the policy hands the step back (`policy.worker.GroupsLost`) so the controller
samples those prompts again. Nothing waits longer than `timeout`.

Files leave a holder's folder when the ledger says their prompt was trained or filtered (the
server looks every few seconds), and all of them when the job ends; the controller's own
`TrajectoryStore.discard` deletes those in its host's folder at each step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from nebula_rl.controller.state import JobState
from nebula_rl.flow.sampler import Trajectory, tensors_trajectory, trajectory_tensors
from nebula_rl.flow.trajectories import TrajectoryStore
from nebula_rl.protocol import Prompt
from nebula_rl.weights.group import Rendezvous, WeightGroup, build_group, leave_group

__all__ = ["TrajectoryServer", "fetch_trajectories"]

log = logging.getLogger(__name__)

_DTYPES = {
    str(d): d
    for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.bool, torch.int64)
}
"""What a trajectory's tensors may be."""
_CLEANUP_S = 3.0
"""How often a server deletes the files of trained prompts."""
_POP_S = 1
"""BLPOP's timeout (seconds): how soon a server notices it was stopped."""
_MAX_CONCURRENT = 8
"""Requests a server answers at once (each its own group)."""


def _requests_key(state: JobState, holder: str) -> str:
    return state.key("trajectory_requests", holder)


def _broadcast_bytes(group: WeightGroup, data: bytes | None) -> bytes:
    """Rank 0's `data` on every rank (length first, then the bytes)."""
    length = torch.tensor([0 if data is None else len(data)], dtype=torch.int64)
    group.pg.broadcast(length, 0, group.timeout).wait()
    buffer = torch.zeros(int(length.item()), dtype=torch.uint8)
    if data is not None:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    group.pg.broadcast(buffer, 0, group.timeout).wait()
    return buffer.numpy().tobytes()


class TrajectoryServer:
    """A rollout replica's side: answer other hosts' requests for the files it wrote, and delete
    them once their prompts are trained."""

    def __init__(self, state: JobState, name: str, store: TrajectoryStore, *, timeout: float):
        self.state, self.name, self.store = state, name, store
        self.timeout = timedelta(seconds=timeout)
        self.written: dict[str, Prompt] = {}
        """File name -> its group's prompt, for the files still kept."""
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._pool = ThreadPoolExecutor(_MAX_CONCURRENT, thread_name_prefix="trajectory-server")
        self._thread: threading.Thread | None = None
        self.served = 0
        """Files handed to other hosts."""

    def wrote(self, file: str, prompt: Prompt) -> None:
        """The replica wrote `file`, its group of `prompt`."""
        with self._lock:
            self.written[file] = prompt

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="trajectory-server", daemon=True)
        self._thread.start()

    def stop(self, *, job_ended: bool) -> None:
        """Stop answering; with `job_ended`, delete every file this replica wrote (nobody will
        read them). Without it they stay: policy ranks on this host may still read them."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * _POP_S + 1)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if job_ended:
            with self._lock:
                files, self.written = list(self.written), {}
            for file in files:
                (self.store.root / file).unlink(missing_ok=True)

    def _run(self) -> None:
        key = _requests_key(self.state, self.name)
        last_cleanup = time.monotonic()
        while not self._stopped.is_set():
            try:
                popped = self.state.redis.blpop([key], timeout=_POP_S)
                if popped is not None:
                    self._pool.submit(self._answer, json.loads(popped[1]))
                if time.monotonic() - last_cleanup > _CLEANUP_S:
                    self.cleanup()
                    last_cleanup = time.monotonic()
            except Exception:  # (Redis unreachable for a while: keep serving once it is back)
                log.exception("trajectory server: retrying in %d s", _POP_S)
                self._stopped.wait(_POP_S)

    def cleanup(self) -> int:
        """Delete the files whose prompts the ledger marks trained or filtered; how many."""
        with self._lock:
            written = dict(self.written)
        if not written:
            return 0
        states = self.state.prompt_states(list(written.values()))
        done = [f for f, s in zip(written, states, strict=True) if s in ("trained", "filtered")]
        with self._lock:
            for file in done:
                self.written.pop(file, None)
        for file in done:
            (self.store.root / file).unlink(missing_ok=True)
        return len(done)

    def _answer(self, request: dict[str, Any]) -> None:
        """Send the files of `request` to the policy rank that asked (rank 1 of its group)."""
        rdzv = Rendezvous("", 0, request["group"], 2, redis=self.state.redis)
        group = None
        try:
            group = build_group(rdzv, rank=0, timeout=self.timeout, cancelled=self._stopped.is_set)
            header, tensors = [], []
            for file in request["files"]:
                path = self.store.root / file
                if not path.is_file():
                    header.append({"file": file, "missing": True})
                    continue
                named = trajectory_tensors(self.store.read(file))
                header.append(
                    {
                        "file": file,
                        "tensors": [[k, str(t.dtype), list(t.shape)] for k, t in named.items()],
                    }
                )
                tensors += [t.contiguous() for t in named.values()]
            _broadcast_bytes(group, json.dumps(header).encode())
            for tensor in tensors:
                group.pg.broadcast(tensor, 0, group.timeout).wait()
            self.served += sum("tensors" in h for h in header)
        except Exception as err:  # (the asker gave up or died: its step goes on without us)
            log.warning("trajectory request %s not answered: %s", request.get("group"), err)
        finally:
            leave_group(group)


def fetch_trajectories(
    state: JobState,
    wanted: dict[str, list[str]],
    *,
    timeout: float,
) -> dict[str, Trajectory | None]:
    """The files `wanted` (holder -> file names) from their holders, at once; a file whose
    holder is gone or does not have it maps to None."""
    out: dict[str, Trajectory | None] = {f: None for files in wanted.values() for f in files}
    asks = {holder: files for holder, files in wanted.items() if state.is_registered(holder)}
    if not asks:
        return out
    with ThreadPoolExecutor(len(asks), thread_name_prefix="trajectory-fetch") as pool:
        futures = [
            pool.submit(_fetch_from, state, holder, files, timeout)
            for holder, files in asks.items()
        ]
        for future in futures:
            out.update(future.result())
    return out


def _fetch_from(
    state: JobState, holder: str, files: list[str], timeout: float
) -> dict[str, Trajectory | None]:
    name = f"{state.job}-trajectories-{uuid.uuid4().hex[:16]}"
    key, request = _requests_key(state, holder), json.dumps({"group": name, "files": files})
    with state.redis.pipeline() as pipe:
        pipe.rpush(key, request)
        pipe.expire(key, max(int(timeout), 1))
        pipe.execute()
    group = None
    try:
        rdzv = Rendezvous("", 0, name, 2, redis=state.redis)
        group = build_group(  # (given up once the holder leaves the registry: it died)
            rdzv,
            rank=1,
            timeout=timedelta(seconds=timeout),
            cancelled=lambda: not state.is_registered(holder),
        )
        start = time.perf_counter()
        header = json.loads(_broadcast_bytes(group, None))
        out: dict[str, Trajectory | None] = {}
        size = 0
        for entry in header:
            if entry.get("missing"):
                out[entry["file"]] = None
                continue
            named: dict[str, Tensor] = {}
            for key_name, dtype, shape in entry["tensors"]:
                tensor = torch.empty(shape, dtype=_DTYPES[dtype])
                group.pg.broadcast(tensor, 0, group.timeout).wait()
                named[key_name] = tensor
                size += tensor.nbytes
            out[entry["file"]] = tensors_trajectory(named)
        got = sum(t is not None for t in out.values())
        log.info(
            "fetched %d trajector%s from %s (%.1f MB in %.2f s)",
            got,
            "y" if got == 1 else "ies",
            holder,
            size / 1e6,
            time.perf_counter() - start,
        )
        return out
    except Exception as err:
        log.warning("trajectories of %s not fetched: %s", holder, err)
        return dict.fromkeys(files)
    finally:
        leave_group(group)
        with contextlib.suppress(Exception):  # (a request nobody took is withdrawn)
            state.redis.lrem(key, 0, request)
