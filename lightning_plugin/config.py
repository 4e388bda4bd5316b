"""`CompileConfig`: every knob of the compiled strategies in one validated dataclass.

Validation happens in ``__post_init__`` so that a bad value fails when the Trainer is
built, not minutes later inside the first training step.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from lcv_kernels import KERNELS

#: Kernels the strategy can substitute into a model (see ``lightning_plugin.kernel_choice.substitution``); each
#: name is also its op (``lcv::<name>``) and its module (``kernels/lcv_kernels/<name>.py``).
KNOWN_KERNELS: tuple[str, ...] = KERNELS

#: Names of the first release, kept only to say what they are called now.
RENAMED_KERNELS: dict[str, str] = {
    "bn_act": "batch_norm_act",
    "groupnorm_act": "group_norm_act",
    "layernorm2d_act": "layer_norm2d_act",
}

#: Values of ``CompileConfig.kernels`` that stand for a set of substitutions.
KERNEL_ALIASES: tuple[str, ...] = ("auto", "all", "none")

_MODES: tuple[str | None, ...] = (
    None,
    "default",
    "reduce-overhead",
    "max-autotune",
    "max-autotune-no-cudagraphs",
)
_FALLBACKS: tuple[str, ...] = ("eager", "raise")
_COMPILE: tuple[str, ...] = ("auto", "always", "never")

KernelsSpec = str | Iterable[str]


@dataclass
class CompileConfig:
    """How the compiled strategies run ``torch.compile`` on a LightningModule.

    Args:
        backend: a ``torch.compile`` backend name (``"inductor"``, ``"aot_eager"``, ``"eager"``, ...)
            or a backend callable.
        mode: Inductor mode: ``None``/``"default"``, ``"reduce-overhead"`` (CUDA graphs),
            ``"max-autotune"`` or ``"max-autotune-no-cudagraphs"``. Only with the inductor backend.
        fullgraph: raise on any graph break instead of splitting the graph.
        dynamic: ``None`` lets dynamo mark a dimension dynamic after it changes once
            (so the smaller last batch costs one recompile), ``True``/``False`` force it.
        options: Inductor config overrides, e.g. ``{"shape_padding": True}``. Not together with ``mode``.
        channels_last: convert the model (and 4-D inputs) to ``torch.channels_last`` before compiling.
        kernels: kernel substitutions applied to the model before compiling: ``"auto"`` (on CUDA, each
            block kept fused only where measured correct and >= 1.05x faster than Inductor alone, see
            :mod:`lightning_plugin.kernel_choice.selection`; none on CPU, where they would only run their
            PyTorch references), ``"all"``, ``"none"``, or a list of names from :data:`KNOWN_KERNELS`.
        compile_eval: also run validation/test/predict through the compiled forward.
        fallback: what to do when compilation fails or dynamo gives up on a frame: ``"eager"`` warns
            and continues eagerly, ``"raise"`` re-raises the compiler error. Unset, it is ``"raise"``
            with ``fullgraph=True`` (a graph break then stops the run, as ``torch.compile`` does) and
            ``"eager"`` otherwise; set ``fallback="eager"`` to let a ``fullgraph`` run continue eagerly.
        regional: compile each repeated block (a submodule class used two or more times, such as
            a ResNet ``BasicBlock``) once instead of the whole ``forward``; cuts compile time.
        cache: a portable compile cache (see ``lightning_plugin.compile.cache``): ``True`` saves
            what was compiled next to the run's checkpoints and loads it in a later process (a
            resume, another rank or node, a rerun into the same folder); a file path loads from and
            saves to that file; ``False`` turns it off. A cache made with another torch, Triton,
            Python or device is skipped with one warning line.
        compile: ``"auto"`` times a few training steps compiled and eager after the first (compiling) ones and
            trains eagerly for the rest of the run when compiled is not faster, saying so in one line; the
            decision is cached per model and machine (see :mod:`lightning_plugin.compile.decision`).
            ``"always"`` compiles without measuring; ``"never"`` trains eagerly (checkpoints, DDP and the
            rest of the strategy unchanged).
        tune_cpu: when training on a CPU, apply what was measured to pay there: Inductor without its
            layout optimisation and with its C++ wrapper, plus our graph changes where torch's defaults
            lose to eager (:mod:`lightning_plugin.cpu.inductor`, :mod:`lightning_plugin.cpu.graph_passes`;
            only when neither ``mode`` nor ``options`` is given), the optimizer's fused step where the
            LightningModule chose no implementation (:mod:`lightning_plugin.cpu.fused_optimizer`), and glibc
            keeping freed memory for reuse instead of handing it back, which cost page faults on every step
            (:mod:`lightning_plugin.cpu.memory`). ``False`` applies none of it.
        fast_step: run the training step's bookkeeping on a leaner path than Lightning's (``self.log``
            stored without its per-call checks and moves, see :mod:`lightning_plugin.fast_step`): the same
            logged values, callback metrics and logger records for a fraction of the host time.
            ``False`` keeps Lightning's own path. On a Lightning version outside the tested range the
            strategy uses Lightning's path and says so once.
        compile_step: trace each training step (``training_step``, backward, gradient clipping and the
            optimizer update) into one graph instead of compiling the forward alone
            (:mod:`lightning_plugin.compile.whole_step`): one call per step instead of Lightning's forward,
            backward and optimizer calls. One device, automatic optimization, one SGD/Adam/AdamW optimizer,
            32-bit or bf16-mixed precision; a fit it cannot capture falls back to the compiled forward and says
            why. Validation then runs the eager forward. With ``compile="auto"`` the one-graph step is timed
            against the eager step like the compiled forward is.
    """

    backend: str | Callable[..., Any] = "inductor"
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    options: dict[str, Any] | None = None
    channels_last: bool = False
    kernels: KernelsSpec = "auto"
    compile_eval: bool = True
    fallback: Literal["eager", "raise"] | None = None
    regional: bool = False
    cache: bool | str | os.PathLike[str] = False
    compile: Literal["auto", "always", "never"] = "auto"
    tune_cpu: bool = True
    fast_step: bool = True
    compile_step: bool = False
    _kernel_names: frozenset[str] | None = field(default=None, init=False, repr=False, compare=False)
    _fallback_given: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.backend, str) and self.backend) and not callable(self.backend):
            raise ValueError(
                f"CompileConfig.backend must be a backend name or a callable, got {self.backend!r}"
            )
        if isinstance(self.backend, str):
            known = set(torch._dynamo.list_backends(exclude_tags=())) | {"inductor"}
            if self.backend not in known:
                raise ValueError(
                    f"CompileConfig.backend={self.backend!r} is not a registered torch.compile backend; "
                    f"known: {sorted(known)}"
                )
        if self.compile not in _COMPILE:
            raise ValueError(f"CompileConfig.compile={self.compile!r} is not one of {list(_COMPILE)}")
        if self.mode not in _MODES:
            raise ValueError(f"CompileConfig.mode={self.mode!r} is not one of {list(_MODES)}")
        if self.mode not in (None, "default") and self.backend != "inductor":
            raise ValueError(
                f"CompileConfig.mode={self.mode!r} needs backend='inductor', got {self.backend!r}"
            )
        for name in (
            "fullgraph",
            "channels_last",
            "compile_eval",
            "regional",
            "tune_cpu",
            "fast_step",
            "compile_step",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"CompileConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.dynamic is not None and not isinstance(self.dynamic, bool):
            raise TypeError(f"CompileConfig.dynamic must be None, True or False, got {self.dynamic!r}")
        if self.options is not None:
            if not isinstance(self.options, dict) or not all(isinstance(k, str) for k in self.options):
                raise TypeError(f"CompileConfig.options must be a dict with str keys, got {self.options!r}")
            if self.mode not in (None, "default"):
                raise ValueError(
                    "CompileConfig: set either `mode` or `options`, not both (torch.compile rule)"
                )
        if not isinstance(self.cache, (bool, str, os.PathLike)) or self.cache == "":
            raise TypeError(f"CompileConfig.cache must be True, False or a file path, got {self.cache!r}")
        if self.fallback is None:
            self.fallback = "raise" if self.fullgraph else "eager"
        elif self.fallback not in _FALLBACKS:
            raise ValueError(f"CompileConfig.fallback={self.fallback!r} is not one of {list(_FALLBACKS)}")
        else:
            self._fallback_given = True
        self._kernel_names = _parse_kernels(self.kernels)

    def resolve_kernels(self, device: torch.device) -> frozenset[str]:
        """The substitutions to apply on ``device`` (``"auto"`` means all on CUDA, none elsewhere)."""
        if self._kernel_names is None:  # "auto"
            return frozenset(KNOWN_KERNELS) if device.type == "cuda" else frozenset()
        return self._kernel_names

    def tunes_cpu(self, device: torch.device) -> bool:
        """Whether the CPU training settings (``tune_cpu``) apply on ``device``."""
        return self.tune_cpu and torch.device(device).type == "cpu"

    def compile_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``torch.compile`` (without the backend, which the strategy wraps)."""
        return {"fullgraph": self.fullgraph, "dynamic": self.dynamic}

    def replace(self, **changes: Any) -> CompileConfig:
        """A validated copy with some fields changed (an unset ``fallback`` stays unset)."""
        if not self._fallback_given:
            changes.setdefault("fallback", None)
        return dataclasses.replace(self, **changes)


