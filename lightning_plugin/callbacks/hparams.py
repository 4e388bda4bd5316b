"""`HParamsRecord`: hyperparameters and final metrics in TensorBoard's HParams tab, at the end of ``fit``.

TensorBoard shows only the first hparams record of a run and Lightning writes a placeholder one
(``hp_metric=-1``) at the start, so this callback turns the placeholder off: its record is the run's only one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from typing_extensions import override

from lightning_plugin.callbacks._options import check_options
from lightning_plugin.callbacks._trainer_lookup import (
    batch_size,
    compile_config,
    compile_stats,
    flush_tensorboard,
    kernel_decisions,
)
from lightning_plugin.trainer_attributes import runtime_attributes

__all__ = ["HParamsRecord"]


class HParamsRecord(Callback):
    """At the end of ``fit`` (global rank zero): the module's and datamodule's hparams (``data/*``), the
    trainer's (``trainer/*``) and the compiler's (``compile/*``) settings, with the ``final/*`` metrics.

    Args:
        batch_size_fn: returns the number of samples in a batch (``trainer/batch_size`` is the largest seen);
            default: dim 0 of the first tensor.
    """

    def __init__(self, batch_size_fn: Callable[[Any], int] | None = None) -> None:
        super().__init__()
        check_options(type(self).__name__, batch_size_fn=batch_size_fn)
        self.batch_size_fn = batch_size_fn
        self._max_batch_size = 0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._max_batch_size = 0
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger) and hasattr(logger, "_default_hp_metric"):
                logger._default_hp_metric = False

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.is_global_zero:  # the last batch of an epoch may be smaller: keep the largest
            self._max_batch_size = max(self._max_batch_size, batch_size(batch, self.batch_size_fn))

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        params, metrics = self._record(trainer, pl_module)
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.log_hyperparams(params, metrics=metrics, step=trainer.global_step)
        flush_tensorboard(trainer)

    def _record(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> tuple[dict[str, Any], dict[str, float]]:
        params: dict[str, Any] = dict(_plain(dict(pl_module.hparams)))
        datamodule = runtime_attributes(trainer).datamodule
        if datamodule is not None:
            params.update({f"data/{k}": v for k, v in _plain(dict(datamodule.hparams)).items()})
        params["trainer/strategy"] = type(trainer.strategy).__name__
        params["trainer/precision"] = str(trainer.precision)
        params["trainer/max_epochs"] = trainer.max_epochs if trainer.max_epochs is not None else -1
        params["trainer/batch_size"] = self._max_batch_size
        config = compile_config(trainer)
        if config is not None:
            for name in ("backend", "mode", "fullgraph", "dynamic", "regional", "fallback"):
                value = getattr(config, name, None)
                params[f"compile/{name}"] = getattr(value, "__name__", value)
            kernels = config.kernels
            params["compile/kernels"] = kernels if isinstance(kernels, str) else ",".join(sorted(kernels))
        metrics = {
            f"final/{k}": float(v)
            for k, v in trainer.callback_metrics.items()
            if isinstance(v, torch.Tensor) and v.numel() == 1 and math.isfinite(float(v))
        }
        stats = compile_stats(trainer)
        if stats is not None:
            metrics.update({f"final/compile_{k}": float(v) for k, v in stats.as_dict().items()})
        decisions = kernel_decisions(trainer)
        if decisions:
            metrics["final/kernel_blocks_fused"] = float(sum(d.fused for d in decisions))
            metrics["final/kernel_blocks_candidates"] = float(len(decisions))
        return params, metrics


def _plain(params: dict[str, Any]) -> dict[str, Any]:
    """Hyperparameters as TensorBoard accepts them: numbers, bools and strings."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, (bool, int, float, str)) or value is None:
            out[key] = "None" if value is None else value
        elif isinstance(value, torch.Tensor) and value.numel() == 1:
            out[key] = value.item()
        else:
            out[key] = str(value)
    return out
