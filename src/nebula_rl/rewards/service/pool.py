"""The reward service's scoring: a bounded queue of tasks, batching of queued requests of the
same reward and shape into one call, and one supervised pool of spawned worker processes whose
dead workers' tasks go back to the front of the queue."""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import uuid as uuidlib
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_ready
from typing import Any

import numpy as np
import torch

from nebula_rl.rewards.service.config import RewardArgs, RewardServiceConfig, build_reward
from nebula_rl.rewards.service.wire import (
    EnqueueRequest,
    RequestError,
    Samples,
    TextSamples,
    bad_request,
)

log = logging.getLogger(__name__)

MAX_START_FAILURES = 3
"""A worker slot that dies this many times in a row before it is ready is given up."""


# Worker processes


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"[:2000]


def _call(fn: Any, name: str, samples: Samples, prompts: list[str]) -> dict[str, list[float]]:
    """`fn` on one batch (pixels in one call, texts one by one), its answer checked: one finite
    number per sample, under the reward's name; or, from a reward that returns a mapping (for
    the batch; a text reward: for each completion) of several scores of each sample, as
    cosmos-rl's `dance_grpo` gives `overall_reward`, `vq_reward`, ..., under each of its keys."""
    if isinstance(samples, TextSamples):
        pairs = zip(samples.completions, samples.references, strict=True)
        answer: Any = [fn(completion, reference) for completion, reference in pairs]
        if answer and all(isinstance(a, Mapping) for a in answer):  # (several per completion)
            answer = {key: [a.get(key, float("nan")) for a in answer] for key in answer[0]}
    else:
        answer = fn(torch.from_numpy(samples), prompts)
    named = dict(answer) if isinstance(answer, Mapping) else {name: answer}
    if not named:
        raise ValueError(f"reward {name} returned no scores")
    out = {}
    for key, scores in named.items():
        what = f"reward {name}" + ("" if key == name else f" (score {key!r})")
        if not isinstance(key, str):
            raise ValueError(f"reward {name} named a score {key!r}: score names are strings")
        if len(scores) != len(prompts):
            raise ValueError(f"{what} returned {len(scores)} scores for {len(prompts)} samples")
        out[key] = [float(s) for s in scores]
        bad = [i for i, s in enumerate(out[key]) if not np.isfinite(s)]
        if bad:
            raise ValueError(f"{what} returned a non-finite score for sample(s) {bad}")
    return out


_Outcome = tuple[dict[str, list[float]] | None, str | None, float]
"""(scores by name, error, seconds) of one task in a batch."""


def _joined(parts: list[Samples]) -> Samples:
    """Several tasks' samples as one batch."""
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], TextSamples):
        texts = [p for p in parts if isinstance(p, TextSamples)]
        return TextSamples(
            [c for p in texts for c in p.completions], [r for p in texts for r in p.references]
        )
    return np.concatenate([p for p in parts if isinstance(p, np.ndarray)])


def _score_batch(fn: Any, name: str, items: list[tuple[Samples, list[str]]]) -> list[_Outcome]:
    """Score the tasks `items` (samples, prompts) with one call of `fn`; split the scores back."""
    start = time.perf_counter()
    prompts = [p for _, ps in items for p in ps]
    try:
        scores = _call(fn, name, _joined([samples for samples, _ in items]), prompts)
    except Exception as err:
        if len(items) > 1:  # one task's input must not fail the tasks batched with it
            return [_score_batch(fn, name, [item])[0] for item in items]
        return [(None, _describe(err), time.perf_counter() - start)]
    seconds = time.perf_counter() - start
    out: list[_Outcome] = []
    offset = 0
    for array, _ in items:
        part = {key: values[offset : offset + len(array)] for key, values in scores.items()}
        out.append((part, None, seconds))
        offset += len(array)
    return out


def _worker_main(
    rewards: list[RewardArgs], inbox: Any, results: Connection, parent_pid: int
) -> None:
    """A scoring process: import the rewards (and load a model-based reward's model), then
    score the batches of `inbox` until None."""
    # Ctrl-C reaches the whole process group; the service stops its workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)  # several processes on few cores slow each other down otherwise
    fns = {args.reward_type: build_reward(args) for args in rewards}
    results.send(("ready", os.getpid()))
    while True:
        try:
            message = inbox.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent_pid:  # the service died without stopping us
                return
            continue
        if message is None:
            return
        batch_id, name, items = message
        results.send(("done", batch_id, _score_batch(fns[name], name, items)))


