"""Run by test_strategy_names.py in a fresh process: fit by strategy name on two CPU processes.

A fresh process because fork-based DDP cannot start from a process that already ran
autograd on worker threads (as the test process has), and so that no port or process group
of an earlier test is in the way. Rank 0 writes what it saw to ``<out>/<name>.json``.
"""

from __future__ import annotations

import json
import os
import sys

import lightning as L
from lightning.pytorch.callbacks import Callback

sys.path.insert(0, os.path.dirname(__file__))
import lightning_plugin  # noqa: E402,F401
from boring import TRAINER_KWARGS, LinearModule, make_vector_loader  # noqa: E402


class ReportFromRankZero(Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        stats = trainer.strategy.compile_stats
        if trainer.is_global_zero:
            with open(self.path, "w") as f:
                json.dump(
                    {
                        "world_size": trainer.world_size,
                        "steps": trainer.global_step,
                        "compiled": stats.graphs + stats.reused_frames,
                        "skipped": stats.skipped_frames,
                        "forward_patched": "forward" in pl_module.__dict__,
                    },
                    f,
                )  # restored in teardown


def main(out: str, names: list[str]) -> None:
    for name in names:
        report = ReportFromRankZero(os.path.join(out, f"{name}.json"))
        trainer = L.Trainer(
            **{
                **TRAINER_KWARGS,
                "devices": 2,
                "strategy": name,
                "callbacks": [report],
                "limit_train_batches": 2,
            }
        )
        trainer.fit(LinearModule(), make_vector_loader())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
