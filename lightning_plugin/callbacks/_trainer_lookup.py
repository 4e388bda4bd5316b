"""What the monitoring callbacks look up on a ``Trainer``: its TensorBoard writer, whoever compiled the module
(strategy or ``TorchCompile`` callback) and what that exposes, the logging interval, a batch's size.

The compile lookups are by attribute (``compile_stats``, ``kernel_decisions``, ``compile_config``) because two
unrelated classes provide them: the compiled strategies and the ``TorchCompile`` callback.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_plugin.config import CompileConfig
from lightning_plugin.trainer_attributes import runtime_attributes


def tensorboard_writer(trainer: pl.Trainer) -> Any:
    """The first ``TensorBoardLogger``'s ``SummaryWriter``; None without one."""
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            return logger.experiment
    return None


def flush_tensorboard(trainer: pl.Trainer) -> None:
    writer = tensorboard_writer(trainer)
    if writer is not None:
        writer.flush()


def logging_interval(trainer: pl.Trainer, log_every_n_steps: int | None) -> int:
    return log_every_n_steps or max(1, int(runtime_attributes(trainer).log_every_n_steps))


def first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for item in value:
            found = first_tensor(item)
            if found is not None:
                return found
    return None


def batch_size(batch: Any, batch_size_fn: Callable[[Any], int] | None = None) -> int:
    """``batch_size_fn(batch)``, or dim 0 of the batch's first tensor (1 for none or a scalar)."""
    if batch_size_fn is not None:
        return int(batch_size_fn(batch))
    tensor = first_tensor(batch)
    return int(tensor.shape[0]) if tensor is not None and tensor.dim() > 0 else 1


def _compilers(trainer: pl.Trainer) -> list[Any]:
    """The strategy, then the callbacks (e.g. ``TorchCompile``): whoever compiled the module."""
    return [trainer.strategy, *runtime_attributes(trainer).callbacks]


def compile_stats(trainer: pl.Trainer) -> Any:
    """``compile_stats`` (graphs, graph_breaks, recompiles, ...); None with a plain strategy."""
    for owner in _compilers(trainer):
        stats = getattr(owner, "compile_stats", None)
        if stats is not None:
            return stats
    return None


def kernel_decisions(trainer: pl.Trainer) -> list[Any]:
    """``kernels="auto"``'s ``KernelDecision`` rows, from a strategy that exposes them; [] otherwise."""
    for owner in _compilers(trainer):
        decisions = getattr(owner, "kernel_decisions", None)
        if decisions:
            return list(decisions)
    return []


def compile_decision(trainer: pl.Trainer) -> Any:
    """``compile="auto"``'s ``CompileDecision``; None while it measures or for a compiler that decides
    nothing."""
    for owner in _compilers(trainer):
        if hasattr(owner, "compile_stats") and getattr(owner, "compile_stats", None) is not None:
            return getattr(owner, "compile_decision", None)
    return None


def substituted_blocks(trainer: pl.Trainer) -> list[Any]:
    """The kernel substitutions applied to the model (``Replacement`` records); [] when none or unknown."""
    for owner in _compilers(trainer):
        blocks = getattr(owner, "substituted_blocks", None)
        if callable(blocks):
            return list(blocks())
    return []


def compile_config(trainer: pl.Trainer) -> CompileConfig | None:
    for owner in _compilers(trainer):
        compiler = getattr(owner, "_compiler", None)  # the TorchCompile callback's
        config = getattr(owner, "compile_config", None) or getattr(compiler, "config", None)
        if config is not None:
            return cast(CompileConfig, config)  # a compiled strategy's or TorchCompile's
    return None
