"""Rewrite a model in place so its conv → norm → activation chains run as our fused ``lcv::`` ops.

Design: *patched forwards*, not module swaps and not an Inductor graph pass. Which blocks hold which chains,
and the forward that runs them, is declared with ``lightning_plugin.blocks`` (``register_block``), next to
the class where we own it (``lcv_vision.models.resnet`` registers its blocks; this module imports nothing from
``vision``) and by class path for torchvision's and timm's (``lightning_plugin.blocks._torchvision``,
``_timm``), so neither library is imported for it. On each instance of exactly a registered class
(subclasses may override forward, so they are left alone) every chain is planned, then the instance gets
the registered forward as an attribute (``forward``, or the one method that holds the chains, e.g. a
ResNet's stem); it computes what the class's method computes but runs each chain with the fused op on the
block's *own* modules. ``nn.Sequential`` (and subclasses that keep its forward, e.g. torchvision's
``Conv2dNormActivation``, which MobileNet/EfficientNet/RegNet blocks are built from) needs no registration:
its runs of ``[Conv2d →] norm [→ act]`` are fused generically. A norm is any class registered with
``register_norm``: ``nn.BatchNorm2d``, ``nn.GroupNorm``, torchvision's and timm's ``LayerNorm2d``, and timm's
norm-activation classes (``BatchNormAct2d``, ``GroupNormAct``: the norm and its own ``act``; a ``drop`` that
is not Identity keeps it eager). Nothing is re-parented or replaced, so parameter names, buffers,
state_dict keys, optimizer state and checkpoints are those of the eager model; undoing is deleting the
instance attribute. It works in eager mode and under ``torch.compile(fullgraph=True)`` alike (the ops are
``torch.library`` custom ops).

Each chain runs in one mode, named after the kernel it uses (the names ``CompileConfig.kernels`` accepts):
``conv_bn_act`` (conv with the BN-statistics epilogue + fused BN apply, or BN folded into the conv in eval),
``batch_norm_act`` (eager conv, fused BN), ``group_norm_act``, ``layer_norm2d_act``, or ``eager`` (the
block's own modules, when that kernel is off, the modules cannot be fused, a module between norm and
activation is not Identity, or their dtype has no kernel, e.g. float64 under ``precision="64-true"``; the
report says which). A norm-activation module that a block's plan runs is not rewritten on its own as well.
Forward hooks registered on the norm or activation modules of a rewritten block do not fire (the fused op
runs instead of those modules); hooks on the block itself do.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, cast

from torch import nn

from lcv_kernels._common import activation_name, unsupported_dtype_reason
from lcv_kernels.conv_bn_act import why_conv_bn_act_not_fusable
from lightning_plugin.blocks import PLAN_ATTR, BlockSpec, Chain, Step, block_spec, norm_spec
from lightning_plugin.blocks._run import is_identity, run_step, submodule
from lightning_plugin.config import KNOWN_KERNELS

__all__ = [
    "PLAN_ATTR",
    "Replacement",
    "SubstitutionReport",
    "apply_substitutions",
    "planned_norms",
    "substituted_modules",
    "undo_substitutions",
]


class _Missing(enum.Enum):
    """The type of ``_MISSING``, an enum so that ``x is not _MISSING`` narrows ``x``'s type."""

    MISSING = enum.auto()


_MISSING: Final = _Missing.MISSING


@dataclass
class Replacement:
    """One rewritten module: where, which kinds (the kernels its chains run, joined by ``+``; ``"eager"``
    under ``all_eager``), what changed, and how to undo it."""

    path: str
    kind: str
    description: str
    attribute: str = field(default="forward", repr=False)
    module: nn.Module | None = field(default=None, repr=False, compare=False)
    previous: Any = field(default=_MISSING, repr=False, compare=False)


@dataclass
class SubstitutionReport:
    """What :func:`apply_substitutions` did: rewritten modules, and the chains of registered blocks and
    Sequentials that stay (partly) eager, with the reasons (``skipped``: ``(path, "norm: reason; ...")``)."""

    replacements: list[Replacement]
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def summary(self) -> str:
        """A table of replaced blocks for the fit-start log."""
        if not self.replacements:
            lines = ["no kernel substitutions applied"]
        else:
            kinds: dict[str, int] = {}
            for r in self.replacements:
                for k in r.kind.split("+"):
                    kinds[k] = kinds.get(k, 0) + 1
            counts = ", ".join(f"{k}: {n}" for k, n in sorted(kinds.items()))
            width = max(len(r.path) for r in self.replacements)
            kind_w = max(len(r.kind) for r in self.replacements)
            lines = [f"kernel substitutions: {len(self.replacements)} module(s) rewritten ({counts})"]
            lines.append(f"{'path'.ljust(width)}  {'kind'.ljust(kind_w)}  description")
            lines += [
                f"{r.path.ljust(width)}  {r.kind.ljust(kind_w)}  {r.description}" for r in self.replacements
            ]
        lines += [f"not fused: {path}: {reason}" for path, reason in self.skipped]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# Planning: the mode of each chain, or why it stays eager


