"""Accuracy of the conv → BatchNorm statistics at large means: ours against ``E[z²] - E[z]²`` and fp32 eager.

A conv whose output has a spread of about 1.3 and a mean set by its bias (0, 30, 300, 1000); float64 is the
truth. For each offset it prints the relative error of the batch variance from our conv epilogue
(``conv_bn_act(..., stats=True)``), of the fp32 sums formula the first release used, and the largest error of
the BatchNorm output (``batch_norm_act`` with the epilogue's statistics) next to fp32 eager's
(``F.conv2d`` → ``F.batch_norm``)::

    TRITON_INTERPRET=1 python benchmarks/channel_stats_accuracy.py  # CPU: Triton kernels in the interpreter
    python benchmarks/channel_stats_accuracy.py                     # GPU: compiled kernels (CPU: references)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # our packages, uninstalled
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vision"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import print_table
from lcv_kernels._common import use_triton
from lcv_kernels.batch_norm_act import batch_norm_act
from lcv_kernels.conv_bn_act import conv_bn_act


def measure(offset: float, device: str, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    x = torch.randn(4, 8, 9, 9, device=device).contiguous(memory_format=torch.channels_last)
    weight = torch.randn(6, 8, 3, 3, device=device) * 0.2
    bias = torch.full((6,), offset, device=device) + torch.randn(6, device=device)
    z64 = F.conv2d(x.double(), weight.double(), bias.double(), padding=1)
    var64, mean64 = torch.var_mean(z64, dim=(0, 2, 3), unbiased=False)
    normalised64 = (z64 - mean64.view(1, -1, 1, 1)) / (var64.view(1, -1, 1, 1) + 1e-5).sqrt()

    z, mean, var = conv_bn_act(x, weight, bias, padding=1, stats=True)
    ours = batch_norm_act(z, None, None, training=True, batch_mean=mean, batch_var=var)
    z32 = F.conv2d(x, weight, bias, padding=1)
    count = z32.numel() // z32.shape[1]
    sums_var = (z32 * z32).sum((0, 2, 3)) / count - (z32.sum((0, 2, 3)) / count) ** 2
    eager = F.batch_norm(z32, None, None, training=True)
    return {
        "offset": offset,
        "var rel err (ours)": ((var.double() - var64) / var64).abs().max().item(),
        "var rel err (E[z²]-E[z]²)": ((sums_var.double() - var64) / var64).abs().max().item(),
        "output err (ours)": (ours.double() - normalised64).abs().max().item(),
        "output err (fp32 eager)": (eager.double() - normalised64).abs().max().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--offsets", type=float, nargs="*", default=[0.0, 30.0, 300.0, 1000.0])
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = "triton" if use_triton(torch.empty(1, device=device)) else "reference"
    print(f"device {device}, ops on the {path} path", file=sys.stderr)
    rows = [measure(offset, device) for offset in args.offsets]
    print_table(rows, list(rows[0]))


if __name__ == "__main__":
    main()
