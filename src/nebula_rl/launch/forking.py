"""Starting a `python -m nebula_rl.cli ...` command in a fork of this process instead of a new
interpreter.

A replica's process spends ~5 s of CPU importing torch and transformers before it does anything
(measured on 2 cores: of a tiny job's ~8 s per replica). The launcher has imported both by the
time it starts the replicas (its checks load the model's config and tokenizer), so a forked child
starts with them loaded: what a zygote or a `forkserver` gives, without a server in between.

Forking is taken only where it is safe, else the command is executed as before:
- CPU builds of torch only: a CUDA or ROCm runtime initialised before `fork` is unusable in the
  child, and the launcher's device count may initialise it;
- this process runs one thread (`/proc/self/task`): another thread's locks would stay held in
  the child, and OpenMP's pool, once started, does not survive a fork;
- the child's OpenMP settings (`OMP_*` but the thread count, `GOMP_*`, `KMP_*`) equal this
  process's: the OpenMP runtime read them when torch was loaded. The thread count is the
  child's own (`torch.set_num_threads` from its `OMP_NUM_THREADS`);
- `NEBULA_FORK=0` in the environment turns it off.

The child gets what a new process would: its own session or a parent-death signal, standard
input from /dev/null, standard output and error where asked, the given environment, default
signal handlers and logging, no exit handlers of the parent's, a fresh numpy seed. Its command
line in `/proc` stays the launcher's; its name (`/proc/<pid>/comm`, `ps -o comm`) says what it
is: the replica's name (`policy-0`), or with the rank for one rank of several (`policy-0:1`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence

__all__ = ["ForkedProcess", "die_with_parent", "fork_command", "why_not_fork"]

FORK_ENV = "NEBULA_FORK"
"""`0` executes every command in a new interpreter."""

_OPENMP_PREFIXES = ("OMP_", "GOMP_", "KMP_")


def why_not_fork(env: dict[str, str]) -> str | None:
    """Why a command with environment `env` cannot be forked from this process; None when it
    can."""
    if os.environ.get(FORK_ENV, "1") == "0" or env.get(FORK_ENV, "1") == "0":
        return f"{FORK_ENV}=0"
    if sys.platform != "linux":
        return "not Linux"
    torch = sys.modules.get("torch")
    if torch is None:
        return "torch is not loaded here (nothing to gain)"
    if torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None:
        return "a GPU build of torch"
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        return f"{threads} threads run here"
    openmp = {k for k in {*os.environ, *env} if k.startswith(_OPENMP_PREFIXES)}
    for key in sorted(openmp - {"OMP_NUM_THREADS"}):
        if os.environ.get(key) != env.get(key):
            return f"{key} differs from this process's"
    return None


class ForkedProcess:
    """A forked child, with the part of `subprocess.Popen`'s interface the launcher uses."""

    def __init__(self, pid: int, args: Sequence[str]) -> None:
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.02)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_command(
    argv: list[str],
    *,
    env: dict[str, str],
    name: str,
    output: int | None = None,
    new_session: bool = False,
    die_with_parent: bool = False,
) -> ForkedProcess:
    """Run `argv`, a `[python, "-m", module, *args]` command, in a forked child (check
    :func:`why_not_fork` first) as `python -m` would: the module runs as `__main__` with
    `sys.argv` set. Its standard output and error go to the file descriptor `output` (else this
    process's); its own session with `new_session`; SIGKILL when this process dies with
    `die_with_parent`; `name` is its process name."""
    if argv[1:2] != ["-m"] or len(argv) < 3:
        raise ValueError(f"fork_command runs `python -m module ...` commands, not {argv}")
    module, args = argv[2], argv[3:]
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return ForkedProcess(pid, argv)
    code = 1
    try:
        _become_new_process(env, name, output, new_session, die_with_parent)
        sys.argv = [module, *args]
        sys.modules.pop(module, None)  # (loaded here as a module: it runs anew as __main__)
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        # The exit handlers the command registered (not the parent's), then leave without the
        # interpreter's teardown of the parent's objects.
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        with contextlib.suppress(BaseException):
            logging.shutdown()
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def die_with_parent() -> None:
    """Be killed when the process that started this one dies (Linux; a rank, before exec or
    after fork), so a killed `run_ranks` leaves no rank behind."""
    PR_SET_PDEATHSIG = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _become_new_process(
    env: dict[str, str], name: str, output: int | None, new_session: bool, orphan_dies: bool
) -> None:
    if new_session:
        os.setsid()
    if orphan_dies:
        die_with_parent()
    PR_SET_NAME = 15
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    if output is not None:
        os.dup2(output, 1)
        os.dup2(output, 2)
    os.environ.clear()
    os.environ.update(env)
    if env.get("PYTHONUNBUFFERED"):  # (read by a new interpreter at its start)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(AttributeError, ValueError):
                stream.reconfigure(line_buffering=True, write_through=True)  # type: ignore[union-attr]
    atexit._clear()
    # (the parent's console handler and run log; the command sets up its own)
    logging.root.handlers.clear()
    logging.getLogger("nebula_rl.traceback").handlers.clear()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
