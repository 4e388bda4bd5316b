"""Behaviour the single-device and DDP compiled strategies share."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_plugin.checkpoint_keys import align_to_module, strip_compile_prefix
from lightning_plugin.compile_stats import CompileStats
from lightning_plugin.compiler import ModuleCompiler
from lightning_plugin.config import CompileConfig

CONFIG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(CompileConfig) if f.init}


def build_config(config: CompileConfig | None, **fields: Any) -> CompileConfig:
    """One ``CompileConfig`` from either a config object or keyword arguments, not a mix of both."""
    changed = {name: value for name, value in fields.items() if value != CONFIG_DEFAULTS[name]}
    if config is None:
        return CompileConfig(**fields)
    if not isinstance(config, CompileConfig):
        raise TypeError(f"config must be a CompileConfig, got {type(config).__name__}")
    if changed:
        raise ValueError(
            f"Pass compile settings either as `config=CompileConfig(...)` or as keyword arguments, not both "
            f"(got config and {sorted(changed)})"
        )
    return config


class CompiledStrategyMixin:
    """Compiles the LightningModule's forward in place; exposes what the compiler did."""

    _compiler: ModuleCompiler

    def _init_compiler(self, config: CompileConfig) -> None:
        self._compiler = ModuleCompiler(config)

    @property
    def compile_config(self) -> CompileConfig:
        return self._compiler.config

    @property
    def compile_stats(self) -> CompileStats:
        """Graphs, graph breaks, recompiles and compile time since the last compile."""
        return self._compiler.stats

    @property
    def is_compiled(self) -> bool:
        return self._compiler.is_compiled

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
        module = self.lightning_module  # type: ignore[attr-defined]
        if module is None:
            return
        if self._compiler.compile(module, self.root_device):  # type: ignore[attr-defined]
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
                from lightning_plugin.kernel_selection import MIN_SPEEDUP

                rank_zero_info(
                    "kernels='auto': these rewrites are candidates; the first forward measures each against "
                    f"Inductor alone and keeps only the correct ones at least {MIN_SPEEDUP}x faster"
                )

    def _restore_lightning_module(self) -> None:
        self._compiler.restore(self.lightning_module)  # type: ignore[attr-defined]

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return strip_compile_prefix(super().lightning_module_state_dict())  # type: ignore[misc]

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        module = self.lightning_module  # type: ignore[attr-defined]
        aligned = dict(checkpoint)
        aligned["state_dict"] = align_to_module(checkpoint["state_dict"], module)
        super().load_model_state_dict(aligned, strict=strict)  # type: ignore[misc]

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        if self._compiler.config.mode == "reduce-overhead" and self._compiler.is_compiled:
            # CUDA graphs reuse output buffers: mark the step so last step's outputs are not overwritten.
            torch.compiler.cudagraph_mark_step_begin()
