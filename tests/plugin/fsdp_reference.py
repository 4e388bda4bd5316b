"""The training of fsdp_script.py replayed in float64 in one process: eager DDP's arithmetic, no FSDP.

Each "rank" runs its own half-batch with its own BatchNorm running statistics; the gradients are averaged
(what DDP's all-reduce and FSDP's reduce-scatter compute), clipped by their global norm, and SGD with
momentum steps; the EMA follows. The running statistics are averaged over the ranks where
``compiled_fsdp`` averages them: at each checkpoint save (end of an epoch) and at the end of training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from fsdp_script import BATCH, CLIP, EMA_DECAY, EPOCHS, LR, MOMENTUM, SAMPLES, Module, make_data

WORLD = 2


def _bn_buffers(net: torch.nn.Module) -> list[torch.Tensor]:
    return [
        b
        for m in net.modules()
        if isinstance(m, _BatchNorm)
        for b in (m.running_mean, m.running_var, m.num_batches_tracked)
    ]


def reference_state() -> dict[str, torch.Tensor]:
    """The state dict (``net.*`` and ``ema.module.*``) after 2 epochs, in float64."""
    torch.manual_seed(0)
    module = Module().double()
    net, ema = module.net, module.ema.module
    data = make_data()
    x_all, y_all = data.tensors[0].double(), data.tensors[1]
    live = _bn_buffers(net)
    ranks = [[b.clone() for b in live] for _ in range(WORLD)]
    params = list(net.parameters())
    momentum: list[torch.Tensor] | None = None
    steps = SAMPLES // (BATCH * WORLD)

    def average_ranks() -> None:
        for i in range(len(live)):
            mean = (
                sum(r[i] for r in ranks) // WORLD
                if not live[i].is_floating_point()
                else sum(r[i] for r in ranks) / WORLD
            )
            for r in ranks:
                r[i].copy_(mean)

    for _ in range(EPOCHS):
        for step in range(steps):
            for p in params:
                p.grad = None
            for rank in range(WORLD):
                for b, mine in zip(live, ranks[rank]):
                    b.copy_(mine)
                # DistributedSampler(shuffle=False): rank r reads samples r, r + W, ...; batch `step` of those.
                index = torch.arange(step * BATCH, (step + 1) * BATCH) * WORLD + rank
                loss = F.cross_entropy(net(x_all[index]), y_all[index]) / WORLD
                loss.backward()
                for b, mine in zip(live, ranks[rank]):
                    mine.copy_(b)
            with torch.no_grad():
                grads = [p.grad for p in params]
                norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
                coef = torch.clamp(CLIP / (norm + 1e-6), max=1.0)
                grads = [g * coef for g in grads]
                momentum = grads if momentum is None else [MOMENTUM * m + g for m, g in zip(momentum, grads)]
                for p, m in zip(params, momentum):
                    p -= LR * m
                # The EMA is linear in the live state: averaging per-rank EMAs = the EMA of the averaged state.
                for b, i in zip(live, range(len(live))):
                    b.copy_(ranks[0][i] if not b.is_floating_point() else sum(r[i] for r in ranks) / WORLD)
                for name, average in ema.state_dict().items():
                    value = net.state_dict()[name]
                    if average.is_floating_point():
                        average.lerp_(value, 1.0 - EMA_DECAY)
                    else:
                        average.copy_(value)
        average_ranks()  # the checkpoint at the end of each epoch averages the statistics first
    for b, mine in zip(live, ranks[0]):
        b.copy_(mine)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}
