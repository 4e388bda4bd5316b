"""A conv's weight gradient: oneDNN's ``convolution_backward`` against one matrix product of the unfolded
input.

Where the rule of :func:`lightning_plugin.cpu.graph_passes.convolution_backward_weight_as_matmul` comes from
(at most ``MATMUL_WEIGHT_GRADIENT_MAX_POSITIONS`` output positions, at least
``MATMUL_WEIGHT_GRADIENT_MIN_TAPS`` input channels x taps): for each batch size, channel count and map size,
3x3 convs with same padding, both sides in this process, eager, median of ``--repeats`` after ``--warmup``.
The matrix-product side runs the strategy's own decomposition (plain torch ops, so it runs eagerly too);
``oneDNN / GEMM`` above 1 means the matrix product is faster. ``applies`` says whether the strategy uses it.

    python benchmarks/conv_weight_gradient.py                       # the grid of docs/compiler.md
    python benchmarks/conv_weight_gradient.py --channels 512 --sizes 2 --batches 32
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # our packages, uninstalled
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vision"))
from _common import machine_info, print_table, time_ms, write_results  # noqa: E402
from lightning_plugin.cpu import graph_passes as cpu_graph_passes  # noqa: E402

CONV = (
    [1, 1],
    [1, 1],
    [1, 1],
    False,
    [0, 0],
    1,
)  # stride, padding, dilation, transposed, output_padding, groups
WEIGHT_ONLY = [False, True, False]


def measure(batch: int, channels: int, size: int, warmup: int, repeats: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, channels, size, size, generator=g)
    weight = torch.randn(channels, channels, 3, 3, generator=g)
    grad_output = torch.randn(batch, channels, size, size, generator=g)
    args = (grad_output, x, weight, None, *CONV, WEIGHT_ONLY)
    ours = cpu_graph_passes.convolution_backward_weight_as_matmul
    onednn_ms = time_ms(lambda: torch.ops.aten.convolution_backward.default(*args), warmup, repeats)
    applies = ours(*args) is not NotImplemented
    force = {
        "MATMUL_WEIGHT_GRADIENT_MAX_POSITIONS": size * size,
        "MATMUL_WEIGHT_GRADIENT_MIN_TAPS": channels * 9,
    }
    saved = {name: getattr(cpu_graph_passes, name) for name in force}
    try:  # time the matrix product on every shape, the ones the rule leaves to oneDNN too
        for name, value in force.items():
            setattr(cpu_graph_passes, name, value)
        gemm_ms = time_ms(lambda: ours(*args), warmup, repeats)
    finally:
        for name, value in saved.items():
            setattr(cpu_graph_passes, name, value)
    return {
        "batch": batch,
        "channels": channels,
        "map": f"{size}x{size}",
        "oneDNN ms": round(onednn_ms, 3),
        "GEMM ms": round(gemm_ms, 3),
        "oneDNN / GEMM": round(onednn_ms / gemm_ms, 2),
        "applies": applies,
    }


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=_ints, default=[32, 128])
    parser.add_argument("--channels", type=_ints, default=[64, 128, 256, 512])
    parser.add_argument("--sizes", type=_ints, default=[1, 2, 3, 4, 6], help="map height = width")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--name", default="conv_weight_gradient-cpu", help="results file name")
    args = parser.parse_args(argv)
    print(
        f"machine: {machine_info()['device']}, {os.cpu_count()} cores, torch {torch.__version__}", flush=True
    )
    rows = []
    for batch in args.batches:
        for channels in args.channels:
            for size in args.sizes:
                rows.append(measure(batch, channels, size, args.warmup, args.repeats))
                print(rows[-1], flush=True)
    path = write_results(args.name, {"args": vars(args), "results": rows})
    print(f"results written to {path}")
    print_table(rows, list(rows[0]))
    return rows


if __name__ == "__main__":
    main()
