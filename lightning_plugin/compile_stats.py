"""What the compiler did: graphs, graph breaks, recompiles, compile time, and why.

Graphs and compile times are counted by wrapping the backend, so they belong to the
strategy's own compiled code. Graph breaks and recompile reasons come from dynamo's
process-wide tables (``counters["graph_break"]`` and ``guard_failures``), read as the
difference from a snapshot taken when the strategy compiled: code compiled elsewhere in
the same process during the run is counted too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._dynamo.utils import compilation_time_metrics, counters, guard_failures

#: dynamo's timing keys that together make a compile's wall time: the whole forward compile (tracing,
#: AOTAutograd, the backend) and the backward graph that AOTAutograd compiles lazily at the first backward.
_COMPILE_TIME_KEYS = ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")


@dataclass
class GraphRecord:
    """One graph handed to the backend."""

    name: str
    frame_id: int | None
    frame_compile_id: int | None
    num_nodes: int
    compile_time_s: float

    @property
    def is_recompile(self) -> bool:
        return bool(self.frame_compile_id)


@dataclass
class CompileStats:
    """Counters a monitoring callback can log; reset each time the strategy compiles."""

    graph_records: list[GraphRecord] = field(default_factory=list)
    fell_back: bool = False
    fallback_reason: str | None = None
    _break_baseline: dict[str, int] = field(default_factory=dict, repr=False)
    _guard_baseline: dict[Any, int] = field(default_factory=dict, repr=False)
    _time_baseline: dict[str, int] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def start(self) -> None:
        """Forget earlier records and snapshot dynamo's global tables."""
        self.graph_records.clear()
        self.fell_back = False
        self.fallback_reason = None
        self._break_baseline = dict(counters["graph_break"])
        self._guard_baseline = {code: len(reasons) for code, reasons in guard_failures.items()}
        self._time_baseline = {key: len(compilation_time_metrics.get(key, [])) for key in _COMPILE_TIME_KEYS}

    def record(self, record: GraphRecord) -> None:
        with self._lock:
            self.graph_records.append(record)

    @property
    def graphs(self) -> int:
        """Graphs compiled, recompiles included."""
        return len(self.graph_records)

    @property
    def recompiles(self) -> int:
        return sum(r.is_recompile for r in self.graph_records)

    @property
    def backend_time_s(self) -> float:
        """Seconds spent inside the backend (Inductor) for the forward graphs this strategy compiled."""
        return sum(r.compile_time_s for r in self.graph_records)

    @property
    def compile_time_s(self) -> float:
        """Whole compile time since :meth:`start`: dynamo tracing, AOTAutograd and the backend, lazy backward
        graphs included. Read from dynamo's process-wide timers, so compiles elsewhere in the process count too;
        never less than :attr:`backend_time_s`."""
        total = 0.0
        for key in _COMPILE_TIME_KEYS:
            total += sum(compilation_time_metrics.get(key, [])[self._time_baseline.get(key, 0) :])
        return max(total, self.backend_time_s)

    @property
    def graph_compile_times(self) -> list[tuple[str, float]]:
        return [(r.name, r.compile_time_s) for r in self.graph_records]

    @property
    def break_reasons(self) -> list[str]:
        return [
            reason
            for reason, count in counters["graph_break"].items()
            if count > self._break_baseline.get(reason, 0)
        ]

    @property
    def graph_breaks(self) -> int:
        return sum(
            max(0, count - self._break_baseline.get(reason, 0)) for reason, count in counters["graph_break"].items()
        )

    @property
    def recompile_reasons(self) -> list[str]:
        reasons: list[str] = []
        for code, failures in list(guard_failures.items()):
            for failure in failures[self._guard_baseline.get(code, 0) :]:
                name = getattr(code, "co_name", str(code))
                reasons.append(f"{name}: {failure}")
        return reasons

    def as_dict(self) -> dict[str, float]:
        """The numeric counters, for ``log_metrics``."""
        return {
            "graphs": float(self.graphs),
            "graph_breaks": float(self.graph_breaks),
            "recompiles": float(self.recompiles),
            "compile_time_s": self.compile_time_s,
            "backend_time_s": self.backend_time_s,
            "fell_back": float(self.fell_back),
        }

    def summary(self) -> str:
        line = (
            f"{self.graphs} graph(s), {self.graph_breaks} graph break(s), {self.recompiles} recompile(s), "
            f"{self.compile_time_s:.1f}s compiling"
        )
        return line + (f"; fell back to eager: {self.fallback_reason}" if self.fell_back else "")


class CountingBackend:
    """A ``torch.compile`` backend that times and records each graph, then delegates."""

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
            )
        )
        return compiled

    def __getattr__(self, name: str) -> Any:
        # dynamo asks backends for optional hooks (get_compiler_config, reset, ...): forward them.
        return getattr(self.inner, name)


def _graph_name(compile_id: Any) -> str:
    return f"graph_{compile_id}" if compile_id is not None else "graph"


def make_backend(backend: str | Callable[..., Any], mode: str | None, options: dict[str, Any] | None,
                 dynamic: bool | None, stats: CompileStats) -> CountingBackend:
    """Resolve ``backend``/``mode``/``options`` the way ``torch.compile`` does, then wrap it for counting."""
    if backend == "inductor":
        inner: Callable[..., Any] = torch._TorchCompileInductorWrapper(mode, options, dynamic)
    else:
        inner = torch._TorchCompileWrapper(backend, mode, options, dynamic)
    return CountingBackend(inner, stats)
