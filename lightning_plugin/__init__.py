"""Compiled training for PyTorch Lightning.

``import lightning_plugin`` registers the strategies, so ``Trainer(strategy="compiled")``
(one device) and ``Trainer(strategy="compiled_ddp")`` (DDP) resolve by name. The
registration must happen before the ``Trainer`` is built: Lightning snapshots its
registry then, and has no entry point for third-party strategies. When the standalone
``pytorch_lightning`` package is installed too, the same names are registered there, for
classes built on its bases (``lightning_plugin.pytorch_lightning_support``).
"""

from __future__ import annotations

import importlib.util
import warnings

from lightning.pytorch.strategies import StrategyRegistry

from lightning_plugin.compile_stats import CompileStats
from lightning_plugin.config import KNOWN_KERNELS, CompileConfig
from lightning_plugin.ddp import CompiledDDPStrategy
from lightning_plugin.registry import register_all
from lightning_plugin.strategy import CompiledStrategy

__all__ = ["CompileConfig", "CompileStats", "CompiledDDPStrategy", "CompiledStrategy", "KNOWN_KERNELS"]

register_all(StrategyRegistry, (CompiledStrategy, CompiledDDPStrategy))

if importlib.util.find_spec("pytorch_lightning") is not None:
    try:
        import lightning_plugin.pytorch_lightning_support  # noqa: F401  (registers the names there too)
    except ImportError as err:  # an installed but unusable pytorch_lightning must not break this package
        warnings.warn(
            f"lightning_plugin: strategy='compiled' is not available to pytorch_lightning.Trainer ({err}); "
            "lightning.pytorch.Trainer is unaffected",
            stacklevel=2,
        )
