"""Rich tables of what the controller's API answers, for `nebula-rl status` and `nebula-rl replica
ls / show`. Pure functions of the JSON, so they print the same whatever asked for it."""

from __future__ import annotations

from typing import Any

from rich.table import Table

__all__ = ["replica_table", "replicas_table", "status_tables"]


def _ago(seconds: float) -> str:
    """`4.2 s ago`, `3 min ago`, `2.1 h ago`."""
    if seconds < 90:
        return f"{seconds:.1f} s ago"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _version(version: int) -> str:
    return "none yet" if version < 0 else str(version)


def status_tables(status: dict[str, Any]) -> list[Table]:
    """`/api/status`, with `total_steps` from `/api/meta` and `replicas` from `/api/replicas`:
    the job, its ledger per epoch, its replicas."""
    job = Table(title=f"job {status['job']}", show_header=False)
    job.add_column("key", style="bold")
    job.add_column("value")
    total = status.get("total_steps")
    job.add_row("step", f"{status['step']} / {total}" if total else str(status["step"]))
    job.add_row("policy version", str(status["policy_version"]))
    job.add_row("groups buffered", str(status["buffer_size"]))
    job.add_row("state", status["finished"] or "running")
    job.add_row("replicas", str(len(status["replicas"])))
    tables = [job]
    if status["ledger"]:  # one column per epoch, one row per count (they are many)
        epochs = sorted(status["ledger"].items(), key=lambda kv: int(kv[0]))
        ledger = Table(title="prompt ledger")
        ledger.add_column("prompts")
        for epoch, _ in epochs:
            ledger.add_column(f"epoch {epoch}", justify="right")
        for key in epochs[0][1]:
            counts = (str(summary.get(key, "")) for _, summary in epochs)
            ledger.add_row(key.replace("_", " "), *counts)
        tables.append(ledger)
    tables.append(replicas_table(status["replicas"]))
    return tables


def replicas_table(replicas: list[dict[str, Any]]) -> Table:
    """One row per replica of `/api/replicas`."""
    table = Table(title=f"replicas ({len(replicas)})")
    for column in ("name", "role", "host", "procs", "version", "heartbeat", "tokens/s"):
        table.add_column(column, justify="right" if column in ("procs", "version") else "left")
    for r in replicas:
        tokens_per_s = r["stats"].get("tokens_per_s")
        table.add_row(
            r["name"],
            r["role"],
            r["host"],
            str(r["world_size"]),
            _version(r["policy_version"]),
            _ago(r["heartbeat_age_s"]),
            "" if tokens_per_s is None else f"{tokens_per_s:.0f}",
        )
    return table


def replica_table(replica: dict[str, Any]) -> Table:
    """One replica's entry (`/api/replicas/{name}`), its heartbeat stats included."""
    table = Table(title=f"replica {replica['name']}", show_header=False)
    table.add_column("key", style="bold")
    table.add_column("value")
    table.add_row("role", replica["role"])
    table.add_row("replica id", str(replica["replica_id"]))
    table.add_row("host", replica["host"])
    table.add_row("processes", str(replica["world_size"]))
    table.add_row("policy version", _version(replica["policy_version"]))
    if "ready" in replica:  # whether it has loaded its model and may join the groups
        table.add_row("ready", "yes" if replica["ready"] else "no (loading)")
    table.add_row("registered", _ago(replica["age_s"]))
    table.add_row("last heartbeat", _ago(replica["heartbeat_age_s"]))
    for key, value in sorted(replica["stats"].items()):
        table.add_row(f"stats.{key}", f"{value:g}")
    return table
