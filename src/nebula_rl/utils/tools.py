"""Tools a model calls from its output: the Hermes `<tool_call>` parser, the built-in tools, and
the sandbox every tool call runs in.

- Parser. Qwen2.5's chat template (and Hermes 2 Pro's, whose format it took) asks the model to
  write each call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
  :func:`parse_tool_calls` finds them, and names each malformed one instead of dropping it.
- Tools are plain Python functions named `"module:function"` (or a built-in name of
  :data:`TOOLS`), with type hints and a Google-style docstring, from which transformers'
  `get_json_schema` builds the schema the chat template shows the model.
- Sandbox. :func:`run_tool` runs one call in a fresh Python process (`python -m
  nebula_rl.utils.tools`) that first limits itself (CPU seconds and address space by `setrlimit`),
  leaves the network (a new network namespace, where the kernel lets an unprivileged process
  make one, and in every case `socket.socket` refuses), then imports the tool and calls it. A
  call past its wall-clock timeout is killed with its process group. Whatever goes wrong (an
  exception, a limit, a hang, output that is not JSON) comes back as a failed :class:`ToolResult`
  whose text the model sees; nothing of it reaches the rollout process. The socket refusal is a
  Python-level guard: a C extension could open a socket anyway where no namespace was made.

This module imports neither torch nor transformers at import time: the sandbox child imports it.
"""

from __future__ import annotations

import ast
import ctypes
import importlib
import json
import operator
import os
import re
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "TOOLS",
    "ToolCall",
    "ToolLimits",
    "ToolResult",
    "calculator",
    "load_tool",
    "parse_tool_calls",
    "run_tool",
    "tool_schema",
]

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model wrote: the tool's name and its arguments; `error` when the call could
    not be read (bad JSON, no name), then name and arguments are empty."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The Hermes-style calls in `text`, in order: each `<tool_call>...</tool_call>` holding a
    JSON object with a string `name` and an object `arguments` (a JSON string of one is read
    too, as some models write it)."""
    calls = []
    for body in _TOOL_CALL.findall(text):
        try:
            data = json.loads(body)
        except json.JSONDecodeError as err:
            calls.append(ToolCall("", {}, f"the tool call is not valid JSON: {err}"))
            continue
        arguments = data.get("arguments", {}) if isinstance(data, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        name = data.get("name") if isinstance(data, dict) else None
        if not isinstance(name, str) or not isinstance(arguments, dict):
            calls.append(
                ToolCall("", {}, 'a tool call needs {"name": "<tool>", "arguments": {...}}')
            )
            continue
        calls.append(ToolCall(name, arguments))
    return calls


# -- built-in tools ---------------------------------------------------------------------------

_OPERATORS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _evaluate(node: ast.AST) -> float | int:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    ):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"unsupported expression: {ast.dump(node)[:60]}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers, + - * / // % ** and parentheses.

    Args:
        expression: The expression, e.g. "(12 + 30) * 4 / 7".
    """
    value = _evaluate(ast.parse(expression.replace(",", ""), mode="eval"))
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 6) if isinstance(value, float) else value)


TOOLS: dict[str, str] = {"calculator": "nebula_rl.utils.tools:calculator"}
"""Built-in tools by name -> `"module:function"`."""


def load_tool(spec: str) -> Callable[..., Any]:
    """The function a tool spec names: a key of :data:`TOOLS` or `"module:function"`."""
    target = TOOLS.get(spec, spec)
    module_name, _, name = target.partition(":")
    if not module_name or not name:
        raise ValueError(
            f"tool {spec!r}: name a built-in tool ({sorted(TOOLS)}) or 'module:function'"
        )
    function = getattr(importlib.import_module(module_name), name, None)
    if not callable(function):
        raise ValueError(f"tool {spec!r}: {module_name} has no function {name!r}")
    return function  # type: ignore[no-any-return]


def tool_schema(spec: str) -> dict[str, Any]:
    """The JSON schema of a tool, as chat templates take it (`{"type": "function", ...}`)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(load_tool(spec))
    except Exception as err:  # (transformers' own exceptions for unusable docstrings or hints)
        raise ValueError(
            f"tool {spec!r}: no JSON schema can be made of it ({err}); give it type hints and a "
            "Google-style docstring with an Args section"
        ) from err


# -- the sandbox -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ToolLimits:
    """What one tool call may use."""

    timeout_s: float = 10.0
    """Wall-clock seconds before the call is killed."""
    cpu_s: int = 5
    """CPU seconds (RLIMIT_CPU)."""
    memory_mb: int = 512
    """Address space in MiB (RLIMIT_AS)."""
    max_output_chars: int = 2000
    """The result's text is cut to this many characters."""


@dataclass(frozen=True, slots=True)
class ToolResult:
    """What a call gave: its output, or the error the model is shown."""

    ok: bool
    text: str


_PASSED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")
"""Environment variables a tool's process gets (besides its PYTHONPATH)."""


def run_tool(spec: str, arguments: dict[str, Any], limits: ToolLimits) -> ToolResult:
    """Call tool `spec` with `arguments` in a sandboxed child process (see the module
    docstring); never raises for what the tool does."""
    request = json.dumps({"spec": spec, "arguments": arguments, "limits": _limits_json(limits)})
    # Only what Python needs: the job's token, Redis URL and any other secret of the
    # environment stay out of reach of a tool (and of the text it returns to the model).
    env = {k: os.environ[k] for k in _PASSED_ENV if k in os.environ}
    env |= {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "nebula_rl.utils.tools"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,  # (its own process group: a timeout kills what it started too)
        text=True,
    )
    try:
        out, err = process.communicate(request, timeout=limits.timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return ToolResult(False, f"error: the tool timed out after {limits.timeout_s:g} s")
    if process.returncode < 0:
        name = signal.Signals(-process.returncode).name
        why = " (CPU time limit)" if name in ("SIGXCPU", "SIGKILL") else ""
        return ToolResult(False, f"error: the tool was killed by {name}{why}")
    try:
        result = json.loads(out.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return ToolResult(False, f"error: the tool failed: {err.strip()[-300:]}")
    text = str(result["text"])[: limits.max_output_chars]
    return ToolResult(bool(result["ok"]), text)


def _limits_json(limits: ToolLimits) -> dict[str, Any]:
    return {"cpu_s": limits.cpu_s, "memory_mb": limits.memory_mb}


_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000


def _leave_network() -> None:
    """A new network namespace (only a down loopback) where permitted; sockets refused always."""
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) == 0:
        for path, line in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", None)):
            try:
                with open(path, "w") as f:
                    f.write(line or f"{uid} {uid} 1")
            except OSError:
                pass
        try:
            with open("/proc/self/gid_map", "w") as f:
                f.write(f"{gid} {gid} 1")
        except OSError:
            pass
    import socket

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError("network access is not allowed in a tool")

    socket.socket = refused  # type: ignore[assignment,misc]
    socket.create_connection = refused
    socket.socketpair = refused


def _child() -> None:
    """The sandbox process: limit, leave the network, call the tool, print a JSON result."""
    request = json.loads(sys.stdin.read())
    cpu, memory = request["limits"]["cpu_s"], request["limits"]["memory_mb"] << 20
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    _leave_network()
    try:
        result = ToolResult(True, str(load_tool(request["spec"])(**request["arguments"])))
    except MemoryError:
        result = ToolResult(False, "error: the tool ran out of memory")
    except Exception as err:  # the tool's own failure is the model's observation
        result = ToolResult(False, f"error: {type(err).__name__}: {err}")
    print(json.dumps({"ok": result.ok, "text": result.text}))


if __name__ == "__main__":
    _child()
