"""`CompiledFSDPStrategy` (``strategy="compiled_fsdp"``): FSDP2 sharding with each block compiled first.

Built on Lightning's ``ModelParallelStrategy`` in data-parallel form (one mesh dimension of size world size,
no tensor parallelism: its default on one node is tensor-parallel, which does not average gradients), so
Lightning's launchers, loggers and distributed checkpoints keep working. The LightningModule needs no
``configure_model``: the strategy picks the units (:mod:`~lightning_plugin.strategies.fsdp_units`), compiles
each, then shards it, the roots last (torchtitan's order: sharding first puts FSDP's hooks, which dynamo does
not trace, inside the graphs).

BatchNorm running statistics: FSDP2 shards parameters, not buffers, so each rank keeps its own. With
``Trainer(sync_batchnorm=True)`` BatchNorms become ``SyncBatchNorm`` (statistics over the global batch; CUDA
only: torch refuses a CPU input). Otherwise the statistics are averaged over the ranks before every checkpoint
save, every evaluation and at the end of ``fit``, so all ranks, the checkpoint and the evaluation agree.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint
from typing_extensions import override

from lightning_plugin.compile.mixin import (
    CompiledStrategyMixin,
    build_config,
    split_compile_settings,
    with_compile_settings,
)
from lightning_plugin.config import CompileConfig
from lightning_plugin.strategies.fsdp_units import (
    ShardingPlan,
    average_batchnorm_statistics,
    block_units,
    mixed_precision_policy,
    shard_module,
)

_FITTING = "fit"


class CompiledFSDPStrategy(CompiledStrategyMixin, ModelParallelStrategy):
    """Fully sharded data parallel (FSDP2) training with each block compiled before it is sharded.

    Accepts the compile settings of :class:`~lightning_plugin.CompiledStrategy` (``backend``, ``mode``, ...;
    ``dynamic`` defaults to False for a model with BatchNorm: its backward fails to compile with dynamic
    shapes) and:

    Args:
        reshard_after_forward: free each block's gathered weights after its forward (less memory, one more
            all-gather in the backward); False keeps them until the backward.
        activation_checkpointing: recompute each block's activations in the backward instead of keeping them.
        save_distributed_checkpoint: each rank writes its shards (a folder, ``torch.distributed.checkpoint``);
            False gathers a single file on rank 0. Either is written atomically.
        process_group_backend, timeout: as Lightning's ``ModelParallelStrategy``.
    """

    strategy_name = "compiled_fsdp"

    @with_compile_settings(forwards_other_kwargs=True)
    def __init__(
        self,
        config: CompileConfig | None = None,
        *,
        reshard_after_forward: bool = True,
        activation_checkpointing: bool = False,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        compile_settings, other = split_compile_settings(kwargs)
        if other:
            raise TypeError(f"CompiledFSDPStrategy got unknown argument(s) {sorted(other)}")
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.reshard_after_forward = reshard_after_forward
        self.activation_checkpointing = activation_checkpointing
        self._plan: ShardingPlan | None = None
        self._checkpointed: list[nn.Module] = []
        self._previous_recompile_limit: int | None = None
        self._init_compiler(build_config(config, type(self).__name__, **compile_settings))

    @property
    def sharding_plan(self) -> ShardingPlan | None:
        """The blocks and roots sharded, and the units kept in fp32 (None before ``setup``)."""
        return self._plan

    @override
    def setup_environment(self) -> None:
        # Data parallel over every process: the mesh's one dimension spans all nodes and devices.
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    @override
    def setup(self, trainer: Any) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if self._layer_sync is not None:
            self._check_layer_sync()
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._shard_and_compile()
        self.barrier()
        fitting = trainer.state.fn == _FITTING
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _check_layer_sync(self) -> None:
        if self.root_device.type == "cpu":
            raise ValueError(
                "compiled_fsdp: Trainer(sync_batchnorm=True) needs a GPU (torch's SyncBatchNorm refuses CPU "
                "inputs: 'SyncBatchNorm expected input tensor to be on GPU'); leave it False to average the "
                "running statistics over the ranks instead"
            )

    def _shard_and_compile(self) -> None:
        module = self.lightning_module
        assert module is not None
        already_sharded = isinstance(module, FSDPModule) or any(
            isinstance(c, FSDPModule) for c in module.children()
        )
        blocks = self._plan.blocks if self._plan is not None else block_units(module)
        if self.compile_config.dynamic is None and any(isinstance(m, _BatchNorm) for m in module.modules()):
            # BatchNorm's backward fails to compile with dynamic shapes (InductorError, torch 2.14).
            self._compiler.config = self.compile_config.replace(dynamic=False)
        if self.activation_checkpointing:
            self._checkpoint_blocks(blocks)
        self._raise_recompile_limit(len(blocks))
        self._compile_lightning_module()
        if already_sharded:
            return
        mesh = self.device_mesh["data_parallel"]
        policy = mixed_precision_policy(str(getattr(self.precision_plugin, "precision", "32-true")))
        self._plan = shard_module(module, mesh, policy, self.reshard_after_forward, blocks)
        rank_zero_info(
            f"{type(self).__name__}: sharded {len(self._plan.blocks)} blocks and {len(self._plan.roots)} root(s) "
            f"over {mesh.size()} ranks ({len(self._plan.fp32_units)} gathered in fp32: they hold BatchNorms)"
        )

    def _raise_recompile_limit(self, blocks: int) -> None:
        """Blocks share one code object, so dynamo keeps one cache entry per block shape (and per train/eval
        mode): with static shapes a ResNet-50's stages fill dynamo's default 8 entries, after which the rest
        would run eagerly. Allow two per block for this run (restored at teardown)."""
        config = torch._dynamo.config
        needed = min(2 * blocks, config.accumulated_recompile_limit)
        if self.compile_config.dynamic is False and needed > config.recompile_limit:
            if self._previous_recompile_limit is None:
                self._previous_recompile_limit = config.recompile_limit
            config.recompile_limit = needed

    @override
    def _compile_targets(self, module: nn.Module) -> list[nn.Module] | None:
        return self._plan.blocks if self._plan is not None else block_units(module)

    def _checkpoint_blocks(self, blocks: list[nn.Module]) -> None:
        for block in blocks:
            if "forward" not in block.__dict__:
                block.forward = _checkpointed(block.forward)
                self._checkpointed.append(block)

    @override
    def teardown(self) -> None:
        self._restore_lightning_module()
        for block in self._checkpointed:
            block.__dict__.pop("forward", None)
        self._checkpointed.clear()
        if self._previous_recompile_limit is not None:
            torch._dynamo.config.recompile_limit = self._previous_recompile_limit
            self._previous_recompile_limit = None
        super().teardown()

    # BatchNorm running statistics: one set for all ranks wherever they are read.
    def _sync_statistics(self) -> None:
        module = self.lightning_module
        if module is not None and self._layer_sync is None:
            average_batchnorm_statistics(module)

    @override
    def on_validation_start(self) -> None:
        self._sync_statistics()
        super().on_validation_start()

    @override
    def on_test_start(self) -> None:
        self._sync_statistics()
        super().on_test_start()

    @override
    def on_predict_start(self) -> None:
        self._sync_statistics()
        super().on_predict_start()

    @override
    def on_train_end(self) -> None:
        self._sync_statistics()
        super().on_train_end()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._sync_statistics()  # every rank builds the state dict (its collectives), so all average here
        return super().lightning_module_state_dict()

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing to do: ``load_checkpoint`` already loaded the (re)sharded weights into the module."""

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        """Write into a sibling folder, then rename: a run killed while saving leaves the last checkpoint whole."""
        path = Path(self.broadcast(filepath))
        partial = path.with_name(f".{path.name}.partial")
        if self.is_global_zero and (partial.exists() or partial.is_symlink()):
            _remove(partial)  # left by a run killed while saving
        self.barrier()
        super().save_checkpoint(checkpoint, partial, storage_options)
        self.barrier()
        if self.is_global_zero:
            old = path.with_name(f".{path.name}.old")
            if path.exists():
                path.rename(old)
            partial.rename(path)
            if old.exists():
                _remove(old)
        self.barrier()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="FSDP2 (data parallel, sharded), each block compiled then sharded",
        )
        strategy_registry.register(
            "compiled_fsdp_activation_checkpointing",
            cls,
            description="'compiled_fsdp' recomputing each block's activations in the backward",
            activation_checkpointing=True,
        )


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