# The service


@dataclass(eq=False)
class _Task:
    """One enqueued batch; one job per reward it asked for."""

    uuid: str
    prompts: list[str]
    pixels: Samples | None
    input_info: dict[str, Any]
    jobs: dict[str, _Job] = field(default_factory=dict)
    remaining: int = 0


@dataclass(eq=False)
class _Job:
    """One reward of one task: what a worker scores."""

    task: _Task
    reward: str
    attempts: int = 0
    running: bool = False
    done: bool = False
    scores: dict[str, list[float]] | None = None
    """Each sample's score by name (the reward's own, or the keys of a reward's mapping)."""
    error: str | None = None
    seconds: float = 0.0

    @property
    def size(self) -> int:
        """Samples in the job."""
        return len(self.task.prompts)

    @property
    def key(self) -> tuple[Any, ...]:
        """What jobs must share to be scored in one call: the reward and [C, T, H, W] (text:
        the reward)."""
        pixels = self.task.pixels
        assert pixels is not None
        return (
            (self.reward,) if isinstance(pixels, TextSamples) else (self.reward, *pixels.shape[1:])
        )


@dataclass(eq=False)
class _Slot:
    """A place in the worker pool and the process that fills it now."""

    index: int
    process: Any = None
    inbox: Any = None
    results: Connection | None = None
    pid: int | None = None
    ready: bool = False
    batch: list[_Job] | None = None
    batch_id: int = -1
    failures: int = 0
    retired: bool = False


