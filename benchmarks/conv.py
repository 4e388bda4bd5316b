"""Fused Triton conv against cuDNN + separate ops and against ``torch.compile(mode="max-autotune")``.

Over ResNet-50 conv shapes (default batch 256, bf16, channels_last), in one process, each case timed with
warm-up and several repeats (median):

* ``conv``: ``lcv::conv_bn_act`` (no epilogue) vs ``F.conv2d`` (cuDNN);
* ``conv+bn+relu`` (training forward): ``FusedConvBNAct`` (conv with the BN-stats epilogue, then one
  elementwise pass) vs eager ``Conv2d → BatchNorm2d(train) → ReLU`` (cuDNN + separate kernels), vs the
  same eager block under ``torch.compile(mode="max-autotune")``, and ``FusedConvBNAct`` under
  ``torch.compile()`` (so Inductor fuses its elementwise pass);
* ``conv+bn+relu fwd+bwd``: the same blocks with a backward (ours uses aten's convolution_backward).

    python benchmarks/conv.py                                   # GPU: full ResNet-50 shapes
    python benchmarks/conv.py --tiny --dtype fp32 --no-compile  # CPU smoke run (reference path)

On CPU (no CUDA) the interpreter is switched off, so "ours" is the PyTorch reference path: the numbers
only show that the script runs, they say nothing about the Triton kernel.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

if os.environ.get("TRITON_INTERPRET") == "1":
    print("note: TRITON_INTERPRET=1 is ignored: benchmarks never time the numpy interpreter", file=sys.stderr)
os.environ["TRITON_INTERPRET"] = "0"  # benchmarks never run the numpy interpreter

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import median, print_table, write_results

from kernels.conv_bn_act import DGRAD_ENV, FusedConvBNAct, conv_bn_act, triton_conv_input_grad

# name: (C_in, H, W, C_out, kernel, stride, padding) — torchvision ResNet-50 (v1.5: stride on the 3x3).
RESNET50_LAYERS: dict[str, tuple[int, int, int, int, int, int, int]] = {
    "conv1_7x7s2": (3, 224, 224, 64, 7, 2, 3),
    "layer1_1x1_reduce": (64, 56, 56, 64, 1, 1, 0),
    "layer1_3x3": (64, 56, 56, 64, 3, 1, 1),
    "layer1_1x1_expand": (64, 56, 56, 256, 1, 1, 0),
    "layer2_3x3s2": (128, 56, 56, 128, 3, 2, 1),
    "layer2_3x3": (128, 28, 28, 128, 3, 1, 1),
    "layer3_1x1_reduce": (1024, 14, 14, 256, 1, 1, 0),
    "layer3_3x3": (256, 14, 14, 256, 3, 1, 1),
    "layer4_3x3": (512, 7, 7, 512, 3, 1, 1),
    "layer4_1x1_expand": (512, 7, 7, 2048, 1, 1, 0),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def time_ms(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    """Median milliseconds of ``fn`` after ``warmup`` calls (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    samples = []
    cuda = torch.cuda.is_available()
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


def _with_triton_dgrad(fn: Callable[[], object]) -> object:
    previous = os.environ.get(DGRAD_ENV)
    os.environ[DGRAD_ENV] = "triton"
    try:
        return fn()
    finally:
        if previous is None:
            del os.environ[DGRAD_ENV]
        else:
            os.environ[DGRAD_ENV] = previous


def eager_block(c: int, k: int, r: int, stride: int, pad: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c, k, r, stride, pad, bias=False), nn.BatchNorm2d(k), nn.ReLU())


