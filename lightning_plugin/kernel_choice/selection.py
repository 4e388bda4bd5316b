"""``kernels="auto"``: keep a fused block only where it was measured correct and faster than Inductor alone.

A fused kernel that wins on one shape, dtype or GPU can lose on another, and nothing but a measurement says
which; no compiler chooses between our ``lcv::`` ops and Inductor's own fusion for us. So every recognised
block is rewritten first (:func:`~lightning_plugin.kernel_choice.substitution.apply_substitutions`), and at the model's
first forward, before Dynamo traces it (block input shapes exist only then), the selection:

1. runs one eager ``no_grad`` forward with pre-hooks on the rewritten blocks to record their inputs' shapes,
   dtypes and layouts (buffers and RNG are restored afterwards, so training is not disturbed);
2. groups the blocks by :class:`BlockSignature` and measures one block per signature
   (:func:`~lightning_plugin.kernel_choice.measurement.measure_block`), or takes the measurement from the
   on-disk cache (:class:`~lightning_plugin.kernel_choice.cache.DecisionCache`);
3. keeps a rewrite only where the block is correct and at least :data:`MIN_SPEEDUP` times faster, and
   undoes the others, so Dynamo then traces exactly the chosen graph.

Under DDP rank 0 decides and broadcasts its decisions, so every rank runs the same graph.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_plugin.config import KNOWN_KERNELS, CompileConfig
from lightning_plugin.kernel_choice.cache import DecisionCache, machine_fingerprint
from lightning_plugin.kernel_choice.measurement import (
    BlockSignature,
    Compile,
    InputSpec,
    Measurement,
    MedianTimer,
    StepTimer,
    TensorSpec,
    measure_block,
)
from lightning_plugin.kernel_choice.substitution import (
    Replacement,
    SubstitutionReport,
    apply_substitutions,
    undo_substitutions,
)

__all__ = [
    "MIN_SPEEDUP",
    "AutoKernelSelection",
    "KernelDecision",
    "KernelSelection",
    "format_decisions",
    "run_selection",
    "select_kernels",
]

#: A fused block must beat Inductor alone by this factor to be kept: a smaller gain is within run-to-run
#: noise, and would not pay for a kernel of ours in the graph where Inductor's would do.
MIN_SPEEDUP = 1.05

#: A rewritten module holding more rewritten modules than this (a whole ResNet, whose stem is a chain) is a
#: model, not a block: timing its own chain would compile everything it holds twice and the ratio would be
#: diluted to ~1x. It stays eager. A ResNet block holds one (its downsample), undone on both sides.
MAX_NESTED_REWRITES = 1


@dataclass(frozen=True)
class KernelDecision:
    """What the selection did with one rewritten block, and why."""

    path: str
    kind: str  # the fused kernels the rewrite uses, e.g. "conv_bn_act+batch_norm_act"
    chosen: str  # ``kind`` when kept fused, else "eager"
    signature: BlockSignature | None  # None when the block was not measured
    ratio: float | None = None  # Inductor-alone time / fused time (above 1: fused is faster)
    correct: bool | None = None  # matched eager (outputs, gradients, buffers) within tolerance
    reason: str = ""
    cached: bool = False  # taken from the decision cache, not measured in this run
    fused_ms: float | None = None  # the measured time of the fused block (one step, median)
    inductor_ms: float | None = None  # the same block compiled by Inductor alone

    @property
    def fused(self) -> bool:
        return self.chosen != "eager"

    def as_row(self) -> dict[str, Any]:
        """Plain values (JSON, TensorBoard, a benchmark's table)."""
        return {
            "path": self.path,
            "signature": self.signature.key if self.signature is not None else None,
            "kind": self.kind,
            "chosen": self.chosen,
            "ratio": self.ratio,
            "correct": self.correct,
            "reason": self.reason,
            "cached": self.cached,
            "fused_ms": self.fused_ms,
            "inductor_ms": self.inductor_ms,
        }


@dataclass
class KernelSelection:
    """What :func:`select_kernels` returns: a decision per block, and the rewrites it kept in the model
    (``undo_substitutions(model, selection.report)`` reverts them)."""

    decisions: list[KernelDecision]
    report: SubstitutionReport


def default_timer() -> StepTimer:
    """The timer the compiled strategies use (a module-level function so tests can put in a fake clock)."""
    return MedianTimer()


def select_kernels(
    model: nn.Module,
    example_inputs: Any,
    *,
    kernels: Iterable[str] | None = None,
    training: bool = True,
    config: CompileConfig | None = None,
    timer: StepTimer | None = None,
    cache_dir: str | None = None,
    use_cache: bool = True,
) -> KernelSelection:
    """Rewrite ``model`` in place, measure every rewritten block, and keep only the chosen rewrites.

    The scripting face of ``kernels="auto"`` (benchmarks, notebooks). ``model`` and ``example_inputs`` (a
    tensor or a tuple of positional arguments) must already be on their device and in their memory format;
    call it inside ``torch.autocast(...)`` to measure the autocast dtype. ``kernels`` limits the candidate
    kinds (default: all); ``training`` times forward+backward in train mode (else forward in eval mode);
    ``config`` gives the backend/mode/options both sides are compiled with (default: Inductor). Under
    ``torch.distributed`` every rank must call it: rank 0 measures, the others take its decisions.
    """
    config = config if config is not None else CompileConfig()
    if isinstance(kernels, str):
        kernels = [kernels]
    kinds = frozenset(KNOWN_KERNELS) if kernels is None else frozenset(kernels)
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    report = apply_substitutions(model, kinds)
    compile_fn, compiler = compile_settings(config)
    decisions = run_selection(
        model,
        report,
        lambda: model(*inputs),
        root_inputs=inputs,
        device=_device_of(inputs, model),
        training=training,
        compile_fn=compile_fn,
        compiler=compiler,
        timer=timer if timer is not None else default_timer(),
        cache=DecisionCache(cache_dir) if use_cache else None,
    )
    return KernelSelection(decisions, report)


#: Inductor modes as measured: without CUDA graphs, whose static output buffers a timing loop that keeps
#: results between calls would overwrite (the model's own compile keeps the configured mode).
_MEASURED_MODE = {"reduce-overhead": None, "max-autotune": "max-autotune-no-cudagraphs"}


def compile_settings(config: CompileConfig) -> tuple[Compile, str]:
    """How both sides of a measurement are compiled (as the model will be), and a label for the signature."""
    mode = _MEASURED_MODE.get(config.mode, config.mode) if config.mode is not None else None
    kwargs: dict[str, Any] = {"backend": config.backend, "dynamic": False}
    if mode is not None:
        kwargs["mode"] = mode
    if config.options:
        kwargs["options"] = config.options
    backend = getattr(config.backend, "__name__", str(config.backend))
    options = ",".join(f"{k}={v}" for k, v in sorted((config.options or {}).items()))
    label = f"{backend}:{mode or 'default'}" + (f":{options}" if options else "")
    return (lambda fn: torch.compile(fn, **kwargs)), label


def run_selection(
    root: nn.Module,
    report: SubstitutionReport,
    forward: Callable[[], Any],
    *,
    root_inputs: Sequence[Any],
    device: torch.device,
    training: bool,
    compile_fn: Compile,
    compiler: str,
    timer: StepTimer,
    cache: DecisionCache | None,
) -> list[KernelDecision]:
    """Decide every rewrite of ``report`` (rank 0 under DDP), undo the rejected ones, return the decisions.

    ``forward`` runs the model once on ``root_inputs`` without compiling. Rejected blocks move from
    ``report.replacements`` to ``report.skipped`` with their reason.
    """
    if not report.replacements:  # e.g. float64 training: nothing was rewritten, on any rank
        return []
    inputs = tuple(root_inputs)
    job = _Job(root, report, forward, inputs, device, training, compile_fn, compiler, timer, cache)
    devices = []
    if device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    # Lightning's validation (the sanity check) runs under inference_mode; measuring needs autograd.
    with torch.inference_mode(False), torch.enable_grad(), torch.random.fork_rng(devices=devices):
        decisions = _decide_on_rank_zero(job) if _world_size() > 1 else _decide(job)
    _keep_chosen(root, report, decisions)
    return decisions


def format_decisions(decisions: Sequence[KernelDecision]) -> str:
    """The selection's table: each block, what was chosen, the measured ratio and why."""
    header = ("path", "kind", "input", "chosen", "ratio", "correct", "why")
    rows = [header]
    for d in decisions:
        sig = d.signature
        rows.append(
            (
                d.path,
                d.kind,
                f"{sig.inputs} {sig.dtype} {sig.layout} {sig.mode}" if sig is not None else "-",
                d.chosen,
                f"{d.ratio:.3g}x" if d.ratio is not None else "-",
                {True: "yes", False: "NO", None: "-"}[d.correct],
                d.reason + (" (cached)" if d.cached else ""),
            )
        )
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header) - 1)]
    fused = sum(d.fused for d in decisions)
    lines = [f"kernel selection: {fused} of {len(decisions)} rewritten block(s) kept fused (kernels='auto')"]
    lines += ["  ".join([*(str(c).ljust(w) for c, w in zip(r[:-1], widths)), r[-1]]).rstrip() for r in rows]
    return "\n".join(lines)


