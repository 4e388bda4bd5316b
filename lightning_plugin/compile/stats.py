"""What the compiler did: graphs, graph breaks, recompiles, compile time, frames run eagerly, and why.

Everything here belongs to the strategy's own compiled code, not to the process: graphs and
graph breaks are recorded by the strategy's backend (as ``torch._dynamo.explain`` counts
them), and compile times, recompile reasons and frames dynamo gave up on come from
dynamo's per-frame compile records made *during the strategy's own forward calls*. A
``torch.compile`` elsewhere in the process (a metric, another model) never shows up.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._dynamo.utils import counters, get_compilation_metrics

from lightning_plugin.cpu import inductor as cpu_inductor


@dataclass
class GraphRecord:
    """One graph handed to the backend."""

    name: str
    frame_id: int | None
    frame_compile_id: int | None
    num_nodes: int
    compile_time_s: float
    break_reason: str | None = None  # set when dynamo ended this graph at a graph break

    @property
    def is_recompile(self) -> bool:
        return bool(self.frame_compile_id)


@dataclass
class FrameRecord:
    """One frame dynamo compiled (or gave up on) during the strategy's forward calls."""

    compile_id: str
    code_name: str | None  # ``forward``, or a resume function dynamo made from it at a graph break
    seconds: float
    failure: str | None = None  # first line of the error when dynamo did not compile the frame
    skipped: bool = False  # dynamo gave up and ran the frame eagerly
    recompile_reason: str | None = None
    restart_reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class FrameWatch:
    """Where dynamo's records stood when a forward call began (see :meth:`CompileStats.collect_frames`)."""

    frames_attempted: int
    started_us: int


