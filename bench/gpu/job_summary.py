"""The numbers of bench/gpu_session.sh's job stages, from the files it leaves in OUT: seconds per
step, rollout tokens/s, the weight push (from the rollout replica's log), the GPU's peak memory.

    python bench/gpu/job_summary.py OUT [JOB_LOGS_DIR [MEMORY_DIR]]
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "step_time" in r]


def _peak_mib(path: Path) -> str:
    if not path.exists():
        return "-"
    values = [int(v) for v in re.findall(r"\d+", path.read_text())]
    return f"{max(values) / 1024:.1f} GiB" if values else "-"


def _median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), int | float)]
    return statistics.median(values) if values else None


def _show(label: str, rows: list[dict], keys: list[str]) -> None:
    if not rows:
        print(f"{label}: no steps recorded")
        return
    later = rows[1:] or rows  # (the first step carries the warm-up)
    parts = [f"{len(rows)} steps"]
    for key in keys:
        value = _median(later, key)
        if value is not None:
            parts.append(f"{key} {value:.3f}")
    print(f"{label} (median of steps 2+): " + ", ".join(parts))


def main() -> None:
    out = Path(sys.argv[1])
    logs = Path(sys.argv[2]) if len(sys.argv) > 2 else None
    memory = Path(sys.argv[3]) if len(sys.argv) > 3 else out
    job = _records(out / "job_metrics.jsonl")
    _show(
        "job (policy + rollout replicas on one GPU)",
        job,
        [
            "step_time",
            "train_time",
            "wait_for_batch_time",
            "rollout_tokens_per_s",
            "gpu_memory_peak_gb",
        ],
    )
    if job:
        print(f"job rollout_tokens_per_s over the run: {job[-1]['rollout_tokens_per_s']:.0f}")
    print(
        f"job GPU memory in use, peak (nvidia-smi, both processes): {_peak_mib(memory / 'job_mem.csv')}"
    )
    if logs is not None and logs.exists():
        # (the console handler wraps long lines: join them back)
        text = " ".join(
            re.sub(r"\s*\n\s*", " ", f.read_text(errors="replace"))
            for f in sorted(logs.glob("rollout*.log"))
        )
        pushes = [
            (float(m.group(1)), float(m.group(2)), float(m.group(3)))
            for m in re.finditer(
                r"received in ([\d.]+) s \(([\d.]+) GB/s of the model's ([\d.]+) GB\)", text
            )
        ]
        peaks = [float(m.group(1)) for m in re.finditer(r"peak GPU memory ([\d.]+) GB", text)]
        if peaks:
            print(f"rollout process peak GPU memory (allocated): {max(peaks):.2f} GB")
        if pushes:
            seconds = [p[0] for p in pushes]
            rates = [p[1] for p in pushes]
            print(
                f"weight pushes: {len(pushes)}, receive time median {statistics.median(seconds):.3f} s "
                f"(min {min(seconds):.3f}), {statistics.median(rates):.2f} GB/s median "
                f"of {pushes[0][2]:.2f} GB"
            )
        else:
            print("weight pushes: none logged")
    local = _records(out / "local_metrics.jsonl")
    _show(
        "local (one process)",
        local,
        [
            "step_time",
            "generate_time",
            "train_time",
            "weight_update_time",
            "rollout_tokens_per_s",
            "gpu_memory_peak_gb",
        ],
    )
    print(f"local GPU memory in use, peak (nvidia-smi): {_peak_mib(memory / 'local_mem.csv')}")


if __name__ == "__main__":
    main()
