"""Fused Triton conv against cuDNN, cuDNN + separate ops, and Inductor, on ResNet-50 and airbench layers.

Over ResNet-50 conv shapes (default batch 256) and the airbench94 net's convs (batch 1024), bf16,
channels_last, in one process; each case timed with warm-up and several repeats (median), cuDNN with
``cudnn.benchmark`` on (ours is autotuned too):

* ``conv``: ``lcv::conv_bn_act`` (no epilogue) vs ``F.conv2d`` (cuDNN);
* ``conv+bn+relu`` (training forward): ``FusedConvBNAct`` (conv with the BN-statistics epilogue, then one
  elementwise pass) vs eager ``Conv2d → BatchNorm2d(train) → ReLU`` (cuDNN + separate kernels), vs the
  same eager block under ``torch.compile`` (Inductor default; ``--compile-mode max-autotune`` adds that
  mode), and ``FusedConvBNAct`` under ``torch.compile`` (so Inductor fuses its elementwise pass);
* ``conv+bn+relu fwd+bwd``: the same blocks with a backward that computes all three gradients (the input
  requires grad, so dgrad runs on both sides: 3 convolutions' worth of FLOPs);
* ``dgrad`` (stride-1 layers): the Triton input-gradient kernel vs cuDNN's.

Each measured case is appended to ``LCV_RESULTS_JSONL`` at once, and no case starts after the deadline
(``LCV_DEADLINE``), so a run cut short keeps what it measured (see ``benchmarks/gpu_check.py``).

    python benchmarks/conv.py                                   # GPU: every layer
    python benchmarks/conv.py --tiny --dtype fp32 --no-compile  # CPU smoke run (reference path)

On CPU (no CUDA) the interpreter is switched off, so "ours" is the PyTorch reference path: the numbers
only show that the script runs, they say nothing about the Triton kernel.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

if os.environ.get("TRITON_INTERPRET") == "1":
    print("note: TRITON_INTERPRET=1 is ignored: benchmarks never time the numpy interpreter", file=sys.stderr)
os.environ["TRITON_INTERPRET"] = "0"  # benchmarks never run the numpy interpreter

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # our packages, uninstalled
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vision"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ResultStream, out_of_time, print_table, time_ms, write_results
from lcv_kernels.conv_bn_act import DGRAD_ENV, FusedConvBNAct, conv_bn_act, triton_conv_input_grad

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
# The airbench94 net's 3x3 convs (after the 2x2 whitening conv: 31x31 input; a 2x2 max pool in each group).
AIRBENCH_LAYERS: dict[str, tuple[int, int, int, int, int, int, int]] = {
    "airbench_g1_conv1": (24, 31, 31, 64, 3, 1, 1),
    "airbench_g1_conv2": (64, 15, 15, 64, 3, 1, 1),
    "airbench_g2_conv1": (64, 15, 15, 256, 3, 1, 1),
    "airbench_g2_conv2": (256, 7, 7, 256, 3, 1, 1),
    "airbench_g3_conv1": (256, 7, 7, 256, 3, 1, 1),
    "airbench_g3_conv2": (256, 3, 3, 256, 3, 1, 1),
}
LAYERS = {**RESNET50_LAYERS, **AIRBENCH_LAYERS}
#: The batch each network trains with (``--batch`` overrides both).
DEFAULT_BATCH = {"resnet50": 256, "airbench": 1024}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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


def forward_backward(block: nn.Module, x: torch.Tensor) -> None:
    """One training step's work for a block: forward, then all three gradients (``x`` requires grad, so
    the backward computes dgrad as well as wgrad, as it does for every conv but a network's first)."""
    x.grad = None
    block(x).sum().backward()


