"""`CompileReport`: what the compiler did, in TensorBoard: graphs, breaks, recompiles, compile time, fallback
and ``kernels="auto"``'s decisions, from whoever compiled the module (a compiled strategy or
``TorchCompile``).

None of Lightning's callbacks knows about the compiler; a graph break or a recompile per step is the commonest
reason a compiled run is slow, so the reasons are logged as text beside the counts.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_plugin.callbacks._options import check_options
from lightning_plugin.callbacks._trainer_lookup import (
    compile_stats,
    flush_tensorboard,
    kernel_decisions,
    logging_interval,
    tensorboard_writer,
)
from lightning_plugin.step_meter import StepMeter

__all__ = ["CompileReport"]


class CompileReport(Callback):
    """Scalars every ``log_every_n_steps`` training batches: ``compile/<field>`` for every field of
    ``CompileStats.as_dict()`` (graphs, graph_breaks, recompiles, compile_time_s, fell_back, ...), and
    ``compile/graph_time_s`` (one point per graph, x-axis = graph index). Text, when it changes and at the end
    of training: ``compile/graphs``, ``compile/break_reasons``, ``compile/recompile_reasons``,
    ``compile/fallback`` and ``compile/kernel_decisions``. Nothing with a plain strategy; global rank zero
    only.

    Args:
        log_every_n_steps: logging interval in training batches; ``None`` uses the Trainer's.
        meter: a :class:`StepMeter` not to charge with the time spent logging here (``StepMonitor.meter``).
    """

    def __init__(self, log_every_n_steps: int | None = None, meter: StepMeter | None = None) -> None:
        super().__init__()
        check_options(type(self).__name__, log_every_n_steps=log_every_n_steps)
        self.log_every_n_steps = log_every_n_steps
        self.meter = meter
        self._reset()

    def _reset(self) -> None:
        self._interval = 1
        self._batches = 0  # since the last scalars
        self._graph_times_logged = 0
        self._logged_counts: dict[str, int] = {}  # text tag -> how many rows it held when written

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._reset()
            self._interval = logging_interval(trainer, self.log_every_n_steps)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not trainer.is_global_zero:
            return
        self._batches += 1
        if self._batches >= self._interval:
            self._batches = 0
            if self._log(trainer) and self.meter is not None:
                self.meter.discard()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            if self._batches:
                self._log(trainer)
            self._log_text(trainer, force=True)
        self._batches = 0

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            flush_tensorboard(trainer)

    def _log(self, trainer: pl.Trainer) -> bool:
        """The scalars, graph times and changed text; False when there is nothing compiled to report."""
        stats = compile_stats(trainer)
        if stats is None:
            return False
        metrics = {f"compile/{k}": float(v) for k, v in stats.as_dict().items()}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        self._log_graph_times(trainer, stats)
        self._log_text(trainer)
        return True

    def _log_graph_times(self, trainer: pl.Trainer, stats: Any) -> None:
        times = list(stats.graph_compile_times)
        if len(times) < self._graph_times_logged:  # the strategy recompiled from scratch (a new fit)
            self._graph_times_logged = 0
        for index in range(self._graph_times_logged, len(times)):
            for logger in trainer.loggers:
                logger.log_metrics({"compile/graph_time_s": float(times[index][1])}, step=index)
        self._graph_times_logged = len(times)

    def _log_text(self, trainer: pl.Trainer, force: bool = False) -> None:
        """Each text tag whose row count changed since it was last written (all of them with ``force``)."""
        stats = compile_stats(trainer)
        writer = tensorboard_writer(trainer)
        if stats is None or writer is None:
            return
        graphs = list(stats.graph_compile_times)
        decisions = kernel_decisions(trainer)
        fell_back = bool(getattr(stats, "fell_back", False))
        texts = {
            "compile/graphs": (len(graphs), lambda: _graph_table(graphs)),
            "compile/break_reasons": (len(stats.break_reasons), lambda: _bullets(list(stats.break_reasons))),
            "compile/recompile_reasons": (
                len(stats.recompile_reasons),
                lambda: _bullets(list(stats.recompile_reasons)),
            ),
            "compile/fallback": (
                int(fell_back),
                lambda: str(getattr(stats, "fallback_reason", "fell back to eager")),
            ),
            "compile/kernel_decisions": (len(decisions), lambda: _decision_table(decisions)),
        }
        for tag, (count, render) in texts.items():
            if count and (force or count != self._logged_counts.get(tag, 0)):
                writer.add_text(tag, render(), trainer.global_step)
                self._logged_counts[tag] = count


def _graph_table(graphs: list[tuple[str, float]]) -> str:
    rows = "\n".join(f"| {i} | `{name}` | {seconds:.3f} |" for i, (name, seconds) in enumerate(graphs))
    return f"| # | graph | compile s |\n|---|---|---|\n{rows}"


def _decision_table(decisions: list[Any]) -> str:
    """Markdown: what ``kernels="auto"`` chose per block, the measured ratio (Inductor time / fused time)."""
    lines = ["| block | chosen | ratio | matches eager | why | signature |", "|---|---|---|---|---|---|"]
    for d in decisions:
        row = d.as_row()
        ratio = f"{row['ratio']:.3g}x" if row["ratio"] is not None else "-"
        correct = {True: "yes", False: "no", None: "-"}[row["correct"]]
        why = row["reason"] + (" (cached)" if row["cached"] else "")
        cells = [f"`{row['path']}`", row["chosen"], ratio, correct, why, f"`{row['signature']}`"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _bullets(lines: list[str]) -> str:
    """A markdown list; dynamo's reasons span several lines, kept inside their item by indenting."""
    return "\n".join("- " + line.strip().replace("\n", "\n  ") for line in lines)
