"""`CompiledDDPStrategy`: Lightning's DDP with the LightningModule's forward compiled first.

The order matters: compiling the module and then letting DDP wrap it gives whole graphs
with no breaks, while compiling ``DDP(module)`` traces Lightning's forward redirection and
``training_step`` (10+ graphs and breaks measured on Lightning 2.6). Evaluation-only runs
never call DDP's ``_setup_model``, so they compile in ``setup``. The behaviour lives in
:class:`CompiledDDPMixin`, shared with the standalone ``pytorch_lightning`` variant.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from lightning_plugin.compile.mixin import (
    CompiledStrategyMixin,
    build_config,
    split_compile_settings,
    with_compile_settings,
)
from lightning_plugin.config import CompileConfig

#: ``trainer.state.fn`` while fitting (a str enum in both Lightning namespaces).
_FITTING = "fit"

# The mixin is put on the `lightning.pytorch` or the `pytorch_lightning` DDPStrategy; mypy checks it against
# the former, so that its overrides and `super()` calls are checked.
if TYPE_CHECKING:
    _DDPStrategyBase = DDPStrategy
else:
    _DDPStrategyBase = object


class CompiledDDPMixin(CompiledStrategyMixin, _DDPStrategyBase):
    """DDP, each process compiling ``forward`` before DDP wraps the module; mixed into a ``DDPStrategy``."""

    strategy_name = "compiled_ddp"

    @with_compile_settings(forwards_other_kwargs=True)
    def __init__(
        self,
        config: CompileConfig | None = None,
        *,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        compile_settings, ddp_kwargs = split_compile_settings(kwargs)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **ddp_kwargs,
        )
        self._init_compiler(build_config(config, type(self).__name__, **compile_settings))

    @override
    def configure_ddp(self) -> None:
        self._compile_lightning_module()
        super().configure_ddp()

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if trainer.state.fn != _FITTING:
            self._compile_lightning_module()

    @override
    def teardown(self) -> None:
        self._restore_lightning_module()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method in (
            ("compiled_ddp", "popen"),
            ("compiled_ddp_spawn", "spawn"),
            ("compiled_ddp_fork", "fork"),
            ("compiled_ddp_notebook", "fork"),
        ):
            strategy_registry.register(
                name,
                cls,
                description=f"DDP with LightningModule.forward compiled, start_method={start_method!r}",
                start_method=start_method,
            )
        strategy_registry.register(
            "compiled_ddp_find_unused_parameters_true",
            cls,
            description="'compiled_ddp' with find_unused_parameters=True",
            find_unused_parameters=True,
        )


class CompiledDDPStrategy(CompiledDDPMixin, DDPStrategy):
    """DDP where each process compiles the LightningModule's ``forward`` before DDP wraps it.

    Accepts the compile settings of :class:`~lightning_plugin.CompiledStrategy` plus every
    argument of Lightning's ``DDPStrategy`` (extra keyword arguments go to
    ``DistributedDataParallel``).
    """
