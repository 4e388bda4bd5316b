"""Run by test_fsdp.py: ``strategy="compiled_fsdp"`` on gloo ranks, 2 epochs x 10 steps of a tiny BN CNN.

Each rank reads every other sample in order (an unshuffled ``DistributedSampler``), batch 4 per rank, with
gradient clipping and an EMA of the weights, so that the test can replay the same training in float64 in
one process. A checkpoint (sharded, ``torch.distributed.checkpoint``) is written at the end of each epoch.

    fsdp_script.py OUT [--num-nodes N] [--devices D] [--kill-at STEP] [--resume CKPT]
                   [--then-device-loader OUT2 CKPT2] [--backend NAME]

``--kill-at``: rank 1 SIGKILLs itself when that step begins. Rank 0 writes ``OUT/result.json`` (what the
compiler did, the bytes each rank holds) and ``OUT/final.pt`` (the full state dict after training).

``--then-device-loader``: afterwards, in the same processes (no new launch), resume ``CKPT2`` for the rest
of its epoch with the project's loader (``DeviceLoader`` through a data module, uncompiled) over uint8
images whose pixel (0, 0, 0) is the sample's index; each rank writes the indices of every batch it trained
on to ``OUT2/seen_rank{R}.json`` (the resume on another world size).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, os.path.dirname(__file__))
import lightning_plugin  # noqa: E402
from boring import ConvBlock  # noqa: E402
from lcv_vision.data import Normalize, Pipeline  # noqa: E402
from lcv_vision.data.datamodules import _DeviceDataModule  # noqa: E402
from lcv_vision.data.datasets import ImageSet  # noqa: E402
from lcv_vision.ema import ModelEMA  # noqa: E402
from lightning_plugin.strategies.fsdp_units import local_bytes, optimizer_state_tensors  # noqa: E402

SAMPLES, BATCH, EPOCHS, CLIP, LR, MOMENTUM, EMA_DECAY = 80, 4, 2, 0.5, 0.1, 0.9, 0.9


class Net(nn.Module):
    """Every tensor's first dimension is even, so 2 ranks hold exactly half of each."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(ConvBlock(8), ConvBlock(8))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.stem(x)))
        return self.head(x.mean(dim=(2, 3)))


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net()
        self.ema = ModelEMA(self.net, decay=EMA_DECAY)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.ema.update(self.net)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(SAMPLES, 3, 8, 8, generator=g), torch.randint(0, 4, (SAMPLES,), generator=g)
    )


class IdDataModule(_DeviceDataModule):
    """SAMPLES uint8 images, unshuffled, pixel (0, 0, 0) = the sample's index (the loader state is saved)."""

    def __init__(self) -> None:
        super().__init__(BATCH, None, None, seed=0, drop_last=False, num_workers=0, dtype=torch.float32)

    def _build(self) -> dict[str, ImageSet]:
        g = torch.Generator().manual_seed(0)
        images = torch.randint(0, 256, (SAMPLES, 3, 8, 8), generator=g, dtype=torch.uint8)
        images[:, 0, 0, 0] = torch.arange(SAMPLES, dtype=torch.uint8)
        targets = torch.randint(0, 4, (SAMPLES,), generator=g)
        return {"train": ImageSet(images, targets, [str(c) for c in range(4)])}

    def default_train_pipeline(self) -> Pipeline:  # x -> x, as float
        return Pipeline([Normalize((0.0,) * 3, (1 / 255,) * 3)], channels_last=False, compile=False)


