"""What each CPU setting of the compiled strategy (``CompileConfig.tune_cpu``) does to a training step.

One plain training step (forward, cross-entropy, backward, optimizer step; no Lightning) per workload of
``strategy_overhead.py``, in variants that add the settings one at a time:

- ``eager``: PyTorch's default step (the optimizer's own loop);
- ``stock``: the forward compiled by stock Inductor (its layout optimisation on);
- ``no-layout``: Inductor with ``layout_optimization=False`` (:mod:`lightning_plugin.cpu.inductor`);
- ``+fused``: and the optimizer's fused step (:mod:`lightning_plugin.cpu.fused_optimizer`);
- ``+cpp-wrapper``: and Inductor's C++ wrapper: everything the strategy applies.

All variants of a workload live in one process and take turns (``--repeats`` rounds of ``--steps`` steps,
the first 2 of each not timed; medians). glibc's memory settings (:mod:`lightning_plugin.cpu.memory`) are per
process, so each workload runs twice, in a fresh process each: with glibc's defaults and with memory kept;
the minor page faults per step are counted for each variant.

    python benchmarks/cpu_tuning.py                                  # resnet18, mobilenet_v3_small, small_cnn
    python benchmarks/cpu_tuning.py --workloads digits --repeats 5  # the digits-small network on real digits
    python benchmarks/cpu_tuning.py --workloads digits --precisions fp32,bf16  # and under bf16 autocast

``x eager`` is against the fp32 eager step of the same process.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # our packages, uninstalled
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vision"))
from _common import machine_info, median, print_table, write_results  # noqa: E402
from lightning_plugin.cpu.memory import retain_freed_memory  # noqa: E402

VARIANTS: dict[str, dict[str, Any]] = {
    "eager": {},
    "stock": {"options": {}},
    "no-layout": {"options": {"layout_optimization": False}},
    "+fused": {"options": {"layout_optimization": False}, "fused": True},
    "+cpp-wrapper": {"options": {"layout_optimization": False, "cpp_wrapper": True}, "fused": True},
}
WORKLOADS = ("resnet18", "mobilenet_v3_small", "small_cnn", "digits")


def _model_and_batch(workload: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The workload's network and one batch (``digits``: the recipe's channels_last network, a real batch)."""
    if workload == "digits":
        from lcv_vision.recipes import build

        module, datamodule = build("digits-small")
        datamodule.setup("fit")
        x, y = next(iter(datamodule.train_dataloader()))
        module.model.init_whitening(x)
        return module.model, x.contiguous(memory_format=torch.channels_last), y
    from strategy_overhead import WORKLOADS as SYNTHETIC

    w = SYNTHETIC[workload]
    g = torch.Generator().manual_seed(0)
    return w.build(), torch.randn(w.batch, 3, w.size, w.size, generator=g), torch.randint(0, 10, (w.batch,))


def measure_in_this_process(
    workload: str, steps: int, repeats: int, precisions: tuple[str, ...] = ("fp32",)
) -> dict[str, Any]:
    torch.manual_seed(0)
    base, x, y = _model_and_batch(workload)
    runs = {}
    for precision in precisions:
        for name, variant in VARIANTS.items():
            model = copy.deepcopy(base)
            optimizer = torch.optim.SGD(
                model.parameters(), lr=0.01, momentum=0.9, fused=True if variant.get("fused") else None
            )
            forward = torch.compile(model, options=variant["options"]) if "options" in variant else model
            label = name if precision == "fp32" else f"{name} {precision}"
            runs[label] = (forward, optimizer, precision == "bf16")

    def run(name: str, n: int) -> tuple[list[float], int]:
        forward, optimizer, bf16 = runs[name]
        times = []
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(n):
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # Lightning's "bf16-mixed"
                loss = F.cross_entropy(forward(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            times.append(time.perf_counter() - start)
        return times, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults

    for name in runs:  # compile
        run(name, 3)
    ms: dict[str, list[float]] = {name: [] for name in runs}
    faults: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name in runs:
            times, n_faults = run(name, steps)
            ms[name].append(1e3 * median(times[2:]))
            faults[name].append(n_faults / steps)
    return {name: {"ms": median(ms[name]), "faults_per_step": median(faults[name])} for name in runs}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workloads", default="resnet18,mobilenet_v3_small,small_cnn")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--precisions",
        default="fp32",
        help="comma-separated: fp32 and/or bf16 (autocast, Lightning's bf16-mixed); every variant in each",
    )
    parser.add_argument("--child", choices=("default", "kept"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; choose from {list(WORKLOADS)}")
    precisions = tuple(p for p in args.precisions.split(",") if p)
    if not precisions or set(precisions) - {"fp32", "bf16"}:
        parser.error(f"--precisions takes fp32 and/or bf16, got {args.precisions!r}")
    if args.steps < 4:
        parser.error("--steps must be at least 4 (the first 2 of each round are not timed)")

    if args.child:
        if args.child == "kept" and not retain_freed_memory():
            print(json.dumps(None))
            return
        print(json.dumps(measure_in_this_process(workloads[0], args.steps, args.repeats, precisions)))
        return

    print(
        f"machine: {machine_info()['device']}, {os.cpu_count()} cores, torch {torch.__version__}", flush=True
    )
    rows = []
    for workload in workloads:
        for memory in ("default", "kept"):
            cmd = [sys.executable, os.path.abspath(__file__), "--workloads", workload, "--child", memory]
            cmd += [
                "--steps",
                str(args.steps),
                "--repeats",
                str(args.repeats),
                "--precisions",
                args.precisions,
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            if result is None:
                print(f"{workload}: glibc memory settings not available here; skipped")
                continue
            eager_ms = result["eager"]["ms"]
            for name, r in result.items():
                row = {
                    "workload": workload,
                    "glibc memory": memory,
                    "variant": name,
                    "ms/step": round(r["ms"], 2),
                    "x eager": round(eager_ms / r["ms"], 3),
                    "faults/step": round(r["faults_per_step"]),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    name = "cpu_tuning" if precisions == ("fp32",) else f"cpu_tuning-{'-'.join(precisions)}"
    path = write_results(name, {"args": vars(args), "results": rows})
    print(f"results written to {path}")
    print_table(rows, ["workload", "glibc memory", "variant", "ms/step", "x eager", "faults/step"])


if __name__ == "__main__":
    main()
