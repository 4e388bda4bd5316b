"""Run by test_kernel_selection_trainer.py: one of two gloo ranks running ``select_kernels``, each with its
own fake clock.

Rank 0's clock finds block "0" faster fused and block "1" slower; rank 1's clock says the opposite. The ranks
must end with rank 0's decisions (and rank 1 must never be asked), or DDP would run two different graphs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from lightning_plugin.kernel_choice.substitution import substituted_modules  # noqa: E402
from selection_helpers import chain, select  # noqa: E402


def main(rank: int, port: str, out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(rank)  # different weights and inputs per rank: only the decisions are shared
    model = chain(3, 4, 5)
    calls = []

    def clock(step, *, arm, signature, device):
        calls.append(arm)
        first_block = signature.inputs == "2x3x6x6"
        fused_wins = first_block if rank == 0 else not first_block
        if arm == "fused":
            return 1.0
        return 1.5 if fused_wins else 0.5

    selection = select(model, torch.randn(2, 3, 6, 6), clock, out / f"cache{rank}")
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "chosen": [d.chosen for d in selection.decisions],
                "rewritten": substituted_modules(model),
                "timer_calls": len(calls),
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))
