"""Inductor's C++ wrapper against its Python wrapper, by graph size: where ``CPP_WRAPPER_MIN_OPS`` comes from.

The strategy's CPU tuning (``lightning_plugin/cpu/inductor.py``) writes the C++ wrapper only for graphs of
``CPP_WRAPPER_MIN_OPS`` ops or more, because a call into it costs more than a call of the Python wrapper. Here
an MLP of ``depth`` Linear+ReLU pairs and a head (``2 * depth + 1`` ops) is compiled both ways in one process
(``layout_optimization=False`` as the strategy sets it) and one forward+backward on a batch of 4 is timed in
CPU time: the two sides of each depth alternate, ``--repeats`` times, each the median call of ``--calls``
after warm-up; the median over repeats is reported.

    python benchmarks/cpp_wrapper.py                                  # ~1 min on 2 cores
    python benchmarks/cpp_wrapper.py --depths 0 24 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, median, print_table, write_results  # noqa: E402


def mlp(depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(16, 16), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(16, 2))


def compiled_step(depth: int, cpp_wrapper: bool) -> Any:
    torch.manual_seed(0)
    model = torch.compile(mlp(depth), options={"cpp_wrapper": cpp_wrapper, "layout_optimization": False})
    x = torch.randn(4, 16)

    def step() -> None:
        model(x).sum().backward()

    return step


def call_us(step: Any, calls: int) -> float:
    """Median CPU microseconds of one call among ``calls``, timed in blocks of 10."""
    blocks = []
    for _ in range(max(1, calls // 10)):
        start = time.process_time()
        for _ in range(10):
            step()
        blocks.append((time.process_time() - start) / 10 * 1e6)
    return statistics.median(blocks)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--depths", type=int, nargs="+", default=[0, 2, 8, 11, 12, 24], help="Linear+ReLU pairs"
    )
    parser.add_argument("--repeats", type=int, default=5, help="alternating rounds of both sides")
    parser.add_argument("--calls", type=int, default=300, help="timed calls a side a round")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", default="cpp_wrapper-cpu", help="results file name (no .json)")
    args = parser.parse_args(argv)
    if min(args.depths) < 0 or args.repeats < 1 or args.calls < 10:
        parser.error("--depths must be >= 0, --repeats >= 1 and --calls >= 10")
    torch.set_num_threads(args.threads)

    rows = []
    for depth in args.depths:
        steps = {"python": compiled_step(depth, False), "cpp": compiled_step(depth, True)}
        for step in steps.values():  # compile, then warm
            for _ in range(30):
                step()
        timings: dict[str, list[float]] = {side: [] for side in steps}
        for _ in range(args.repeats):
            for side, step in steps.items():
                timings[side].append(call_us(step, args.calls))
        python_us, cpp_us = median(timings["python"]), median(timings["cpp"])
        rows.append(
            {
                "depth": depth,
                "ops": 2 * depth + 1,
                "python us": python_us,
                "cpp us": cpp_us,
                "cpp minus python us": cpp_us - python_us,
                "per repeat python us": timings["python"],
                "per repeat cpp us": timings["cpp"],
            }
        )
        print(f"depth {depth}: python {python_us:.0f} us, cpp {cpp_us:.0f} us", flush=True)
    payload = {"args": vars(args), "gpu": "not measured on GPU", "results": rows}
    path = write_results(args.out, payload)
    info = machine_info()
    print(
        f"machine: {info['device']}, {info['cpu_count']} cores, torch {info['torch']}, {args.threads} thread(s)"
    )
    print_table(rows, ["depth", "ops", "python us", "cpp us", "cpp minus python us"])
    print(f"results written to {path}")
    return payload


if __name__ == "__main__":
    main()
