"""`compiled_ddp` on two CPU processes (gloo) against one eager process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from boring import TRAINER_KWARGS, make_loader
from ddp_script import NoBatchNorm
from lcv_kernels.tolerances import bound, network_length, trajectory_tolerance

HERE = os.path.dirname(__file__)


@pytest.mark.timeout(600)
def test_compiled_ddp_matches_single_process_eager(tmp_path):
    out = str(tmp_path / "ddp")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run(
        # aot_eager: DDPOptimizer's graph split at the buckets and AOTAutograd's backward, as under Inductor;
        # the compiled_ddp names compile with Inductor on two processes in test_strategy_names.py.
        [sys.executable, os.path.join(HERE, "ddp_script.py"), out, "aot_eager"],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out + ".json") as f:
        info = json.load(f)
    assert info["world_size"] == 2
    assert info["steps"] == 4  # 32 samples / 2 ranks / batch 4
    assert info["graphs"] >= 1 and info["graph_breaks"] == 0
    assert info["forward_restored"]

    torch.manual_seed(0)
    eager = NoBatchNorm()
    L.Trainer(**TRAINER_KWARGS).fit(eager, DataLoader(make_loader(n=32).dataset, batch_size=8, shuffle=False))
    ddp_state = torch.load(out + ".pt")
    # Gradient all-reduce sums in another order than one batch: fp32 rounding of the 4 steps' sums only.
    tol = trajectory_tolerance(torch.float32, network_length(eager, (8, 3, 8, 8)), info["steps"])
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(ddp_state[key], value, atol=bound(tol, value), rtol=0, msg=key)
