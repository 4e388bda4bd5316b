"""Run by test_compile_cache.py: one fit in a fresh process with its own (empty) Inductor cache directory.

Prints one JSON line: Inductor's cache counters and how many C++ kernels the process compiled.
"""

from __future__ import annotations

import json
import os
import sys

import lightning as L
import torch
from torch._dynamo.utils import counters
from torch._inductor import cpp_builder

sys.path.insert(0, os.path.dirname(__file__))
import lightning_plugin  # noqa: E402
from boring import TRAINER_KWARGS, LinearModule, make_vector_loader  # noqa: E402

builds = []
_build = cpp_builder.CppBuilder.build


def counting_build(self, *args, **kwargs):
    builds.append(self.get_target_file_path())
    return _build(self, *args, **kwargs)


def main(cache_file: str) -> None:
    cpp_builder.CppBuilder.build = counting_build
    torch.manual_seed(0)
    strategy = lightning_plugin.CompiledStrategy(cache=cache_file, compile_eval=False)
    trainer = L.Trainer(**{**TRAINER_KWARGS, "strategy": strategy, "limit_train_batches": 2})
    trainer.fit(LinearModule(), make_vector_loader())
    print(
        json.dumps(
            {
                "fx_hits": counters["inductor"]["fxgraph_cache_hit"],
                "fx_misses": counters["inductor"]["fxgraph_cache_miss"],
                # Kernel binaries only: computing the key of Inductor's precompiled header preprocesses it
                # each time.
                "cpp_builds": sum(path.endswith(".so") for path in builds),
                "graphs": strategy.compile_stats.graphs,
                "saved": os.path.isfile(cache_file),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
