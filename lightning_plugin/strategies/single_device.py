"""`CompiledStrategy`: single-device training with the LightningModule's forward compiled.

Registered as ``"compiled"`` (and variants) when ``lightning_plugin`` is imported. The
behaviour lives in :class:`CompiledSingleDeviceMixin`, so that the same strategy can also be
built on the standalone ``pytorch_lightning`` package's base class
(``lightning_plugin.pytorch_lightning_support``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.types import _DEVICE
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from typing_extensions import override

from lightning_plugin.compile.mixin import CompiledStrategyMixin, build_config, with_compile_settings
from lightning_plugin.config import CompileConfig

# The mixin is put on the `lightning.pytorch` or the `pytorch_lightning` SingleDeviceStrategy; mypy checks it
# against the former, so that its overrides and `super()` calls are checked.
if TYPE_CHECKING:
    _SingleDeviceStrategyBase = SingleDeviceStrategy
else:
    _SingleDeviceStrategyBase = object


class CompiledSingleDeviceMixin(CompiledStrategyMixin, _SingleDeviceStrategyBase):
    """One device, ``forward`` compiled; combined with a ``SingleDeviceStrategy`` of either namespace."""

    strategy_name = "compiled"
    _supports_whole_step = True

    @with_compile_settings()
    def __init__(
        self,
        config: CompileConfig | None = None,
        *,
        device: _DEVICE | None = None,
        accelerator: Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        **compile_settings: Any,
    ) -> None:
        super().__init__(
            device="cpu" if device is None else device,
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._explicit_device = device is not None
        # `parallel_devices` makes the accelerator connector hand us the Trainer's device.
        self._parallel_devices: list[torch.device] | None = None
        self._init_compiler(build_config(config, type(self).__name__, **compile_settings))

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        if devices and len(devices) > 1:
            raise ValueError(
                f"strategy='compiled' trains on one device, but the Trainer asked for {len(devices)} "
                f"({', '.join(str(d) for d in devices)}). Use strategy='compiled_ddp' for several devices, "
                "or set devices=1."
            )
        self._parallel_devices = list(devices) if devices else None

    @property
    @override
    def root_device(self) -> torch.device:
        if not self._explicit_device and self._parallel_devices:
            return self._parallel_devices[0]
        return self._root_device

    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        self._compile_lightning_module()
        return super()._setup_model(model)

    @override
    def teardown(self) -> None:
        self._restore_lightning_module()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Single device, LightningModule.forward compiled with torch.compile",
        )
        strategy_registry.register(
            "compiled_max_autotune",
            cls,
            description="'compiled' with mode='max-autotune'",
            mode="max-autotune",
        )
        strategy_registry.register(
            "compiled_reduce_overhead",
            cls,
            description="'compiled' with mode='reduce-overhead' (CUDA graphs)",
            mode="reduce-overhead",
        )
        strategy_registry.register(
            "compiled_regional",
            cls,
            description="'compiled', each repeated block compiled once",
            regional=True,
        )
        strategy_registry.register(
            "compiled_step",
            cls,
            description="'compiled' with compile_step=True: forward, backward and optimizer update as one graph",
            compile_step=True,
        )


class CompiledStrategy(CompiledSingleDeviceMixin, SingleDeviceStrategy):
    """Train on one device with ``torch.compile`` applied to the LightningModule's ``forward``.

    ``training_step`` stays eager, so ``self.log`` works and the graphs have no breaks; with
    ``compile_step=True`` (``strategy="compiled_step"``) the whole step, ``training_step``, backward and the
    optimizer update, is traced as one graph instead (``lightning_plugin.compile.whole_step``). The
    device follows the Trainer's accelerator (unlike ``strategy="single_device"``, which
    defaults to the CPU, Lightning #18902). After ``fit``/``validate``/``test``/``predict``
    the module is restored to its uncompiled self.

    Pass either ``config=CompileConfig(...)`` or its fields as keyword arguments.
    """
