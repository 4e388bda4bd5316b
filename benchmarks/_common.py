"""Shared benchmark helpers: medians, machine facts, results written as they are measured, the deadline.

A benchmark run by ``gpu_check.py`` lives under a deadline (``LCV_DEADLINE``, a Unix time) and appends each
measured case, as soon as it is measured, to a JSON-lines stream (``LCV_RESULTS_JSONL``): a step killed at
its time limit has still handed over everything it measured. The full JSON at the end of a benchmark goes to
``benchmarks/results/`` (or ``LCV_RESULTS_DIR``).
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import time
from typing import Any

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
#: The real CIFAR-10 JPEGs beside the repository (``../shared/data``), the default data of the CPU benchmarks.
SHARED_ZIP = os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data", "cifar10-jpeg.zip")
)
#: Environment variables set by gpu_check.py for the benchmarks it runs.
DEADLINE_ENV = "LCV_DEADLINE"
STREAM_ENV = "LCV_RESULTS_JSONL"
RESULTS_DIR_ENV = "LCV_RESULTS_DIR"
#: The commit, for copies of the repository without ``.git`` (the lent GPU machine gets a bare working tree).
COMMIT_ENV = "LCV_COMMIT"


def _git_commit() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False, cwd=here
        ).stdout.strip()
        if not head:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=False,
            cwd=here,
        ).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except OSError:
        return None


#: The commit when the benchmark process started: a long run must not be credited to a later commit.
#: ``LCV_COMMIT`` wins when set: a copied tree can carry a stale ``.git`` (a lent GPU machine's copy did,
#: naming the session's first commit with "-dirty").
_COMMIT_AT_START = os.environ.get(COMMIT_ENV) or _git_commit() or None
_STARTED = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


@functools.lru_cache(maxsize=1)
def _gpu_facts() -> dict[str, Any]:
    """GPU name, driver, CUDA and cuDNN versions (all None without a CUDA device)."""
    if not torch.cuda.is_available():
        return {"gpu": None, "driver": None, "cuda": torch.version.cuda, "cudnn": None}
    driver = None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
            timeout=20,
        ).stdout.strip()
        driver = out.splitlines()[0] if out else None
    except (OSError, subprocess.TimeoutExpired):
        pass
    return {
        "gpu": torch.cuda.get_device_name(0),
        "driver": driver,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
    }


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: device, versions, the commit the run started from, dates."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - triton is a Linux dependency
        triton_version = None
    gpu = _gpu_facts()
    return {
        "device": gpu["gpu"] or f"CPU ({platform.processor() or platform.machine()})",
        **gpu,
        **_cpu_facts(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "commit": _COMMIT_AT_START,
        "started": _STARTED,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def _cpu_facts() -> dict[str, Any]:
    """The CPU's name and the instruction set its kernels use (oneDNN's int8 and bf16 speed hang on AMX/VNNI),
    so a CPU result says which kind of machine made it."""
    from lcv_kernels.hardware import amx_supported, cpu_capability, cpu_name

    return {"cpu": cpu_name(), "cpu_capability": cpu_capability(), "amx": amx_supported()}


def median(values: list[float]) -> float:
    if not values:
        raise ValueError("no timings to take the median of")
    return statistics.median(values)


def seconds_left() -> float:
    """Seconds until the run's deadline (``LCV_DEADLINE``); infinite when no deadline was set."""
    deadline = os.environ.get(DEADLINE_ENV)
    return math.inf if not deadline else float(deadline) - time.time()


def out_of_time(needed_s: float = 0.0) -> bool:
    """True when fewer than ``needed_s`` seconds are left before the deadline: do not start the next case."""
    return seconds_left() < needed_s


class ResultStream:
    """Appends one JSON line per measured case to ``LCV_RESULTS_JSONL`` the moment it is measured.

    The first line a stream writes holds the machine facts, so every file carries its versions. Without the
    environment variable (a benchmark run by hand) rows are only collected for the final JSON.
    """

    def __init__(self, bench: str) -> None:
        self.bench = bench
        self.rows: list[dict[str, Any]] = []
        self._path = os.environ.get(STREAM_ENV) or None
        self._write({"bench": bench, "record": "machine", **machine_info()})

    def add(self, row: dict[str, Any]) -> dict[str, Any]:
        self.rows.append(row)
        self._write({"bench": self.bench, "record": "case", **row})
        return row

    def skip(self, case: str, reason: str) -> None:
        """Say what was not measured, and why (a missing package, the deadline)."""
        print(f"{self.bench}: skipped {case}: {reason}", flush=True)
        self._write({"bench": self.bench, "record": "skipped", "case": case, "reason": reason})

    def _write(self, record: dict[str, Any]) -> None:
        if self._path is None:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self._path)), exist_ok=True)
        with open(self._path, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())


def results_dir() -> str:
    return os.environ.get(RESULTS_DIR_ENV) or RESULTS_DIR


def write_results(name: str, payload: dict[str, Any]) -> str:
    """Write ``payload`` plus machine facts to ``<results dir>/<name>.json``; return the path."""
    directory = results_dir()
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"machine": machine_info(), **payload}, f, indent=2, default=str)
    return path


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    """A plain fixed-width table, last thing a benchmark prints."""
    if not rows:
        print("(no rows)")
        return
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    print("  ".join("-" * widths[c] for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def time_ms(fn: Any, warmup: int, repeats: int) -> float:
    """Median milliseconds of one ``fn()`` after ``warmup`` calls (CUDA events on a GPU, else
    perf_counter)."""
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return median(samples)
