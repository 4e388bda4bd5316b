"""Compiling a LightningModule in place, and undoing it: shared by both compiled strategies.

Only ``forward`` is compiled (or, with ``regional=True``, the forward of each repeated
block), never ``training_step``: Lightning's ``self.log`` breaks or crashes dynamo
(Lightning #21836), while a compiled ``forward`` called from an eager ``training_step``
gives whole graphs with zero breaks. Patching the instance attribute ``forward`` keeps
``state_dict`` keys clean (no ``_orig_mod.``) and is undone by deleting the attribute.

A copy of a compiled module (``copy.deepcopy`` for an EMA or teacher model, ``pickle``,
``torch.save(module)``) is the plain eager module: each patched module gets an instance
``__getstate__`` that leaves the compiled ``forward`` out of its state.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch._functorch.config as functorch_config
from torch import nn

from lightning_plugin.compile import dynamo_cache
from lightning_plugin.compile.stats import CompileStats, CountingBackend, FrameRecord, make_backend
from lightning_plugin.config import CompileConfig
from lightning_plugin.cpu import graph_passes as cpu_graph_passes
from lightning_plugin.cpu import inductor as cpu_inductor
from lightning_plugin.cpu.strided_pointwise_conv import restore_convs, subsample_strided_pointwise_convs

log = logging.getLogger(__name__)

#: Exceptions that mean "the compiler failed", as opposed to an error in the user's code
#: (a user error raised while tracing is re-raised by the eager re-run after a fallback).
COMPILE_ERRORS: tuple[type[BaseException], ...] = (
    torch._dynamo.exc.TorchDynamoException,
    torch._dynamo.exc.FailOnRecompileLimitHit,  # not a TorchDynamoException
    torch._inductor.exc.InductorError,
)

_MISSING = object()


@dataclass
class _PatchedForward:
    module: nn.Module
    previous: Any  # the instance attribute ``forward`` before patching, or _MISSING


class ModuleCompiler:
    """Compiles a module's ``forward`` (or its repeated blocks) in place and restores it."""

    def __init__(self, config: CompileConfig) -> None:
        self.config = config
        self.stats = CompileStats()
        self._patched: list[_PatchedForward] = []
        self._substitution_report: Any = None
        self._subsampled_convs: list[nn.Conv2d] = []  # see lightning_plugin.cpu.strided_pointwise_conv
        self._selection: Any = None  # an AutoKernelSelection with kernels="auto"
        self._targets: list[nn.Module] = []
        self._backend: CountingBackend | None = None
        self._use_eager = False  # compiling failed: eager for the rest of the run
        #: Run the eager forward in training / evaluation mode (set by ``compile="auto"``'s measurement and
        #: decision, see :mod:`lightning_plugin.compile.decision`); nothing is traced while they are set.
        self.eager_train = False
        self.eager_eval = False

    @property
    def is_compiled(self) -> bool:
        return bool(self._patched)

    @property
    def substitution_report(self) -> Any:
        """The ``SubstitutionReport`` of the last compile, or ``None`` when no kernels were substituted."""
        return self._substitution_report

    @property
    def kernel_decisions(self) -> list[Any]:
        """A ``KernelDecision`` per rewritten block, once ``kernels="auto"`` has measured (first forward)."""
        return list(self._selection.decisions) if self._selection is not None else []

    @property
    def inductor_options(self) -> dict[str, Any]:
        """The Inductor options of the compiled forward (the CPU tuning's too); empty before compiling."""
        return self._backend.inductor_options if self._backend is not None else {}

    @property
    def graph_passes(self) -> str | None:
        """The version of the CPU graph changes the compiled forward runs with (:mod:`~lightning_plugin.
        cpu_graph_passes`); None without them. A changed version makes an earlier measurement stale."""
        inner = getattr(self._backend, "inner", None)
        return cpu_graph_passes.source_hash() if isinstance(inner, cpu_inductor.CPUTrainingInductor) else None

    @property
    def selection_pending(self) -> bool:
        return self._selection is not None and self._selection.pending

    def compile(
        self, module: nn.Module, device: torch.device, targets: list[nn.Module] | None = None
    ) -> bool:
        """Compile ``module`` in place; return False when it was left alone (already compiled).

        ``targets``: the submodules whose forwards to compile instead of the module's (or its repeated
        blocks'); ``compiled_fsdp`` passes its sharding units, each compiled before it is sharded."""
        if self.is_compiled:
            return True
        reason = already_compiled_reason(module)
        if reason is not None:
            warnings.warn(
                f"The compiled strategy leaves the model as it is: {reason}. It will not be compiled twice; "
                "pass the plain module to `Trainer.fit` to let the strategy compile it.",
                stacklevel=2,
            )
            return False
        if self.config.channels_last:
            module.to(memory_format=torch.channels_last)
        kinds = self.config.resolve_kernels(device)
        if kinds:
            from lightning_plugin.kernel_choice.substitution import apply_substitutions

            self._substitution_report = apply_substitutions(module, kinds)
            log.info("Kernel substitutions:\n%s", self._substitution_report.summary())
        if device.type == "cpu":
            self._subsampled_convs = subsample_strided_pointwise_convs(module)
        self._selection = None
        if kinds and self.config.kernels == "auto":
            from lightning_plugin.kernel_choice.selection import AutoKernelSelection

            self._selection = AutoKernelSelection(
                module,
                self._substitution_report,
                self.config,
                device,
                uncompiled=functools.partial(self._uncompiled, module),
                prepare_args=_channels_last_args if self.config.channels_last else tuple,
                on_finish=self.stats.start,  # the measurement's compiles are not the model's
            )
        self._use_eager = False
        self._backend = make_backend(
            self.config.backend,
            self.config.mode,
            self.config.options,
            self.config.dynamic,
            self.stats,
            device,
            self.config.tune_cpu,
        )
        if targets is None:
            targets = find_repeated_blocks(module) if self.config.regional else []
        elif not targets:
            warnings.warn(
                f"{type(module).__name__} has no block to compile on its own; compiling its whole forward.",
                stacklevel=2,
            )
        if self.config.regional and not targets:
            warnings.warn(
                f"CompileConfig(regional=True): {type(module).__name__} has no repeated block; "
                "compiling its whole forward instead.",
                stacklevel=2,
            )
        self._targets = targets or [module]
        codes = {
            dynamo_cache.code_of(target.forward) for target in self._targets
        }  # repeated blocks share one
        self.stats.start(reused_frames=sum(dynamo_cache.prepare(code, self._backend) for code in codes))
        self._patch_targets(module)
        return True

    def restore(self, module: nn.Module | None = None) -> None:
        """Undo :meth:`compile`: original forwards back, substituted kernels reverted."""
        self._unpatch_targets()
        if self._selection is not None:
            self._selection.close()
        if self._substitution_report is not None and module is not None:
            from lightning_plugin.kernel_choice.substitution import undo_substitutions

            undo_substitutions(module, self._substitution_report)
        self._substitution_report = None
        restore_convs(self._subsampled_convs)
        self._subsampled_convs = []

    def _patch_targets(self, root: nn.Module) -> None:
        for target in self._targets:
            assert self._backend is not None
            self._patch(target, self._backend, to_channels_last=self.config.channels_last and target is root)

    def _unpatch_targets(self) -> None:
        for patched in reversed(self._patched):
            patched.module.__dict__.pop("__getstate__", None)
            if patched.previous is _MISSING:
                patched.module.__dict__.pop("forward", None)
            else:
                patched.module.forward = patched.previous
        self._patched.clear()

    @contextlib.contextmanager
    def _uncompiled(self, root: nn.Module) -> Iterator[None]:
        """The module's own forwards while ``kernels="auto"`` measures and undoes rewrites (its copies and
        undos must not meet our wrappers), then fresh wrappers over the forwards it left. Nothing was
        traced."""
        self._unpatch_targets()
        try:
            yield
        finally:
            self._patch_targets(root)

    def _patch(self, target: nn.Module, backend: Callable[..., Any], to_channels_last: bool) -> None:
        previous = target.__dict__.get("forward", _MISSING)
        eager = target.forward
        compiled = torch.compile(eager, backend=backend, **self.config.compile_kwargs())
        target.forward = self._guarded(target, eager, compiled, to_channels_last)
        target.__dict__["__getstate__"] = _state_without_compiled_forward(target, previous)
        self._patched.append(_PatchedForward(target, previous))

    def _guarded(
        self,
        target: nn.Module,
        eager: Callable[..., Any],
        compiled: Callable[..., Any],
        to_channels_last: bool,
    ) -> Callable[..., Any]:
        config, stats = self.config, self.stats

        @functools.wraps(eager)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if to_channels_last:
                args = _channels_last_args(args)
            if self._selection is not None:
                self._selection.before_compiled_call(target, args, kwargs)
                if target.__dict__.get("forward") is not forward:  # replaced while the selection ran
                    return target.forward(*args, **kwargs)
            eager_now = self.eager_train if target.training else (self.eager_eval or not config.compile_eval)
            if self._use_eager or eager_now:
                return eager(*args, **kwargs)
            watch = stats.watch_frames()
            try:
                # AOTAutograd normally compiles the backward graph lazily, at the first loss.backward(),
                # outside this try; lowering it now makes a failing backward compile fall back too (and puts
                # its compile time inside the forward frame's, counted once). Set around this call only, with
                # plain assignments (a config.patch context cost ~20 us a step): set for a whole fit, it
                # changed what the user's other torch.compile calls generate, and a fit that never reached
                # teardown left it set for the rest of the process.
                lazy_before = functorch_config.force_non_lazy_backward_lowering
                functorch_config.force_non_lazy_backward_lowering = True
                try:
                    output = compiled(*args, **kwargs)
                finally:
                    functorch_config.force_non_lazy_backward_lowering = lazy_before
            except COMPILE_ERRORS as err:
                stats.collect_frames(watch)
                if config.fallback == "raise":
                    raise
                first_line = _first_line(err)
                inner = getattr(err, "inner_exception", None)  # BackendCompilerFailed wraps the real error
                if isinstance(inner, BaseException):
                    first_line = f"{type(inner).__name__}: {_first_line(inner)}"
                warnings.warn(
                    f"torch.compile failed for {type(target).__name__}.forward ({type(err).__name__}: "
                    f"{first_line}); continuing in eager mode (CompileConfig(fallback='eager')). "
                    "Use fallback='raise' to stop instead.",
                    stacklevel=2,
                )
                self._use_eager = True
                stats.fell_back = True
                stats.fallback_reason = f"{type(err).__name__}: {first_line}"
                return eager(*args, **kwargs)
            skipped = stats.collect_frames(watch)
            if skipped:
                dynamo_cache.mark_given_up(code)
                _report_skipped(target, skipped, config.fallback)
            return output

        code = dynamo_cache.code_of(eager)
        forward.__lcv_compiled__ = True  # type: ignore[attr-defined]  # a marker on the function object
        return forward


