"""The Hopper TMA conv (``lcv_kernels.conv_hopper``) against cuDNN on its table's layer shapes, one command.

On a CUDA device (bf16, channels_last), per layer: the kernel's result against an fp32 cuDNN conv (TF32
off) within ``reduction_tolerance``, its BatchNorm statistics against ``var_mean`` of that result, then
four sides timed with ``--calls`` back-to-back calls per CUDA event pair (host launch cost amortised,
reported separately as ``host_us`` per call) and, with ``--profile``, ``torch.profiler`` device time per call:
cuDNN conv, our conv, cuDNN conv + ``var_mean`` and our conv with statistics. The table's config is printed
for every case. Without a GPU it needs ``TRITON_INTERPRET=1``, checks correctness only on tiny batches in
fp16 (the interpreter has no bf16) and says "not measured on GPU".

    python benchmarks/conv_hopper.py --profile             # on the GPU machine
    TRITON_INTERPRET=1 python benchmarks/conv_hopper.py --tiny
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "kernels"))
sys.path.insert(0, _HERE)
from _common import ResultStream, median, out_of_time, print_table, write_results  # noqa: E402
from lcv_kernels.conv_hopper import CONFIGS, conv_hopper, conv_hopper_stats  # noqa: E402
from lcv_kernels.tolerances import bound, reduction_tolerance  # noqa: E402

#: airbench94's layer shapes train at batch 1024, the ResNets' at 256 (as in benchmarks/conv.py).
AIRBENCH_HW = {31, 15, 7, 3}


def layer_name(shape: tuple[int, ...]) -> str:
    c, h, w, k, r, stride, pad = shape
    return f"C{c} {h}x{w} K{k} {r}x{r}/{stride} p{pad}"


def default_batch(shape: tuple[int, ...]) -> int:
    return 1024 if shape[1] in AIRBENCH_HW and shape[0] != 1024 else 256


def time_per_call(fn: Callable[[], Any], calls: int, repeats: int) -> tuple[float, float]:
    """Median device ms per call (``calls`` back to back between two events) and host µs per call."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    device_ms, host_us = [], []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        host_us.append((time.perf_counter() - t0) * 1e6 / calls)
        torch.cuda.synchronize()
        device_ms.append(start.elapsed_time(end) / calls)
    return median(device_ms), median(host_us)


