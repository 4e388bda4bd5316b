"""Which modules FSDP2 shards on their own, and sharding them: the units of ``strategy="compiled_fsdp"``.

Why these units: a unit is all-gathered as one piece before its forward and freed after, so the peak memory
is about one unit's full weights plus every unit's shard. The modules the project already treats as blocks
(the block registry's classes, which the kernel substitution fuses, and any class repeated in the model, which
regional compilation compiles once) are the natural units: each is compiled once and reused. The root units
are the LightningModule's children (and the LightningModule itself when it holds parameters of its own), so
every parameter belongs to exactly one unit.

BatchNorm is the exception to mixed precision: its CPU kernels refuse bf16 weights with fp32 running
statistics ("expected scalar type BFloat16 but found Float"). A unit that holds a BatchNorm's parameters is
therefore gathered in fp32 (its compute still runs in bf16 under the Trainer's autocast). Sharding each
BatchNorm as a unit of its own would also keep it fp32, but puts FSDP's hooks, which dynamo does not trace,
inside the compiled block: a graph break per BatchNorm (and no graph at all with activation checkpointing).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_plugin.blocks import block_spec, norm_spec

#: Trainer ``precision`` -> the dtype FSDP2 gathers parameters in (``None``: keep the parameters' own).
_PARAM_DTYPES: dict[str, torch.dtype] = {
    "bf16-mixed": torch.bfloat16,
    "16-mixed": torch.float16,
}


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """The FSDP2 policy for a Trainer ``precision``: low-precision parameters, gradients reduced in fp32."""
    param_dtype = _PARAM_DTYPES.get(str(precision))
    if param_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def block_units(root: nn.Module) -> list[nn.Module]:
    """The blocks under ``root``: registered block classes and classes that occur twice or more.

    Norm-activation classes (registered as norms too) are not units: they are parts of blocks. A candidate
    that holds other candidates is a container (a registered ResNet whose stem is a chain, the model and its
    EMA copy, a stage): the search goes inside it, so the units are the innermost candidates that hold no
    block of their own.
    """
    counts = _class_counts(root)

    def candidate(module: nn.Module, counts: Counter[type]) -> bool:
        # A leaf (timm's LayerNorm, twice in every ViT block) is a layer, not a block.
        if (
            _is_torch_builtin(module)
            or norm_spec(module) is not None
            or not any(True for _ in module.children())
        ):
            return False
        return block_spec(module) is not None or counts[type(module)] >= 2

    def is_block(module: nn.Module) -> bool:
        if not candidate(module, counts):
            return False
        inner = _class_counts(module)
        # Inside a block, a class counts as repeated only when it repeats within the block itself (a ViT
        # block's one Mlp is part of it; a stage's many blocks are not).
        return not any(candidate(m, inner) for m in module.modules() if m is not module)

    found: list[nn.Module] = []

    def visit(parent: nn.Module) -> None:
        for child in parent.children():
            if is_block(child):
                found.append(child)
            else:
                visit(child)

    visit(root)
    return found


def make_parameters_contiguous(module: nn.Module) -> int:
    """Give every parameter the default (row-major) layout, in place; returns how many changed.

    FSDP2 refuses other layouts ("FSDP does not support non-contiguous parameters yet", torch 2.14), and
    lcv's recipes put their models in channels_last. Convolutions keep computing in channels_last: their
    output follows the channels_last input batches."""
    changed = 0
    with torch.no_grad():
        for param in module.parameters():
            if not param.is_contiguous():
                param.data = param.data.contiguous()
                changed += 1
    return changed


@dataclass
class ShardingPlan:
    """What :func:`shard_module` did: the blocks (to compile), the roots, and the units kept in fp32."""

    blocks: list[nn.Module] = field(default_factory=list)
    roots: list[nn.Module] = field(default_factory=list)
    fp32_units: list[nn.Module] = field(default_factory=list)


def shard_module(
    module: nn.Module,
    mesh: DeviceMesh,
    policy: MixedPrecisionPolicy,
    reshard_after_forward: bool,
    blocks: Iterable[nn.Module],
) -> ShardingPlan:
    """``fully_shard`` ``blocks``, then the roots (the module's children holding parameters not yet sharded,
    and the module itself when it holds parameters of its own).

    ``blocks`` must already be compiled (their forwards patched): FSDP's hooks sit on ``__call__`` outside the
    compiled forward, so the graphs have no breaks (sharding first puts hooks that dynamo skips inside them).
    """
    plan = ShardingPlan(blocks=list(blocks))
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    make_parameters_contiguous(module)

    def shard(unit: nn.Module, reshard: bool, recurse: bool = True) -> None:
        unit_policy = policy
        if policy.param_dtype is not None and _holds_batchnorm_parameters(unit, recurse):
            unit_policy = fp32
            plan.fp32_units.append(unit)
        fully_shard(unit, mesh=mesh, mp_policy=unit_policy, reshard_after_forward=reshard)

    for block in plan.blocks:
        shard(block, reshard_after_forward)
    for child in module.children():
        if not isinstance(child, FSDPModule) and _has_unsharded_parameters(child):
            # The roots' parameters are needed again at once by the backward: keep them gathered.
            shard(child, False)
            plan.roots.append(child)
    if any(True for _ in module.parameters(recurse=False)):
        shard(module, False, recurse=False)
        plan.roots.append(module)
    return plan


def _holds_batchnorm_parameters(unit: nn.Module, recurse: bool) -> bool:
    """Whether ``unit`` would manage a BatchNorm's parameters (ones no inner unit has sharded yet)."""
    norms = unit.modules() if recurse else [unit]
    return any(
        isinstance(m, _BatchNorm) and any(not isinstance(p, DTensor) for p in m.parameters(recurse=False))
        for m in norms
    )


def _class_counts(root: nn.Module) -> Counter[type]:
    return Counter(type(m) for m in root.modules() if m is not root and not _is_torch_builtin(m))


def _has_unsharded_parameters(module: nn.Module) -> bool:
    return any(not isinstance(p, DTensor) for p in module.parameters())


def _is_torch_builtin(module: nn.Module) -> bool:
    return type(module).__module__.startswith("torch.")


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank stores for ``tensors``: a DTensor's local shard, a plain tensor whole."""
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += local.numel() * local.element_size()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors of an optimizer's per-parameter state (momentum, Adam's moments), not its step counters."""
    return [
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    ]


@torch.no_grad()
def average_batchnorm_statistics(module: nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """Average every BatchNorm's running mean and variance over the ranks; return how many were averaged.

    FSDP2 shards parameters, not buffers, so each rank's running statistics come from its own batches only.
    Averaging them before a save or an evaluation gives one set that all ranks share (the mean of per-rank
    estimates; the variance is averaged as an estimate too, without the between-rank term).
    """
    buffers = [
        b
        for m in module.modules()
        if isinstance(m, _BatchNorm) and m.track_running_stats
        for b in (m.running_mean, m.running_var)
        if b is not None
    ]
    if not buffers or not dist.is_initialized():
        return 0
    world = dist.get_world_size(group)
    if world == 1:
        return 0
    # One all-reduce for all of them; gloo has no AVG, so SUM then divide.
    flat = torch.cat([b.detach().reshape(-1).to(torch.float64) for b in buffers])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flat /= world
    offset = 0
    for b in buffers:
        n = b.numel()
        b.copy_(flat[offset : offset + n].view_as(b).to(b.dtype))
        offset += n
    return len(buffers) // 2
