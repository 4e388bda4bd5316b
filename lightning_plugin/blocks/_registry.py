"""The two registries: norm classes our kernels compute, and block classes whose forward we restate."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lcv_kernels import KERNELS

#: Kernels that compute a norm on their own (``conv_bn_act`` is ``batch_norm_act`` with its conv fused in).
NORM_KERNELS: tuple[str, ...] = tuple(k for k in KERNELS if k != "conv_bn_act")


@dataclass(frozen=True)
class Chain:
    """One ``[conv →] norm [→ between …] [+ residual] [→ act]`` run inside a block's forward.

    Paths are relative to the block, dotted for deeper modules; ``""`` is the block itself, for a norm class
    that is its own block (timm's ``BatchNormAct2d``). A chain whose norm attribute is ``None`` on an instance
    is absent there (an optional branch, e.g. timm's ``bn_s2d``); its forward must not run it.

    Attributes:
        norm: the norm module; a class registered with :func:`register_norm`, or the chain stays eager. It
            names the chain in :func:`run_chain`.
        conv: the ``nn.Conv2d`` whose output the forward feeds straight into the norm (``conv_bn_act`` then
            fuses the two), or None.
        act: the activation the forward applies last, or None: none at all, or the norm applies its own
            (a norm class registered with ``act``).
        between: modules the forward calls after the norm, before the residual add and the activation
            (timm's ``drop_block``, ``se``, ``drop_path``). The chain fuses only when each is ``nn.Identity``
            or ``None``; otherwise it stays eager and the report says which one.
    """

    norm: str
    conv: str | None = None
    act: str | None = None
    between: tuple[str, ...] = ()


@dataclass(frozen=True)
class BlockSpec:
    """A registered block class: the method to replace, its replacement and the chains it runs."""

    attribute: str
    forward: Callable[..., torch.Tensor]
    chains: tuple[Chain, ...]


@dataclass(frozen=True)
class NormSpec:
    """A registered norm class: the kernel that computes its normalisation, the activation child its forward
    applies after it (and the children it calls in between, which must be Identity to fuse), and an instance
    check saying why one cannot fuse."""

    kernel: str
    act: str | None = None
    identities: tuple[str, ...] = ()
    check: Callable[[nn.Module], str | None] | None = None


_BLOCKS: dict[str, BlockSpec] = {}
_NORMS: dict[str, NormSpec] = {}


def class_path(cls: type | str) -> str:
    """``module.QualifiedName`` of a class: the key it is registered and looked up by."""
    return cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"


def register_block(
    cls: type[nn.Module] | str,
    *,
    chains: Sequence[Chain],
    forward: Callable[..., torch.Tensor],
    attribute: str = "forward",
) -> None:
    """Declare a block class whose ``chains`` the kernel substitution may fuse.

    On each instance of exactly ``cls`` (a subclass may override its forward, so it is left alone) the
    substitution plans every chain, then sets the instance attribute ``attribute`` to ``forward`` bound to
    the instance. ``forward(block, *args)`` must compute exactly what ``cls.<attribute>`` computes, calling
    ``run_chain(block, chain.norm, x, residual)`` where the class's method runs a chain (``residual``: what
    the method adds after the chain's ``between`` modules and before its ``act``), and the block's own
    modules everywhere else. With every kernel off, :func:`run_chain` calls those very modules, so the
    result equals the class's; ``tests/plugin/test_blocks.py`` checks that for every registered class, which
    catches a class whose forward changed upstream.

    ``cls`` may be given as its dotted path (``"timm.layers.norm_act.BatchNormAct2d"``): nothing is imported,
    so a library that is absent, or not used, costs nothing. Registering a class twice raises.
    """
    chains = tuple(chains)
    if not chains:
        raise ValueError(f"register_block({class_path(cls)}): a block needs at least one chain")
    norms = [c.norm for c in chains]
    if len(set(norms)) != len(norms):
        raise ValueError(f"register_block({class_path(cls)}): two chains share a norm in {norms}")
    if not callable(forward):
        raise TypeError(f"register_block({class_path(cls)}): forward must be callable, got {forward!r}")
    _add(_BLOCKS, cls, BlockSpec(attribute, forward, chains), "block")


def register_norm(
    cls: type[nn.Module] | str,
    kernel: str,
    *,
    act: str | None = None,
    identities: Sequence[str] = (),
    check: Callable[[nn.Module], str | None] | None = None,
) -> None:
    """Declare that the forward of exactly ``cls`` normalises as ``kernel`` computes it.

    ``kernel`` is one of :data:`NORM_KERNELS`: ``batch_norm_act`` (an ``nn.BatchNorm2d``'s forward),
    ``group_norm_act`` (``nn.GroupNorm``'s) or ``layer_norm2d_act`` (an ``nn.LayerNorm`` over the channels of
    an NCHW tensor), read from the attributes that base class defines. A norm-activation class names the
    child its forward applies afterwards in ``act``, and the children it calls in between in ``identities``
    (each must be ``nn.Identity`` to fuse). ``check(norm)`` says why an instance cannot fuse (e.g. it takes
    another code path), or returns None. ``cls`` may be a dotted path, as in :func:`register_block`.
    """
    if kernel not in NORM_KERNELS:
        raise ValueError(
            f"register_norm({class_path(cls)}): unknown kernel {kernel!r}; expected one of {NORM_KERNELS}"
        )
    _add(_NORMS, cls, NormSpec(kernel, act, tuple(identities), check), "norm")


def _add(registry: dict, cls: type | str, spec: object, what: str) -> None:
    key = class_path(cls)
    if key in registry:
        raise ValueError(f"{key} is already registered as a {what}")
    registry[key] = spec


def block_spec(module: nn.Module) -> BlockSpec | None:
    """The spec registered for ``module``'s exact class, or None."""
    return _BLOCKS.get(class_path(type(module)))


def norm_spec(module: nn.Module) -> NormSpec | None:
    """The spec registered for ``module``'s exact class, or None."""
    return _NORMS.get(class_path(type(module)))


def registered_blocks() -> dict[str, BlockSpec]:
    """Every registered block spec, by class path (a copy)."""
    return dict(_BLOCKS)


def registered_norms() -> dict[str, NormSpec]:
    """Every registered norm spec, by class path (a copy)."""
    return dict(_NORMS)


register_norm(nn.BatchNorm2d, "batch_norm_act")
register_norm(nn.GroupNorm, "group_norm_act")