def bench_layer(
    name: str, shape: tuple, args: argparse.Namespace, device: str, dtype: torch.dtype, stream: ResultStream
) -> None:
    """Time every case of one layer, streaming a row per (case, provider) as soon as it is measured."""
    c, h, w, k, r, stride, pad = shape
    n = args.batch or DEFAULT_BATCH["airbench" if name.startswith("airbench") else "resnet50"]
    if args.tiny:  # shrink batch, channels and space, keep the kernel geometry
        n = 2
        c, k, h, w = max(3, c // 16) if c > 3 else c, max(4, k // 16), max(r, h // 8), max(r, w // 8)
    x = torch.randn(n, c, h, w, device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)
    x_grad = x.detach().clone().requires_grad_()  # fwd+bwd: dgrad is computed on both sides
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

    # Baseline first in each case: the speed-ups are relative to it.
    cases: dict[str, dict[str, Callable[[], object]]] = {
        "conv": {
            "cudnn": lambda: F.conv2d(x, weight, stride=stride, padding=pad),
            "ours": lambda: conv_bn_act(x, weight, stride=stride, padding=pad),
        },
        "conv+bn+relu": {"cudnn+ops": lambda: eager(x), "ours": lambda: ours(x)},
        "conv+bn+relu fwd+bwd": {
            "cudnn+ops": lambda: forward_backward(eager, x_grad),
            "ours": lambda: forward_backward(ours, x_grad),
        },
    }
    if stride == 1:  # the Triton dgrad covers stride-1 convs
        grad_y = torch.randn(n, k, p, q, device=device, dtype=dtype).contiguous(
            memory_format=torch.channels_last
        )
        cases["dgrad"] = {
            "cudnn": lambda: torch.ops.aten.convolution_backward(
                grad_y, x, weight, None, [1, 1], [pad, pad], [1, 1], False, [0, 0], 1, [True, False, False]
            ),
            "ours": lambda: triton_conv_input_grad(grad_y, weight, [pad, pad], [1, 1]),
        }
        cases["conv+bn+relu fwd+bwd"]["ours(dgrad=triton)"] = lambda: _with_triton_dgrad(
            lambda: forward_backward(ours, x_grad)
        )
    if not args.no_compile:
        label = "inductor" if args.compile_mode == "default" else f"inductor:{args.compile_mode}"
        compiled_eager = torch.compile(
            eager_block(c, k, r, stride, pad).to(
                device=device, dtype=dtype, memory_format=torch.channels_last
            ),
            mode=None if args.compile_mode == "default" else args.compile_mode,
            backend=args.compile_backend,
        )
        compiled_ours = torch.compile(ours, backend=args.compile_backend)
        cases["conv"][label] = torch.compile(
            lambda: F.conv2d(x, weight, stride=stride, padding=pad),
            mode=None if args.compile_mode == "default" else args.compile_mode,
            backend=args.compile_backend,
        )
        cases["conv+bn+relu"][label] = lambda: compiled_eager(x)
        cases["conv+bn+relu"]["ours+inductor"] = lambda: compiled_ours(x)
        cases["conv+bn+relu fwd+bwd"][label] = lambda: forward_backward(compiled_eager, x_grad)
        cases["conv+bn+relu fwd+bwd"]["ours+inductor"] = lambda: forward_backward(compiled_ours, x_grad)

    for case, providers in cases.items():
        baseline_ms = None
        for prov, fn in providers.items():
            if args.only_providers and prov not in args.only_providers and baseline_ms is not None:
                continue
            if out_of_time(args.case_seconds):
                stream.skip(f"{name} {case} {prov}", "deadline reached")
                continue
            try:
                ms = time_ms(fn, args.warmup, args.repeats)
            except Exception as err:  # noqa: BLE001 - one failing provider must not lose the others
                stream.add(
                    {
                        "layer": name,
                        "shape": dims,
                        "case": case,
                        "provider": prov,
                        "error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
                    }
                )
                continue
            baseline_ms = baseline_ms or ms
            passes = 3.0 if "bwd" in case else 1.0  # fwd + dgrad + wgrad
            stream.add(
                {
                    "layer": name,
                    "shape": dims,
                    "case": case,
                    "provider": prov,
                    "ms": ms,
                    "TFLOP/s": passes * flops / (ms * 1e-3) / 1e12,
                    "GB/s": passes * conv_bytes / (ms * 1e-3) / 1e9,
                    "speedup_vs_baseline": baseline_ms / ms,
                }
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=None,
        help="default 256 for ResNet-50 layers, 1024 for airbench layers (2 with --tiny)",
    )
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--layers", nargs="*", default=list(LAYERS), choices=list(LAYERS))
    parser.add_argument("--warmup", type=int, default=None, help="default 10 on GPU, 1 on CPU")
    parser.add_argument("--repeats", type=int, default=None, help="default 30 on GPU, 3 on CPU")
    parser.add_argument(
        "--tiny", action="store_true", help="batch 2, channels/16, spatial/8: a CPU smoke run"
    )
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile providers")
    parser.add_argument("--compile-mode", default="default", help="Inductor mode of the compiled baseline")
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend ('eager' in dry runs: exercises the code, compiles nothing)",
    )
    parser.add_argument(
        "--only-providers",
        nargs="*",
        default=None,
        help="time only these providers besides each case's baseline (e.g. inductor:max-autotune)",
    )
    parser.add_argument(
        "--case-seconds",
        type=float,
        default=15.0,
        help="do not start a case with less than this left before the deadline",
    )
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.backends.cudnn.benchmark = True  # cuDNN picks its fastest algorithm, as ours is autotuned
    args.warmup = args.warmup if args.warmup is not None else (10 if cuda else 1)
    args.repeats = args.repeats or (30 if cuda else 3)
    dtype = DTYPES[args.dtype]
    if not cuda:
        print("no CUDA: 'ours' runs the PyTorch reference path; not measured on GPU", file=sys.stderr)
    stream = ResultStream("conv")
    for name in args.layers:
        torch._dynamo.reset()  # compile every layer for its own static shapes, as a model's layers are
        print(f"benchmarking {name}", file=sys.stderr, flush=True)
        bench_layer(name, LAYERS[name], args, device, dtype, stream)
    rows = stream.rows
    print_table(rows, ["layer", "shape", "case", "provider", "ms", "TFLOP/s", "GB/s", "speedup_vs_baseline"])
    suffix = "gpu" if cuda else "cpu"
    if args.compile_mode != "default":
        suffix += f"-{args.compile_mode}"
    path = write_results(
        f"conv-{suffix}", {"args": vars(args), "path": "triton" if cuda else "reference", "rows": rows}
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
