"""A pool of spawned processes that run test bodies as members of process groups.

Spawning (and importing torch) is paid once per test module; each scenario sends every member a
module-level function (so 'spawn' can import it by name) and its arguments, and collects what
each returns on a queue. Members leave with `os._exit`: gloo may abort in its destructors at
interpreter exit. A member that dies (a signal, a native abort) fails the scenario at once, naming
its exit code; its Python stacks at the crash are in the test's captured stderr (faulthandler).
"""

import faulthandler
import os
import queue
import time
import traceback
from collections.abc import Callable, Iterable

import pytest
import torch

from conftest import rank_context


def _member(rank, inbox, out):
    """A member process: run each (body, args) it is sent as body(rank, *args), report."""
    faulthandler.enable()
    torch.set_num_threads(1)
    while (task := inbox.get()) is not None:
        body, args = task
        try:
            out.put((rank, "ok", body(rank, *args)))
        except BaseException:
            out.put((rank, "error", traceback.format_exc()))
    out.close()
    out.join_thread()
    os._exit(0)


class MemberPool:
    """`num_procs` spawned member processes, numbered from 0."""

    def __init__(self, num_procs: int) -> None:
        ctx = rank_context()
        self.out = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(num_procs)]
        self.procs = [
            ctx.Process(target=_member, args=(rank, inbox, self.out), daemon=True)
            for rank, inbox in enumerate(self.inboxes)
        ]
        for p in self.procs:
            p.start()

    def run_on(
        self, members: Iterable[int], body: Callable, *args, timeout_s: float = 120.0
    ) -> dict:
        """body(member, *args) on each of `members`; member -> result. Fails the test with every
        member's error (the first to fail is often not the first to report), on a member's death,
        or on timeout."""
        members = list(members)
        for member in members:
            self.inboxes[member].put((body, args))
        reports, errors = {}, {}
        deadline = time.monotonic() + timeout_s
        while len(reports) + len(errors) < len(members) and time.monotonic() < deadline:
            try:
                member, status, payload = self.out.get(
                    timeout=min(max(deadline - time.monotonic(), 0.1), 1.0)
                )
            except queue.Empty:
                for member in members:
                    code = self.procs[member].exitcode
                    if code is not None and member not in reports and member not in errors:
                        errors[member] = f"the member process died (exit code {code})"
                continue
            (errors if status == "error" else reports)[member] = payload
        if errors:
            pytest.fail("\n".join(f"member {m} failed:\n{e}" for m, e in sorted(errors.items())))
        if len(reports) < len(members):
            pytest.fail(f"only members {sorted(reports)} reported within {timeout_s}s")
        return reports

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