def bench_layer(
    name: str, shape: tuple, args: argparse.Namespace, device: str, dtype: torch.dtype
) -> list[dict]:
    c, h, w, k, r, stride, pad = shape
    n = args.batch
    if args.tiny:  # shrink channels and space, keep the kernel geometry
        c, k, h, w = max(3, c // 16) if c > 3 else c, max(4, k // 16), max(r, h // 8), max(r, w // 8)
    x = torch.randn(n, c, h, w, device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)
    eager = eager_block(c, k, r, stride, pad).to(
        device=device, dtype=dtype, memory_format=torch.channels_last
    )
    ours = FusedConvBNAct.from_modules(*[m for m in eager_block(c, k, r, stride, pad)]).to(
        device=device, dtype=dtype, memory_format=torch.channels_last
    )
    ours.load_state_dict(
        {"conv.weight": eager[0].weight, **{f"bn.{key}": v for key, v in eager[1].state_dict().items()}}
    )
    weight = eager[0].weight
    p = (h + 2 * pad - r) // stride + 1
    q = (w + 2 * pad - r) // stride + 1
    flops = 2.0 * n * p * q * k * c * r * r
    elem = x.element_size()
    conv_bytes = (x.numel() + weight.numel() + n * k * p * q) * elem  # one read of x and w, one write of y
    dims = f"N{n} C{c} {h}x{w} K{k} {r}x{r}/s{stride}"

    cases: dict[str, dict[str, Callable[[], object]]] = {
        "conv": {
            "ours": lambda: conv_bn_act(x, weight, stride=stride, padding=pad),
            "cudnn": lambda: F.conv2d(x, weight, stride=stride, padding=pad),
        },
        "conv+bn+relu": {"ours": lambda: ours(x), "cudnn+ops": lambda: eager(x)},
        "conv+bn+relu fwd+bwd": {
            "ours": lambda: ours(x).sum().backward(),
            "cudnn+ops": lambda: eager(x).sum().backward(),
        },
    }
    if stride == 1:  # the Triton dgrad covers stride-1 convs
        grad_y = torch.randn(n, k, p, q, device=device, dtype=dtype).contiguous(
            memory_format=torch.channels_last
        )
        cases["dgrad"] = {
            "ours": lambda: triton_conv_input_grad(grad_y, weight, [pad, pad], [1, 1]),
            "cudnn": lambda: torch.ops.aten.convolution_backward(
                grad_y, x, weight, None, [1, 1], [pad, pad], [1, 1], False, [0, 0], 1, [True, False, False]
            ),
        }
        cases["conv+bn+relu fwd+bwd"]["ours(dgrad=triton)"] = lambda: _with_triton_dgrad(
            lambda: ours(x).sum().backward()
        )
    if not args.no_compile:
        compiled_eager = torch.compile(
            eager_block(c, k, r, stride, pad).to(
                device=device, dtype=dtype, memory_format=torch.channels_last
            ),
            mode=args.compile_mode,
        )
        compiled_ours = torch.compile(ours)
        cases["conv+bn+relu"]["compiled:" + args.compile_mode] = lambda: compiled_eager(x)
        cases["conv+bn+relu"]["ours+compile"] = lambda: compiled_ours(x)

    rows = []
    for case, providers in cases.items():
        times = {prov: time_ms(fn, args.warmup, args.repeats) for prov, fn in providers.items()}
        baseline = times["cudnn"] if "cudnn" in times else times["cudnn+ops"]
        for prov, ms in times.items():
            passes = 3.0 if "bwd" in case else 1.0  # fwd+bwd ≈ 3 convs' worth of FLOPs (fwd, dgrad, wgrad)
            rows.append(
                {
                    "layer": name,
                    "shape": dims,
                    "case": case,
                    "provider": prov,
                    "ms": ms,
                    "TFLOP/s": passes * flops / (ms * 1e-3) / 1e12,
                    "GB/s": passes * conv_bytes / (ms * 1e-3) / 1e9,
                    "speedup_vs_cudnn": baseline / ms,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=None, help="default 256 on GPU, 2 on CPU")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--layers", nargs="*", default=list(RESNET50_LAYERS), choices=list(RESNET50_LAYERS))
    parser.add_argument("--warmup", type=int, default=None, help="default 10 on GPU, 1 on CPU")
    parser.add_argument("--repeats", type=int, default=None, help="default 30 on GPU, 3 on CPU")
    parser.add_argument("--tiny", action="store_true", help="channels/16, spatial/8: a CPU smoke run")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile providers")
    parser.add_argument("--compile-mode", default="max-autotune")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    args.batch = args.batch or (256 if cuda else 2)
    args.warmup = args.warmup if args.warmup is not None else (10 if cuda else 1)
    args.repeats = args.repeats or (30 if cuda else 3)
    dtype = DTYPES[args.dtype]
    if not cuda:
        print("no CUDA: 'ours' runs the PyTorch reference path; not measured on GPU", file=sys.stderr)
    rows = []
    for name in args.layers:
        torch._dynamo.reset()  # compile every layer for its own static shapes, as a model's layers are
        print(f"benchmarking {name}", file=sys.stderr)
        rows += bench_layer(name, RESNET50_LAYERS[name], args, device, dtype)
    print_table(rows, ["layer", "shape", "case", "provider", "ms", "TFLOP/s", "GB/s", "speedup_vs_cudnn"])
    suffix = "gpu" if cuda else "cpu"
    path = write_results(
        f"conv-{suffix}", {"args": vars(args), "path": "triton" if cuda else "reference", "rows": rows}
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
