"""Eager vs ``strategy="compiled"`` on a small CNN: steady-state step time and compile time.

Steady state: both sides train the same model on the same data in this process, under
Lightning, and the median step time after warm-up is compared. Compile time: the first
training step in a fresh process, with an empty Inductor cache (cold) and then with the
cache that run left behind (warm).

    python benchmarks/strategy_overhead.py              # defaults: batch 64, 32x32, 60 steps, 3 repeats
    python benchmarks/strategy_overhead.py --steps 200 --channels 64
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ResultStream, median, print_table, write_results  # noqa: E402

import lightning_plugin  # noqa: E402


class SmallCNN(nn.Module):
    def __init__(self, channels: int, num_classes: int = 10) -> None:
        super().__init__()
        c = channels
        self.features = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, padding=1, bias=False), nn.BatchNorm2d(2 * c), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(2 * c, 2 * c, 3, padding=1, bias=False), nn.BatchNorm2d(2 * c), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Linear(2 * c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


class Classifier(L.LightningModule):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.net = SmallCNN(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class StepTimer(L.Callback):
    """Wall time of each training step (the clock is read after a device sync)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        _sync()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        _sync()
        self.times.append(time.perf_counter() - self._start)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _loader(args: argparse.Namespace, steps: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    n = args.batch * steps
    x = torch.randn(n, 3, args.size, args.size, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=args.batch, drop_last=True)


def run(args: argparse.Namespace, strategy: str, steps: int) -> list[float]:
    torch.manual_seed(0)
    timer = StepTimer()
    if strategy == "compiled" and args.compile_backend != "inductor":
        strategy = lightning_plugin.CompiledStrategy(backend=args.compile_backend)
    trainer = L.Trainer(
        accelerator="auto", devices=1, strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
    )
    trainer.fit(Classifier(args.channels), _loader(args, steps))
    return timer.times


def first_step_in_fresh_process(args: argparse.Namespace, cache_dir: str) -> float:
    """Seconds of the first compiled step in a new Python process using ``cache_dir`` as Inductor's cache."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    cmd = [sys.executable, __file__, "--first-step-only", "--batch", str(args.batch), "--size", str(args.size),
           "--channels", str(args.channels), "--compile-backend", args.compile_backend]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["first_step_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--steps", type=int, default=60, help="steps per run; the first --warmup are not timed")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend ('eager' in dry runs: exercises the code, compiles nothing)")
    parser.add_argument("--no-first-step", action="store_true",
                        help="skip the first-step compile times in fresh processes (cold and warm cache)")
    parser.add_argument("--first-step-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warmup >= args.steps:
        parser.error(f"--warmup ({args.warmup}) must be smaller than --steps ({args.steps})")

    if args.first_step_only:
        print(json.dumps({"first_step_s": run(args, "compiled", 2)[0]}))
        return

    cold = warm = float("nan")
    if not args.no_first_step:
        with tempfile.TemporaryDirectory(prefix="lcv-inductor-cache-") as cache_dir:
            cold = first_step_in_fresh_process(args, cache_dir)
            warm = first_step_in_fresh_process(args, cache_dir)

    medians: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(args.repeats):
        for name, strategy in (("eager", "auto"), ("compiled", "compiled")):
            medians[name].append(median(run(args, strategy, args.steps)[args.warmup:]))
    eager_ms = 1e3 * median(medians["eager"])
    compiled_ms = 1e3 * median(medians["compiled"])
    rows = [
        {"measure": "steady-state step, eager (ms)", "value": eager_ms},
        {"measure": "steady-state step, compiled (ms)", "value": compiled_ms},
        {"measure": "speed-up (eager / compiled)", "value": eager_ms / compiled_ms},
        {"measure": "first compiled step, cold cache (s)", "value": cold},
        {"measure": "first compiled step, warm cache (s)", "value": warm},
        {"measure": "cold / warm compile", "value": cold / warm},
    ]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = write_results(
        f"strategy_overhead-{device}",
        {"args": vars(args), "per_repeat_median_s": medians, "results": {r["measure"]: r["value"] for r in rows}},
    )
    stream = ResultStream("strategy_overhead")
    for row in rows:
        stream.add(row)
    print(f"results written to {path}")
    print_table(rows, ["measure", "value"])


if __name__ == "__main__":
    main()
