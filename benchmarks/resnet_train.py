"""Training throughput: eager vs Inductor vs our compiled strategy with kernel substitutions (none, auto,
all), plus the normalization kernels alone against device-to-device copy bandwidth. One process, one script.

Training (default: torchvision ResNet-50, batch 256, 224 px, bf16 autocast, channels_last, SGD momentum;
``--model airbench94``: the airbench94 net, batch 1024, 32 px): each variant starts from the same weights,
runs ``--warmup`` steps (compilation happens there), then ``--repeats`` timed windows of ``--steps`` steps;
images/s come from the median window.

* ``eager``            the model as is;
* ``eager_kernels``    eager, with every substitution applied (fused ops without ``torch.compile``);
* ``compile``          ``torch.compile(model)`` (Inductor default);
* ``max_autotune``     ``torch.compile(model, mode="max-autotune")``;
* ``ours_none``        what ``Trainer(strategy="compiled")`` does to the model (``ModuleCompiler``,
                       ``channels_last=True``) with ``kernels="none"``: the strategy's own overhead;
* ``ours_auto``        the same with ``kernels="auto"`` (the default);
* ``ours_all``         the same with ``kernels="all"`` (every recognised block substituted);
* ``ours_no_conv``     ``kernels="all"`` without ``conv_bn_act`` (cuDNN convs, fused norms).

Kernels alone (``--norm``; default shapes are ResNet-50 activations at batch 256): BatchNorm (training,
+ReLU), GroupNorm (32 groups, +SiLU) and LayerNorm2d, forward and forward+backward, in GB/s of *effective*
traffic (each tensor the op must read or write counted once: fwd reads x and writes y; bwd reads the
gradient and x and writes dx) and as a fraction of the bandwidth of ``dst.copy_(src)`` on the same tensor.
Eager PyTorch and ``torch.compile`` of the same norm+activation are timed alongside.

Each variant and norm case is appended to ``LCV_RESULTS_JSONL`` as soon as it is measured, and none starts
after the deadline (``LCV_DEADLINE``): see ``benchmarks/gpu_check.py``.

    python benchmarks/resnet_train.py                       # GPU: ResNet-50, batch 256, bf16
    python benchmarks/resnet_train.py --tiny                # CPU smoke run (small model, fp32, references)

Without CUDA the interpreter is switched off, so the substituted ops run their PyTorch references: CPU
numbers only show that the script runs; they say nothing about the kernels.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import sys
import time
from collections.abc import Callable

if os.environ.get("TRITON_INTERPRET") == "1":
    print("note: TRITON_INTERPRET=1 is ignored: benchmarks never time the numpy interpreter", file=sys.stderr)
os.environ["TRITON_INTERPRET"] = "0"

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # our packages, uninstalled
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vision"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ResultStream, out_of_time, print_table, time_ms, write_results
from lcv_kernels import KERNELS as KNOWN_KERNELS  # what lightning_plugin.config calls KNOWN_KERNELS
from lcv_kernels.batch_norm_act import batch_norm_act
from lcv_kernels.group_norm_act import group_norm_act
from lcv_kernels.layer_norm2d_act import layer_norm2d_act

VARIANTS = (
    "eager",
    "compile",
    "ours_none",
    "ours_auto",
    "ours_all",
    "ours_no_conv",
    "eager_kernels",
    "max_autotune",
)
#: CompileConfig.kernels of each strategy variant.
STRATEGY_KERNELS = {
    "ours_none": "none",
    "ours_auto": "auto",
    "ours_all": "all",
    "ours_no_conv": [k for k in KNOWN_KERNELS if k != "conv_bn_act"],
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (name, N, C, H, W): ResNet-50 activations that a BatchNorm/GroupNorm sees, at the default batch.
NORM_SHAPES = (
    ("layer1_256x56", 256, 256, 56, 56),
    ("layer2_512x28", 256, 512, 28, 28),
    ("stem_64x112", 256, 64, 112, 112),
)


# ---------------------------------------------------------------------------------------------------------
# Training throughput


def build_model(args: argparse.Namespace) -> nn.Module:
    if args.model == "airbench94":
        from lcv_vision.models.airbench import airbench94

        return airbench94(num_classes=args.classes, **({"widths": (8, 16, 16)} if args.tiny else {}))
    if args.tiny:  # ResNet-50's structure (Bottleneck 3-4-6-3) at 1/8 width: same graph, small tensors
        from lcv_vision.models.resnet import Bottleneck, ResNet

        return ResNet(Bottleneck, (3, 4, 6, 3), num_classes=args.classes, width=8)
    import torchvision

    return torchvision.models.resnet50(num_classes=args.classes)


def prepare_variant(
    name: str, base: nn.Module, device: torch.device, args: argparse.Namespace
) -> tuple[nn.Module, Callable]:
    """A fresh copy of ``base`` set up as ``name``: (the model whose parameters train, the forward)."""
    model = copy.deepcopy(base).to(device).to(memory_format=torch.channels_last)
    if name == "eager":
        return model, model
    if name == "eager_kernels":
        from lightning_plugin.kernel_choice.substitution import apply_substitutions

        report = apply_substitutions(model, frozenset(KNOWN_KERNELS))
        print(report.summary().splitlines()[0], file=sys.stderr)
        return model, model
    if name == "compile":
        return model, torch.compile(model, backend=args.compile_backend)
    if name == "max_autotune":
        return model, torch.compile(model, mode="max-autotune", backend=args.compile_backend)
    if name in STRATEGY_KERNELS:
        # Imported here: lightning_plugin imports Lightning (~5 s on a CPU), which the norms-only run never needs.
        from lightning_plugin.compile.compiler import ModuleCompiler
        from lightning_plugin.config import CompileConfig

        # fallback="raise": a compile failure must not be timed as "ours" running eagerly
        compiler = ModuleCompiler(
            CompileConfig(
                kernels=STRATEGY_KERNELS[name],
                channels_last=True,
                mode=args.ours_mode,
                backend=args.compile_backend,
                fallback="raise",
            )
        )
        compiler.compile(model, device)
        report = compiler.substitution_report
        print(report.summary().splitlines()[0] if report else "no kernel substitutions", file=sys.stderr)
        model._bench_compiler = compiler  # read back for the graph-break count
        return model, model
    raise ValueError(f"unknown variant {name!r}; choose from {VARIANTS}")


def train_variant(
    name: str,
    base: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    dtype: torch.dtype,
    args: argparse.Namespace,
) -> dict:
    """Warm up (compiling), then time ``--repeats`` windows of ``--steps`` training steps."""
    device = x.device
    torch._dynamo.reset()
    model, forward = prepare_variant(name, base, device, args)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses: list[torch.Tensor] = []

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = F.cross_entropy(forward(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    def window() -> None:
        for _ in range(args.steps):
            step()

    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    warmup_s = time.perf_counter() - t0
    ms = time_ms(window, 0, args.repeats)
    compiler = getattr(model, "_bench_compiler", None)
    decisions = [d.as_row() for d in compiler.kernel_decisions] if compiler is not None else []
    return {
        "variant": name,
        "graph_breaks": None if compiler is None else compiler.stats.graph_breaks,
        "blocks_fused": sum(d["chosen"] != "eager" for d in decisions) if decisions else None,
        "kernel_decisions": decisions,  # kernels="auto": per block, what was chosen and the measured ratio
        "images_per_s": args.batch * args.steps / (ms / 1e3),
        "ms_per_step": ms / args.steps,
        "warmup_s": warmup_s,
        "first_loss": float(losses[0]),
        "last_loss": float(losses[-1]),
    }


def bench_training(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype, stream: ResultStream
) -> list[dict]:
    torch.manual_seed(0)
    base = build_model(args)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size, generator=g).to(device)
    x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, args.classes, (args.batch,), generator=g).to(device)
    rows = []
    for name in args.variants:
        if out_of_time(args.variant_seconds):
            stream.skip(f"training {args.model} {name}", "deadline reached")
            continue
        print(f"training: {name}", file=sys.stderr, flush=True)
        try:
            row = {"model": args.model, **train_variant(name, base, x, y, dtype, args)}
        except Exception as err:  # noqa: BLE001 - one failing variant must not lose the others
            row = {
                "model": args.model,
                "variant": name,
                "error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
            }
        for ref in ("eager", "compile", "max_autotune"):
            ref_row = next((r for r in rows if r["variant"] == ref and "images_per_s" in r), None)
            if ref_row is not None and "images_per_s" in row:
                row[f"x_vs_{ref}"] = row["images_per_s"] / ref_row["images_per_s"]
        decisions = row.pop("kernel_decisions", [])
        rows.append(stream.add(row))
        for decision in decisions:  # one streamed row per block, after the variant's row
            stream.add({"model": args.model, "variant": name, "kernel_decision": decision})
        if decisions:
            print(f"{name}: kernel selection per block", file=sys.stderr)
            print_table(decisions, ["path", "kind", "chosen", "ratio", "correct", "cached", "reason"])
            row["kernel_decisions"] = decisions  # kept in the final JSON
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------------------
# Normalization kernels alone


def _norm_cases(
    shape: tuple[int, int, int, int], device: torch.device, dtype: torch.dtype
) -> dict[str, tuple]:
    """name → (ours, eager) callables of x; each applies the norm + activation the substitution fuses."""
    c = shape[1]
    w = torch.rand(c, device=device) + 0.5
    b = torch.randn(c, device=device)
    rm, rv = torch.zeros(c, device=device), torch.ones(c, device=device)
    return {
        "bn_relu": (
            lambda x: batch_norm_act(x, rm, rv, w, b, True, 0.1, 1e-5, activation="relu"),
            lambda x: F.relu(F.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5)),
        ),
        "gn32_silu": (
            lambda x: group_norm_act(x, 32, w, b, 1e-5, activation="silu"),
            lambda x: F.silu(F.group_norm(x, 32, w.to(dtype), b.to(dtype), 1e-5)),
        ),
        "ln2d": (
            lambda x: layer_norm2d_act(x, w, b, 1e-6),
            lambda x: F.layer_norm(x.permute(0, 2, 3, 1), (c,), w.to(dtype), b.to(dtype), 1e-6).permute(
                0, 3, 1, 2
            ),
        ),
    }


def _gbs_row(
    shape: str, op: str, provider: str, mode: str, ms: float, nbytes: float, copy_gbs: float
) -> dict:
    gbs = nbytes / (ms / 1e3) / 1e9
    return {
        "shape": shape,
        "op": op,
        "provider": provider,
        "mode": mode,
        "ms": ms,
        "GB/s": gbs,
        "pct_of_copy": 100.0 * gbs / copy_gbs,
    }


def _time_fwd_and_bwd(fn: Callable, x: torch.Tensor, args: argparse.Namespace) -> tuple[float, float]:
    """(forward ms, forward+backward ms) of ``fn`` on ``x``."""
    xg = x.detach().clone().requires_grad_()
    probe = torch.randn_like(x)
    fwd = time_ms(lambda: fn(x), args.warmup, args.repeats)
    both = time_ms(lambda: torch.autograd.grad(fn(xg), xg, probe), args.warmup, args.repeats)
    return fwd, both


def bench_norms(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype, stream: ResultStream
) -> list[dict]:
    shapes = NORM_SHAPES
    if args.tiny:
        # 1/8 of the space, 1/8 of the channels but at least 32 (GroupNorm uses 32 groups)
        shapes = tuple((name, 4, max(32, c // 8), h // 8, w // 8) for name, _, c, h, w in NORM_SHAPES)
    rows = []
    for name, n, c, h, w in shapes:
        x = torch.randn(n, c, h, w, device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)
        nbytes = x.numel() * x.element_size()
        dst = torch.empty_like(x)
        copy_ms = time_ms(lambda dst=dst, x=x: dst.copy_(x), args.warmup, args.repeats)
        copy_gbs = 2 * nbytes / (copy_ms / 1e3) / 1e9
        rows.append(stream.add(_gbs_row(name, "copy", "torch", "fwd", copy_ms, 2 * nbytes, copy_gbs)))
        for op, (ours, eager) in _norm_cases((n, c, h, w), device, dtype).items():
            torch._dynamo.reset()
            providers = {"ours": ours, "eager": eager}
            if not args.no_compile:
                providers["compile"] = torch.compile(eager, backend=args.compile_backend)
            for provider, fn in providers.items():
                if out_of_time(args.case_seconds):
                    stream.skip(f"norm {name} {op} {provider}", "deadline reached")
                    continue
                fwd_ms, both_ms = _time_fwd_and_bwd(fn, x, args)
                # effective traffic: fwd reads x, writes y; bwd reads grad and x, writes dx
                rows.append(stream.add(_gbs_row(name, op, provider, "fwd", fwd_ms, 2 * nbytes, copy_gbs)))
                rows.append(
                    stream.add(_gbs_row(name, op, provider, "fwd+bwd", both_ms, 5 * nbytes, copy_gbs))
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tiny", action="store_true", help="CPU smoke run: ResNet-50 structure at 1/8 width, 32 px"
    )
    parser.add_argument("--model", choices=("resnet50", "airbench94"), default="resnet50")
    parser.add_argument(
        "--batch",
        type=int,
        default=None,
        help="default 256 for resnet50, 1024 for airbench94 (4 with --tiny)",
    )
    parser.add_argument(
        "--size",
        type=int,
        default=None,
        help="image size, default 224 for resnet50, 32 for airbench94 (and with --tiny)",
    )
    parser.add_argument(
        "--classes", type=int, default=None, help="default 1000 for resnet50, 10 for airbench94"
    )
    parser.add_argument("--dtype", choices=list(DTYPES), default=None, help="default bf16 (fp32 with --tiny)")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--ours-mode", default=None, help="CompileConfig.mode for the 'ours_*' variants")
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend ('eager' in dry runs: exercises the code, compiles nothing)",
    )
    parser.add_argument(
        "--variant-seconds",
        type=float,
        default=60.0,
        help="do not start a training variant with less than this left before the deadline",
    )
    parser.add_argument(
        "--case-seconds",
        type=float,
        default=10.0,
        help="do not start a norm case with less than this left before the deadline",
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="steps before timing, default 10 (2 with --tiny)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per timed window, default 10 (2 with --tiny)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed windows, default 5 (3 with --tiny)")
    parser.add_argument("--no-train", action="store_true", help="skip the training throughput part")
    parser.add_argument("--no-norm", action="store_true", help="skip the normalization kernels part")
    parser.add_argument(
        "--no-compile", action="store_true", help="skip torch.compile providers in the norm part"
    )
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda and not args.tiny:
        print("no CUDA device: running the --tiny smoke configuration", file=sys.stderr)
        args.tiny = True
    airbench = args.model == "airbench94"
    args.batch = args.batch or (4 if args.tiny else 1024 if airbench else 256)
    args.size = args.size or (32 if args.tiny or airbench else 224)
    args.classes = args.classes or (10 if airbench else 1000)
    args.dtype = args.dtype or ("fp32" if args.tiny else "bf16")
    args.warmup = args.warmup if args.warmup is not None else (2 if args.tiny else 10)
    args.steps = args.steps or (2 if args.tiny else 10)
    args.repeats = args.repeats or (3 if args.tiny else 5)
    dtype = DTYPES[args.dtype]
    stream = ResultStream("resnet_train")
    train_rows = [] if args.no_train else bench_training(args, device, dtype, stream)
    norm_rows = [] if args.no_norm else bench_norms(args, device, dtype, stream)
    if train_rows:
        print_table(
            train_rows,
            [
                "model",
                "variant",
                "images_per_s",
                "ms_per_step",
                "x_vs_eager",
                "x_vs_compile",
                "x_vs_max_autotune",
                "warmup_s",
                "graph_breaks",
                "blocks_fused",
                "first_loss",
                "error",
            ],
        )
    if norm_rows:
        print_table(norm_rows, ["shape", "op", "provider", "mode", "ms", "GB/s", "pct_of_copy"])
    parts = (
        ["gpu" if cuda else "cpu"]
        + (["airbench94"] if airbench else [])
        + (["norms"] if args.no_train else [])
    )
    path = write_results(
        "resnet_train-" + "-".join(parts),
        {
            "args": vars(args),
            "path": "triton" if cuda else "reference (CPU smoke run: says nothing about the kernels)",
            "training": train_rows,
            "norm_kernels": norm_rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