def _report_skipped(target: nn.Module, skipped: list[FrameRecord], fallback: str | None) -> None:
    """Dynamo ran some of the compiled code eagerly: warn (or raise, with ``fallback="raise"``)."""
    message = (
        f"torch.compile gave up on {len(skipped)} frame(s) of {type(target).__name__}.forward and ran them "
        f"eagerly (frame {skipped[0].compile_id}: {skipped[0].failure}); dynamo does not retry them in this "
        "run. compile_stats.skipped_frames lists them; TORCH_LOGS=recompiles,graph_breaks shows why."
    )
    if fallback == "raise":
        raise RuntimeError(message + " (CompileConfig(fallback='raise'))")
    warnings.warn(message, stacklevel=3)


def _state_without_compiled_forward(target: nn.Module, previous: Any) -> Callable[[], dict[str, Any]]:
    """An instance ``__getstate__`` for ``target``: its pickled or deep-copied state without our forward."""

    def state() -> dict[str, Any]:
        result = dict(type(target).__getstate__(target))
        result.pop("__getstate__", None)
        if previous is _MISSING:
            result.pop("forward", None)
        else:
            result["forward"] = previous
        return result

    return state


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def already_compiled_reason(module: nn.Module) -> str | None:
    """Why ``module`` counts as compiled by someone else, or None."""
    if getattr(module, "_compiler_ctx", None):
        return "it was passed to the Trainer as torch.compile(model)"
    for name, sub in module.named_modules():
        if isinstance(sub, torch._dynamo.eval_frame.OptimizedModule):
            return f"submodule {name!r} is a torch.compile'd module"
        if getattr(sub, "_compiled_call_impl", None) is not None:
            return f"submodule {name or type(module).__name__!r} was compiled with nn.Module.compile()"
        if getattr(sub.__dict__.get("forward"), "__lcv_compiled__", False):
            return (
                f"submodule {name or type(module).__name__!r} is already compiled by another compiled "
                "strategy"
            )
    return None


def find_repeated_blocks(root: nn.Module) -> list[nn.Module]:
    """The outermost submodules whose (non-``torch.nn``) class occurs at least twice."""
    counts = Counter(type(m) for m in root.modules() if m is not root and not _is_torch_builtin(m))
    repeated = {cls for cls, n in counts.items() if n >= 2}
    found: list[nn.Module] = []

    def visit(parent: nn.Module) -> None:
        for child in parent.children():
            if type(child) in repeated:
                found.append(child)
            else:
                visit(child)

    visit(root)
    return found


def _is_torch_builtin(module: nn.Module) -> bool:
    return type(module).__module__.startswith("torch.")


def _channels_last_args(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(_channels_last(a) for a in args)


def _channels_last(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() == 4 and value.is_floating_point():
        return value.contiguous(memory_format=torch.channels_last)
    return value