class _SpecMismatch(Exception):
    """A registered block's instance lacks a module its spec names (another version of the library?)."""


def _find(block: nn.Module, path: str) -> Any:
    """The module at ``path`` (None where the block sets it to None); raises when an attribute is missing."""
    try:
        return submodule(block, path)
    except AttributeError:
        raise _SpecMismatch(f"{type(block).__name__} has no {path!r}") from None


def _norm_mode(conv: nn.Module | None, norm: nn.Module, kinds: frozenset[str]) -> tuple[str, str | None]:
    """The mode (kernel name or "eager") ``[conv →] norm`` runs in, and why it stays (partly) eager."""
    spec = norm_spec(norm)
    if spec is None:
        return "eager", f"{type(norm).__name__} has no fused kernel"
    why = spec.check(norm) if spec.check is not None else None
    layer_norm = cast(nn.LayerNorm, norm)  # the layer_norm2d_act norms subclass it (timm, torchvision)
    if why is None and spec.kernel == "layer_norm2d_act" and len(layer_norm.normalized_shape) != 1:
        why = f"normalized_shape {tuple(layer_norm.normalized_shape)} is not one channel dimension"
    for name in spec.identities:
        if why is None and not is_identity(getattr(norm, name, None)):
            why = f"{type(norm).__name__}.{name} is {type(getattr(norm, name)).__name__}, not Identity"
    if why is not None:
        return "eager", why
    reason = None
    if spec.kernel == "batch_norm_act" and conv is not None and "conv_bn_act" in kinds:
        reason = why_conv_bn_act_not_fusable(conv, norm)
        if reason is None:
            return "conv_bn_act", None
    if spec.kernel not in kinds:
        return "eager", reason or f"{spec.kernel} is not enabled"
    dtype_reason = unsupported_dtype_reason(norm)
    if dtype_reason is not None:
        return "eager", dtype_reason
    return spec.kernel, (None if reason is None else f"conv stays eager ({reason})")


def _own_act(norm: nn.Module) -> nn.Module | None | _Missing:
    """A norm-activation class's own activation module, or ``_MISSING`` for a plain norm."""
    spec = norm_spec(norm)
    return _MISSING if spec is None or spec.act is None else getattr(norm, spec.act, None)


def _plan_chain(block: nn.Module, chain: Chain, kinds: frozenset[str]) -> tuple[Step | None, str | None]:
    """The chain's step and why it stays (partly) eager; no step when its norm is None on this instance."""
    norm = _find(block, chain.norm)
    if norm is None:
        return None, None
    conv = _find(block, chain.conv) if chain.conv is not None else None
    if chain.conv is not None and conv is None:
        raise _SpecMismatch(f"{type(block).__name__}.{chain.conv} is None")
    own = _own_act(norm)
    act_module = own if own is not _MISSING else (_find(block, chain.act) if chain.act is not None else None)
    between = [_find(block, path) for path in chain.between]
    act = activation_name(act_module)
    why: str | None
    if own is not _MISSING and chain.act is not None:
        mode, why = (
            "eager",
            f"{type(norm).__name__} applies its own activation; the chain names {chain.act!r}",
        )
    elif act is None:
        mode, why = "eager", f"{type(act_module).__name__} cannot be fused"
    elif not all(is_identity(m) for m in between):
        path, module = next((p, m) for p, m in zip(chain.between, between, strict=True) if not is_identity(m))
        mode, why = "eager", f"{path} is {type(module).__name__}, not Identity"
    else:
        mode, why = _norm_mode(conv, norm, kinds)
    step = Step(
        mode, chain.conv, chain.norm, act or "none", chain.act, chain.between, type(norm), own is not _MISSING
    )
    return step, why


