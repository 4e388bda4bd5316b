"""Eager vs ``strategy="compiled"`` training, per workload: steady-state speed and compile time.

Steady state: every side (``eager`` = Lightning's default strategy, ``compiled`` = the compiled
strategy as users get it, ``untuned`` = the compiled strategy with ``tune_cpu=False``: stock Inductor
settings, the LightningModule's own optimizer step; ``auto`` = the compiled strategy with ``compile="auto"``,
which measures its own compiled and eager steps and keeps the faster: its decision and the ratio it measured
are recorded, each fit measuring anew with an empty decision cache; ``compile_step`` = the compiled strategy
with ``compile_step=True``, forward, backward and the optimizer update as one graph per step) trains the
same workload in this process, one fit after another in turn, ``--repeats`` times; each fit's first
``--warmup`` steps are not timed and the median step time of the rest is kept, then the median over
repeats. ``digits-small`` trains the recipe's own module and data (``lcv_vision.recipes.build``) for
``--epochs`` epochs and counts images per second after the first epoch, as ``lcv fit --recipe digits-small``
would.

glibc's memory settings (:mod:`lightning_plugin.cpu.memory`) belong to the process, so they are made once
before the first fit and every side runs with them, eager included: the ratios leave out what they save the
compiled side against an eager run with glibc's defaults (conservative).

Compile time: the first compiled training step in a fresh process with an empty Inductor cache
(``TORCHINDUCTOR_CACHE_DIR`` a new temporary folder: cold), then in a second process with the cache
the first left behind (warm).

    python benchmarks/strategy_overhead.py                               # all workloads (~10 min on 2 cores)
    python benchmarks/strategy_overhead.py --workloads resnet18,vit_tiny --sides eager,compiled,untuned
    python benchmarks/strategy_overhead.py --no-compile-time --repeats 5
    python benchmarks/strategy_overhead.py --workloads hf_vit_tiny,hf_convnext_tiny --tag hf   # needs transformers
    python benchmarks/strategy_overhead.py --workloads hf_vit_tiny --sides eager,compiled,auto --steps 16

``hf_vit_tiny`` and ``hf_convnext_tiny`` are Hugging Face ``transformers`` classifiers built from configs
(``hf:vit-tiny`` with 4-pixel patches for 32 px images, as ``vit_tiny``; ``hf:convnext-tiny``, the full
ConvNeXt-T, at 32 px) through :mod:`lcv_vision.models.hf`, so they train as ``--model.model hf:...`` does.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # our packages, uninstalled
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vision"))
import lightning_plugin  # noqa: E402
from _common import ResultStream, machine_info, median, print_table, write_results  # noqa: E402
from lightning_plugin.cpu.memory import retain_freed_memory  # noqa: E402


class SmallCNN(nn.Module):
    def __init__(self, channels: int, num_classes: int = 10) -> None:
        super().__init__()
        c = channels
        self.features = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1, bias=False),
            nn.BatchNorm2d(c),
            nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * c),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * c, 2 * c, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * c),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(2 * c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


class Classifier(L.LightningModule):
    """Cross-entropy and SGD with momentum around any image classifier."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


@dataclass(frozen=True)
class Workload:
    """A model and its synthetic data: ``batch`` images of ``size`` px per training step."""

    name: str
    build: Callable[[], nn.Module]
    batch: int
    size: int


def _torchvision(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision

        return getattr(torchvision.models, name)(num_classes=10)

    return build


def _vit_tiny() -> nn.Module:
    from lcv_vision.models import create_model

    return create_model("vit_tiny_patch4_32", num_classes=10)


def _hf(name: str, **config: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from lcv_vision.models import create_model

        return create_model(f"hf:{name}", num_classes=10, **config)

    return build


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("small_cnn", lambda: SmallCNN(32), batch=64, size=32),
        Workload("resnet18", _torchvision("resnet18"), batch=32, size=64),
        Workload("mobilenet_v3_small", _torchvision("mobilenet_v3_small"), batch=32, size=64),
        Workload("vit_tiny", _vit_tiny, batch=32, size=32),
        Workload("hf_vit_tiny", _hf("vit-tiny", image_size=32, patch_size=4), batch=32, size=32),
        Workload("hf_convnext_tiny", _hf("convnext-tiny"), batch=32, size=32),
    )
}
RECIPE_WORKLOAD = "digits-small"
ALL_WORKLOADS = (*WORKLOADS, RECIPE_WORKLOAD)
SIDES = ("eager", "compiled", "untuned", "auto", "compile_step")


#: Where ``--compile-backend`` is kept, so that the fresh processes timing the first step inherit it.
BACKEND_ENV = "LCV_BENCH_COMPILE_BACKEND"


