"""Shared benchmark helpers: medians, machine facts, and writing results to benchmarks/results/."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
from typing import Any

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip() or None
    except OSError:
        return None


#: The commit when the benchmark process started: a long run must not be credited to a later commit.
_COMMIT_AT_START = _git_commit()
_STARTED = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: device, versions, the commit the run started from, dates."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - triton is a Linux dependency
        triton_version = None
    commit = _COMMIT_AT_START
    return {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.processor() or platform.machine()})",
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "commit": commit,
        "started": _STARTED,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def median(values: list[float]) -> float:
    if not values:
        raise ValueError("no timings to take the median of")
    return statistics.median(values)


def write_results(name: str, payload: dict[str, Any]) -> str:
    """Write ``payload`` plus machine facts to ``benchmarks/results/<name>.json``; return the path."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"machine": machine_info(), **payload}, f, indent=2)
    return path


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    """A plain fixed-width table, last thing a benchmark prints."""
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    print("  ".join("-" * widths[c] for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)
