"""Keep every core busy for a bounded time: the load under which `make test` must still pass (issue 31).

    python benchmarks/cpu_hog.py --seconds 1200 &   # then, beside it: make test

One process per core spins on integer arithmetic until the deadline, then exits; nothing is written."""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time


def spin(deadline: float) -> None:
    x = 0
    while time.monotonic() < deadline:
        for _ in range(100_000):
            x = (x * 1_103_515_245 + 12_345) & 0xFFFFFFFF


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=900.0, help="how long to load the cores")
    parser.add_argument(
        "--workers", type=int, default=os.cpu_count() or 1, help="processes (default: one a core)"
    )
    args = parser.parse_args()
    deadline = time.monotonic() + args.seconds
    procs = [multiprocessing.Process(target=spin, args=(deadline,)) for _ in range(args.workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()


if __name__ == "__main__":
    main()
