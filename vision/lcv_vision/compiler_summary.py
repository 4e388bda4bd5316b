"""What the compiler did in an ``lcv fit``, for the run summary: graphs, breaks, recompiles, compile time and
whether it came from a cache, kernel substitutions, and compiled against eager training throughput.

The strategy restores the model (and a later ``trainer.test`` compiles again) after training, so the
callback reads everything when training ends.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

__all__ = ["CompilerSummary"]


class CompilerSummary(Callback):
    """Keeps the compiled strategy's account of the fit; :meth:`lines` formats it (nothing with a plain
    one)."""

    def __init__(self) -> None:
        self.batch_size: int | None = None
        self._lines: list[str] = []

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.batch_size is None:
            self.batch_size = int(batch[0].shape[0])

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._lines = describe_compiler(trainer.strategy, self.batch_size)

    def lines(self) -> list[str]:
        return list(self._lines)


def describe_compiler(strategy: Any, batch_size: int | None = None) -> list[str]:
    """The summary's compiler lines for ``strategy``; none for a strategy that does not compile."""
    stats = getattr(strategy, "compile_stats", None)
    if stats is None:
        return []
    decision = strategy.compile_decision
    if (
        decision is not None
        and decision.source == "cached"
        and decision.choice == "eager"
        or (decision is not None and decision.source == "never")
    ):
        compiled = "nothing compiled"
    else:
        hits, misses = stats.cache_hits_and_misses
        cache = (
            f"{hits} hit(s), {misses} miss(es) in the on-disk compile caches"
            if hits + misses
            else "no on-disk cache used"
        )
        reused = (
            f", {stats.reused_frames} frame(s) reused from earlier in this process"
            if stats.reused_frames
            else ""
        )
        compiled = (
            f"{stats.graphs} graph(s), {stats.graph_breaks} graph break(s), {stats.recompiles} "
            f"recompile(s), {stats.compile_time_s:.1f} s compiling ({cache}{reused})"
        )
        if stats.fell_back:
            compiled += f"; fell back to eager: {stats.fallback_reason}"
    lines = [f"  compiler: {compiled}"]
    blocks = strategy.substituted_blocks()
    kernels = strategy.kernel_decisions
    if kernels:
        kept = [d for d in kernels if d.fused]
        lines.append(
            f"  kernel substitutions: {len(kept)} of {len(kernels)} measured block(s) kept fused"
            + (f" ({', '.join(f'{d.path}: {d.kind}' for d in kept)})" if kept else "")
        )
    else:
        lines.append(
            f"  kernel substitutions: {len(blocks)}"
            + (f" ({', '.join(sorted({b.kind for b in blocks}))})" if blocks else " (none on this device)")
        )
    lines.append("  " + _throughput(decision, stats, batch_size))
    return lines


def _throughput(decision: Any, stats: Any, batch_size: int | None) -> str:
    if decision is None:
        reason = stats.decision_reason or "the fit ended before the measurement"
        return f"compiled vs eager: not measured ({reason})"
    if decision.speedup is None:
        return f"compiled vs eager: not measured ({decision.describe()})"
    where = (
        "measured at the start of this fit" if decision.source == "measured" else "cached from an earlier run"
    )
    if batch_size:
        rates = (
            f"{batch_size * 1e3 / decision.compiled_ms:,.0f} vs {batch_size * 1e3 / decision.eager_ms:,.0f} "
            f"images/s"
        )
    else:
        rates = f"{decision.compiled_ms:.1f} vs {decision.eager_ms:.1f} ms/step"
    outcome = "kept compiling" if decision.choice == "compiled" else "trained eagerly"
    return (
        f"compiled vs eager training steps: {rates} ({decision.speedup:.2f}x, median of {decision.steps} "
        f"each, {where}): {outcome} (compile='auto'; 'always' or 'never' overrides)"
    )