def _plan_block(
    block: nn.Module, spec: BlockSpec, kinds: frozenset[str]
) -> tuple[dict[str, Step] | None, str]:
    """A step per chain present on ``block`` and the reasons some stay eager; None when ``block`` does not
    have what its spec names."""
    plan: dict[str, Step] = {}
    reasons = []
    for chain in spec.chains:
        try:
            step, why = _plan_chain(block, chain, kinds)
        except _SpecMismatch as mismatch:
            return None, f"not rewritten: {mismatch}"
        if why is not None:
            reasons.append(f"{chain.norm or 'self'}: {why}")
        if step is not None:
            plan[chain.norm] = step
    return plan, "; ".join(reasons)


def _is_plain_sequential(module: nn.Module) -> bool:
    return isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward


#: Norm layers a report names when they stay eager even where no spec is registered for their class.
_NORM_BASES = (nn.BatchNorm2d, nn.GroupNorm, nn.LayerNorm)


def _plan_sequential(seq: nn.Sequential, kinds: frozenset[str]) -> tuple[tuple[Step, ...], str]:
    """Steps for a Sequential, fusing ``[Conv2d →] norm [→ act]`` runs (a norm-activation class brings its
    own activation); the rest are "call" steps, run as they are. Also why norms among them stay (partly)
    eager, as ``name: why; ...``."""
    names = list(seq._modules)
    mods = [seq._modules[n] for n in names]
    steps: list[Step] = []
    reasons: list[str] = []
    i = 0
    while i < len(names):
        conv = mods[i] if type(mods[i]) is nn.Conv2d and i + 1 < len(mods) else None
        norm_at = i + 1 if conv is not None else i
        norm = mods[norm_at] if norm_at < len(mods) else None
        is_norm = norm is not None and (norm_spec(norm) is not None or isinstance(norm, _NORM_BASES))
        mode, why = _norm_mode(conv, norm, kinds) if norm is not None and is_norm else ("eager", None)
        if why is not None and (mode != "eager" or conv is None):  # else the norm's own turn says why
            reasons.append(f"{names[norm_at]}: {why}")
        if mode == "eager" or (conv is not None and mode != "conv_bn_act"):
            steps.append(Step("call", None, names[i]))  # runs as is (a conv not fused: its norm comes next)
            i += 1
            continue
        assert norm is not None  # a fused mode comes from _norm_mode(conv, norm, ...)
        own = _own_act(norm)
        nxt = norm_at + 1
        act_child = None
        if own is not _MISSING:
            act = activation_name(own)
            if act is None:  # a norm-activation class with an activation no kernel applies
                reasons.append(f"{names[norm_at]}: {type(own).__name__} cannot be fused")
                steps.append(Step("call", None, names[i]))
                i += 1
                continue
        else:
            act = activation_name(mods[nxt]) if nxt < len(mods) else None
            act_child = names[nxt] if act is not None else None  # consumed: the fused op applies it
        conv_name = names[i] if conv is not None else None
        own_act = own is not _MISSING
        steps.append(Step(mode, conv_name, names[norm_at], act or "none", act_child, (), type(norm), own_act))
        i = nxt + 1 if act_child is not None else nxt
    return tuple(steps), "; ".join(reasons)


def _fused(steps: Iterable[Step]) -> bool:
    return any(step.mode not in ("call", "eager") for step in steps)


def _describe(steps: Iterable[Step]) -> str:
    parts = []
    for step in steps:
        if step.mode == "call":
            continue
        act = None if step.act == "none" else step.act
        chain = "+".join(p for p in (step.conv, step.norm or "self", act) if p)
        parts.append(f"{chain} -> {step.mode}")
    return ", ".join(parts)


def _kinds_of(steps: Iterable[Step]) -> str:
    kinds: list[str] = []
    for step in steps:
        if step.mode not in ("call", "eager") and step.mode not in kinds:
            kinds.append(step.mode)
    return "+".join(kinds) or "eager"


def _norms_of(owner: nn.Module, steps: Iterable[Step]) -> set[int]:
    """ids of the norms (other than ``owner``) that ``owner``'s plan runs: a norm-activation module among them
    is not rewritten on its own as well."""
    found = (submodule(owner, step.norm) for step in steps if step.mode != "call")
    return {id(norm) for norm in found if norm is not None and norm is not owner}


def _sequential_forward(self: nn.Sequential, x: Any) -> Any:
    for step in getattr(self, PLAN_ATTR):
        x = run_step(self, step, x)
    return x


def _steps(plan: Mapping[str, Step] | tuple[Step, ...]) -> Iterable[Step]:
    return plan.values() if isinstance(plan, Mapping) else plan


