"""Single-threaded CPU workers for work split by sample.

Many small ATen calls (one per image, or per slice of a batch) each open an OpenMP parallel region with a
barrier when run with several intra-op threads; when other processes take a core, every barrier waits for a
descheduled thread, and the time per image grew tenfold in our measurements.  Workers with one thread each,
like a DataLoader's worker processes, keep going instead.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}
_in_worker = threading.local()


def _start_worker() -> None:
    _in_worker.active = True
    torch.set_num_threads(1)


def split_threads(items: int) -> int:
    """How many pool workers to split ``items`` across: torch's intra-op thread count (at most ``items``),
    and 1 on a pool worker itself. A worker that mapped onto its own pool would wait for tasks queued
    behind itself and its siblings: with every worker doing so, the pool deadlocks (a pipeline's rows run
    on the workers, reaching a per-image resize that split its images across the same pool, once did)."""
    if getattr(_in_worker, "active", False):
        return 1
    return max(1, min(torch.get_num_threads(), items))


def cpu_pool(threads: int) -> ThreadPoolExecutor:
    """A shared pool of ``threads`` workers, each with one intra-op thread. OpenMP's setting is per thread:
    the caller's own count stays as it was (a new thread starts from the main thread's)."""
    key = (
        os.getpid(),
        threads,
    )  # a forked child (DataLoader worker) must not reuse the parent's dead threads
    if key not in _POOLS:
        _POOLS[key] = ThreadPoolExecutor(threads, "vision-data", initializer=_start_worker)
    return _POOLS[key]
