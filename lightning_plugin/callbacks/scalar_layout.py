"""`ScalarLayout`: TensorBoard's Custom Scalars tab laid out so the curves a reader looks for come first: train
and validation loss on one chart, train and validation accuracy on another, then speed and learning rate.

TensorBoard's scalar dashboards sort charts by tag name, one chart per tag; comparing train with validation
loss then means finding two charts. The layout (the ``custom_scalars`` plugin) is written once per fit, and
its charts match tags by regular expression, so the module's own names decide what goes on them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_plugin.callbacks._trainer_lookup import tensorboard_writer

__all__ = ["DEFAULT_CHARTS", "ScalarLayout"]

#: category -> chart title -> regular expressions of the tags drawn together on it, in order.
DEFAULT_CHARTS: dict[str, dict[str, list[str]]] = {
    "Curves": {
        "loss: train and validation": [r"^(train|val)[/_]loss(_step|_epoch)?$"],
        "accuracy: train and validation": [r"^(train|val)[/_]acc(uracy)?(_step|_epoch)?$"],
    },
    "Speed": {
        "samples per second": [r"^vitals/samples_per_sec$"],
        "step time (ms)": [r"^vitals/step_time_ms$"],
        "data wait fraction": [r"^vitals/data_wait_fraction$"],
        "learning rate": [r"^vitals/lr"],
        "peak device memory (GiB)": [r"^vitals/peak_memory_gib$"],
    },
}


class ScalarLayout(Callback):
    """Writes the Custom Scalars layout at the start of ``fit`` (global rank zero, TensorBoard loggers only).

    Args:
        charts: category -> chart title -> tag regexes drawn on one chart; default :data:`DEFAULT_CHARTS`.
    """

    def __init__(self, charts: Mapping[str, Mapping[str, Sequence[str]]] | None = None) -> None:
        super().__init__()
        self.charts = {
            category: {title: list(tags) for title, tags in group.items()}
            for category, group in (charts if charts is not None else DEFAULT_CHARTS).items()
        }

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        writer = tensorboard_writer(trainer) if trainer.is_global_zero else None
        if writer is not None:
            layout = {
                category: {title: ["Multiline", tags] for title, tags in group.items()}
                for category, group in self.charts.items()
            }
            writer.add_custom_scalars(layout)
