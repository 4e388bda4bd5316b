"""`TorchCompile`: the compiled strategies' forward compilation as a callback, for any strategy.

Use it when the strategy is not ours (Lightning's ``ddp``, ``fsdp``, a custom one): it
compiles the LightningModule's ``forward`` in ``setup`` (before the strategy wraps the
module) and restores it in ``teardown``, with the same ``CompileConfig`` and counters, and on a CPU the same
``tune_cpu`` settings.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_plugin.compile.compiler import ModuleCompiler
from lightning_plugin.compile.mixin import CompiledStrategyMixin, build_config, with_compile_settings
from lightning_plugin.compile.stats import CompileStats
from lightning_plugin.config import CompileConfig
from lightning_plugin.cpu.fused_optimizer import fuse_optimizer_steps
from lightning_plugin.cpu.memory import retain_freed_memory


class TorchCompile(Callback):
    """Compile ``pl_module.forward`` for the duration of a ``fit``/``validate``/``test``/``predict``.

    Accepts ``config=CompileConfig(...)`` or its fields as keyword arguments.
    """

    @with_compile_settings()
    def __init__(self, config: CompileConfig | None = None, **compile_settings: Any) -> None:
        self._compiler = ModuleCompiler(build_config(config, "TorchCompile", **compile_settings))

    @property
    def compile_stats(self) -> CompileStats:
        return self._compiler.stats

    @property
    def kernel_decisions(self) -> list[Any]:
        """With ``kernels="auto"``: the measured decision per rewritten block (see ``kernel_selection``)."""
        return self._compiler.kernel_decisions

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if isinstance(trainer.strategy, CompiledStrategyMixin):
            raise ValueError(
                "TorchCompile is for strategies that do not compile; "
                f"{type(trainer.strategy).__name__} already "
                "compiles the module. Remove the callback, or pass the settings to the strategy instead."
            )
        device = trainer.strategy.root_device
        if self._compiler.config.tunes_cpu(device):
            retain_freed_memory()
        self._compiler.compile(pl_module, device)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._compiler.config.tunes_cpu(trainer.strategy.root_device):
            fuse_optimizer_steps(trainer.optimizers, pl_module)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._compiler.restore(pl_module)