def strategy_for(side: str) -> Any:
    """The ``compiled`` and ``untuned`` sides use ``compile="always"``: with the default ``"auto"`` a side
    that measured slower than eager would switch to eager after its first steps, and this benchmark would
    time eager twice. The ``auto`` side is that default, to record what it decides."""
    if side == "eager":
        return "auto"
    backend = os.environ.get(BACKEND_ENV, "inductor")
    if side == "auto":
        return lightning_plugin.CompiledStrategy(backend=backend, compile="auto")
    if side == "compile_step":
        return lightning_plugin.CompiledStrategy(backend=backend, compile="always", compile_step=True)
    if backend != "inductor":
        return lightning_plugin.CompiledStrategy(backend=backend, compile="always")
    if side == "compiled":
        return lightning_plugin.CompiledStrategy(compile="always")
    return lightning_plugin.CompiledStrategy(tune_cpu=False, compile="always")


class BatchTimer(L.Callback):
    """Start and end of every training step (clock read after a device sync) and its number of images."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, float, float, int]] = []  # (epoch, start, end, images)
        self._start = 0.0
        self.decision: Any = None  # compile="auto": the strategy's CompileDecision at the end of the fit

    def on_train_end(self, trainer, pl_module):
        self.decision = getattr(trainer.strategy, "compile_decision", None)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        _sync()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        _sync()
        images = batch[0] if isinstance(batch, (list, tuple)) else next(iter(batch.values()))
        self.steps.append((trainer.current_epoch, self._start, time.perf_counter(), len(images)))

    def step_seconds(self, skip: int) -> list[float]:
        return [end - start for _, start, end, _ in self.steps[skip:]]

    def images_per_second_after_first_epoch(self) -> float:
        """Images over wall time of each epoch's training steps (data loading between them included)."""
        rates = []
        for epoch in sorted({e for e, *_ in self.steps} - {0}):
            steps = [s for s in self.steps if s[0] == epoch]
            rates.append(sum(s[3] for s in steps) / (steps[-1][2] - steps[0][1]))
        return median(rates)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _trainer(strategy: Any, timer: BatchTimer, **kwargs: Any) -> L.Trainer:
    # A folder of its own per fit: the strategy's compile cache file goes to default_root_dir and is loaded
    # from there, so the working folder would collect it and make the next run's "cold" compiles warm.
    run_dir = tempfile.mkdtemp(prefix="lcv-strategy-overhead-")
    atexit.register(shutil.rmtree, run_dir, ignore_errors=True)
    return L.Trainer(
        default_root_dir=run_dir,
        accelerator="auto",
        devices=1,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
        num_sanity_val_steps=0,
        **kwargs,
    )


def fit_synthetic(workload: Workload, side: str, steps: int) -> BatchTimer:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    n = workload.batch * steps
    data = TensorDataset(
        torch.randn(n, 3, workload.size, workload.size, generator=g), torch.randint(0, 10, (n,), generator=g)
    )
    timer = BatchTimer()
    with _fresh_decision_cache():
        _trainer(strategy_for(side), timer, max_epochs=1).fit(
            Classifier(workload.build()), DataLoader(data, batch_size=workload.batch, drop_last=True)
        )
    return timer


@contextlib.contextmanager
def _fresh_decision_cache() -> Iterator[None]:
    """An empty ``compile="auto"`` decision cache for one fit: the ``auto`` side measures in every repeat
    instead of reading the first repeat's decision (or a decision of the user's own runs)."""
    from lightning_plugin.kernel_choice.cache import CACHE_DIR_ENV

    before = os.environ.get(CACHE_DIR_ENV)
    with tempfile.TemporaryDirectory(prefix="lcv-decisions-") as folder:
        os.environ[CACHE_DIR_ENV] = folder
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(CACHE_DIR_ENV, None)
            else:
                os.environ[CACHE_DIR_ENV] = before


def fit_recipe(side: str, epochs: int, limit_batches: int | None = None) -> BatchTimer:
    from lcv_vision.recipes import build, trainer_kwargs

    L.seed_everything(0, verbose=False)
    module, datamodule = build(RECIPE_WORKLOAD)
    precision = trainer_kwargs(RECIPE_WORKLOAD, gpu=torch.cuda.is_available())["precision"]
    timer = BatchTimer()
    limits = {} if limit_batches is None else {"limit_train_batches": limit_batches, "limit_val_batches": 0}
    with _fresh_decision_cache():
        _trainer(strategy_for(side), timer, max_epochs=epochs, precision=precision, **limits).fit(
            module, datamodule
        )
    return timer


