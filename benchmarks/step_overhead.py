"""What the Trainer adds to a training step: a plain PyTorch loop against ``Trainer(strategy="compiled")``.

A tiny model (``Linear(8, 2)``, batch 4) makes the compute near zero, so each side's step time is the host
work of its loop. Three sides train the same model, data and optimizer in this one process:

* ``plain``: a PyTorch loop around the compiled ``forward`` (the same ``torch.compile`` the strategy does),
  the loss and accuracy computed as the module's ``training_step`` computes them, ``zero_grad``,
  ``backward``, ``step``;
* ``compiled``: ``Trainer(strategy=CompiledStrategy(compile="always"))`` with Lightning's defaults (progress
  bar, TensorBoard logger, checkpointing), the module calling ``self.log`` on its loss (``prog_bar=True``) and
  accuracy every step, as the recipes' module does;
* ``lightning``: the same Trainer with Lightning's default strategy (the model eager);
* ``compiled_lightning_path`` (``--sides``): the compiled strategy with its fast step off (``fast_step=False``,
  Lightning's own logging and closure), to show what the fast path saves;
* ``compile_step`` (``--sides``): the compiled strategy with ``compile_step=True``: forward, backward and the
  SGD update traced as one graph (:mod:`lightning_plugin.compile.whole_step`).

A step's time is read where the loader hands out its batches (a ``collate_fn`` that stamps the clock): the
same point for every side, and no callback of ours in the step. The sides run in turn, ``--repeats`` times,
``--steps`` steps a fit; each fit's first ``--warmup`` steps are left out and the median step of the rest is
kept, then the median over repeats. A cProfile of one more fit of each of ``plain`` and ``compiled`` says where
the difference goes.

The CPU this runs on may be shared with other jobs (``load_average`` in the JSON says how loaded it was);
the sides alternate so that the load falls on all of them alike, and medians keep the outliers out.

    python benchmarks/step_overhead.py                       # ~2 min on 2 cores
    python benchmarks/step_overhead.py --steps 60 --warmup 10 --repeats 1 --backend eager --no-profile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data._utils.collate import default_collate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # our packages, uninstalled
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels"))
import lightning_plugin  # noqa: E402
from _common import machine_info, median, out_of_time, print_table, write_results  # noqa: E402

SIDES = ("plain", "compiled", "lightning", "compiled_lightning_path", "compile_step")
BATCH = 4


class TinyModule(L.LightningModule):
    """``Linear(8, 2)``; logs loss (on the progress bar) and accuracy every step, like the recipes' module."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss, acc = loss_and_accuracy(logits, y)
        self.log("train/loss", loss.detach(), prog_bar=True)
        self.log("train/acc", acc)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def loss_and_accuracy(logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return F.cross_entropy(logits, y), (logits.detach().argmax(dim=1) == y).float().mean()


class StampedLoader:
    """A DataLoader whose ``collate_fn`` records the clock each time it makes a batch."""

    def __init__(self, steps: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        n = BATCH * steps
        self.data = TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 2, (n,), generator=g))
        self.stamps: list[float] = []
        self.cpu_stamps: list[float] = []

    def _collate(self, items: list[Any]) -> Any:
        self.stamps.append(time.perf_counter())
        self.cpu_stamps.append(time.process_time())
        return default_collate(items)

    def loader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=BATCH, collate_fn=self._collate)

    def step_seconds(self, warmup: int, cpu: bool = False) -> list[float]:
        """Time between consecutive batches after ``warmup`` of them: one step each in the steady state.

        ``cpu``: the process's CPU time instead of wall time (all its threads: a progress bar's drawing
        thread counts), which other jobs on a shared machine disturb far less."""
        kept = (self.cpu_stamps if cpu else self.stamps)[warmup:]
        return [b - a for a, b in zip(kept, kept[1:], strict=False)]


