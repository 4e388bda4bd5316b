"""Run by test_ddp.py: two gloo processes with strategy="compiled_ddp", weights saved by rank 0.

Each rank sees every other sample (an unshuffled DistributedSampler), and DDP averages
the gradients, so two ranks with batch 4 equal one process with batch 8 over the same data.
"""

from __future__ import annotations

import json
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, __import__("os").path.dirname(__file__))
import lightning_plugin  # noqa: E402,F401
from boring import TinyModule, make_loader  # noqa: E402


class NoBatchNorm(TinyModule):
    """BatchNorm statistics are per rank, so they would differ from one process: use eval-mode BN."""

    def on_train_epoch_start(self) -> None:
        for m in self.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.eval()


def main(out: str, backend: str) -> None:
    torch.manual_seed(0)
    module = NoBatchNorm()
    data = make_loader(n=32, batch_size=4).dataset
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=lightning_plugin.CompiledDDPStrategy(backend=backend, start_method="popen"),
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # Lightning would shuffle; shard in order instead
    )
    sampler = DistributedSampler(data, num_replicas=2, rank=trainer.global_rank, shuffle=False)
    trainer.fit(module, DataLoader(data, batch_size=4, sampler=sampler))
    stats = trainer.strategy.compile_stats
    if trainer.global_rank == 0:
        torch.save(module.state_dict(), out + ".pt")
        with open(out + ".json", "w") as f:
            json.dump(
                {
                    "graphs": stats.graphs,
                    "graph_breaks": stats.graph_breaks,
                    "steps": trainer.global_step,
                    "world_size": trainer.world_size,
                    "forward_restored": "forward" not in module.__dict__,
                },
                f,
            )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