def first_step_in_fresh_process(workload: str, cache_dir: str) -> float:
    """Seconds of the first compiled step in a new Python process using ``cache_dir`` as Inductor's cache."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    cmd = [sys.executable, os.path.abspath(__file__), "--first-step-only", workload]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["first_step_s"]


def measure(workload: str, args: argparse.Namespace) -> dict[str, Any]:
    """Steady state of every side in turn, ``--repeats`` times; medians."""
    per_repeat: dict[str, list[float]] = {side: [] for side in args.sides}
    decisions: list[dict[str, Any]] = []
    for _ in range(args.repeats):
        for side in args.sides:
            if workload == RECIPE_WORKLOAD:
                timer = fit_recipe(side, args.epochs)
                per_repeat[side].append(timer.images_per_second_after_first_epoch())
            else:
                timer = fit_synthetic(WORKLOADS[workload], side, args.steps)
                per_repeat[side].append(1e3 * median(timer.step_seconds(args.warmup)))
            if side == "auto":
                decisions.append(_decision_record(timer.decision))
    row: dict[str, Any] = {"workload": workload}
    unit = "img/s" if workload == RECIPE_WORKLOAD else "ms/step"
    for side in args.sides:
        row[f"{side} {unit}"] = median(per_repeat[side])
    for side in args.sides:
        if side != "eager" and "eager" in args.sides:
            faster = row[f"eager {unit}"] / row[f"{side} {unit}"]
            row[f"{side} ratio"] = 1 / faster if unit == "img/s" else faster
    if decisions:
        row["auto decisions"] = decisions  # one per repeat; its ms/step mixes measuring and decided steps
    row["per_repeat"] = per_repeat
    return row


def _decision_record(decision: Any) -> dict[str, Any]:
    """What ``compile="auto"`` decided in one fit, and its one-line reason (none: the fit ended first)."""
    if decision is None:
        return {
            "choice": None,
            "line": "no decision: the fit ended before the measurement did (more --steps)",
        }
    return {"choice": decision.choice, "speedup": decision.speedup, "line": decision.describe()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workloads",
        default=",".join(ALL_WORKLOADS),
        help=f"comma-separated, from {', '.join(ALL_WORKLOADS)}",
    )
    parser.add_argument("--sides", default="eager,compiled", help=f"comma-separated, from {', '.join(SIDES)}")
    parser.add_argument(
        "--steps", type=int, default=25, help="steps per fit; the first --warmup are not timed"
    )
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--epochs", type=int, default=3, help="digits-small: epochs per fit (the first is not timed)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--no-compile-time",
        action="store_true",
        help="skip the first-step compile times in fresh processes (cold and warm cache)",
    )
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend ('eager' in dry runs: exercises the code, compiles nothing)",
    )
    parser.add_argument(
        "--tag", default="", help="appended to the results file name (strategy_overhead-<device>-<tag>.json)"
    )
    parser.add_argument("--first-step-only", metavar="WORKLOAD", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ[BACKEND_ENV] = args.compile_backend

    if args.first_step_only:
        if args.first_step_only == RECIPE_WORKLOAD:
            timer = fit_recipe("compiled", epochs=1, limit_batches=2)
        else:
            timer = fit_synthetic(WORKLOADS[args.first_step_only], "compiled", steps=2)
        print(json.dumps({"first_step_s": timer.step_seconds(0)[0]}))
        return

    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    args.sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = [w for w in args.workloads if w not in ALL_WORKLOADS] + [
        s for s in args.sides if s not in SIDES
    ]
    if unknown:
        parser.error(
            f"unknown workload(s)/side(s) {unknown}; workloads: {list(ALL_WORKLOADS)}, sides: {list(SIDES)}"
        )
    if args.warmup >= args.steps:
        parser.error(f"--warmup ({args.warmup}) must be smaller than --steps ({args.steps})")
    if args.epochs < 2:
        parser.error("--epochs must be at least 2 (the first epoch is not timed)")

    kept = retain_freed_memory()  # process-wide: every side runs with it (see the module docstring)
    print(
        f"machine: {machine_info()['device']}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"glibc keeps freed memory: {kept}",
        flush=True,
    )
    load_before = os.getloadavg()
    stream = ResultStream("strategy_overhead")
    rows = []
    for workload in args.workloads:
        row = measure(workload, args)
        if not args.no_compile_time:
            with tempfile.TemporaryDirectory(prefix="lcv-inductor-cache-") as cache_dir:
                row["compile cold s"] = first_step_in_fresh_process(workload, cache_dir)
                row["compile warm s"] = first_step_in_fresh_process(workload, cache_dir)
        rows.append(stream.add(row))
        print(json.dumps({k: v for k, v in row.items() if k != "per_repeat"}, default=str), flush=True)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = f"strategy_overhead-{device}" + (f"-{args.tag}" if args.tag else "")
    load = {"before": load_before, "after": os.getloadavg(), "cores": os.cpu_count()}
    path = write_results(name, {"args": vars(args), "load_average": load, "results": rows})
    print(f"results written to {path}")
    listed = {k for r in rows for k in r if k not in ("per_repeat", "auto decisions")}
    columns = sorted(listed, key=lambda k: (k != "workload", k))
    print_table(rows, columns)


if __name__ == "__main__":
    main()
