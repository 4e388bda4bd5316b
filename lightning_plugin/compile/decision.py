"""Compile or eager, by measurement: the compiled strategies keep compiling only where it pays.

Compiling does not speed up every model on every device: on a 2-core CPU a small ResNet trains slower
compiled than eager. With ``CompileConfig(compile="auto")`` the strategy times whole training steps
(forward, backward and optimizer step; data loading excluded) both ways right after the compiling steps,
alternating and taking medians, and trains eagerly for the rest of the run when the compiled step is not
faster. The measured steps still train: only which forward runs changes, and both compute the same maths.

A decision is stored in the per-user decision cache (``$LCV_KERNEL_CACHE_DIR``, see
:mod:`lightning_plugin.kernel_choice.cache`), keyed by the machine (device, torch version, thread count) and by the
model's signature (module classes, parameter shapes and dtypes, the first batch's shapes, precision, compile
settings): a later run with an "eager" decision never compiles, one with a "compiled" decision skips the
measurement. In DDP global rank 0 measures, looks up and stores; every rank follows its decision.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.utils._pytree import tree_leaves

from lightning_plugin.compile.compiler import ModuleCompiler
from lightning_plugin.kernel_choice.cache import DecisionCache, machine_fingerprint

CompileMode = Literal["auto", "always", "never"]
COMPILE_MODES: tuple[str, ...] = ("auto", "always", "never")

#: Compiled is kept when (median eager step time) / (median compiled step time) is at least this: a model that
#: compiles to no faster than eager trains eagerly, which also saves the compile of its evaluation graph.
MIN_SPEEDUP = 1.0
#: Compiled steps before the clock runs: the first compiles, the second runs the cached graphs once.
WARMUP_STEPS = 2
#: Steps measured each way (after one unmeasured eager step that warms eager's own caches).
SAMPLES = 4
#: Measured steps after which the measurement gives up (compiles kept spoiling samples) and compiled stays.
MAX_MEASURED_STEPS = 6 * SAMPLES

DECISIONS_FILE = "compile_decisions.json"

#: The clock the steps are timed with (a test may replace it).
step_clock: Callable[[], float] = time.perf_counter
#: Bumped when the key or the measurement changes, so old decisions are measured again.
DECISION_FORMAT = 1


@dataclass(frozen=True)
class CompileDecision:
    """Whether the strategy runs the compiled forward, and the measurement behind it."""

    choice: Literal["compiled", "eager"]
    source: Literal["measured", "cached", "always", "never"]
    #: median eager step time / median compiled step time (above 1: compiled is faster)
    speedup: float | None = None
    compiled_ms: float | None = None
    eager_ms: float | None = None
    steps: int = 0  # measured steps each way

    def describe(self) -> str:
        """One line: what runs, the measured ratio, and how to override it."""
        if self.source == "always":
            return "compile='always': compiled, not measured against eager"
        if self.source == "never":
            return "compile='never': training eagerly, nothing compiled"
        measured = (
            f"compiled steps {self.speedup:.2f}x the speed of eager (median of {self.steps} each: "
            f"{self.compiled_ms:.1f} ms compiled, {self.eager_ms:.1f} ms eager)"
        )
        if self.source == "cached":
            if self.choice == "eager":
                return (
                    f"compile='auto': an earlier run on this machine measured {measured}; training eagerly "
                    f"without compiling (compile='always' compiles anyway)"
                )
            return f"compile='auto': compiling; an earlier run on this machine measured {measured}"
        if self.choice == "eager":
            return (
                f"compile='auto': {measured}, below {MIN_SPEEDUP}x; training eagerly from here "
                "(compile='always' keeps compiling)"
            )
        return f"compile='auto': {measured}; keeps compiling"


class CompileDecider:
    """Runs the measurement for one strategy: which forward each training step runs, and the decision."""

    def __init__(self, compiler: ModuleCompiler, mode: str) -> None:
        self.compiler = compiler
        self.mode = mode
        self.decision: CompileDecision | None = None
        self.key: tuple[str, str] | None = None  # (machine fingerprint, model signature) of ``decision``
        self._broadcast: Callable[[Any], Any] = _same
        self._is_global_zero = True
        self._device = torch.device("cpu")
        self._precision = ""
        self._active = False
        self._measuring = False
        self._step_start: float | None = None

    # ------------------------------------------------------------------ a run (fit, validate, ...)
    def begin(
        self,
        device: torch.device,
        precision: str,
        fitting: bool,
        broadcast: Callable[[Any], Any],
        is_global_zero: bool,
    ) -> None:
        """The strategy compiled the module for a new run: evaluation waits for a fit's decision."""
        self._device, self._precision, self._broadcast = device, precision, broadcast
        self._is_global_zero = is_global_zero
        self._first_batch = True
        self._batches = 0
        self._units = 0
        self._measured_units = 0
        self._unit_eager = False
        self._unit_sampled = False
        self._unit_seconds = 0.0
        self._unit_clean = True
        self._unit_compiles = 0
        self._step_start = None
        self._step_end: float | None = None
        self._samples: dict[bool, list[float]] = {True: [], False: []}
        self._active = True
        self._measuring = fitting and self.mode == "auto"
        if self.mode == "never":
            self._apply(CompileDecision("eager", "never"))
        elif self.mode == "always":
            self._apply(CompileDecision("compiled", "always"))
        elif self.decision is not None:
            self._apply(
                self.decision
            )  # an earlier fit of this strategy decided; checked again at its first batch
        else:
            self._run(eager_train=False, eager_eval=fitting)  # evaluation compiles once compiling is decided

    def before_batch(self, module: nn.Module, batch: Any, accumulate: int) -> None:
        """A training batch begins: close the previous step's sample and choose this step's forward."""
        if not (self._active and self._measuring):
            return
        if self._first_batch:
            self._first_batch = False
            self._look_up(module, batch)
        if self.decision is not None:  # found in the cache
            self._measuring = False
            return
        self._close_batch()
        if self._batches % max(accumulate, 1) == 0:
            self._close_unit()
            if self.decision is None:
                self._open_unit()
        self._batches += 1
        if self.decision is None:
            self._step_start = self._now()
            self._step_end = None

    def after_work(self) -> None:
        """The step's training_step, backward or optimizer step returned (its end, unless more follows)."""
        if self._step_start is not None:
            self._step_end = self._now()

    def end(self) -> None:
        self._active = False
        self._step_start = None
        self._broadcast = _same  # the strategy's, for this run only (a strategy pickles without it)

    # ------------------------------------------------------------------ measuring
    def _open_unit(self) -> None:
        """Choose the next unit's forward: compiled warm-up, one eager warm-up, then eager/compiled ABBA."""
        warming = self._units < WARMUP_STEPS or self.compiler.selection_pending
        if warming:
            eager, sampled = False, False
        else:
            index = self._units - WARMUP_STEPS - 1  # -1: the eager warm-up
            eager, sampled = (True, False) if index < 0 else (index % 4 in (0, 3), True)
        if not self.compiler.selection_pending:
            self._units += 1
        self._unit_eager, self._unit_sampled = eager, sampled
        self._unit_seconds, self._unit_clean = 0.0, True
        self._unit_compiles = self._compiles()
        self.compiler.eager_train = eager

    def _close_batch(self) -> None:
        if self._step_start is None:
            return
        if self._step_end is None:  # no training_step ran (skipped batch): nothing to time
            self._unit_clean = False
        else:
            self._unit_seconds += self._step_end - self._step_start
        self._step_start = None

    def _close_unit(self) -> None:
        if self._batches == 0 or not self._unit_sampled:
            return
        self._unit_sampled = False
        clean = self._unit_clean and self._compiles() == self._unit_compiles  # a compile spoils the sample
        if clean:
            self._samples[self._unit_eager].append(self._unit_seconds)
        self._measured_units += 1
        decision = None
        if self._is_global_zero:
            decision = self._decide()
        decision = self._broadcast(decision)  # every rank reaches this point at the same unit
        if decision is not None:
            self._measuring = False
            self._apply(decision)
            rank_zero_info(decision.describe())
            self._store(decision)
        elif self._measured_units >= MAX_MEASURED_STEPS:
            self._give_up()

    def _decide(self) -> CompileDecision | None:
        eager, compiled = self._samples[True], self._samples[False]
        enough = len(eager) >= SAMPLES and len(compiled) >= SAMPLES
        out_of_steps = self._measured_units >= MAX_MEASURED_STEPS
        if not enough and not (out_of_steps and len(eager) >= 2 and len(compiled) >= 2):
            return None
        eager_s, compiled_s = statistics.median(eager), statistics.median(compiled)
        speedup = eager_s / compiled_s if compiled_s > 0 else float("inf")
        return CompileDecision(
            "compiled" if speedup >= MIN_SPEEDUP else "eager",
            "measured",
            speedup,
            compiled_s * 1e3,
            eager_s * 1e3,
            min(len(eager), len(compiled)),
        )

    def _give_up(self) -> None:
        self._measuring = False
        self.compiler.eager_train = False
        self.compiler.eager_eval = not self.compiler.config.compile_eval
        reason = (
            f"compile='auto': no clean measurement in {MAX_MEASURED_STEPS} steps (compiles kept "
            "interrupting them); compiling, not cached"
        )
        self.compiler.stats.decision_reason = reason
        rank_zero_info(reason)

    def _compiles(self) -> int:
        stats = self.compiler.stats
        return stats.graphs + len(stats.frame_records)

    def _now(self) -> float:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return step_clock()

    # ------------------------------------------------------------------ applying and caching
    def _run(self, eager_train: bool, eager_eval: bool) -> None:
        self.compiler.eager_train = eager_train
        self.compiler.eager_eval = eager_eval

    def _apply(self, decision: CompileDecision) -> None:
        self.decision = decision
        eager = decision.choice == "eager"
        self._run(eager_train=eager, eager_eval=eager)
        stats = self.compiler.stats
        stats.decision, stats.speedup, stats.decision_reason = (
            decision.choice,
            decision.speedup,
            decision.describe(),
        )

    def _look_up(self, module: nn.Module, batch: Any) -> None:
        key = (
            decision_fingerprint(self._device),
            model_signature(module, batch, self._precision, self.compiler),
        )
        if self.decision is not None and key == self.key:
            return  # decided by an earlier fit of this strategy
        self.key, self.decision = key, None
        self._run(eager_train=False, eager_eval=True)
        found = None
        if self._is_global_zero:
            entry = _cache().lookup(key[0], [key[1]]).get(key[1])
            found = _from_entry(entry)
        found = self._broadcast(found)
        if found is not None:
            self._apply(found)
            rank_zero_info(found.describe())

    def _store(self, decision: CompileDecision) -> None:
        if self._is_global_zero and self.key is not None:
            entry = {k: v for k, v in asdict(decision).items() if k != "source"}
            _cache().store(self.key[0], {self.key[1]: {"format": DECISION_FORMAT, **entry}})