def _parse_kernels(spec: KernelsSpec) -> frozenset[str] | None:
    """``None`` for "auto"; otherwise the validated set of substitution names."""
    if isinstance(spec, str):
        if spec == "auto":
            return None
        if spec == "all":
            return frozenset(KNOWN_KERNELS)
        if spec == "none":
            return frozenset()
        names = [spec]
    else:
        try:
            names = list(spec)
        except TypeError:
            raise TypeError(
                f"CompileConfig.kernels must be a string or a list of strings, got {spec!r}"
            ) from None
    renamed = [n for n in names if isinstance(n, str) and n in RENAMED_KERNELS]
    if renamed:
        raise ValueError(
            "CompileConfig.kernels: "
            + ", ".join(f"{n!r} is now called {RENAMED_KERNELS[n]!r}" for n in renamed)
            + f"; choose from {list(KNOWN_KERNELS)} or one of {list(KERNEL_ALIASES)}"
        )
    unknown = [n for n in names if n not in KNOWN_KERNELS]
    if unknown or not all(isinstance(n, str) for n in names):
        raise ValueError(
            f"CompileConfig.kernels: unknown substitution(s) {unknown or names}; "
            f"choose from {list(KNOWN_KERNELS)} or one of {list(KERNEL_ALIASES)}"
        )
    return frozenset(names)
