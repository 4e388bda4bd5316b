"""The compiler's story of one fit as one Markdown card: the compile-or-eager decision and the times behind
it, graphs, breaks and recompiles with their reasons, the compile caches, compile time and the kernel choice
per block.

Counters that hardly change (graphs, breaks, compile seconds) read badly as TensorBoard curves: flat lines a
reader has to hover to get a number, and no reasons beside them. One card says all of it in one place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CompileFacts", "render_compile_card"]


@dataclass(frozen=True)
class CompileFacts:
    """What the card is made from, as the strategy (or ``TorchCompile``) exposes it.

    ``stats`` is a ``CompileStats``; ``decision`` a ``CompileDecision`` (None while ``compile="auto"``
    measures, or for a compiler that does not decide); ``kernels`` the ``KernelDecision`` rows of
    ``kernels="auto"``; ``substituted`` the blocks rewritten without a selection (an explicit kernel list).
    """

    stats: Any
    decision: Any = None
    kernels: Sequence[Any] = ()
    substituted: Sequence[Any] = ()
    kernels_setting: Any = None  # CompileConfig.kernels
    device: torch.device | None = None


def render_compile_card(facts: CompileFacts) -> str:
    """The card in Markdown (TensorBoard's text plugin renders it): a table of the facts first (TensorBoard
    shows the top of a card), then the reasons and the per-block and per-graph tables."""
    stats = facts.stats
    sections = [
        _summary_table(facts),
        "### Graph breaks\n\n" + _bullets(list(stats.break_reasons), "none"),
        "### Recompiles\n\n" + _bullets(list(stats.recompile_reasons), "none"),
    ]
    skipped = list(stats.skipped_frames)
    if skipped:
        sections.append("### Frames run eagerly\n\n" + _bullets(skipped, "none"))
    if facts.kernels:
        sections.append("### Kernel choice per block\n\n" + _kernel_table(facts.kernels))
    elif facts.substituted:
        rows = "\n".join(f"| `{r.path}` | {r.kind} |" for r in facts.substituted)
        sections.append(f"### Kernels substituted as configured\n\n| block | kernel |\n|---|---|\n{rows}")
    graphs = list(stats.graph_compile_times)
    if graphs:
        sections.append("### Graphs\n\n" + _graph_table(graphs))
    return "\n\n".join(sections)


def _summary_table(facts: CompileFacts) -> str:
    stats = facts.stats
    hits, misses = stats.cache_hits_and_misses
    rows = [
        ("compile or eager", _decision(facts.decision, stats)),
        ("graphs", f"{stats.graphs} ({stats.recompiles} of them recompiles)"),
        ("graph breaks", str(stats.graph_breaks)),
        ("compile time", f"{stats.compile_time_s:.2f} s (backend {stats.backend_time_s:.2f} s)"),
        ("on-disk compile caches", f"{hits} hit(s), {misses} miss(es)"),
    ]
    if stats.reused_frames:
        rows.append(("frames reused in this process", str(stats.reused_frames)))
    if stats.fell_back:
        rows.append(("fell back to eager", str(stats.fallback_reason)))
    rows.append(("kernels", _kernels(facts)))
    return "| | |\n|---|---|\n" + "\n".join(f"| {name} | {_cell(value)} |" for name, value in rows)


def _decision(decision: Any, stats: Any) -> str:
    if decision is None:
        return stats.decision_reason or (
            "not decided: `compile='auto'` had not finished timing compiled against eager steps (it needs a few "
            "warm-up steps, then several steps each way)"
        )
    choice = f"**{'compiled' if decision.choice == 'compiled' else 'eager'}**"
    if decision.speedup is None:
        return f"{choice}: {decision.describe()}"
    where = "measured in this run" if decision.source == "measured" else "measured by an earlier run"
    return (
        f"{choice}: compiled steps **{decision.speedup:.2f}x** the speed of eager; median step "
        f"{decision.compiled_ms:.1f} ms compiled, {decision.eager_ms:.1f} ms eager ({decision.steps} steps "
        f"each, {where}; `compile='always'` or `'never'` overrides)"
    )


def _kernels(facts: CompileFacts) -> str:
    if facts.kernels:
        fused = sum(1 for d in facts.kernels if d.fused)
        return f"{fused} of {len(facts.kernels)} rewritten block(s) kept fused (table below)"
    if facts.substituted:
        return f"{len(facts.substituted)} block(s) substituted as configured, not measured (table below)"
    return _why_no_kernels(facts.kernels_setting, facts.device)


def _graph_table(graphs: list[tuple[str, float]]) -> str:
    rows = "\n".join(f"| `{name}` | {seconds:.3f} |" for name, seconds in graphs)
    return f"| graph (`/1`: a recompile) | backend s |\n|---|---|\n{rows}"


def _kernel_table(decisions: Sequence[Any]) -> str:
    """Each rewritten block: the chosen kernel, the measured time of each candidate, and why."""
    lines = [
        "| block | candidate | chosen | fused ms | Inductor ms | ratio | matches eager | why |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for d in decisions:
        ratio = f"{d.ratio:.3g}x" if d.ratio is not None else "-"
        correct = {True: "yes", False: "no", None: "-"}[d.correct]
        why = _cell(d.reason + (" (cached)" if d.cached else ""))
        cells = [f"`{d.path}`", d.kind, d.chosen, _ms(d.fused_ms), _ms(d.inductor_ms), ratio, correct, why]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _why_no_kernels(setting: Any, device: torch.device | None) -> str:
    if setting == "auto" and device is not None and device.type == "cuda":
        return "None tried: no block of this model has a fused kernel of ours."
    if setting == "auto":
        where = f"this run is on {device.type}" if device is not None else "no CUDA device"
        return (
            f"None tried: `kernels='auto'` measures our fused kernels on CUDA only ({where}, where they would "
            "run their PyTorch references)."
        )
    if setting == "none" or setting is None:
        return "None tried: kernel substitution is off (`kernels='none'`)."
    return f"None tried: no block of this model matches `kernels={setting!r}`."


def _ms(value: float | None) -> str:
    return f"{value:.3f}" if value is not None else "-"


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def _bullets(lines: list[str], empty: str) -> str:
    """A Markdown list; dynamo's reasons span several lines, kept inside their item by indenting."""
    if not lines:
        return empty
    return "\n".join("- " + line.strip().replace("\n", "\n  ") for line in lines)
