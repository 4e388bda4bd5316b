"""The portable compile cache: first compiled step in a fresh process, cold vs loaded from the cache file.

Every measurement runs in a new Python process whose Inductor cache directory
(``TORCHINDUCTOR_CACHE_DIR``) is a new empty folder, as on another machine or in a new
container:

* cold: ``CompiledStrategy(cache=<file>)`` compiles from scratch and writes the cache file;
* loaded: the same, reading that file before compiling (the load time is added to the step);
* warm (reference): Inductor's own local cache left by the cold run, same folder, no file:
  what a rerun on the same machine gets today.

The number is the wall time of the first training step (forward, backward, optimizer; it
holds the whole compile), read by a callback; process start-up is not in it. Repeats run
cold -> loaded -> warm in turn, and the median of each is reported. Validation is off so
the first step compiles the training graphs only.

    python benchmarks/compile_cache.py                       # small CNN and ResNet-18, 3 repeats
    python benchmarks/compile_cache.py --models small_cnn --repeats 5
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
import torchvision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lightning_plugin  # noqa: E402
import lightning_plugin.compile.mixin as compile_mixin  # noqa: E402
from _common import median, print_table, write_results  # noqa: E402

MODELS = ("small_cnn", "resnet18")


def build_network(name: str) -> nn.Module:
    if name == "small_cnn":
        return nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1, bias=False),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(64, 10),
        )
    if name == "resnet18":
        return torchvision.models.resnet18(num_classes=10)
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


class Classifier(L.LightningModule):
    def __init__(self, network: str) -> None:
        super().__init__()
        self.net = build_network(network)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class FirstStepTimer(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 0:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.seconds = time.perf_counter() - self.start


def worker(model: str, cache_file: str | None, batch: int, size: int) -> dict[str, float]:
    """One fit of two steps in this (fresh) process; the first step's time and the cache load time."""
    load_seconds = []
    load = compile_mixin.load_compile_cache

    def timed_load(*args, **kwargs):
        start = time.perf_counter()
        try:
            return load(*args, **kwargs)
        finally:
            load_seconds.append(time.perf_counter() - start)

    compile_mixin.load_compile_cache = timed_load
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(2 * batch, 3, size, size, generator=g), torch.randint(0, 10, (2 * batch,), generator=g)
    )
    timer = FirstStepTimer()
    strategy = lightning_plugin.CompiledStrategy(cache=cache_file or False, compile_eval=False)
    trainer = L.Trainer(
        accelerator="auto",
        devices=1,
        strategy=strategy,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    trainer.fit(Classifier(model), DataLoader(data, batch_size=batch))
    stats = strategy.compile_stats
    return {
        "first_step_s": timer.seconds,
        "load_s": sum(load_seconds),
        "graphs": stats.graphs,
        "compile_time_s": stats.compile_time_s,
    }


def in_fresh_process(args: argparse.Namespace, model: str, inductor_dir: str, cache_file: str | None) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor_dir}
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        model,
        "--batch",
        str(args.batch),
        "--size",
        str(args.size),
    ] + (["--cache-file", cache_file] if cache_file else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {model} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(args: argparse.Namespace, model: str) -> dict[str, list[float]]:
    runs: dict[str, list[float]] = {"cold": [], "loaded": [], "load": [], "warm": [], "cache_mb": []}
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="lcv-cache-bench-") as scratch:
            cache_file = os.path.join(scratch, "torch_compile_cache.bin")
            cold_dir, loaded_dir = os.path.join(scratch, "cold"), os.path.join(scratch, "loaded")
            cold = in_fresh_process(args, model, cold_dir, cache_file)
            loaded = in_fresh_process(args, model, loaded_dir, cache_file)
            warm = in_fresh_process(args, model, cold_dir, None)
            runs["cold"].append(cold["first_step_s"])
            runs["loaded"].append(loaded["first_step_s"] + loaded["load_s"])
            runs["load"].append(loaded["load_s"])
            runs["warm"].append(warm["first_step_s"])
            runs["cache_mb"].append(os.path.getsize(cache_file) / 2**20)
            print(
                f"{model} repeat {repeat + 1}: cold {cold['first_step_s']:.1f}s, "
                f"loaded {loaded['first_step_s']:.1f}s + load {loaded['load_s']:.2f}s, "
                f"warm {warm['first_step_s']:.1f}s",
                flush=True,
            )
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", choices=MODELS, help=argparse.SUPPRESS)
    parser.add_argument("--cache-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.cache_file, args.batch, args.size)))
        return

    rows, raw = [], {}
    for model in args.models:
        runs = raw[model] = measure(args, model)
        cold, loaded, warm = median(runs["cold"]), median(runs["loaded"]), median(runs["warm"])
        rows.append(
            {
                "model": model,
                "cold_s": cold,
                "loaded_s": loaded,
                "load_s": median(runs["load"]),
                "loaded/cold": loaded / cold,
                "warm_local_s": warm,
                "warm/cold": warm / cold,
                "cache_mb": median(runs["cache_mb"]),
            }
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = write_results(f"compile_cache-{device}", {"args": vars(args), "runs": raw, "results": rows})
    print(f"results written to {path}")
    print_table(
        rows,
        ["model", "cold_s", "loaded_s", "load_s", "loaded/cold", "warm_local_s", "warm/cold", "cache_mb"],
    )


if __name__ == "__main__":
    main()