class IdModule(Module):
    """Records ``(epoch, batch_idx, sample indices)`` of every training batch."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, int, list[int]]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append((self.current_epoch, batch_idx, x[:, 0, 0, 0].round().long().tolist()))
        return super().training_step((x / 255, y), batch_idx)


class Probe(Callback):
    """Records the compile counts after step 2, the shard bytes after the first step, and kills on request."""

    def __init__(self, kill_at: int | None) -> None:
        self.kill_at = kill_at
        self.info: dict[str, object] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.kill_at is not None and trainer.global_step == self.kill_at and trainer.global_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        stats = trainer.strategy.compile_stats
        if trainer.global_step == 2:
            self.info["frames_after_step_2"] = len(stats.frame_records)
        if "param_bytes" not in self.info:
            params = list(pl_module.net.parameters())
            self.info["param_bytes"] = local_bytes(params)
            self.info["param_bytes_full"] = sum(p.numel() * p.element_size() for p in params)
            self.info["optimizer_bytes"] = local_bytes(optimizer_state_tensors(trainer.optimizers[0]))
            self.info["dtensor_params"] = all(type(p).__name__ == "DTensor" for p in params)


def _trainer(out: Path, args: argparse.Namespace, callbacks: list[Callback], **checkpoint: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=lightning_plugin.CompiledFSDPStrategy(
            backend=args.backend, compile=args.compile, tune_cpu=False
        ),
        max_epochs=args.max_epochs,
        gradient_clip_val=CLIP,
        logger=False,
        callbacks=[*callbacks, ModelCheckpoint(dirpath=out / "checkpoints", save_top_k=-1, **checkpoint)],
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        default_root_dir=out,
    )


def fit_device_loader(out: Path, resume: str | None, args: argparse.Namespace) -> None:
    """One epoch of the project's loader from ``resume``, a checkpoint every 10 steps; the batches seen."""
    torch.manual_seed(0)
    module = IdModule()
    args = argparse.Namespace(**{**vars(args), "max_epochs": 1, "compile": "never"})
    trainer = _trainer(out, args, [], every_n_train_steps=10)
    trainer.fit(module, datamodule=IdDataModule(), ckpt_path=resume)
    (out / f"seen_rank{trainer.global_rank}.json").write_text(json.dumps(module.seen))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--then-device-loader", nargs=2, metavar=("OUT", "CKPT"), default=None)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend of the blocks")
    args = parser.parse_args()
    args.max_epochs, args.compile = EPOCHS, "always"
    out = Path(args.out)
    torch.manual_seed(0)
    module = Module()
    probe = Probe(args.kill_at)
    trainer = _trainer(out, args, [probe], every_n_epochs=1)
    data = make_data()
    sampler = DistributedSampler(
        data, num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=False
    )
    trainer.fit(module, DataLoader(data, batch_size=BATCH, sampler=sampler), ckpt_path=args.resume)
    stats = trainer.strategy.compile_stats
    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    bytes_per_rank = [None] * trainer.world_size
    dist.all_gather_object(bytes_per_rank, [probe.info.get("param_bytes"), probe.info.get("optimizer_bytes")])
    node_ranks = [None] * trainer.world_size
    dist.all_gather_object(node_ranks, trainer.node_rank)
    if trainer.global_rank == 0:
        torch.save({k: v.clone() for k, v in state.items()}, out / "final.pt")
        plan = trainer.strategy.sharding_plan
        info = {
            **probe.info,
            "bytes_per_rank": bytes_per_rank,
            "world_size": trainer.world_size,
            "cluster_environment": type(trainer.strategy.cluster_environment).__name__,
            "node_ranks": node_ranks,
            "steps": trainer.global_step,
            "graphs": stats.graphs,
            "graph_breaks": stats.graph_breaks,
            "frames": len(stats.frame_records),
            "recompiles": [r.recompile_reason for r in stats.frame_records if r.recompile_reason],
            "blocks": len(plan.blocks) if plan else 0,
            "fell_back": stats.fell_back,
        }
        (out / "result.json").write_text(json.dumps(info, indent=1))
    if args.then_device_loader:
        grown_out, grown_from = args.then_device_loader
        fit_device_loader(Path(grown_out), grown_from, args)


if __name__ == "__main__":
    main()
