"""Running a planned chain: the fused op on the block's own modules, or those modules as its class calls
them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch
from torch import nn

from lcv_kernels._common import SUPPORTED_DTYPES
from lcv_kernels.batch_norm_act import batch_norm_act_forward
from lcv_kernels.conv_bn_act import conv_bn_act_forward
from lcv_kernels.group_norm_act import group_norm_act_forward
from lcv_kernels.layer_norm2d_act import layer_norm2d_act_forward

#: Instance attribute holding a rewritten module's plan (dicts/tuples of :class:`Step`: deep-copies, pickles).
PLAN_ATTR = "_lcv_plan"

_NORM_OPS: dict[str, Callable[..., torch.Tensor]] = {
    "batch_norm_act": batch_norm_act_forward,
    "group_norm_act": group_norm_act_forward,
    "layer_norm2d_act": layer_norm2d_act_forward,
}


class Step(NamedTuple):
    """How one chain runs. Paths are relative to the rewritten module (``""``: the module itself)."""

    #: A kernel name, ``"eager"`` (the modules as the class calls them), or ``"call"`` (a Sequential member
    #: run as is; ``norm`` is then its name).
    mode: str
    conv: str | None
    norm: str
    #: The activation the fused op applies (the chain's, or the norm's own).
    act: str = "none"
    #: The chain's activation module, run by the eager path (None: no activation, or the norm's own).
    act_module: str | None = None
    between: tuple[str, ...] = ()
    #: The norm's class when planned: a norm swapped since (e.g. for SyncBatchNorm) runs as is.
    norm_class: type | None = None
    #: The norm applies its activation itself, before any residual the block adds.
    own_act: bool = False


def submodule(owner: nn.Module, path: str) -> Any:
    """``owner``'s attribute at dotted ``path`` (``""``: ``owner``); None where an attribute is None."""
    target: Any = owner
    for name in path.split(".") if path else ():
        target = getattr(target, name)
        if target is None:
            return None
    return target


def run_chain(
    block: nn.Module, norm: str, x: torch.Tensor, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """Run the chain of ``block`` named by its ``norm`` path on ``x``, as planned; see ``register_block``.

    Computes ``act(between(norm(conv(x))) + residual)``, with the fused op or, when the chain stays eager,
    with the block's own modules (then exactly what the class's forward computes).
    """
    return run_step(block, getattr(block, PLAN_ATTR)[norm], x, residual)


def run_step(
    owner: nn.Module, step: Step, x: torch.Tensor, residual: torch.Tensor | None = None
) -> torch.Tensor:
    if step.mode == "call":
        return cast(nn.Module, owner._modules[step.norm])(x)  # planned from a present submodule
    conv = submodule(owner, step.conv) if step.conv is not None else None
    norm = submodule(owner, step.norm)
    mode = step.mode if _still_fusable(owner, step, conv, norm, x) else "eager"
    if mode == "eager":
        if conv is not None:
            x = conv(x)
        # The block itself as its norm: its class's forward (calling ``norm`` would recurse into the plan).
        x = type(norm).forward(norm, x) if norm is owner else norm(x)
        for path in step.between:
            module = submodule(owner, path)
            if module is not None:
                x = module(x)
        if residual is not None:
            x = x + residual
        return submodule(owner, step.act_module)(x) if step.act_module is not None else x
    # A norm with its own activation applies it before the block adds a residual: add that one afterwards.
    late = residual if step.own_act and step.act != "none" else None
    fused_residual = None if late is not None else residual
    if mode == "conv_bn_act":
        # The plan fuses conv+BN only for a block with a conv (Step.conv set).
        y = conv_bn_act_forward(cast(nn.Conv2d, conv), norm, x, step.act, fused_residual)
    else:
        if conv is not None:
            x = conv(x)
        y = _NORM_OPS[mode](norm, x, step.act, fused_residual)
    return y if late is None else y + late


def _still_fusable(
    owner: nn.Module, step: Step, conv: nn.Module | None, norm: nn.Module, x: torch.Tensor
) -> bool:
    """Dynamo-constant checks that keep a plan correct if a module was replaced after planning or the input
    has a dtype no kernel takes (the chain then runs its own modules, as planned for an eager step)."""
    if step.mode == "eager":
        return False
    if x.dtype not in SUPPORTED_DTYPES and not torch.is_autocast_enabled(x.device.type):
        return False
    if type(norm) is not step.norm_class:
        return False
    if step.mode == "conv_bn_act" and type(conv) is not nn.Conv2d:
        return False
    return all(is_identity(submodule(owner, path)) for path in step.between)


def is_identity(module: nn.Module | None) -> bool:
    """True for what a forward may skip: an ``nn.Identity`` or an absent (None) module."""
    return module is None or type(module) is nn.Identity