class AutoKernelSelection:
    """``kernels="auto"`` for one compiled module, waiting for the module's first forward.

    It runs from a forward pre-hook on the module (before the compiled ``forward`` is entered) and, for a
    forward called directly (``self.forward(x)``), from the compiler's wrapper through
    :meth:`before_compiled_call`. It measures inside ``uncompiled()``, the compiler's window in which the
    module has its own forwards (so copies and undone rewrites never meet a compiled wrapper) and after
    which the compiler wraps the forwards the selection left: nothing is traced before it has decided.
    """

    def __init__(
        self,
        root: nn.Module,
        report: SubstitutionReport,
        config: CompileConfig,
        device: torch.device,
        uncompiled: Callable[[], AbstractContextManager[None]],
        prepare_args: Callable[[tuple[Any, ...]], tuple[Any, ...]],
        on_finish: Callable[[], None],
    ) -> None:
        self.root, self.report, self.config, self.device = root, report, config, device
        self.decisions: list[KernelDecision] = []
        self._uncompiled = uncompiled
        self._prepare_args = prepare_args
        self._on_finish = on_finish
        self._state = "pending"  # -> "running" -> "done"
        self._hook = root.register_forward_pre_hook(self._before_forward, with_kwargs=True)

    @property
    def pending(self) -> bool:
        return self._state == "pending"

    def before_compiled_call(self, target: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Called by a compiled forward before it runs (afterwards, the compiler's wrappers may be new)."""
        if self._state != "pending":
            return
        if target is self.root:
            self._run(args, kwargs)
        else:  # a repeated block compiled alone, reached without the root's pre-hook: inputs are unknown
            self._give_up(
                f"{type(self.root).__name__} was not called as a module (e.g. self.forward(x), or a "
                "training_step calling a submodule), so the inputs of its blocks could not be recorded"
            )

    def close(self) -> None:
        """Stop waiting (the strategy restored the module); decisions already made stay readable."""
        self._hook.remove()
        if self._state == "pending":
            self._state = "done"

    def _before_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._state == "pending":
            self._run(self._prepare_args(args), kwargs)

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._state = "running"
        self._hook.remove()
        try:
            compile_fn, compiler = compile_settings(self.config)
            with self._uncompiled():
                self.decisions = run_selection(
                    self.root,
                    self.report,
                    lambda: self.root.forward(*args, **kwargs),
                    root_inputs=(*args, *kwargs.values()),
                    device=self.device,
                    training=_will_train(self.root),
                    compile_fn=compile_fn,
                    compiler=compiler,
                    timer=default_timer(),
                    cache=DecisionCache(),
                )
        finally:
            self._state = "done"
        self._on_finish()

    def _give_up(self, why: str) -> None:
        warnings.warn(
            f"kernels='auto': {why}; every block stays eager. Call the module as self(x), or pick kernels "
            "explicitly (kernels='all' or a list).",
            stacklevel=4,
        )
        self.close()
        self.decisions = [
            KernelDecision(rep.path, rep.kind, "eager", None, reason="not measured")
            for rep in self.report.replacements
        ]
        with self._uncompiled():
            _keep_chosen(self.root, self.report, self.decisions)


# ---------------------------------------------------------------------------------------------------------
# Deciding


@dataclass(frozen=True)
class _Job:
    """The arguments of :func:`run_selection`, as the rank that decides needs them."""

    root: nn.Module
    report: SubstitutionReport
    forward: Callable[[], Any]
    root_inputs: tuple[Any, ...]
    device: torch.device
    training: bool
    compile_fn: Compile
    compiler: str
    timer: StepTimer
    cache: DecisionCache | None


def _decide(job: _Job) -> list[KernelDecision]:
    started = time.perf_counter()
    training, compiler, cache = job.training, job.compiler, job.cache
    reps = list(job.report.replacements)
    nested = {id(rep): _nested_in(rep, reps) for rep in reps}
    inputs = _record_block_inputs(job.root, reps, job.forward, job.root_inputs)
    decisions: dict[int, KernelDecision] = {}
    groups: dict[str, list[Replacement]] = {}
    signatures: dict[int, BlockSignature] = {}
    for rep in reps:
        if len(nested[id(rep)]) > MAX_NESTED_REWRITES:
            why = f"holds {len(nested[id(rep)])} other rewritten blocks: a model, not timed as a block"
            decisions[id(rep)] = KernelDecision(rep.path, rep.kind, "eager", None, reason=why)
        elif (block_inputs := inputs.get(id(rep))) is None:
            why = "called with keyword tensors" if id(rep) in inputs else "not called in the first forward"
            decisions[id(rep)] = KernelDecision(rep.path, rep.kind, "eager", None, reason=why)
        else:
            assert rep.module is not None
            signature = BlockSignature.of(rep, rep.module, block_inputs, training, compiler)
            signatures[id(rep)] = signature
            groups.setdefault(signature.key, []).append(rep)

    fingerprint = machine_fingerprint(job.device)
    found = {
        key: Measurement.from_json(entry)
        for key, entry in (cache.lookup(fingerprint, list(groups)) if cache is not None else {}).items()
    }
    todo = [key for key in groups if key not in found]
    if todo:
        rank_zero_info(
            f"kernel selection (kernels='auto'): measuring {len(todo)} block signature(s) on {fingerprint}: "
            f"each fused block against the same block compiled by {compiler} alone "
            f"({'forward+backward' if training else 'forward'}); this compiles every block twice"
        )
    measured: dict[str, Measurement] = {}
    failed: dict[str, str] = {}
    for key in todo:
        rep = groups[key][0]
        try:
            measured[key] = measure_block(
                rep,
                nested[id(rep)],
                cast(tuple[Any, ...], inputs[id(rep)]),  # grouped above: called with positional inputs
                signatures[id(rep)],
                training=training,
                compile_fn=job.compile_fn,
                timer=job.timer,
            )
        except Exception as err:  # a block that cannot be measured stays eager; the others are still decided
            first_line = (str(err).strip().splitlines() or [""])[0]
            failed[key] = f"measurement failed ({type(err).__name__}: {first_line})"
            warnings.warn(f"kernel selection: {rep.path}: {failed[key]}; it stays eager", stacklevel=2)
    if cache is not None:  # failures are not stored: they may be passing (out of memory, a compiler bug)
        cache.store(fingerprint, {key: m.to_json() for key, m in measured.items()})

    for key, members in groups.items():
        for rep in members:
            if key in failed:
                decisions[id(rep)] = KernelDecision(
                    rep.path, rep.kind, "eager", signatures[id(rep)], reason=failed[key]
                )
            else:
                measurement = measured[key] if key in measured else found[key]
                cached = key not in measured
                decisions[id(rep)] = _decision(rep, signatures[id(rep)], measurement, cached)
    ordered = [decisions[id(rep)] for rep in reps]
    elapsed = time.perf_counter() - started
    _log_outcome(ordered, len(measured) + len(failed), len(groups) - len(todo), elapsed, cache)
    return ordered


def _decision(rep: Replacement, signature: BlockSignature, m: Measurement, cached: bool) -> KernelDecision:
    times = {
        "fused_ms": m.fused_s * 1e3 if m.fused_s is not None else None,
        "inductor_ms": m.inductor_s * 1e3 if m.inductor_s is not None else None,
    }
    if not m.correct:
        why = f"differs from eager: {m.problem}"
        return KernelDecision(rep.path, rep.kind, "eager", signature, None, False, why, cached, **times)
    ratio = m.ratio if m.ratio is not None else 0.0
    if ratio < MIN_SPEEDUP:
        why = f"below {MIN_SPEEDUP:.2f}x"
        return KernelDecision(rep.path, rep.kind, "eager", signature, ratio, True, why, cached, **times)
    return KernelDecision(rep.path, rep.kind, rep.kind, signature, ratio, True, "faster", cached, **times)


def _log_outcome(
    decisions: list[KernelDecision],
    measured: int,
    from_cache: int,
    seconds: float,
    cache: DecisionCache | None,
) -> None:
    where = f" ({cache.path})" if cache is not None else ""
    if measured:
        line = f"kernel selection: measured {measured} block signature(s) in {seconds:.1f}s"
        if from_cache:
            line += f"; {from_cache} more from the cache{where}"
    else:
        line = f"kernel selection: used cached decisions for {from_cache} block signature(s){where}"
        line += "; nothing measured"
    rank_zero_info(line)
    rank_zero_info(format_decisions(decisions))


def _keep_chosen(root: nn.Module, report: SubstitutionReport, decisions: Sequence[KernelDecision]) -> None:
    """Undo every rewrite not chosen (on every rank: decisions are matched by path)."""
    by_path = {d.path: d for d in decisions}
    kept = []
    for rep in report.replacements:
        decision = by_path.get(rep.path)
        if decision is not None and decision.fused:
            kept.append(rep)
            continue
        undo_substitutions(root, SubstitutionReport([rep]))
        reason = decision.reason if decision is not None else "no decision from rank 0"
        report.skipped.append((rep.path, f"kernels='auto' kept it eager: {reason}"))
    report.replacements[:] = kept


def _nested_in(rep: Replacement, reps: Sequence[Replacement]) -> list[Replacement]:
    """The other rewrites whose module lies inside ``rep``'s module."""
    assert rep.module is not None
    inside = {id(m) for m in rep.module.modules() if m is not rep.module}
    return [other for other in reps if other is not rep and id(other.module) in inside]


def _record_block_inputs(
    root: nn.Module, reps: Sequence[Replacement], forward: Callable[[], Any], root_inputs: Sequence[Any]
) -> dict[int, InputSpec | None]:
    """Input specs of each rewritten block's first call (None: called with keyword tensors), by ``id(rep)``.

    One eager forward without gradients; buffers the forward updates (BatchNorm running statistics in train
    mode) are put back, so the model trains exactly as without the selection.
    """
    model_inputs = {id(t) for t in root_inputs if isinstance(t, torch.Tensor)}
    seen: dict[int, InputSpec | None] = {}

    def recorder(rep: Replacement) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if id(rep) in seen:
                return
            if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
                seen[id(rep)] = None
                return
            seen[id(rep)] = tuple(_spec_of(a, model_inputs) for a in args)

        return record

    handles = [
        rep.module.register_forward_pre_hook(recorder(rep), with_kwargs=True) for rep in reps if rep.module
    ]
    saved = [(buffer, buffer.detach().clone()) for buffer in root.buffers()]
    try:
        with torch.no_grad():
            forward()
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)
    return seen


def _spec_of(value: Any, model_inputs: set[int]) -> Any:
    """A tensor argument as a spec (the model's own inputs need no gradient); other arguments as they are."""
    if isinstance(value, torch.Tensor):
        return TensorSpec.of(value, requires_grad=id(value) not in model_inputs)
    return value


def _decide_on_rank_zero(job: _Job) -> list[KernelDecision]:
    """Rank 0 decides, every rank receives the same decisions (an error on rank 0 is raised on all ranks)."""
    payload: list[Any] = [None]
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            payload[0] = ("decisions", _decide(job))
        except Exception as err:
            error = err
            payload[0] = ("error", f"{type(err).__name__}: {err}")
    dist.broadcast_object_list(payload, src=0)
    status, value = payload[0]
    if error is not None:
        raise error
    if status == "error":
        raise RuntimeError(f"kernel selection failed on rank 0: {value}")
    return list(value)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _will_train(root: nn.Module) -> bool:
    """Whether the module is about to be trained (so forward+backward in train mode is what to time). The
    first forward of a fit is often Lightning's sanity check, in eval mode, so the module's mode at that
    moment does not tell; the Trainer's state does."""
    trainer = getattr(root, "_trainer", None)
    state = getattr(trainer, "state", None)
    if state is not None and getattr(state, "fn", None) is not None:
        return str(state.fn.value if hasattr(state.fn, "value") else state.fn) == "fit"
    return root.training


def _device_of(inputs: Sequence[Any], model: nn.Module) -> torch.device:
    for value in inputs:
        if isinstance(value, torch.Tensor):
            return value.device
    return next(model.parameters()).device
