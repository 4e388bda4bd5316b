"""Compiled training for PyTorch Lightning.

``import lightning_plugin`` registers the strategies, so ``Trainer(strategy="compiled")``
(one device) and ``Trainer(strategy="compiled_ddp")`` (DDP) resolve by name. The
registration must happen before the ``Trainer`` is built: Lightning snapshots its
registry then, and has no entry point for third-party strategies.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from lightning_plugin.compile_stats import CompileStats
from lightning_plugin.config import KNOWN_KERNELS, CompileConfig
from lightning_plugin.ddp import CompiledDDPStrategy
from lightning_plugin.strategy import CompiledStrategy

__all__ = ["CompileConfig", "CompileStats", "CompiledDDPStrategy", "CompiledStrategy", "KNOWN_KERNELS"]


class _Overriding:
    """Registers with ``override=True`` so a re-import (e.g. a reload in a notebook) does not fail."""

    def register(self, name: str, strategy: Any, description: str | None = None, **init_params: Any) -> None:
        StrategyRegistry.register(name, strategy, description, override=True, **init_params)


for _cls in (CompiledStrategy, CompiledDDPStrategy):
    _cls.register_strategies(_Overriding())