def _same(obj: Any) -> Any:
    return obj


def _cache() -> DecisionCache:
    return DecisionCache(file_name=DECISIONS_FILE, owner="compile='auto'")


def _from_entry(entry: dict[str, Any] | None) -> CompileDecision | None:
    if (
        not entry
        or entry.get("format") != DECISION_FORMAT
        or entry.get("choice") not in ("compiled", "eager")
    ):
        return None
    try:
        return CompileDecision(
            entry["choice"],
            "cached",
            float(entry["speedup"]),
            float(entry["compiled_ms"]),
            float(entry["eager_ms"]),
            int(entry["steps"]),
        )
    except (KeyError, TypeError, ValueError):
        return None


def decision_fingerprint(device: torch.device) -> str:
    """Where a measurement holds: the device and compiler stack, the CPU's instruction set, the thread
    count."""
    return (
        f"{machine_fingerprint(device)}|{torch.backends.cpu.get_cpu_capability()}|"
        f"{torch.get_num_threads()} threads"
    )


def model_signature(module: nn.Module, batch: Any, precision: str, compiler: ModuleCompiler) -> str:
    """What the measured ratio depends on besides the machine: the model's structure, parameter shapes and
    dtypes, the training batch's shapes, the precision and the compile settings (a readable prefix + a
    hash)."""
    config = compiler.config
    backend = (
        config.backend
        if isinstance(config.backend, str)
        else getattr(config.backend, "__qualname__", type(config.backend).__qualname__)
    )
    parts = [
        f"precision={precision}",
        f"backend={backend}",
        f"mode={config.mode}",
        f"options={config.options}",
        f"tune_cpu={config.tune_cpu}",
        # what Inductor is given (the CPU tuning included): a retuned strategy measures anew
        f"inductor={sorted(compiler.inductor_options.items())}",
        f"graph_passes={compiler.graph_passes}",  # new CPU graph changes: a cached "eager" is measured anew
        f"dynamic={config.dynamic}",
        f"regional={config.regional}",
        f"channels_last={config.channels_last}",
        f"kernels={sorted(config.kernels) if not isinstance(config.kernels, str) else config.kernels}",
    ]
    parts += [f"{name}:{type(m).__module__}.{type(m).__qualname__}" for name, m in module.named_modules()]
    parts += [f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}" for name, p in module.named_parameters()]
    parts += [f"{name}:{tuple(b.shape)}:{b.dtype}" for name, b in module.named_buffers()]
    parts += [f"input:{tuple(t.shape)}:{t.dtype}" for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]
    return f"{type(module).__name__}:{digest}"
