"""Single-threaded CPU workers for work split by sample.

Many small ATen calls (one per image, or per slice of a batch) each open an OpenMP parallel region with a
barrier when run with several intra-op threads; when other processes take a core, every barrier waits for a
descheduled thread, and the time per image grew tenfold in our measurements.  Workers with one thread each,
like a DataLoader's worker processes, keep going instead.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}


def cpu_pool(threads: int) -> ThreadPoolExecutor:
    """A shared pool of ``threads`` workers, each with one intra-op thread (OpenMP's setting is per
    thread)."""
    key = (
        os.getpid(),
        threads,
    )  # a forked child (DataLoader worker) must not reuse the parent's dead threads
    if key not in _POOLS:
        _POOLS[key] = ThreadPoolExecutor(
            threads, "vision-data", initializer=torch.set_num_threads, initargs=(1,)
        )
    return _POOLS[key]
