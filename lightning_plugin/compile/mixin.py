"""Behaviour the single-device and DDP compiled strategies share (in both Lightning namespaces)."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import DistributedSampler
from typing_extensions import override

from lightning_plugin.compile.cache import cache_locations, load_compile_cache, save_compile_cache
from lightning_plugin.compile.checkpoint_keys import align_to_module, strip_compile_prefix
from lightning_plugin.compile.compiler import ModuleCompiler
from lightning_plugin.compile.decision import CompileDecider, CompileDecision
from lightning_plugin.compile.stats import CompileStats, CountingBackend, make_backend
from lightning_plugin.compile.whole_step import WholeStep, whole_step_unsupported
from lightning_plugin.config import CompileConfig
from lightning_plugin.cpu.fused_optimizer import fuse_optimizer_steps
from lightning_plugin.cpu.memory import retain_freed_memory
from lightning_plugin.cpu.strided_pointwise_conv import restore_convs, subsample_strided_pointwise_convs
from lightning_plugin.fast_step import (
    install_lean_hook_calls,
    install_lean_log,
    install_lean_progress_metrics,
    remove_lean_hook_calls,
    remove_lean_log,
    remove_lean_progress_metrics,
)
from lightning_plugin.resumed_sampler import ResumedDistributedSampler
from lightning_plugin.world_size_resume import WORLD_SIZE_KEY, plain_resume_warning, saved_world_size

CONFIG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(CompileConfig) if f.init}

_Init = TypeVar("_Init", bound=Callable[..., None])


def build_config(
    config: CompileConfig | None, owner: str = "compile settings", **settings: Any
) -> CompileConfig:
    """One ``CompileConfig`` from either a config object or keyword arguments, not a mix of both."""
    unknown = sorted(set(settings) - set(CONFIG_DEFAULTS))
    if unknown:
        raise TypeError(f"{owner} got unknown compile setting(s) {unknown}; known: {sorted(CONFIG_DEFAULTS)}")
    changed = {name: value for name, value in settings.items() if value != CONFIG_DEFAULTS[name]}
    if config is None:
        return CompileConfig(**settings)
    if not isinstance(config, CompileConfig):
        raise TypeError(f"config must be a CompileConfig, got {type(config).__name__}")
    if changed:
        raise ValueError(
            f"Pass compile settings either as `config=CompileConfig(...)` or as keyword arguments, not both "
            f"(got config and {sorted(changed)})"
        )
    return config


def split_compile_settings(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``kwargs`` split into ``CompileConfig`` fields and the rest."""
    settings = {k: v for k, v in kwargs.items() if k in CONFIG_DEFAULTS}
    return settings, {k: v for k, v in kwargs.items() if k not in CONFIG_DEFAULTS}


def with_compile_settings(forwards_other_kwargs: bool = False) -> Callable[[_Init], _Init]:
    """Show ``CompileConfig``'s fields as keyword-only parameters of an ``__init__`` taking ``**kwargs``.

    One definition (the dataclass) serves every class that accepts compile settings; the
    signature is what ``LightningCLI``/jsonargparse, ``help()`` and ``inspect`` read. With
    ``forwards_other_kwargs`` the ``**kwargs`` stays in the signature for what is not a
    compile setting (``DistributedDataParallel``'s arguments).
    """

    def decorate(init: _Init) -> _Init:
        own = list(inspect.signature(init).parameters.values())
        hints = typing.get_type_hints(CompileConfig)
        settings = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=hints[name])
            for name, default in CONFIG_DEFAULTS.items()
        ]
        var_keyword = [p for p in own if p.kind is inspect.Parameter.VAR_KEYWORD]
        plain = [p for p in own if p not in var_keyword]
        split = next((i for i, p in enumerate(plain) if p.kind is inspect.Parameter.KEYWORD_ONLY), len(plain))
        tail = var_keyword if forwards_other_kwargs else []
        parameters = [*plain[:split], *settings, *plain[split:], *tail]
        # inspect.signature reads this attribute; mypy's Callable type does not declare it.
        init.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        return init

    return decorate


if TYPE_CHECKING:  # the methods below use and override Strategy's; at runtime the concrete class supplies it
    from lightning.pytorch.strategies import Strategy

    _StrategyBase = Strategy
else:
    _StrategyBase = object


