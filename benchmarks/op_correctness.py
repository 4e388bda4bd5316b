"""Every fused op on this device against float64 eager PyTorch: the first thing a GPU session checks.

For each op (``conv_bn_act``, ``batch_norm_act``, ``group_norm_act``, ``layer_norm2d_act``), dtype, memory
layout, training mode and a couple of small shapes (odd sizes, a 1x1 output, channels not a multiple of 16),
the fused module (sharing the eager module's parameters) runs forward and backward; its output, input gradient
and parameter gradients are compared with the same eager modules in float64, at the tolerances of
``kernels/lcv_kernels/tolerances.py``. Half types run under autocast with float32 parameters, as mixed-precision
training runs them. Each case is written the moment it is checked (see ``_common.ResultStream``).

    python benchmarks/op_correctness.py              # on a GPU: the Triton kernels, fp32/bf16/fp16
    python benchmarks/op_correctness.py --tiny       # CPU: the Triton interpreter, fp32, tiny shapes

Exit status 1 when any case is outside its tolerance.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from collections.abc import Callable, Iterator

if "--tiny" in sys.argv[1:]:
    os.environ["TRITON_INTERPRET"] = "1"  # must be set before triton is first imported

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # our packages, uninstalled
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vision"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ResultStream, out_of_time, print_table, write_results  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (N, C, H, W, K): odd sizes and channel counts not a multiple of 16; a 1x1 output; the dry run's tiny one.
GPU_SHAPES = ((8, 24, 13, 11, 40), (3, 16, 1, 1, 32))
TINY_SHAPES = ((2, 4, 5, 3, 6),)


def _layer_norm_2d(channels: int) -> nn.Module:
    from torchvision.models.convnext import LayerNorm2d

    return LayerNorm2d(channels)


def _builders() -> dict[
    str, tuple[str, Callable[[int, int], nn.Sequential], Callable[[nn.Sequential], nn.Module]]
]:
    """op → (tolerance family, eager block of (C, K), fused module sharing that block's state)."""
    from lcv_kernels import FusedBatchNormAct, FusedConvBNAct, FusedGroupNormAct, FusedLayerNorm2dAct

    return {
        "conv_bn_act": (
            "conv",
            lambda c, k: nn.Sequential(
                nn.Conv2d(c, k, 3, padding=1, bias=False), nn.BatchNorm2d(k), nn.ReLU()
            ),
            lambda b: FusedConvBNAct.from_modules(b[0], b[1], b[2]),
        ),
        "batch_norm_act": (
            "norm",
            lambda c, k: nn.Sequential(nn.BatchNorm2d(c), nn.ReLU()),
            lambda b: FusedBatchNormAct.from_module(b[0], b[1]),
        ),
        "group_norm_act": (
            "norm",
            lambda c, k: nn.Sequential(nn.GroupNorm(2, c), nn.SiLU()),
            lambda b: FusedGroupNormAct.from_module(b[0], b[1]),
        ),
        "layer_norm2d_act": (
            "norm",
            lambda c, k: nn.Sequential(_layer_norm_2d(c), nn.GELU()),
            lambda b: FusedLayerNorm2dAct.from_module(b[0], b[1]),
        ),
    }


def _randomize(block: nn.Module, generator: torch.Generator) -> None:
    """Non-trivial affine parameters and running statistics, so eval mode tests more than the identity."""
    with torch.no_grad():
        for m in block.modules():
            if isinstance(m, (nn.BatchNorm2d, nn.GroupNorm, nn.LayerNorm)):
                m.weight.copy_(torch.rand(m.weight.shape, generator=generator) + 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=generator))
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=generator))
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=generator) + 0.5)


