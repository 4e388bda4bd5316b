"""Single-threaded CPU workers for work split by sample.

Many small ATen calls (one per image, or per slice of a batch) each open an OpenMP parallel region with a
barrier when run with several intra-op threads; when other processes take a core, every barrier waits for a
descheduled thread, and the time per image grew tenfold in our measurements.  Workers with one thread each,
like a DataLoader's worker processes, keep going instead.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

Part = TypeVar("Part")

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


def run_parts(fn: Callable[[Part], None], parts: Sequence[Part], first_alone: bool = False) -> None:
    """Run ``fn`` on every part: on the shared single-threaded workers, or in order on this thread where
    :func:`split_threads` says so (one part, one intra-op thread, or already on a worker). The workers take
    this thread's grad and inference modes, which threads do not inherit (Lightning evaluates in inference
    mode, where the output is an inference tensor that only inference mode may write). ``first_alone`` runs
    the first part before the others start (it compiles a graph: once, on one worker)."""
    threads = split_threads(len(parts))
    if threads <= 1:
        for part in parts:
            fn(part)
        return
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    def in_callers_mode(part: Part) -> None:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            fn(part)

    pool, rest = cpu_pool(threads), list(parts)
    if first_alone:
        pool.submit(in_callers_mode, rest.pop(0)).result()
    list(pool.map(in_callers_mode, rest))


def run_rows(fn: Callable[[range], None], n: int) -> None:
    """Run ``fn`` on rows ``0..n-1``, dealt round-robin into one range per worker (see :func:`run_parts`):
    for per-image calls, where neighbouring images cost alike."""
    threads = split_threads(n)
    run_parts(fn, [range(k, n, threads) for k in range(threads)])