class CompiledStrategyMixin(_StrategyBase):
    """Compiles the LightningModule's forward in place; exposes what the compiler did."""

    _compiler: ModuleCompiler
    #: Whether ``compile_step`` can replace the training step (one device; set by the single-device mixin).
    _supports_whole_step = False

    def _init_compiler(self, config: CompileConfig) -> None:
        self._compiler = ModuleCompiler(config)
        self._decider = CompileDecider(self._compiler, config.compile)
        self._cache_file: Path | None = None  # where this run writes its compile cache
        self._frames_at_cache_save = 0
        self._lean_hooks_installed = False
        self._saved_world_size: int | None = None  # recorded by the checkpoint being resumed
        self._whole_step: WholeStep | None = None  # compile_step: the one-graph training step of this fit
        self._whole_step_backend: CountingBackend | None = None
        self._whole_step_pending = False
        self._whole_step_convs: list[torch.nn.Conv2d] = []  # swapped for oneDNN#6035 while the step runs

    @property
    def compile_config(self) -> CompileConfig:
        return self._compiler.config

    @property
    def compile_stats(self) -> CompileStats:
        """Graphs, graph breaks, recompiles and compile time since the last compile."""
        return self._compiler.stats

    @property
    def whole_step(self) -> WholeStep | None:
        """``compile_step=True``: the one-graph training step while a fit runs it; None otherwise."""
        return self._whole_step

    @property
    def is_compiled(self) -> bool:
        return self._compiler.is_compiled or self._whole_step is not None

    @property
    def compile_decision(self) -> CompileDecision | None:
        """Whether training runs compiled or eager and the measured ratio behind it (``compile="auto"``);
        None while the measurement runs, or when the fit ended before it did."""
        return self._decider.decision

    @property
    def kernel_decisions(self) -> list[Any]:
        """With ``kernels="auto"``: a ``KernelDecision`` per rewritten block (what was chosen, the measured
        ratio, whether it matched eager), available once the first forward has run the selection."""
        return self._compiler.kernel_decisions

    def substituted_blocks(self) -> list[Any]:
        """The kernel substitutions applied to the model (``Replacement`` records), if any."""
        report = self._compiler.substitution_report
        return list(report.replacements) if report is not None else []

    def _compile_lightning_module(self) -> None:
        module = self.lightning_module
        if module is None:
            return
        if self.compile_config.fast_step:
            install_lean_log(module)
            install_lean_progress_metrics(getattr(module, "_trainer", None))
            if not self._lean_hooks_installed:
                self._lean_hooks_installed = install_lean_hook_calls(getattr(module, "_trainer", None))
        if self.compile_config.tunes_cpu(self.root_device):
            retain_freed_memory()
        if self._compiler.config.compile == "never":
            self._begin_decision(module)
            return
        trainer = getattr(module, "_trainer", None)
        fitting = trainer is not None and trainer.state.fn == "fit"
        if trainer is not None and not fitting and not self._compiler.config.compile_eval:
            return  # validate/test/predict run the eager forward (compile_eval=False): nothing to compile
        if fitting and self._compiler.config.compile_step:
            if self._supports_whole_step:
                self._whole_step_pending = True  # decided in on_train_start, once the optimizers exist
                return
            rank_zero_warn(
                f"{type(self).__name__}: compile_step needs the one-device compiled strategy; "
                "compiling the forward alone"
            )
        self._compile_forward(module)

    def _compile_forward(self, module: Any) -> None:
        """Compile the forward (the strategy's usual path) and begin ``compile="auto"``'s measurement."""
        self._load_compile_cache(module)
        if self._compiler.compile(module, self.root_device, self._compile_targets(module)):
            self._begin_decision(module)
            config = self._compiler.config
            what = "repeated blocks" if config.regional else "forward"
            rank_zero_info(
                f"{type(self).__name__}: compiling {type(module).__name__}.{what} "
                f"(backend={getattr(config.backend, '__name__', config.backend)!r}, mode={config.mode!r})"
            )
            report = self._compiler.substitution_report
            if report is not None:
                rank_zero_info(report.summary())
            if self._compiler.selection_pending:
                from lightning_plugin.kernel_choice.selection import MIN_SPEEDUP

                rank_zero_info(
                    "kernels='auto': these rewrites are candidates; the first forward measures each against "
                    f"Inductor alone and keeps only the correct ones at least {MIN_SPEEDUP}x faster"
                )

    def _install_whole_step(self, module: Any) -> None:
        """``compile_step``: one graph per training step (:mod:`lightning_plugin.compile.whole_step`), or, where
        the fit cannot be captured, the compiled forward and one line saying why."""
        self._whole_step_pending = False
        trainer = module.trainer
        self._compiler.stats.one_graph_steps = 0
        self._compiler.stats.one_graph_fallback = None
        reason = whole_step_unsupported(trainer, module, self._world_size)
        if reason is not None:
            self._whole_step_fell_back(reason)
            return
        config = self._compiler.config
        if self.root_device.type == "cpu":  # oneDNN#6035, as the compiled forward does (docs/compiler.md)
            self._whole_step_convs = subsample_strided_pointwise_convs(module)
        self._load_compile_cache(module)
        backend = make_backend(
            config.backend,
            config.mode,
            config.options,
            config.dynamic,
            self._compiler.stats,
            self.root_device,
            config.tune_cpu,
        )
        self._whole_step_backend = backend
        self._whole_step = WholeStep(
            backend,
            self._compiler.stats,
            config.dynamic,
            use_graph=lambda: not self._compiler.eager_train,
            after_step=self._decider.after_work,
            on_fallback=self._whole_step_fell_back,
        )
        self._whole_step.install(trainer)
        self._begin_decision(module)
        rank_zero_info(
            f"{type(self).__name__}: compiling each training step of {type(module).__name__} as one graph "
            f"(forward, backward, optimizer update; backend={getattr(config.backend, '__name__', config.backend)!r})"
        )

    def _whole_step_fell_back(self, reason: str) -> None:
        """The step stays in Lightning's pieces: say why once, then compile the forward alone."""
        if self._whole_step is not None:
            self._whole_step.remove()
            self._whole_step = None
        self._compiler.stats.one_graph_fallback = reason
        rank_zero_warn(
            f"{type(self).__name__}: compile_step: the training step stays in pieces: {reason}. "
            "Compiling the forward alone."
        )
        module = self.lightning_module
        if module is not None and not self._compiler.is_compiled:
            self._compile_forward(module)

    @override
    def on_train_start(self) -> None:
        """On a CPU: the fused optimizer step (:mod:`lightning_plugin.cpu.fused_optimizer`) and one line on
        the CPU tuning. Here: after a resume restored the optimizer's state (and its groups' settings)."""
        super().on_train_start()
        self._warn_plain_resume()
        module = self.lightning_module
        if module is not None and self._whole_step_pending:
            self._install_whole_step(module)
        if module is None or not self.compile_config.tunes_cpu(self.root_device):
            return
        fused = fuse_optimizer_steps(self.optimizers, module)
        applied = []
        whole_step = self._whole_step is not None
        options = (
            self._whole_step_backend.inductor_options
            if whole_step and self._whole_step_backend is not None
            else self._compiler.inductor_options
        )
        if options.get("cpp_wrapper"):
            applied.append("Inductor's C++ wrapper, no layout optimisation, CPU graph passes")
        if fused:
            where = (
                " for the steps run eagerly; the one-graph step updates in its graph" if whole_step else ""
            )
            applied.append(f"fused {'/'.join(fused)} step (fused=True in the optimizer's settings{where})")
        if retain_freed_memory():  # set at compile time; answers from its once-per-process result
            applied.append("glibc keeps freed memory")
        if applied:
            rank_zero_info(
                f"{type(self).__name__}: CPU training settings: {', '.join(applied)} (tune_cpu=False: none)"
            )

    def _compile_targets(self, module: torch.nn.Module) -> list[torch.nn.Module] | None:
        """The submodules to compile on their own; None: the forward (or the repeated blocks, ``regional``)."""
        return None

    def _begin_decision(self, module: Any) -> None:
        trainer = getattr(module, "_trainer", None)
        fitting = trainer is not None and trainer.state.fn == "fit"
        plugin = self.precision_plugin
        precision = getattr(plugin, "precision", type(plugin).__name__)
        self._decider.begin(
            self.root_device,
            str(precision),
            fitting,
            broadcast=self.broadcast,
            is_global_zero=self.is_global_zero,
        )

    @property
    def lean_hooks(self) -> bool:
        """Whether Lightning's hook calls skip the hooks nobody defined (``lightning_plugin.fast_step``)."""
        return self._lean_hooks_installed

    def _restore_lightning_module(self) -> None:
        if self._lean_hooks_installed:
            remove_lean_hook_calls(getattr(self.lightning_module, "_trainer", None))
            self._lean_hooks_installed = False
        if self._whole_step is not None:
            self._whole_step.remove()
            self._whole_step = None
        self._whole_step_pending = False
        restore_convs(self._whole_step_convs)
        self._whole_step_convs = []
        remove_lean_log(self.lightning_module)
        remove_lean_progress_metrics(getattr(self.lightning_module, "_trainer", None))
        self._decider.end()
        self._save_compile_cache(at_end=True)
        self._compiler.restore(self.lightning_module)

    def _load_compile_cache(self, module: torch.nn.Module) -> None:
        """Before compiling: load the run's compile cache, if there is one (``CompileConfig.cache``)."""
        self._cache_file, self._frames_at_cache_save = None, 0
        trainer = getattr(module, "_trainer", None)
        if not self._compiler.config.cache or trainer is None:
            return
        candidates, self._cache_file = cache_locations(self._compiler.config.cache, trainer)
        found = next((path for path in candidates if path.is_file()), None)
        if found is not None and load_compile_cache(found, self.root_device):
            rank_zero_info(f"{type(self).__name__}: loaded the compile cache {found}")

    def _save_compile_cache(self, at_end: bool = False) -> None:
        """Write the compile cache (global rank 0) when this run compiled something since the last write, and
        at the end when the run's folder has none yet (a fit that reused graphs compiled in this process)."""
        compiled = len(self._compiler.stats.frame_records)
        if self._cache_file is None:
            return
        if compiled == self._frames_at_cache_save and not (at_end and not self._cache_file.exists()):
            return
        device = self.root_device
        if self.is_global_zero and save_compile_cache(self._cache_file, device):
            rank_zero_info(f"{type(self).__name__}: saved the compile cache {self._cache_file}")
        self._frames_at_cache_save = compiled

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Records the world size, so that a resume on another one can say what its loader does."""
        checkpoint[WORLD_SIZE_KEY] = self._world_size
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._saved_world_size = saved_world_size(checkpoint)
        return checkpoint

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """The training loader of an epoch resumed on another world size skips the samples already used."""
        return self._remap_resumed_epoch(super().process_dataloader(dataloader))

    def _remap_resumed_epoch(self, dataloader: Any) -> Any:
        """Swap Lightning's ``DistributedSampler`` for a :class:`ResumedDistributedSampler` when fitting
        resumes mid-epoch on another world size (a custom sampler or batch sampler is left, and warned of)."""
        # None also for a subclass that skipped _init_compiler
        saved = getattr(self, "_saved_world_size", None)
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        if saved is None or saved == self._world_size or trainer is None or trainer.state.stage != "train":
            return dataloader
        sampler = getattr(dataloader, "sampler", None)
        batch_size = getattr(dataloader, "batch_size", None)
        if type(sampler) is not DistributedSampler or batch_size is None:
            return dataloader
        fit_loop = trainer.fit_loop
        epochs = fit_loop.epoch_progress.total
        mid_epoch = (
            fit_loop.restarting
            and epochs.started == epochs.ready
            and epochs.processed == epochs.started - 1
            and epochs.completed == epochs.processed
        )  # Lightning's RESTARTED_MID_EPOCH, which it sets only after building the loader
        done = fit_loop.epoch_loop.batch_progress.current.processed
        if not mid_epoch or done <= 0:
            return dataloader
        resumed = ResumedDistributedSampler(
            sampler,
            epoch=fit_loop.epoch_progress.current.processed,
            start=done * batch_size * saved,
            batches_done=done,
            batch_size=batch_size,
        )
        return _update_dataloader(dataloader, resumed, mode=RunningStage.TRAINING)

    @property
    def _world_size(self) -> int:
        """``ParallelStrategy.world_size``; 1 for the one-device strategy, which has none."""
        return int(getattr(self, "world_size", 1))

    def _warn_plain_resume(self) -> None:
        """One line when a mid-epoch resume on another world size meets a plain DataLoader
        (:mod:`lightning_plugin.world_size_resume`)."""
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        fit_loop = getattr(trainer, "fit_loop", None)
        combined = getattr(fit_loop, "_combined_loader", None)
        if fit_loop is None or combined is None:
            return
        message = plain_resume_warning(
            saved=getattr(self, "_saved_world_size", None),
            world_size=self._world_size,
            batches_done=fit_loop.epoch_loop.batch_progress.current.processed,
            mid_epoch=fit_loop.restarted_mid_epoch,
            loaders=combined.flattened,
        )
        if message is not None:
            rank_zero_warn(message)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return strip_compile_prefix(super().lightning_module_state_dict())

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        module = self.lightning_module
        assert module is not None  # connected before a checkpoint is restored (as Strategy asserts)
        aligned = dict(checkpoint)
        aligned["state_dict"] = align_to_module(checkpoint["state_dict"], module)
        super().load_model_state_dict(aligned, strict=strict)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        module = self.lightning_module
        assert module is not None  # a training batch runs with the module connected
        self._decider.before_batch(module, batch, module.trainer.accumulate_grad_batches)
        self._save_compile_cache()  # the previous step compiled: keep it even if the run dies later
        if self._compiler.config.mode == "reduce-overhead" and self._compiler.is_compiled:
            # CUDA graphs reuse output buffers: mark the step so last step's outputs are not overwritten.
            torch.compiler.cudagraph_mark_step_begin()

    # The three parts of a training step; compile="auto" times a step from its batch's start to the last of
    # them.
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        self._decider.after_work()
        return output

    @override
    def backward(self, *args: Any, **kwargs: Any) -> Any:
        output = super().backward(*args, **kwargs)
        self._decider.after_work()
        return output

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(*args, **kwargs)
        self._decider.after_work()
        return output