def run_plain(
    module: TinyModule, compiled_forward: Callable[..., Any], steps: int, device: str = "cpu"
) -> StampedLoader:
    """The loop without a framework: what the strategy's step should cost."""
    stamped = StampedLoader(steps)
    module.to(device)
    optimizer = module.configure_optimizers()
    if device == "cpu":
        for group in optimizer.param_groups:  # the strategy's CPU setting (tune_cpu): the fused step
            group["fused"] = True
    module.train()
    for x, y in stamped.loader():
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss, _ = loss_and_accuracy(compiled_forward(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return stamped


def strategy_for(side: str, backend: str) -> Any:
    if side == "lightning":
        return "auto"
    # compile="always": with "auto" the tiny model would be measured and kept eager after a few steps.
    return lightning_plugin.CompiledStrategy(
        compile="always",
        backend=backend,
        fast_step=side != "compiled_lightning_path",
        compile_step=side == "compile_step",
    )


def progress_bar_kwargs(bar: str) -> dict[str, Any]:
    """Trainer arguments for ``--progress-bar``: Lightning's default (Rich when installed), or one named."""
    if bar == "default":
        return {}
    if bar == "none":
        return {"enable_progress_bar": False}
    if bar == "lcv":  # the recipes' bar (lcv fit)
        sys.path.insert(
            0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vision")
        )
        from lcv_vision.callbacks import LcvProgressBar

        return {"callbacks": [LcvProgressBar()]}
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

    return {"callbacks": [RichProgressBar() if bar == "rich" else TQDMProgressBar()]}


def run_trainer(
    module: TinyModule,
    side: str,
    steps: int,
    backend: str,
    root: str,
    bar: str = "default",
    device: str = "cpu",
) -> StampedLoader:
    stamped = StampedLoader(steps)
    trainer = L.Trainer(
        default_root_dir=root,
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=1,
        strategy=strategy_for(side, backend),
        max_steps=steps,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **progress_bar_kwargs(bar),
    )
    trainer.fit(module, stamped.loader())
    return stamped


class Sides:
    """One module per side, kept across repeats (the compiled graphs are made once)."""

    def __init__(self, backend: str, root: str, bar: str = "default", device: str = "cpu") -> None:
        self.backend, self.root, self.bar, self.device = backend, root, bar, device
        self.modules: dict[str, TinyModule] = {}
        self._plain_forward: Callable[..., Any] | None = None

    def run(self, side: str, steps: int) -> StampedLoader:
        torch.manual_seed(0)
        module = self.modules.setdefault(side, TinyModule())
        if side == "plain":
            if self._plain_forward is None:
                self._plain_forward = torch.compile(module.forward, backend=self.backend)
            return run_plain(module, self._plain_forward, steps, self.device)
        root = os.path.join(self.root, side)
        return run_trainer(module, side, steps, self.backend, root, self.bar, self.device)


class CudaSyncWarnings:
    """On CUDA: ``torch.cuda.set_sync_debug_mode("warn")`` around the timed fits, counting the host syncs
    it reports (the logging steps make some: the logger writes numbers). Nothing on a CPU."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.count = 0

    def __enter__(self) -> CudaSyncWarnings:
        if self.device == "cuda":
            self._caught = warnings.catch_warnings(record=True)
            self._records = self._caught.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
            self.count += sum("synchroniz" in str(w.message) for w in self._records)
            self._caught.__exit__(*exc)


def profile_side(sides: Sides, side: str, steps: int, top: int) -> tuple[float, str]:
    """cProfile of one fit of ``side``: total seconds per step and the ``top`` functions by own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    sides.run(side, steps)
    profiler.disable()
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream)
    total = stats.total_tt  # type: ignore[attr-defined]
    stats.sort_stats("tottime").print_stats(top)
    return total / steps, stream.getvalue()


def info_gpu() -> str:
    return str(machine_info()["gpu"])


def lightning_functions(text: str) -> str:
    """The rows of a pstats listing (header kept) that come from Lightning or this project."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    keep = [lines[start]] + [ln for ln in lines[start + 1 :] if "lightning" in ln or "tqdm" in ln]
    return "\n".join(keep)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=400, help="steps per fit")
    parser.add_argument("--warmup", type=int, default=50, help="first steps of each fit not timed")
    parser.add_argument("--repeats", type=int, default=5, help="fits per side, in turn")
    parser.add_argument("--sides", default="plain,compiled,lightning", help=f"from {', '.join(SIDES)}")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend ('eager' for dry runs)")
    parser.add_argument(
        "--progress-bar",
        default="default",
        choices=("default", "rich", "tqdm", "lcv", "none"),
        help="the Trainer sides' progress bar: Lightning's default (Rich when installed), or one named "
        "(lcv: the recipes' LcvProgressBar)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads: 1 keeps a loaded machine's thread wake-ups out of a step this small",
    )
    parser.add_argument("--no-profile", action="store_true", help="skip the cProfile fits")
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda")
    )
    parser.add_argument(
        "--cpp-wrapper-min-ops",
        type=int,
        default=None,
        help="the compiled sides' CPP_WRAPPER_MIN_OPS (lightning_plugin/cpu/inductor.py; 0: the C++ wrapper "
        "for every graph); default: the strategy's own",
    )
    parser.add_argument(
        "--out", default=None, help="results file name (no .json; default step_overhead-DEVICE)"
    )
    args = parser.parse_args(argv)
    sides_run = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = sorted(set(sides_run) - set(SIDES))
    if unknown or "plain" not in sides_run:
        parser.error(f"--sides must include 'plain' and be from {list(SIDES)}; got unknown {unknown}")
    if args.warmup + 2 > args.steps:
        parser.error(f"--warmup ({args.warmup}) leaves fewer than 2 timed steps of --steps ({args.steps})")

    if args.cpp_wrapper_min_ops is not None:
        if args.cpp_wrapper_min_ops < 0:
            parser.error(f"--cpp-wrapper-min-ops must be >= 0; got {args.cpp_wrapper_min_ops}")
        from lightning_plugin.cpu import inductor as cpu_inductor

        cpu_inductor.CPP_WRAPPER_MIN_OPS = args.cpp_wrapper_min_ops
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")
    root = tempfile.mkdtemp(prefix="lcv-step-overhead-")
    load_start = os.getloadavg()[0]
    try:
        sides = Sides(args.backend, root, args.progress_bar, args.device)
        for side in sides_run:  # compile and warm every side once, untimed
            sides.run(side, min(args.steps, args.warmup + 2))
        per_repeat: dict[str, list[float]] = {side: [] for side in sides_run}
        per_repeat_cpu: dict[str, list[float]] = {side: [] for side in sides_run}
        sync_warnings = {side: CudaSyncWarnings(args.device) for side in sides_run}
        repeat_s = 0.0
        for repeat in range(args.repeats):
            if repeat and out_of_time(2 * repeat_s):  # under gpu_check's deadline: keep what was measured
                print(f"deadline: {repeat} of {args.repeats} repeats measured", flush=True)
                break
            started = time.perf_counter()
            for side in sides_run:
                with sync_warnings[side]:
                    stamped = sides.run(side, args.steps)
                per_repeat[side].append(1e6 * median(stamped.step_seconds(args.warmup)))
                per_repeat_cpu[side].append(1e6 * median(stamped.step_seconds(args.warmup, cpu=True)))
            repeat_s = time.perf_counter() - started
        profile: dict[str, Any] = {}
        if not args.no_profile and not out_of_time(2 * repeat_s):
            plain_us, _ = profile_side(sides, "plain", args.steps, 0)
            compiled_us, listing = profile_side(sides, "compiled", args.steps, 40)
            profile = {
                "plain us/step under cProfile": 1e6 * plain_us,
                "compiled us/step under cProfile": 1e6 * compiled_us,
                "compiled top functions by own time": lightning_functions(listing),
            }
    finally:
        shutil.rmtree(root, ignore_errors=True)

    plain, plain_cpu = median(per_repeat["plain"]), median(per_repeat_cpu["plain"])
    rows = []
    for side in sides_run:
        us, cpu_us = median(per_repeat[side]), median(per_repeat_cpu[side])
        rows.append(
            {
                "side": side,
                "us/step": us,
                "minus plain us": us - plain,
                "ratio": us / plain,
                "cpu us/step": cpu_us,
                "cpu minus plain us": cpu_us - plain_cpu,
            }
        )
    overhead = median(per_repeat["compiled"]) - plain if "compiled" in per_repeat else None
    overhead_cpu = median(per_repeat_cpu["compiled"]) - plain_cpu if "compiled" in per_repeat else None
    payload = {
        "args": vars(args),
        # the machine's load (1-minute average) when the sides started and when they ended: other jobs on
        # the same cores show here (on the shared 2-core CPU it has been 12-17 during some runs)
        "load_average": {"start": load_start, "end": os.getloadavg()[0]},
        "gpu": "not measured on GPU" if args.device == "cpu" else info_gpu(),
        "results": rows,
        "per_repeat_us": per_repeat,
        "per_repeat_cpu_us": per_repeat_cpu,
        "compiled_minus_plain_us": overhead,
        "compiled_minus_plain_cpu_us": overhead_cpu,
        "target_us": 150,
        "device": args.device,
        "cuda_syncs_warned_per_fit": (
            {side: w.count / args.repeats for side, w in sync_warnings.items()}
            if args.device == "cuda"
            else None
        ),
        "profile": profile,
    }
    info = machine_info()
    path = write_results(args.out or f"step_overhead-{args.device}", payload)
    print(
        f"machine: {info['device']}, {info['cpu_count']} cores, load average {load_start:.1f} at the start and "
        f"{payload['load_average']['end']:.1f} at the end, torch {info['torch']}"
    )
    print_table(rows, ["side", "us/step", "minus plain us", "ratio", "cpu us/step", "cpu minus plain us"])
    if overhead is not None and overhead_cpu is not None:
        print(
            f"compiled - plain: {overhead:.0f} us/step wall, {overhead_cpu:.0f} us/step of CPU time (target <= 150)"
        )
    if profile:
        print(
            f"\ncProfile: plain {profile['plain us/step under cProfile']:.0f} us/step, compiled "
            f"{profile['compiled us/step under cProfile']:.0f} us/step; Lightning/project functions of the "
            "compiled fit by own time:"
        )
        print(profile["compiled top functions by own time"])
    print(f"results written to {path}")
    return payload


if __name__ == "__main__":
    main()
