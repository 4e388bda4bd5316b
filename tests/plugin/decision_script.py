"""Run by test_compile_decision.py: a fit with compile="auto" and a slow compiled side, in its own process.

``decision_script.py OUT 1`` fits on one process; ``OUT 2`` on two gloo ranks with ``compiled_ddp``, where
rank 1 would keep compiling on its own (its threshold is lowered to 0), so agreeing with rank 0 means it
followed rank 0's decision. Each rank writes what it decided to ``OUT`` (rank 0) or ``OUT.rank<r>``.
"""

from __future__ import annotations

import json
import os
import sys

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(__file__))
import lightning_plugin  # noqa: E402
from boring import TRAINER_KWARGS, TinyModule, make_loader  # noqa: E402
from lightning_plugin.compile import decision as compile_decision  # noqa: E402
from test_compile_decision import slow_backend, virtual_clock  # noqa: E402


def main(out: str, world: int) -> None:
    torch.manual_seed(0)
    compile_decision.step_clock = virtual_clock
    kwargs = {**TRAINER_KWARGS, "limit_train_batches": 16}
    if world == 1:
        strategy = lightning_plugin.CompiledStrategy(backend=slow_backend)
    else:
        kwargs.update(devices=world)
        strategy = lightning_plugin.CompiledDDPStrategy(backend=slow_backend, start_method="popen")
    trainer = L.Trainer(**kwargs, strategy=strategy)
    if trainer.global_rank == 1:
        compile_decision.MIN_SPEEDUP = 0.0  # alone, this rank would never choose eager
    trainer.fit(TinyModule(), make_loader(n=16 * 8 * world, batch_size=8))
    decision = trainer.strategy.compile_decision
    result = {
        "decision": decision.choice if decision else None,
        "source": decision.source if decision else None,
        "speedup": decision.speedup if decision else None,
        "graphs": trainer.strategy.compile_stats.graphs,
    }
    path = out if world == 1 else f"{out}.rank{trainer.global_rank}"
    with open(path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