class RewardService:
    """The queue, the worker processes that score it, and the results; no HTTP (see
    :func:`create_app`). Thread-safe; `start` before use, `stop` after."""

    def __init__(self, cfg: RewardServiceConfig) -> None:
        self.cfg = cfg
        self.rewards = cfg.rewards
        self.text_rewards = cfg.text_rewards
        self._ctx = mp.get_context("spawn")
        self._lock = threading.Lock()
        self._queue: deque[_Job] = deque()
        self._tasks: dict[str, _Task] = {}
        self._expiry: deque[tuple[float, str]] = deque()
        self._unfinished = 0
        self._slots = [_Slot(i) for i in range(cfg.num_workers)]
        self._batch_ids = itertools.count()
        self._calls: Counter[str] = Counter()
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._dead_reason = ""

    # -- life cycle

    def start(self, timeout_s: float = 120.0) -> None:
        """Start the workers and the supervisor; return once every worker is ready."""
        with self._lock:
            for slot in self._slots:
                self._spawn(slot)
        self._supervisor = threading.Thread(
            target=self._supervise, name="reward-supervisor", daemon=True
        )
        self._supervisor.start()
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if all(s.retired for s in self._slots):
                    reason = self._dead_reason
                    break
                if all(s.ready or s.retired for s in self._slots):
                    return
            if time.monotonic() > deadline:
                reason = f"workers not ready within {timeout_s:.0f} s"
                break
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"the reward service could not start: {reason}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the supervisor and the workers (asked first, then terminated)."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout_s)
        with self._lock:
            slots = [s for s in self._slots if s.process is not None]
            for slot in slots:
                if slot.batch is not None:  # nobody will pull what it is scoring
                    slot.process.terminate()
                elif slot.process.is_alive():
                    slot.inbox.put(None)
        deadline = time.monotonic() + timeout_s
        for slot in slots:
            slot.process.join(max(0.0, deadline - time.monotonic()))
            if slot.process.is_alive():
                log.warning(
                    "reward worker %d (pid %s) did not stop; killing it", slot.index, slot.pid
                )
                slot.process.kill()
                slot.process.join(5.0)
        with self._lock:
            for slot in slots:
                self._close(slot)
                slot.process = None

    # -- requests

    def submit(self, request: EnqueueRequest) -> str:
        """Queue `request`; its uuid. Raises :class:`RequestError` 429 when `max_pending` tasks
        are waiting or running, 503 when no worker is alive."""
        with self._lock:
            if self._stopping.is_set():
                raise RequestError(503, "the reward service is stopping")
            if all(s.retired for s in self._slots):
                raise RequestError(503, f"no scoring worker is alive: {self._dead_reason}")
            if self._unfinished >= self.cfg.max_pending:
                raise RequestError(
                    429,
                    f"{self._unfinished} tasks are waiting or being scored (max_pending = "
                    f"{self.cfg.max_pending}); retry later",
                    {"Retry-After": "1"},
                )
            task = _Task(str(uuidlib.uuid4()), request.prompts, request.pixels, request.input_info)
            for name in request.rewards:
                task.jobs[name] = _Job(task, name)
            task.remaining = len(task.jobs)
            self._tasks[task.uuid] = task
            self._unfinished += 1
            self._queue.extend(task.jobs.values())
            self._dispatch()
        log.debug("queued %s: %d samples for %s", task.uuid, len(task.prompts), request.rewards)
        return task.uuid

    def result(self, uuid: str, reward: str | None) -> dict[str, Any]:
        """The pull answer for `reward` of task `uuid`; raises :class:`RequestError`: 400 "Not
        found scores" while not ready (or unknown, or expired), 422 when scoring failed."""
        with self._lock:
            task = self._tasks.get(uuid)
            if task is None:
                raise RequestError(400, f"Not found scores for {uuid}")
            if reward is None:
                if len(task.jobs) != 1:
                    raise bad_request(f"give the form field `type`: one of {', '.join(task.jobs)}")
                reward = next(iter(task.jobs))
            job = task.jobs.get(reward)
            if job is None:
                raise bad_request(
                    f"reward {reward!r} was not asked for task {uuid}; it asked for "
                    f"{', '.join(task.jobs)}"
                )
            if not job.done:
                raise RequestError(400, f"Not found scores for {uuid}")
            if job.error is not None:
                raise bad_request(f"scoring failed: {job.error}")
            return {
                "scores": job.scores,
                "input_info": task.input_info,
                "duration": job.seconds,
                "type": reward,
            }

    def stats(self) -> dict[str, Any]:
        """Load and workers, for the ping endpoint and tests."""
        with self._lock:
            live = [s for s in self._slots if s.process is not None and s.ready]
            return {
                "pending": self._unfinished,
                "queued": len(self._queue),
                "running": sum(len(s.batch or ()) for s in self._slots),
                "workers": sum(1 for s in live if s.process.is_alive()),
                "worker_pids": [s.pid for s in live],
                "calls": dict(self._calls),
                "rewards": list(self.rewards),
            }

    # -- inside (callers hold self._lock)

    def _spawn(self, slot: _Slot) -> None:
        reader, writer = self._ctx.Pipe(duplex=False)
        slot.inbox = self._ctx.Queue()
        slot.process = self._ctx.Process(
            target=_worker_main,
            args=(
                [a for a in self.cfg.reward_args if a.enable],
                slot.inbox,
                writer,
                os.getpid(),
            ),
            name=f"reward-worker-{slot.index}",
            daemon=True,
        )
        slot.process.start()
        # The worker holds the only write end, so its death reads as EOF here.
        writer.close()
        slot.results, slot.pid, slot.ready, slot.batch = reader, slot.process.pid, False, None

    def _close(self, slot: _Slot) -> None:
        if slot.results is not None:
            slot.results.close()
            slot.results = None
        if slot.inbox is not None:
            # (a message a dead worker never read must not keep this process from exiting)
            slot.inbox.cancel_join_thread()
            slot.inbox.close()
            slot.inbox = None

    def _supervise(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                waitables: list[Any] = [s.results for s in self._slots if s.results is not None]
                waitables += [s.process.sentinel for s in self._slots if s.process is not None]
            if waitables:
                wait_ready(waitables, timeout=0.05)
            else:
                time.sleep(0.05)
            with self._lock:
                if self._stopping.is_set():
                    return
                try:
                    self._collect()
                    self._reap()
                    self._dispatch()
                    self._expire()
                except Exception:  # a bug here must not leave every task waiting forever
                    log.exception("reward service supervisor error")

    def _collect(self) -> None:
        """Take the workers' messages (readiness, finished batches)."""
        for slot in self._slots:
            while slot.results is not None and slot.results.poll():
                try:
                    message = slot.results.recv()
                except (EOFError, OSError):  # the worker is gone; `_reap` handles it
                    slot.results.close()
                    slot.results = None
                    break
                if message[0] == "ready":
                    slot.ready, slot.failures = True, 0
                    log.debug("reward worker %d ready (pid %s)", slot.index, message[1])
                elif (
                    message[0] == "done" and slot.batch is not None and message[1] == slot.batch_id
                ):
                    for job, (scores, error, seconds) in zip(slot.batch, message[2], strict=True):
                        self._finish(job, scores, error, seconds)
                    slot.batch = None

    def _reap(self) -> None:
        """Replace dead workers; the tasks they held go back to the front of the queue."""
        for slot in self._slots:
            if slot.process is None or slot.retired or slot.process.is_alive():
                continue
            why = _exit_reason(slot.process.exitcode)
            batch, slot.batch = slot.batch or [], None
            retry = []
            for job in batch:
                job.running = False
                if job.attempts >= self.cfg.max_attempts:
                    self._finish(
                        job,
                        None,
                        f"worker died ({why}) while scoring it; gave up after {job.attempts} "
                        f"attempts (max_attempts = {self.cfg.max_attempts})",
                        0.0,
                    )
                else:
                    retry.append(job)
            self._queue.extendleft(reversed(retry))
            held = ", ".join(f"{j.task.uuid}/{j.reward}" for j in batch) or "nothing"
            log.warning(
                "reward worker %d (pid %s) died (%s) holding %s; %d task(s) requeued",
                slot.index,
                slot.pid,
                why,
                held,
                len(retry),
            )
            slot.failures = slot.failures + 1 if not slot.ready else 0
            self._close(slot)
            slot.process = None
            if slot.failures >= MAX_START_FAILURES:
                slot.retired = True
                self._dead_reason = (
                    f"worker {slot.index} died {slot.failures} times before it was ready (last: "
                    f"{why}); see its output above"
                )
                log.error("reward worker %d given up: %s", slot.index, self._dead_reason)
                continue
            self._spawn(slot)
        if all(s.retired for s in self._slots):
            while self._queue:
                job = self._queue.popleft()
                self._finish(job, None, f"no scoring worker is alive: {self._dead_reason}", 0.0)

    def _dispatch(self) -> None:
        """Give each idle worker a batch: the oldest job and queued jobs of its reward and sample
        shape, up to `max_batch_samples` samples."""
        for slot in self._slots:
            if not self._queue:
                return
            if not slot.ready or slot.batch is not None or slot.inbox is None:
                continue
            first = self._queue.popleft()
            batch, size, keep = [first], first.size, deque[_Job]()
            for job in self._queue:
                if job.key == first.key and size + job.size <= self.cfg.max_batch_samples:
                    batch.append(job)
                    size += job.size
                else:
                    keep.append(job)
            self._queue = keep
            for job in batch:
                job.attempts += 1
                job.running = True
            slot.batch, slot.batch_id = batch, next(self._batch_ids)
            self._calls[first.reward] += 1
            items = [(job.task.pixels, job.task.prompts) for job in batch]
            slot.inbox.put((slot.batch_id, first.reward, items))

    def _finish(
        self,
        job: _Job,
        scores: dict[str, list[float]] | None,
        error: str | None,
        seconds: float,
    ) -> None:
        job.scores, job.error, job.seconds = scores, error, seconds
        job.running, job.done = False, True
        task = job.task
        if error is not None:
            log.warning("scoring %s of %s failed: %s", job.reward, task.uuid, error)
        task.remaining -= 1
        if task.remaining == 0:
            task.pixels = None  # the scores stay for result_ttl_s; the pixels need not
            self._unfinished -= 1
            self._expiry.append((time.monotonic() + self.cfg.result_ttl_s, task.uuid))

    def _expire(self) -> None:
        now = time.monotonic()
        while self._expiry and self._expiry[0][0] <= now:
            self._tasks.pop(self._expiry.popleft()[1], None)


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