def _worst(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> tuple[float, float]:
    """(max |actual - expected|, max of that over the allowed error): <= 1 passes.

    The absolute part scales with the reference's magnitude, since gradients are sums over many elements."""
    diff = (actual.double() - expected).abs()
    allowed = atol * max(1.0, float(expected.abs().max())) + rtol * expected.abs()
    return float(diff.max()), float((diff / allowed).max())


def check_case(
    op: str, shape: tuple[int, ...], dtype_name: str, layout: str, training: bool, device: torch.device
) -> dict:
    """One fused op vs float64 eager: forward output, input gradient, parameter gradients."""
    from lcv_kernels.tolerances import tolerance

    family, eager_block, fused_of = _builders()[op]
    n, c, h, w, k = shape
    dtype = DTYPES[dtype_name]
    g = torch.Generator().manual_seed(0)
    block = eager_block(c, k)
    _randomize(block, g)
    reference = copy.deepcopy(block).double().train(training)
    block = block.to(device).train(training)
    fused = fused_of(block)
    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    x64 = torch.randn(n, c, h, w, generator=g, dtype=torch.float64)
    x = x64.to(device=device, dtype=dtype).contiguous(memory_format=memory_format).requires_grad_()
    x64 = x.detach().double().cpu().requires_grad_()  # the reference sees the rounded input
    autocast = dtype != torch.float32
    with torch.autocast(device.type, dtype=dtype, enabled=autocast):
        y = fused(x)
    y_ref = reference(x64)
    probe = torch.randn(y_ref.shape, generator=g, dtype=torch.float64)
    y.backward(probe.to(device=device, dtype=y.dtype))
    y_ref.backward(probe)

    atol, rtol = tolerance(family, dtype)
    grad_atol, grad_rtol = (
        (atol * 10, rtol * 10) if dtype != torch.float32 else tolerance(family + "_grad", dtype)
    )
    checks = {
        "out": (y.detach().cpu(), y_ref.detach(), atol, rtol),
        "grad_x": (x.grad.cpu(), x64.grad, grad_atol, grad_rtol),
    }
    for (name, p), p_ref in zip(block.named_parameters(), reference.parameters()):
        checks[f"grad_{name}"] = (p.grad.cpu(), p_ref.grad, grad_atol, grad_rtol)
    errors = {name: _worst(*args) for name, args in checks.items()}
    worst_name = max(errors, key=lambda name: errors[name][1])
    return {
        "op": op,
        "dtype": dtype_name,
        "layout": layout,
        "mode": "train" if training else "eval",
        "shape": "N{} C{} {}x{} K{}".format(*shape),
        "max_abs_err_out": errors["out"][0],
        "worst": worst_name,
        "worst_err_over_tol": errors[worst_name][1],
        "ok": all(ratio <= 1.0 for _, ratio in errors.values()),
    }


def cases(args: argparse.Namespace) -> Iterator[tuple]:
    """Most valuable first: bf16 channels_last training (mixed-precision training), then the rest."""
    shapes = TINY_SHAPES if args.tiny else GPU_SHAPES
    layouts = ("channels_last", "contiguous")
    for dtype_name in args.dtypes:
        for layout in layouts:
            for shape in shapes:
                for op in args.ops:
                    for training in (True, False):
                        if not training and op in ("group_norm_act", "layer_norm2d_act"):
                            continue  # same computation in both modes
                        yield op, shape, dtype_name, layout, training


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tiny", action="store_true", help="CPU dry run: the Triton interpreter, fp32, one tiny shape"
    )
    parser.add_argument("--ops", nargs="*", default=list(_builders()), choices=list(_builders()))
    parser.add_argument(
        "--dtypes",
        nargs="*",
        default=None,
        choices=list(DTYPES),
        help="default bf16 fp32 fp16 on a GPU, fp32 on CPU",
    )
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    if not torch.cuda.is_available() and not args.tiny:
        parser.error("no CUDA device here: pass --tiny to check the kernels in the Triton interpreter on CPU")
    args.dtypes = args.dtypes or (["bf16", "fp32", "fp16"] if cuda else ["fp32"])
    device = torch.device("cuda" if cuda else "cpu")
    path = "triton" if cuda else "triton interpreter"
    print(f"op_correctness: {path} on {device}", flush=True)
    stream = ResultStream("op_correctness")
    for op, shape, dtype_name, layout, training in cases(args):
        label = f"{op} {dtype_name} {layout} {'train' if training else 'eval'} {shape}"
        if out_of_time(5):
            stream.skip(label, "deadline reached")
            continue
        started = time.perf_counter()
        try:
            row = check_case(op, shape, dtype_name, layout, training, device)
        except Exception as err:  # noqa: BLE001 - one broken case must not hide the others
            row = {
                "op": op,
                "dtype": dtype_name,
                "layout": layout,
                "mode": "train" if training else "eval",
                "shape": "N{} C{} {}x{} K{}".format(*shape),
                "ok": False,
                "error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
            }
        row["seconds"] = time.perf_counter() - started
        stream.add(row)
        print(("ok  " if row["ok"] else "FAIL") + f" {label} {row.get('error', '')}", flush=True)
    rows = stream.rows
    print_table(
        rows, ["op", "dtype", "layout", "mode", "shape", "worst", "worst_err_over_tol", "ok", "error"]
    )
    failed = [r for r in rows if not r["ok"]]
    out = write_results(
        f"op_correctness-{'gpu' if cuda else 'cpu'}",
        {"args": vars(args), "path": path, "rows": rows, "failed": len(failed)},
    )
    print(f"{len(rows) - len(failed)}/{len(rows)} cases within tolerance; wrote {out}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
