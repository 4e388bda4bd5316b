"""The max-pool cases of test_which_pools_take_the_gather, in a fresh process, each graph lowered afresh.

``python pool_gather_script.py tiles:channels_last tiles:nchw ...`` prints one JSON line per case: whether the
generated backward holds a scatter, and the largest gradient difference from eager with its bound. No FX or
autograd cache hits. A fresh process, because in a long pytest worker some earlier test's state made torch's
scatter decomposition step aside (CI runs saw it for different cases, not reproducible alone); one process for
all cases, because each start costs seconds of imports."""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.utils import run_and_get_code

from lcv_kernels.tolerances import bound, network_length, reduction_tolerance
from lightning_plugin.compile.stats import CompileStats, make_backend
from lightning_plugin.cpu import inductor as cpu_inductor

POOLS = {"tiles": nn.MaxPool2d(2), "overlapping": nn.MaxPool2d(3, stride=2, padding=1)}


class ConvPool(nn.Module):
    def __init__(self, pool: nn.Module) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(F.gelu(self.conv(x)))


def run_case(pool: str, channels_last: bool) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ConvPool(POOLS[pool]).double()
    x = torch.randn(2, 3, 15, 15, dtype=torch.float64)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    backend = make_backend("inductor", None, None, None, CompileStats(), torch.device("cpu"))
    compiled = torch.compile(copy.deepcopy(model), backend=backend)

    def step(m: nn.Module) -> torch.Tensor:
        leaf = x.clone().requires_grad_()
        m(leaf).square().sum().backward()
        return leaf.grad

    _, codes = run_and_get_code(step, compiled)
    want = step(model)
    error = float((step(compiled) - want).abs().max())
    limit = bound(reduction_tolerance(torch.float64, network_length(model, x.shape)), want)
    return {"scatter": "scatter" in "\n".join(codes), "error": error, "bound": limit}


if __name__ == "__main__":
    cpu_inductor.CPU_TRAINING_OPTIONS["cpp_wrapper"] = False  # extern calls readable in the code
    # Each graph lowered here, not loaded from the shared cache folder (whose CPU probes and precompiled
    # header, built by earlier tests, this process reuses: ~7 s of C++ builds for a folder of its own).
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    for case in sys.argv[1:]:
        pool, layout = case.split(":")
        print(json.dumps({"case": case, **run_case(pool, layout == "channels_last")}), flush=True)
