"""Rewrite a model in place so its conv → norm → activation chains run as our fused ``lcv::`` ops.

Design: *patched forwards*, not module swaps and not an Inductor graph pass. For each block we recognise,
the instance gets a ``forward`` (or the one method that holds the chain) that computes exactly what the
class's forward computes, but calls the fused ops on the tensors of the block's *own* modules. Nothing is
re-parented or replaced, so parameter names, buffers, state_dict keys, optimizer state and checkpoints are
those of the eager model; undoing is deleting the instance attribute. It works in eager mode and under
``torch.compile(fullgraph=True)`` alike (the ops are ``torch.library`` custom ops).

Recognised (exact classes; subclasses may override forward, so they are left alone):

* torchvision ``BasicBlock``/``Bottleneck`` and ``ResNet`` (stem), and ours in ``vision.models.resnet``;
* our airbench ``ConvGroup`` (``vision.models.airbench``);
* ``nn.Sequential`` (and subclasses that keep its forward, e.g. torchvision ``Conv2dNormActivation``):
  ``Conv2d → BatchNorm2d [→ act]``, ``BatchNorm2d [→ act]``, ``GroupNorm [→ act]``, ``LayerNorm2d [→ act]``.

Each norm in a recognised block runs in one mode, named after the kernel it uses (the names
``CompileConfig.kernels`` accepts): ``conv_bn_act`` (conv with the BN-statistics epilogue + fused BN apply, or
BN folded into the conv in eval), ``batch_norm_act`` (eager conv, fused BN), ``group_norm_act``,
``layer_norm2d_act``, or ``eager`` (the original modules, when that kernel is off, the modules cannot be
fused, or their dtype has no kernel, e.g. float64 under ``precision="64-true"``; the fit-start table says
which). Forward hooks registered on the norm or activation modules of a rewritten block do not fire (the fused
op runs instead of those modules); hooks on the block itself do.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_plugin.config import KNOWN_KERNELS

#: Instance attribute holding a rewritten module's plan (plain tuples/dicts: deep-copies and pickles).
PLAN_ATTR = "_lcv_plan"

_MISSING = object()

# A step: (mode, conv child or None, norm child, fused activation name, activation child or None).
# mode "call" runs child ``norm`` as is (an untouched member of a rewritten Sequential).
Step = tuple[str, "str | None", str, str, "str | None"]


@dataclass
class Replacement:
    """One rewritten module: where, which kinds, what changed, and how to undo it."""

    path: str
    kind: str
    description: str
    attribute: str = field(default="forward", repr=False)
    module: nn.Module | None = field(default=None, repr=False, compare=False)
    previous: Any = field(default=_MISSING, repr=False, compare=False)


@dataclass
class SubstitutionReport:
    """What :func:`apply_substitutions` did: rewritten modules, and chains of recognised blocks that stay
    eager, with the reason (``skipped``: ``(path, reason)``)."""

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
# Running a plan


def _run_step(
    owner: nn.Module, step: Step, x: torch.Tensor, residual: torch.Tensor | None = None
) -> torch.Tensor:
    from kernels.batch_norm_act import batch_norm_act_forward
    from kernels.conv_bn_act import conv_bn_act_forward
    from kernels.group_norm_act import group_norm_act_forward
    from kernels.layer_norm2d_act import layer_norm2d_act_forward

    mode, conv_name, norm_name, act, act_name = step
    mods = owner._modules
    if mode == "call":
        return mods[norm_name](x)
    if not _still_fusable(mode, mods[norm_name], mods[conv_name] if conv_name is not None else None, x):
        # A module swapped after planning (e.g. for SyncBatchNorm), or an input dtype no kernel takes.
        mode = "eager"
    if mode == "conv_bn_act":
        return conv_bn_act_forward(mods[conv_name], mods[norm_name], x, act, residual)
    if conv_name is not None:
        x = mods[conv_name](x)
    norm = mods[norm_name]
    if mode == "batch_norm_act":
        return batch_norm_act_forward(norm, x, act, residual)
    if mode == "group_norm_act":
        return group_norm_act_forward(norm, x, act, residual)
    if mode == "layer_norm2d_act":
        return layer_norm2d_act_forward(norm, x, act, residual)
    x = norm(x)  # "eager": the block's own modules, exactly as its class's forward calls them
    if residual is not None:
        x = x + residual
    return mods[act_name](x) if act_name is not None else x


def _still_fusable(mode: str, norm: nn.Module, conv: nn.Module | None, x: torch.Tensor) -> bool:
    """Dynamo-constant checks that keep a plan correct if a module was replaced after planning or the input
    has a dtype no kernel takes (the block then runs its own modules, as planned for an eager step)."""
    from kernels._common import SUPPORTED_DTYPES

    if mode != "eager" and x.dtype not in SUPPORTED_DTYPES and not torch.is_autocast_enabled(x.device.type):
        return False
    if mode == "conv_bn_act":
        return type(norm) is nn.BatchNorm2d and type(conv) is nn.Conv2d
    if mode == "batch_norm_act":
        return type(norm) is nn.BatchNorm2d
    if mode == "group_norm_act":
        return type(norm) is nn.GroupNorm
    if mode == "layer_norm2d_act":
        return _is_layernorm2d(norm)
    return True


def _chain(
    block: nn.Module, x: torch.Tensor, norm_name: str, residual: torch.Tensor | None = None
) -> torch.Tensor:
    return _run_step(block, getattr(block, PLAN_ATTR)[norm_name], x, residual)


def _sequential_forward(self: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    for step in getattr(self, PLAN_ATTR):
        x = _run_step(self, step, x)
    return x


def _basic_block_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    identity = x if self.downsample is None else self.downsample(x)
    out = _chain(self, x, "bn1")
    return _chain(self, out, "bn2", identity)


def _bottleneck_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    identity = x if self.downsample is None else self.downsample(x)
    out = _chain(self, x, "bn1")
    out = _chain(self, out, "bn2")
    return _chain(self, out, "bn3", identity)


def _torchvision_resnet_forward_impl(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = self.maxpool(_chain(self, x, "bn1"))
    x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
    return self.fc(torch.flatten(self.avgpool(x), 1))


def _vision_resnet_forward_features(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = self.maxpool(_chain(self, x, "bn1"))
    x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
    return torch.flatten(self.avgpool(x), 1)


def _airbench_conv_group_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = _chain(self, self.pool(self.conv1(x)), "norm1")
    return _chain(self, x, "norm2")


# ---------------------------------------------------------------------------------------------------------
# Recognising blocks


@dataclass(frozen=True)
class _BlockSpec:
    """A block class we know the forward of: the method to patch, its replacement, and its chains
    ``(conv child or None, norm child, activation child)``, in the order the forward runs them."""

    attribute: str
    forward: Callable[..., torch.Tensor]
    chains: tuple[tuple[str | None, str, str], ...]


def _block_specs() -> dict[type[nn.Module], _BlockSpec]:
    specs: dict[type[nn.Module], _BlockSpec] = {}
    basic = _BlockSpec("forward", _basic_block_forward, (("conv1", "bn1", "relu"), ("conv2", "bn2", "relu")))
    bottleneck = _BlockSpec(
        "forward",
        _bottleneck_forward,
        (("conv1", "bn1", "relu"), ("conv2", "bn2", "relu"), ("conv3", "bn3", "relu")),
    )
    try:
        from torchvision.models import resnet as tv_resnet

        specs[tv_resnet.BasicBlock] = basic
        specs[tv_resnet.Bottleneck] = bottleneck
        specs[tv_resnet.ResNet] = _BlockSpec(
            "_forward_impl", _torchvision_resnet_forward_impl, (("conv1", "bn1", "relu"),)
        )
    except ImportError:  # pragma: no cover - torchvision is a dependency
        pass
    from vision.models import airbench, resnet

    specs[resnet.BasicBlock] = basic
    specs[resnet.Bottleneck] = bottleneck
    specs[resnet.ResNet] = _BlockSpec(
        "forward_features", _vision_resnet_forward_features, (("conv1", "bn1", "relu"),)
    )
    specs[airbench.ConvGroup] = _BlockSpec(
        "forward", _airbench_conv_group_forward, ((None, "norm1", "act"), ("conv2", "norm2", "act"))
    )
    return specs


#: LayerNorm-over-channels classes (``nn.LayerNorm`` subclasses whose forward permutes NCHW → NHWC → NCHW).
_LAYERNORM2D_CLASSES = ("torchvision.models.convnext.LayerNorm2d", "timm.layers.norm.LayerNorm2d")


def _is_layernorm2d(module: nn.Module) -> bool:
    cls = type(module)
    return (
        isinstance(module, nn.LayerNorm)
        and f"{cls.__module__}.{cls.__qualname__}" in _LAYERNORM2D_CLASSES
        and len(module.normalized_shape) == 1
    )


def _norm_mode(conv: nn.Module | None, norm: nn.Module, kinds: frozenset[str]) -> tuple[str, str | None]:
    """The mode (kernel name or "eager") a norm runs in, and why it stays eager (None when it does not)."""
    from kernels._common import unsupported_dtype_reason
    from kernels.conv_bn_act import why_conv_bn_act_not_fusable

    reason = None
    if type(norm) is nn.BatchNorm2d:
        if conv is not None and "conv_bn_act" in kinds:
            reason = why_conv_bn_act_not_fusable(conv, norm)
            if reason is None:
                return "conv_bn_act", None
        mode = "batch_norm_act"
    elif type(norm) is nn.GroupNorm:
        mode = "group_norm_act"
    elif _is_layernorm2d(norm):
        mode = "layer_norm2d_act"
    else:
        return "eager", f"{type(norm).__name__} has no fused kernel"
    if mode not in kinds:
        return "eager", reason or f"{mode} is not enabled"
    dtype_reason = unsupported_dtype_reason(norm)
    if dtype_reason is not None:
        return "eager", dtype_reason
    return mode, (None if reason is None else f"conv stays eager ({reason})")


def _act_step_name(module: nn.Module | None) -> str | None:
    from kernels._common import activation_name

    return activation_name(module)


def _plan_block(
    block: nn.Module, spec: _BlockSpec, kinds: frozenset[str]
) -> tuple[dict[str, Step] | None, str]:
    """Per-norm steps for a known block, or (None, reason) when nothing can be fused."""
    mods = block._modules
    plan: dict[str, Step] = {}
    reasons = []
    for conv_name, norm_name, act_attr in spec.chains:
        conv = mods.get(conv_name) if conv_name is not None else None
        norm, act_mod = mods.get(norm_name), mods.get(act_attr)
        if norm is None or act_mod is None or (conv_name is not None and conv is None):
            return None, f"missing submodule for chain {conv_name}/{norm_name}/{act_attr}"
        act = _act_step_name(act_mod)
        mode, why = (
            _norm_mode(conv, norm, kinds)
            if act is not None
            else ("eager", f"{type(act_mod).__name__} cannot be fused")
        )
        if why is not None:
            reasons.append(f"{norm_name}: {why}")
        plan[norm_name] = (mode, conv_name, norm_name, act or "none", act_attr)
    if all(step[0] == "eager" for step in plan.values()):
        return None, "; ".join(reasons) or "nothing to fuse"
    return plan, "; ".join(reasons)


def _is_plain_sequential(module: nn.Module) -> bool:
    return isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward


def _plan_sequential(seq: nn.Sequential, kinds: frozenset[str]) -> tuple[Step, ...] | None:
    """Steps for a Sequential, fusing ``[Conv2d →] norm [→ act]`` runs; None when nothing fuses."""
    names = list(seq._modules)
    mods = [seq._modules[n] for n in names]
    steps: list[Step] = []
    i = 0
    while i < len(names):
        conv = mods[i] if type(mods[i]) is nn.Conv2d and i + 1 < len(mods) else None
        norm_at = i + 1 if conv is not None else i
        mode, _ = _norm_mode(conv, mods[norm_at], kinds) if norm_at < len(mods) else ("eager", None)
        if conv is not None and mode != "conv_bn_act":
            steps.append(("call", None, names[i], "none", None))  # the conv runs as is; the norm is next
            i += 1
            continue
        if mode == "eager":
            steps.append(("call", None, names[i], "none", None))
            i += 1
            continue
        nxt = norm_at + 1
        act = _act_step_name(mods[nxt]) if nxt < len(mods) else None
        act_child = names[nxt] if act is not None else None  # consumed: the fused op applies it
        steps.append((mode, names[i] if conv is not None else None, names[norm_at], act or "none", act_child))
        i = nxt + 1 if act is not None else nxt
    if all(s[0] == "call" for s in steps):
        return None
    return tuple(steps)


def _describe(steps: list[Step]) -> str:
    parts = []
    for mode, conv, norm, act, _ in steps:
        if mode == "call":
            continue
        chain = "+".join(p for p in (conv, norm, None if act == "none" else act) if p)
        parts.append(f"{chain} -> {mode}")
    return ", ".join(parts)


def _kinds_of(steps: list[Step]) -> str:
    kinds: list[str] = []
    for mode, *_ in steps:
        if mode not in ("call", "eager") and mode not in kinds:
            kinds.append(mode)
    return "+".join(kinds)


def _patch(module: nn.Module, attribute: str, fn: Callable[..., Any], plan: Any) -> Any:
    """Set the instance attribute; ``functools.partial`` (not a bound method) so the model still pickles
    and deep-copies with its rewrite (a bound method of a free function would unpickle to the class's)."""
    previous = module.__dict__.get(attribute, _MISSING)
    setattr(module, PLAN_ATTR, plan)
    setattr(module, attribute, functools.partial(fn, module))
    return previous


def apply_substitutions(module: nn.Module, kinds: frozenset[str]) -> SubstitutionReport:
    """Rewrite recognised blocks of ``module`` in place to run fused ops; return what was rewritten.

    ``kinds`` are kernel names from :data:`KNOWN_KERNELS`; unknown names raise. Idempotent: a module that
    already carries a plan is left alone.
    """
    unknown = set(kinds) - set(KNOWN_KERNELS)
    if unknown:
        raise ValueError(f"unknown kernels {sorted(unknown)}; known: {KNOWN_KERNELS}")
    kinds = frozenset(kinds)
    report = SubstitutionReport([])
    if not kinds:
        return report
    specs = _block_specs()
    for path, sub in list(module.named_modules()):
        if PLAN_ATTR in sub.__dict__:
            continue
        label = path or type(sub).__name__
        spec = specs.get(type(sub))
        if spec is not None:
            plan, why = _plan_block(sub, spec, kinds)
            if why:
                report.skipped.append((label, why))
            if plan is None:
                continue
            steps = list(plan.values())
            previous = _patch(sub, spec.attribute, spec.forward, plan)
            report.replacements.append(
                Replacement(
                    label,
                    _kinds_of(steps),
                    f"{type(sub).__name__}.{spec.attribute}: {_describe(steps)}",
                    spec.attribute,
                    sub,
                    previous,
                )
            )
        elif _is_plain_sequential(sub):
            seq_plan = _plan_sequential(sub, kinds)  # type: ignore[arg-type]
            if seq_plan is None:
                continue
            previous = _patch(sub, "forward", _sequential_forward, seq_plan)
            report.replacements.append(
                Replacement(
                    label,
                    _kinds_of(list(seq_plan)),
                    f"{type(sub).__name__}: {_describe(list(seq_plan))}",
                    "forward",
                    sub,
                    previous,
                )
            )
    return report


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
