"""The compiled strategies for the standalone ``pytorch_lightning`` package.

``pytorch_lightning`` is a second copy of Lightning, with its own strategy registry and its
own base classes: a ``lightning.pytorch`` strategy is not a ``pytorch_lightning`` one, and
its ``Trainer`` rejects it. These classes put the same behaviour on ``pytorch_lightning``'s
bases. ``import lightning_plugin`` imports this module and registers them under the same
names (``"compiled"``, ``"compiled_ddp"``, ...) when ``pytorch_lightning`` is installed;
instances come from here: ``from lightning_plugin.pytorch_lightning_support import CompiledStrategy``.
"""

from __future__ import annotations

from pytorch_lightning.strategies import DDPStrategy, SingleDeviceStrategy, StrategyRegistry

from lightning_plugin.strategies.ddp import CompiledDDPMixin
from lightning_plugin.strategies.registry import register_all
from lightning_plugin.strategies.single_device import CompiledSingleDeviceMixin

__all__ = ["CompiledDDPStrategy", "CompiledStrategy"]

# The `type: ignore[misc]` below: mypy checks the mixins against `lightning.pytorch`'s bases, whose members
# it finds incompatible with the same-named ones of `pytorch_lightning` (the same code in another package).


class CompiledStrategy(CompiledSingleDeviceMixin, SingleDeviceStrategy):  # type: ignore[misc]
    """``lightning_plugin.CompiledStrategy`` for ``pytorch_lightning.Trainer``."""


class CompiledDDPStrategy(CompiledDDPMixin, DDPStrategy):  # type: ignore[misc]
    """``lightning_plugin.CompiledDDPStrategy`` for ``pytorch_lightning.Trainer``."""


register_all(StrategyRegistry, (CompiledStrategy, CompiledDDPStrategy))
