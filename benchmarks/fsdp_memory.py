"""Memory per rank and step time: ``compiled_ddp`` vs ``compiled_fsdp`` vs Lightning's eager FSDP2 path.

Every side trains the same model (a stack of transformer-style MLP blocks, sized so that its parameters,
gradients and Adam state dominate a rank's memory) for ``--steps`` steps on ``--world-size`` processes
started by Lightning's launcher (gloo on a CPU, NCCL on GPUs), one side after another from this script:

* ``compiled_ddp``: ``CompiledDDPStrategy``, every rank holds the whole model and optimizer state;
* ``compiled_fsdp``: ``CompiledFSDPStrategy``, blocks compiled then sharded;
* ``eager_fsdp2``: Lightning's ``ModelParallelStrategy(data_parallel_size=W, tensor_parallel_size=1)`` with
  ``fully_shard`` per block and on the root in ``configure_model`` (Lightning's ``"fsdp"`` refuses a CPU).

Per rank: the bytes of parameters + gradients + optimizer state it holds (from its local shards, exact), its
peak resident memory (``ru_maxrss``, which includes Inductor's compile on the compiled sides) or, on CUDA, peak
allocated memory; the median step time after ``--warmup`` steps. Ratios are against ``compiled_ddp``.

    python benchmarks/fsdp_memory.py                      # 2 ranks on the CPU
    python benchmarks/fsdp_memory.py --world-size 1       # a GPU machine with one GPU
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import median, print_table, write_results  # noqa: E402

SIDES = ("compiled_ddp", "compiled_fsdp", "eager_fsdp2")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(L.LightningModule):
    def __init__(self, width: int, depth: int, shard_in_configure_model: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 10)
        self.shard_in_configure_model = shard_in_configure_model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x).mean(dim=1))

    def configure_model(self) -> None:
        if not self.shard_in_configure_model:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.net:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class Meter(Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0
        self.state_bytes = 0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._start)
        if trainer.global_step == 1:
            self.state_bytes = _held_bytes(module, trainer.optimizers[0])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _held_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters, gradients and optimizer state this rank stores (local shards)."""
    total = 0
    for p in module.parameters():
        total += _local(p).numel() * p.element_size()
        if p.grad is not None:
            total += _local(p.grad).numel() * p.grad.element_size()
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                total += _local(value).numel() * value.element_size()
    return total


def worker(args: argparse.Namespace) -> None:
    import lightning_plugin

    torch.manual_seed(0)
    world = args.world_size
    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if args.side == "compiled_ddp":
        strategy: Any = lightning_plugin.CompiledDDPStrategy(compile="always")
    elif args.side == "compiled_fsdp":
        strategy = lightning_plugin.CompiledFSDPStrategy(compile="always")
    else:
        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    module = Model(args.width, args.depth, shard_in_configure_model=args.side == "eager_fsdp2")
    meter = Meter()
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=world,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[meter],
    )
    g = torch.Generator().manual_seed(0)
    n = args.steps * args.batch * world
    data = TensorDataset(
        torch.randn(n, args.tokens, args.width, generator=g), torch.randint(0, 10, (n,), generator=g)
    )
    trainer.fit(module, DataLoader(data, batch_size=args.batch))
    if accelerator == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    row = {
        "peak_bytes": peak,
        "held_bytes": meter.state_bytes,
        "step_ms": 1e3 * median(meter.times[args.warmup :]),
    }
    rows = [row] * world
    if dist.is_initialized():
        rows = [None] * world
        dist.all_gather_object(rows, row)
    if trainer.global_rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        worker(args)
        return
    results = []
    for side in args.sides.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--side", side, "--out", out]
            env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // args.world_size))}
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                print(proc.stdout[-2000:], proc.stderr[-4000:])
                raise SystemExit(f"{side} failed")
            with open(out) as f:
                ranks = json.load(f)
        results.append(
            {
                "side": side,
                "ranks": ranks,
                "peak_mib_max": max(r["peak_bytes"] for r in ranks) / 2**20,
                "held_mib_max": max(r["held_bytes"] for r in ranks) / 2**20,
                "step_ms_median": median([r["step_ms"] for r in ranks]),
            }
        )
    base = next((r for r in results if r["side"] == "compiled_ddp"), None)
    for r in results:
        if base is not None:
            r["held_vs_ddp"] = r["held_mib_max"] / base["held_mib_max"]
            r["peak_vs_ddp"] = r["peak_mib_max"] / base["peak_mib_max"]
            r["step_time_vs_ddp"] = r["step_ms_median"] / base["step_ms_median"]
    cuda = torch.cuda.is_available()
    name = f"fsdp_memory-{'gpu' if cuda else 'cpu'}-ws{args.world_size}"
    path = write_results(
        name,
        {
            "config": {k: v for k, v in vars(args).items() if k not in ("side", "out")},
            "memory": "CUDA max_memory_allocated" if cuda else "ru_maxrss (includes Inductor's compile)",
            "note": (
                "CPU run on a 2-core machine shared with other jobs: step times are noisy; held_bytes is exact. "
                "Not measured on GPU."
                if not cuda
                else "GPU run"
            ),
            "results": results,
        },
    )
    print_table(
        results,
        [
            "side",
            "held_mib_max",
            "peak_mib_max",
            "step_ms_median",
            "held_vs_ddp",
            "peak_vs_ddp",
            "step_time_vs_ddp",
        ],
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