def profiled_ms(fn: Callable[[], Any], calls: int) -> float:
    """Device time per call summed over its kernels, from ``torch.profiler``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total_us = 0.0
    for event in prof.key_averages():
        total_us += getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0))
    return total_us / 1000.0 / calls


def check_layer(shape: tuple[int, ...], batch: int, device: str, dtype: torch.dtype) -> dict[str, Any]:
    """Our conv and statistics against a wider reference (fp32 cuDNN without TF32, or float64 on CPU)."""
    c, h, w, k, r, stride, pad = shape
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = (
        torch.randn(batch, c, h, w, generator=gen)
        .to(device, dtype)
        .contiguous(memory_format=torch.channels_last)
    )
    weight = (torch.randn(k, c, r, r, generator=gen) / (c * r * r) ** 0.5).to(device, dtype)
    wide = torch.float32 if device == "cuda" else torch.float64
    ref = F.conv2d(x.to(wide), weight.to(wide), stride=stride, padding=pad)
    y, mean, var = conv_hopper_stats(x, weight, stride, pad)
    y_plain = conv_hopper(x, weight, stride, pad)
    limit = bound(reduction_tolerance(dtype, c * r * r), ref)
    err = (y.to(wide) - ref).abs().max().item()
    e_var, e_mean = torch.var_mean(ref, dim=(0, 2, 3), unbiased=False)
    stats_err = max(
        ((mean.to(wide) - e_mean) / e_var.sqrt()).abs().max().item(),
        ((var.to(wide) - e_var) / e_var).abs().max().item(),
    )
    return {
        "max_error": err,
        "error_bound": limit,
        "ok": err <= limit and torch.equal(y, y_plain) and stats_err <= 1e-3,
        "stats_max_relative_error": stats_err,
    }


def time_layer(shape: tuple[int, ...], batch: int, args: argparse.Namespace) -> dict[str, Any]:
    c, h, w, k, r, stride, pad = shape
    x = torch.randn(batch, c, h, w, device="cuda", dtype=torch.bfloat16).contiguous(
        memory_format=torch.channels_last
    )
    weight = torch.randn(k, c, r, r, device="cuda", dtype=torch.bfloat16).contiguous(
        memory_format=torch.channels_last
    )
    sides: dict[str, Callable[[], Any]] = {
        "cudnn": lambda: F.conv2d(x, weight, stride=stride, padding=pad),
        "ours": lambda: conv_hopper(x, weight, stride, pad),
        "cudnn_var_mean": lambda: torch.var_mean(
            F.conv2d(x, weight, stride=stride, padding=pad).float(), dim=(0, 2, 3), unbiased=False
        ),
        "ours_stats": lambda: conv_hopper_stats(x, weight, stride, pad),
    }
    row: dict[str, Any] = {}
    for side, fn in sides.items():
        row[f"{side}_ms"], row[f"{side}_host_us"] = time_per_call(fn, args.calls, args.repeats)
        if args.profile:
            row[f"{side}_profiled_ms"] = profiled_ms(fn, args.calls)
    p = (h + 2 * pad - r) // stride + 1
    q = (w + 2 * pad - r) // stride + 1
    row["ours_tflops"] = 2 * batch * p * q * k * c * r * r / row["ours_ms"] / 1e9
    row["ours_vs_cudnn"] = row["cudnn_ms"] / row["ours_ms"]
    row["stats_vs_cudnn_var_mean"] = row["cudnn_var_mean_ms"] / row["ours_stats_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=None, help="default 256 (ResNets), 1024 (airbench)")
    parser.add_argument("--tiny", action="store_true", help="batch 1 and the smallest layers (interpreter)")
    parser.add_argument("--calls", type=int, default=20, help="back-to-back calls per event pair")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--profile", action="store_true", help="also torch.profiler device time per call")
    parser.add_argument("--case-seconds", type=float, default=60.0, help="skip a case with less time left")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("no CUDA device: set TRITON_INTERPRET=1 to check correctness in the interpreter")
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    shapes = list(CONFIGS)
    if args.tiny:
        shapes = [s for s in shapes if s[1] <= 7]  # 7x7 and 3x3 maps: each mode but stride 2
    stream = ResultStream("conv_hopper")
    for shape in shapes:
        if out_of_time(args.case_seconds):
            stream.skip(layer_name(shape), "deadline")
            continue
        batch = 1 if args.tiny else (args.batch or default_batch(shape))
        row = {
            "layer": layer_name(shape),
            "shape": list(shape),
            "batch": batch,
            "config": CONFIGS[shape].describe(),
        }
        print(f"{row['layer']} batch {batch}: config {row['config']}", flush=True)
        row.update(check_layer(shape, batch, device, dtype))
        if device == "cuda":
            row.update(time_layer(shape, batch, args))
        stream.add(row)
    columns = ["layer", "batch", "config", "ok", "max_error", "error_bound"]
    if device == "cuda":
        columns += ["cudnn_ms", "ours_ms", "ours_vs_cudnn", "ours_stats_ms", "stats_vs_cudnn_var_mean"]
    print_table(stream.rows, columns)
    payload = {
        "dtype": str(dtype),
        "timing": "median of --repeats, each --calls back-to-back calls between two CUDA events"
        if device == "cuda"
        else "not measured on GPU (interpreter correctness only)",
        "rows": stream.rows,
    }
    suffix = "gpu" if device == "cuda" else "interpreter"
    print(write_results(f"conv_hopper-{suffix}{'-tiny' if args.tiny else ''}", payload))
    if not all(r["ok"] for r in stream.rows):
        sys.exit("some layers are outside the tolerance")


if __name__ == "__main__":
    main()