@dataclass
class CompileStats:
    """Counters a monitoring callback can log; reset each time the strategy compiles."""

    graph_records: list[GraphRecord] = field(default_factory=list)
    frame_records: list[FrameRecord] = field(default_factory=list)
    fell_back: bool = False
    fallback_reason: str | None = None
    #: Compiled frames an earlier compile in this process left in dynamo's cache and this one reuses.
    reused_frames: int = 0
    #: What the training steps run after ``compile="auto"/"always"/"never"``: "compiled", "eager", or None
    #: while ``"auto"`` is still measuring (kept across :meth:`start`; the decision outlives a compile).
    decision: str | None = None
    #: Median eager step time / median compiled step time that decided (above 1: compiled is faster).
    speedup: float | None = None
    decision_reason: str | None = None  # the decision in one line
    #: ``compile_step``: training steps of this fit run as one graph (forward, backward, update), and why the
    #: step was left in pieces when it was (kept across :meth:`start`: a fallback compiles the forward).
    one_graph_steps: int = 0
    one_graph_fallback: str | None = None
    _cache_counts_at_start: dict[str, int] = field(default_factory=dict, repr=False)

    def start(self, reused_frames: int = 0) -> None:
        """Forget earlier records."""
        self._cache_counts_at_start = _cache_counts()
        self.graph_records.clear()
        self.frame_records.clear()
        self.fell_back = False
        self.fallback_reason = None
        self.reused_frames = reused_frames

    def record(self, record: GraphRecord) -> None:
        self.graph_records.append(record)  # dynamo compiles one frame at a time, under its own lock

    # ------------------------------------------------------------------ frames, from dynamo's records
    @staticmethod
    def watch_frames() -> FrameWatch:
        """A cheap snapshot taken before each compiled call (two reads, no copies)."""
        return FrameWatch(counters["frames"]["total"], time.time_ns() // 1000)

    def collect_frames(self, watch: FrameWatch) -> list[FrameRecord]:
        """Record the frames dynamo compiled since ``watch``; return those it gave up on and ran eagerly."""
        if counters["frames"]["total"] == watch.frames_attempted:
            return []  # the common case: every frame hit dynamo's cache
        metrics = get_compilation_metrics()
        new = [_frame_record(m) for m in metrics if (m.start_time_us or 0) >= watch.started_us]
        self.frame_records.extend(new)
        return [r for r in new if r.skipped]

    # ------------------------------------------------------------------ counters
    @property
    def graphs(self) -> int:
        """Graphs compiled, recompiles included."""
        return len(self.graph_records)

    @property
    def cache_hits_and_misses(self) -> tuple[int, int]:
        """(graphs loaded from the on-disk compile caches, graphs compiled) since :meth:`start`: AOTAutograd's
        cache where it was consulted, else Inductor's FX graph cache. Counted process-wide (dynamo's
        counters)."""
        now, before = _cache_counts(), self._cache_counts_at_start
        diff = {k: v - before.get(k, 0) for k, v in now.items()}
        if diff["autograd_cache_hit"] or diff["autograd_cache_miss"]:
            return diff["autograd_cache_hit"], diff["autograd_cache_miss"]
        return diff["fxgraph_cache_hit"], diff["fxgraph_cache_miss"]

    @property
    def recompiles(self) -> int:
        return sum(r.is_recompile for r in self.graph_records)

    @property
    def backend_time_s(self) -> float:
        """Seconds spent inside the backend (Inductor) for the graphs this strategy compiled."""
        return sum(r.compile_time_s for r in self.graph_records)

    @property
    def compile_time_s(self) -> float:
        """Whole compile time: dynamo tracing, AOTAutograd and the backend, forward and backward graphs.

        The sum of dynamo's per-frame compile times for the strategy's frames; the backward graph is
        compiled inside its forward frame (the strategy turns off lazy backward compilation), so each
        second counts once.
        """
        return max(sum(r.seconds for r in self.frame_records), self.backend_time_s)

    @property
    def graph_compile_times(self) -> list[tuple[str, float]]:
        return [(r.name, r.compile_time_s) for r in self.graph_records]

    @property
    def break_reasons(self) -> list[str]:
        """One entry per graph break: where dynamo split the strategy's code, and why."""
        reasons = [r.break_reason for r in self.graph_records if r.break_reason is not None]
        # A break before the first op of a frame leaves no graph to hand to the backend; dynamo's frame
        # record still names it (as the reason it restarted tracing).
        with_graph = {r.name for r in self.graph_records}
        for frame in self.frame_records:
            no_graph = _graph_name(frame.compile_id) not in with_graph
            if frame.failure is None and frame.restart_reasons and no_graph:
                reasons.append(_describe(frame.restart_reasons[0]))
        return reasons

    @property
    def graph_breaks(self) -> int:
        return len(self.break_reasons)

    @property
    def recompile_reasons(self) -> list[str]:
        return [
            f"{r.code_name or 'frame'}: {r.recompile_reason}"
            for r in self.frame_records
            if r.recompile_reason
        ]

    @property
    def skipped_frames(self) -> list[str]:
        """Frames dynamo gave up on and ran eagerly (recompile limit, graph break in a loop, ...), and why."""
        return [f"frame {r.compile_id}: {r.failure}" for r in self.frame_records if r.skipped]

    def as_dict(self) -> dict[str, float]:
        """The numeric counters, for ``log_metrics``."""
        return {
            "graphs": float(self.graphs),
            "graph_breaks": float(self.graph_breaks),
            "recompiles": float(self.recompiles),
            "compile_time_s": self.compile_time_s,
            "backend_time_s": self.backend_time_s,
            "fell_back": float(self.fell_back),
            "skipped_frames": float(len(self.skipped_frames)),
            "reused_frames": float(self.reused_frames),
            **({"speedup_vs_eager": self.speedup} if self.speedup is not None else {}),
            **({"trains_eagerly": float(self.decision == "eager")} if self.decision is not None else {}),
        }

    def summary(self) -> str:
        line = (
            f"{self.graphs} graph(s), {self.graph_breaks} graph break(s), {self.recompiles} recompile(s), "
            f"{self.compile_time_s:.1f}s compiling"
        )
        if self.reused_frames:
            line += f", {self.reused_frames} compiled frame(s) reused from earlier in this process"
        skipped = self.skipped_frames
        if skipped:
            line += f"; {len(skipped)} frame(s) ran eagerly: {skipped[0]}"
        line += f"; fell back to eager: {self.fallback_reason}" if self.fell_back else ""
        return line + (f"; {self.decision_reason}" if self.decision_reason else "")


def _cache_counts() -> dict[str, int]:
    return {
        "autograd_cache_hit": counters["aot_autograd"]["autograd_cache_hit"],
        "autograd_cache_miss": counters["aot_autograd"]["autograd_cache_miss"],
        "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
    }


# dynamo raises SkipFrame for a frame with nothing to compile (no tensor ops): eager is all it can be
_NOTHING_TO_COMPILE = "SkipFrame"


def _frame_record(metrics: Any) -> FrameRecord:
    failure = f"{metrics.fail_type}: {_describe(metrics.fail_reason or '')}" if metrics.fail_type else None
    return FrameRecord(
        compile_id=str(metrics.compile_id),
        code_name=metrics.co_name,
        seconds=metrics.entire_frame_compile_time_s or 0.0,
        failure=failure,
        skipped=failure is not None and metrics.fail_type != _NOTHING_TO_COMPILE,
        recompile_reason=metrics.recompile_reason,
        restart_reasons=tuple(sorted(metrics.restart_reasons or ())),
    )


def _describe(message: str) -> str:
    """A dynamo message in one line: its title plus the explanation that follows it."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    explanation = next((line for line in lines[1:] if line.startswith("Explanation:")), None)
    return f"{lines[0]} ({explanation.removeprefix('Explanation:').strip()})" if explanation else lines[0]


class CountingBackend:
    """A ``torch.compile`` backend that times and records each graph, then delegates.

    Two instances with equal inner backends compare equal, like ``torch.compile``'s own
    wrappers: dynamo then reuses the graphs one fit compiled in the next fit with the same
    settings instead of piling up new cache entries until it hits its recompile limit.
    """

    def __init__(self, inner: Callable[..., Any], stats: CompileStats) -> None:
        self.inner = inner
        self.stats = stats

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        compile_id = torch._guards.CompileContext.current_compile_id()
        start = time.perf_counter()
        compiled = self.inner(gm, example_inputs)
        self.stats.record(
            GraphRecord(
                name=_graph_name(compile_id),
                frame_id=getattr(compile_id, "frame_id", None),
                frame_compile_id=getattr(compile_id, "frame_compile_id", None),
                num_nodes=len(gm.graph.nodes),
                compile_time_s=time.perf_counter() - start,
                break_reason=_break_reason(gm),
            )
        )
        return compiled

    @property
    def inductor_options(self) -> dict[str, Any]:
        """The Inductor options the inner backend compiles with (the CPU tuning's too); empty for others."""
        return dict(getattr(self.inner, "config", None) or {})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CountingBackend) and self.inner == other.inner

    __hash__ = None  # type: ignore[assignment]  # equal by settings, like torch's backend wrappers

    def __getattr__(self, name: str) -> Any:
        # dynamo asks backends for optional hooks (get_compiler_config, reset, ...): forward them.
        if name.startswith("__") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def _graph_name(compile_id: Any) -> str:
    return f"graph_{compile_id}" if compile_id is not None else "graph"


def _break_reason(gm: torch.fx.GraphModule) -> str | None:
    """Why dynamo ended ``gm`` at a graph break, with the user's line, or None (what ``explain`` reads)."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return None
    where = ""
    if reason.user_stack:
        frame = reason.user_stack[-1]
        where = f" at {frame.filename}:{frame.lineno}"
    return f"{_describe(reason.reason)}{where}"


def make_backend(
    backend: str | Callable[..., Any],
    mode: str | None,
    options: dict[str, Any] | None,
    dynamic: bool | None,
    stats: CompileStats,
    device: torch.device | None = None,
    tune_cpu: bool = True,
) -> CountingBackend:
    """Resolve ``backend``/``mode``/``options`` the way ``torch.compile`` does, then wrap it for counting.

    Plain Inductor for a CPU gets the CPU training tuning of :mod:`lightning_plugin.cpu.inductor`, options
    and decompositions (unless ``tune_cpu`` is False).
    """
    cpu_options = cpu_inductor.training_options(backend, mode, options, device, tune_cpu)
    if cpu_options is not None:
        inner: Callable[..., Any] = cpu_inductor.CPUTrainingInductor(mode, cpu_options, dynamic)
    elif backend == "inductor":
        inner = torch._TorchCompileInductorWrapper(mode, options, dynamic)
    else:
        inner = torch._TorchCompileWrapper(backend, mode, options, dynamic)
    return CountingBackend(inner, stats)
