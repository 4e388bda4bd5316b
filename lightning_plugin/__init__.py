"""Compiled training for PyTorch Lightning.

``import lightning_plugin`` registers the strategies, so ``Trainer(strategy="compiled")``
(one device), ``Trainer(strategy="compiled_ddp")`` (DDP) and ``Trainer(strategy="compiled_fsdp")`` (FSDP2)
resolve by name. The
registration must happen before the ``Trainer`` is built: Lightning snapshots its
registry then, and has no entry point for third-party strategies. Where the user imports the
standalone ``pytorch_lightning`` package, the same names are registered there too, for classes
built on its bases; this package never imports it itself (``lightning_plugin.pytorch_lightning_hook``).
"""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from lightning_plugin.compile.stats import CompileStats
from lightning_plugin.config import KNOWN_KERNELS, CompileConfig
from lightning_plugin.pytorch_lightning_hook import register_when_imported
from lightning_plugin.strategies.ddp import CompiledDDPStrategy
from lightning_plugin.strategies.fsdp import CompiledFSDPStrategy
from lightning_plugin.strategies.registry import register_all
from lightning_plugin.strategies.single_device import CompiledStrategy

__all__ = [
    "KNOWN_KERNELS",
    "CompileConfig",
    "CompileStats",
    "CompiledDDPStrategy",
    "CompiledFSDPStrategy",
    "CompiledStrategy",
]

register_all(StrategyRegistry, (CompiledStrategy, CompiledDDPStrategy, CompiledFSDPStrategy))

register_when_imported()  # pytorch_lightning: registered there too, once the user imports it