def _patch(module: nn.Module, attribute: str, fn: Callable[..., Any], plan: Any) -> Any:
    """Set the instance attribute; ``functools.partial`` (not a bound method) so the model still pickles
    and deep-copies with its rewrite (a bound method of a free function would unpickle to the class's)."""
    previous = module.__dict__.get(attribute, _MISSING)
    setattr(module, PLAN_ATTR, plan)
    setattr(module, attribute, functools.partial(fn, module))
    return previous


def apply_substitutions(
    module: nn.Module, kinds: Iterable[str], *, all_eager: bool = False
) -> SubstitutionReport:
    """Rewrite the registered blocks and the Sequentials of ``module`` in place to run fused ops; return what
    was rewritten and what stays eager, with the reasons.

    ``kinds`` are kernel names from :data:`KNOWN_KERNELS`; unknown names raise. Idempotent: a module that
    already carries a plan is left alone. ``all_eager=True`` plans as for ``kinds`` but runs every chain on
    the block's own modules, and rewrites every recognised block even so: the restated forwards with no
    kernel, which must compute exactly what the classes' own forwards do (what the tests check; not for
    training).
    """
    unknown = set(kinds) - set(KNOWN_KERNELS)
    if unknown:
        raise ValueError(f"unknown kernels {sorted(unknown)}; known: {KNOWN_KERNELS}")
    kinds = frozenset(kinds)
    report = SubstitutionReport([])
    if not kinds:
        return report
    covered: set[int] = set()  # norm-activation modules a block's plan already runs
    for path, sub in list(module.named_modules()):
        if id(sub) in covered:
            continue
        existing = sub.__dict__.get(PLAN_ATTR)
        if existing is not None:
            covered |= _norms_of(sub, _steps(existing))
            continue
        label = path or type(sub).__name__
        spec = block_spec(sub)
        plan: dict[str, Step] | tuple[Step, ...] | None
        if spec is not None:
            plan, why = _plan_block(sub, spec, kinds)
            attribute, forward = spec.attribute, spec.forward
        elif _is_plain_sequential(sub):
            plan, why = _plan_sequential(sub, kinds)
            attribute, forward = "forward", _sequential_forward
        else:
            continue
        if why:
            report.skipped.append((label, why))
        if plan is None:
            continue
        covered |= _norms_of(sub, _steps(plan))
        if all_eager:
            plan = _all_eager(plan)
        elif not _fused(_steps(plan)):
            continue
        steps = list(_steps(plan))
        previous = _patch(sub, attribute, forward, plan)
        where = f"{type(sub).__name__}.{attribute}" if spec is not None else type(sub).__name__
        report.replacements.append(
            Replacement(label, _kinds_of(steps), f"{where}: {_describe(steps)}", attribute, sub, previous)
        )
    return report


def _all_eager(plan: dict[str, Step] | tuple[Step, ...]) -> dict[str, Step] | tuple[Step, ...]:
    def eager(step: Step) -> Step:
        return step if step.mode == "call" else step._replace(mode="eager")

    if isinstance(plan, dict):
        return {name: eager(step) for name, step in plan.items()}
    return tuple(eager(step) for step in plan)


def undo_substitutions(module: nn.Module, report: SubstitutionReport) -> None:
    """Restore the original methods (parameters were never moved, so training carries over)."""
    for rep in reversed(report.replacements):
        target = rep.module if rep.module is not None else module.get_submodule(rep.path)
        if rep.previous is _MISSING:
            target.__dict__.pop(rep.attribute, None)
        else:
            setattr(target, rep.attribute, rep.previous)
        target.__dict__.pop(PLAN_ATTR, None)
    report.replacements.clear()


def substituted_modules(module: nn.Module) -> list[str]:
    """Paths of the submodules of ``module`` that currently run a substitution plan."""
    return [path or type(sub).__name__ for path, sub in module.named_modules() if PLAN_ATTR in sub.__dict__]


def planned_norms(module: nn.Module) -> dict[str, str]:
    """The mode (a kernel name, or "eager") of each norm that a rewritten submodule of ``module`` runs, by the
    norm's path: what a coverage report counts."""
    modes: dict[str, str] = {}
    for path, sub in module.named_modules():
        plan = sub.__dict__.get(PLAN_ATTR)
        for step in _steps(plan) if plan is not None else ():
            if step.mode != "call":
                modes[".".join(p for p in (path, step.norm) if p)] = step.mode
    return modes
