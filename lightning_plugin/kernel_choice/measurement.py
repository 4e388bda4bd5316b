"""Measuring one rewritten block: is the fused copy correct, and how much faster than Inductor alone?

Both sides are copies of the block, so the model's weights and buffers are untouched. The fused side keeps its
rewrite and is compiled like the model will be (our ops are opaque to Inductor, everything around them is
fused by it); the baseline is the same block with the rewrite undone, compiled by the same backend, because
the rest of the model runs under Inductor too (eager would flatter the fused block). Rewritten blocks nested
inside the measured one are undone on both sides, so the ratio is the measured block's own.

Correctness is checked against the eager block (in float64 for an fp32 block on the CPU, see ``_run``) in
both train and eval mode (a model that trains also
validates): outputs, the gradients of the input and of every parameter, and the buffers after the forward
(BatchNorm running statistics), with the bound ``atol + rtol * max|reference|`` from
:mod:`lcv_kernels.tolerances` for the compute dtype.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
import statistics
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from lcv_kernels.tolerances import reduction_tolerance, tolerance
from lightning_plugin.kernel_choice.substitution import Replacement, SubstitutionReport, undo_substitutions


@dataclass(frozen=True)
class TensorSpec:
    """One tensor argument of a block, as seen in the model's first forward (values are not kept)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str
    channels_last: bool
    requires_grad: bool  # False for the model's own inputs, True for activations

    @classmethod
    def of(cls, tensor: torch.Tensor, requires_grad: bool) -> TensorSpec:
        channels_last = (
            tensor.dim() == 4
            and tensor.is_contiguous(memory_format=torch.channels_last)
            and not tensor.is_contiguous()
        )
        return cls(tuple(tensor.shape), tensor.dtype, str(tensor.device), channels_last, requires_grad)

    def make(self, generator: torch.Generator) -> torch.Tensor:
        if self.dtype.is_floating_point:
            t = torch.randn(self.shape, generator=generator, device=self.device, dtype=self.dtype)
        else:
            t = torch.randint(0, 2, self.shape, generator=generator, device=self.device, dtype=self.dtype)
        return t.contiguous(memory_format=torch.channels_last) if self.channels_last else t


#: A block's positional arguments: tensor specs, or plain values passed as they were.
InputSpec = tuple[Any, ...]


@dataclass(frozen=True)
class BlockSignature:
    """What a measurement depends on, besides the machine: blocks with equal signatures share one measurement.

    ``structure`` hashes the block's modules (channels, kernel sizes, strides, norms, activations) and its
    rewrite, so two blocks of one class with other strides never share. ``inputs`` has the batch size rounded
    up to a power of two (the smaller last batch, or a validation batch, does not measure again).
    """

    block: str
    kind: str
    structure: str
    inputs: str
    dtype: str
    layout: str
    mode: str  # "train" (forward+backward timed) or "eval" (forward timed)
    compiler: str

    @property
    def key(self) -> str:
        return "|".join(dataclasses.astuple(self))

    @classmethod
    def of(
        cls, rep: Replacement, block: nn.Module, inputs: InputSpec, training: bool, compiler: str
    ) -> BlockSignature:
        tensors = [t for t in inputs if isinstance(t, TensorSpec)]
        device_type = torch.device(tensors[0].device).type if tensors else "cpu"
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
        if dtype is None:
            dtype = next((t.dtype for t in tensors if t.dtype.is_floating_point), torch.float32)
        structure = hashlib.sha1(f"{rep.description}\n{block!r}".encode()).hexdigest()[:12]
        return cls(
            block=type(block).__name__,
            kind=rep.kind,
            structure=structure,
            inputs=",".join(_bucketed_shape(t.shape) for t in tensors),
            dtype=str(dtype).removeprefix("torch."),
            layout="channels_last" if any(t.channels_last for t in tensors) else "contiguous",
            mode="train" if training else "eval",
            compiler=compiler,
        )


def _bucketed_shape(shape: tuple[int, ...]) -> str:
    if not shape:
        return "scalar"
    batch = 1 << max(shape[0] - 1, 0).bit_length()
    return "x".join(str(d) for d in (batch, *shape[1:]))


@dataclass(frozen=True)
class Measurement:
    """The outcome for one signature: correct against eager, and Inductor time / fused time (``ratio``)."""

    correct: bool
    ratio: float | None = None
    fused_s: float | None = None
    inductor_s: float | None = None
    problem: str = ""  # what differed from eager, when not correct

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Measurement:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})


class StepTimer(Protocol):
    """Seconds one call of ``step`` takes (``arm`` is "fused" or "inductor"); tests inject a fake clock."""

    def __call__(
        self, step: Callable[[], None], *, arm: str, signature: BlockSignature, device: torch.device
    ) -> float: ...


class MedianTimer:
    """The median over ``repeats`` timed runs of ``steps`` calls each, after ``warmup`` calls; CUDA events on
    a GPU (the host clock would measure the launch queue, not the kernels)."""

    def __init__(self, warmup: int = 3, repeats: int = 7, steps: int = 3) -> None:
        if min(warmup, repeats, steps) < 1:
            raise ValueError(f"MedianTimer needs positive counts, got {warmup=}, {repeats=}, {steps=}")
        self.warmup, self.repeats, self.steps = warmup, repeats, steps

    def __call__(
        self, step: Callable[[], None], *, arm: str, signature: BlockSignature, device: torch.device
    ) -> float:
        for _ in range(self.warmup):
            step()
        samples = []
        for _ in range(self.repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(self.steps):
                    step()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3 / self.steps)
            else:
                begin = time.perf_counter()
                for _ in range(self.steps):
                    step()
                samples.append((time.perf_counter() - begin) / self.steps)
        return statistics.median(samples)


Compile = Callable[[Callable[..., Any]], Callable[..., Any]]


def measure_block(
    rep: Replacement,
    nested: Sequence[Replacement],
    inputs: InputSpec,
    signature: BlockSignature,
    *,
    training: bool,
    compile_fn: Compile,
    timer: StepTimer,
    seed: int = 0,
) -> Measurement:
    """Check the rewritten ``rep.module`` against eager in both modes, then time it against Inductor alone
    in the mode given by ``training`` (forward+backward in train mode, forward in eval mode)."""
    block = rep.module
    assert block is not None
    fused_base = _copy_without(block, nested)
    plain_base = _copy_without(block, [rep, *nested])
    device = next((torch.device(t.device) for t in inputs if isinstance(t, TensorSpec)), torch.device("cpu"))

    fused = _in_mode(copy.deepcopy(fused_base), training)
    fused_call = compile_fn(_fresh_caller())
    reduction = _longest_reduction(inputs)
    problem = _compare(
        _run(fused_call, fused, inputs, training, seed),
        _run(_call_module, _in_mode(copy.deepcopy(plain_base), training), inputs, training, seed, True),
        signature,
        reduction,
    )
    if problem is None:  # the other mode, eagerly: our ops are opaque to Inductor, so numerics are the same
        problem = _compare(
            _run(_call_module, _in_mode(copy.deepcopy(fused_base), not training), inputs, True, seed),
            _run(_call_module, _in_mode(copy.deepcopy(plain_base), not training), inputs, True, seed, True),
            signature,
            reduction,
        )
        if problem is not None:
            problem = f"{'eval' if training else 'train'} mode: {problem}"
    if problem is not None:
        return Measurement(correct=False, problem=problem)

    plain = _in_mode(copy.deepcopy(plain_base), training)
    plain_call = compile_fn(_fresh_caller())
    fused_step = _step(fused_call, fused, inputs, training, seed)
    fused_s = timer(fused_step, arm="fused", signature=signature, device=device)
    plain_step = _step(plain_call, plain, inputs, training, seed)
    inductor_s = timer(plain_step, arm="inductor", signature=signature, device=device)
    return Measurement(correct=True, ratio=inductor_s / fused_s, fused_s=fused_s, inductor_s=inductor_s)


# ---------------------------------------------------------------------------------------------------------
# Copies and calls


def _copy_without(block: nn.Module, rewrites: Sequence[Replacement]) -> nn.Module:
    """A deep copy of ``block`` with ``rewrites`` (its own, or ones nested in it) undone in the copy."""
    memo: dict[int, Any] = {}
    clone = copy.deepcopy(block, memo)
    for rep in rewrites:
        target = memo.get(id(rep.module))
        if target is not None:
            undo_substitutions(clone, SubstitutionReport([dataclasses.replace(rep, module=target)]))
    return clone


def _in_mode(module: nn.Module, training: bool) -> nn.Module:
    return module.train(training)


def _call_module(module: nn.Module, *args: Any) -> Any:
    return module(*args)


def _fresh_caller() -> Callable[..., Any]:
    """``_call_module`` with a code object of its own. Dynamo caches compiled code per code object and gives
    up after ``recompile_limit`` (8) entries; compiling every block through one shared function (or through
    ``torch.compile(module)``, which shares ``Module._call_impl``) would silently run later blocks eagerly."""
    fn = _call_module
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__)


def _make_inputs(inputs: InputSpec, seed: int, backward: bool, dtype: torch.dtype | None = None) -> list[Any]:
    """The block's arguments, drawn from ``seed``; floating ones cast to ``dtype`` after drawing, if given."""
    tensors = [t for t in inputs if isinstance(t, TensorSpec)]
    generator = torch.Generator(device=tensors[0].device if tensors else "cpu").manual_seed(seed)
    made = []
    for spec in inputs:
        if isinstance(spec, TensorSpec):
            value = spec.make(generator)
            if dtype is not None and value.dtype.is_floating_point:
                value = value.to(dtype)
            wants_grad = backward and spec.requires_grad and spec.dtype.is_floating_point
            made.append(value.requires_grad_(wants_grad))
        else:
            made.append(spec)
    return made


def _grad_outputs(
    outputs: list[torch.Tensor], seed: int, drawn: torch.dtype | None = None
) -> list[torch.Tensor]:
    """Random output gradients, drawn in ``drawn`` (default: each output's dtype), cast to the output's."""
    grads = []
    for i, out in enumerate(outputs):
        generator = torch.Generator(device=out.device).manual_seed(seed + 1 + i)
        g = torch.randn(out.shape, generator=generator, device=out.device, dtype=drawn or out.dtype)
        grads.append(g.to(out.dtype))
    return grads


def _differentiable(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.requires_grad]


def _run(
    call: Callable[..., Any],
    module: nn.Module,
    inputs: InputSpec,
    backward: bool,
    seed: int,
    reference: bool = False,
) -> dict[str, torch.Tensor]:
    """Outputs, gradients (input and parameters) and buffers of one call, by name.

    ``reference``: the eager side of the check. An fp32 block on the CPU then runs in float64 on the same
    draws, and its results are rounded back to fp32: the reference is exact to fp32, whatever the CPU's
    vector width (oneDNN capped at AVX2 returned a wrong fp32 weight gradient for a strided 1x1 conv on a
    channels_last input, which made correct fused blocks look wrong)."""
    upcast = reference and _upcasts(module, inputs)
    if upcast:
        module = module.double()
    args = _make_inputs(inputs, seed, backward, torch.float64 if upcast else None)
    with torch.set_grad_enabled(backward):
        output = call(module, *args)
    leaves = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
    result = {f"output {i}": t.detach() for i, t in enumerate(leaves)}
    if backward:
        outs = _differentiable(output)
        if outs:
            torch.autograd.backward(outs, _grad_outputs(outs, seed, torch.float32 if upcast else None))
        for i, arg in enumerate(args):
            if isinstance(arg, torch.Tensor) and arg.grad is not None:
                result[f"gradient of input {i}"] = arg.grad
        for name, param in module.named_parameters():
            if param.grad is not None:
                result[f"gradient of {name}"] = param.grad
    for name, buffer in module.named_buffers():
        result[f"buffer {name}"] = buffer.detach()
    if upcast:
        result = {k: v.float() if v.dtype == torch.float64 else v for k, v in result.items()}
    return result


def _upcasts(module: nn.Module, inputs: InputSpec) -> bool:
    """Whether the eager reference runs in float64: an fp32 block on the CPU, outside autocast."""
    tensors = [t for t in inputs if isinstance(t, TensorSpec) and t.dtype.is_floating_point]
    floats = [t.dtype for t in (*module.parameters(), *module.buffers()) if t.dtype.is_floating_point]
    floats += [t.dtype for t in tensors]
    on_cpu = all(torch.device(t.device).type == "cpu" for t in tensors)
    autocast = torch.is_autocast_enabled("cpu")
    return on_cpu and not autocast and bool(floats) and all(d == torch.float32 for d in floats)


def _step(
    call: Callable[..., Any], module: nn.Module, inputs: InputSpec, backward: bool, seed: int
) -> Callable[[], None]:
    """One training (forward+backward) or inference (forward) call of ``module``, on fixed inputs."""
    args = _make_inputs(inputs, seed, backward)
    params = [p for p in module.parameters() if p.requires_grad]
    if not backward:

        def infer() -> None:
            with torch.no_grad():
                call(module, *args)

        return infer
    outs = _differentiable(call(module, *args))  # also the shapes of the output gradients
    grads = _grad_outputs(outs, seed)
    del outs

    def train() -> None:
        for p in params:
            p.grad = None
        outs = _differentiable(call(module, *args))
        if outs:
            torch.autograd.backward(outs, grads)

    return train


# ---------------------------------------------------------------------------------------------------------
# Comparing with eager


def _compare(
    fused: dict[str, torch.Tensor],
    eager: dict[str, torch.Tensor],
    signature: BlockSignature,
    reduction: int = 1,
) -> str | None:
    """The first quantity where the fused block differs from eager beyond tolerance, or None.

    The tolerance is the larger of the table's for the family and dtype and the one that grows with the
    block's longest sum, ``reduction`` terms (:func:`lcv_kernels.tolerances.reduction_tolerance`)."""
    family = "conv" if "conv" in signature.kind else "norm"
    dtype = _tolerance_dtype(signature, next(iter(eager.values())).device)
    by_length = reduction_tolerance(dtype, reduction)
    missing = sorted(set(fused) ^ set(eager))
    if missing:
        return f"{missing[0]} exists on one side only"
    for name, expected in eager.items():
        actual = fused[name]
        if actual.shape != expected.shape or actual.dtype != expected.dtype:
            got, want = (tuple(actual.shape), actual.dtype), (tuple(expected.shape), expected.dtype)
            return f"{name} is {got}, eager gives {want}"
        if expected.numel() == 0:
            continue
        table = tolerance(f"{family}_grad" if name.startswith("gradient") else family, dtype)
        atol, rtol = max(table[0], by_length[0]), max(table[1], by_length[1])
        a, e = actual.double(), expected.double()
        if not torch.isfinite(a).all() and torch.isfinite(e).all():
            return f"{name} is not finite"
        error = float((a - e).abs().nan_to_num(0.0).max())
        bound = atol + rtol * float(e.abs().nan_to_num(0.0).max())
        if error > bound:
            return f"{name} differs by {error:.3g} (tolerance {bound:.3g})"
    return None


def _longest_reduction(inputs: InputSpec) -> int:
    """The longest sum in a conv or norm block's forward and backward: over batch and space (N*H*W, a
    weight gradient or BatchNorm's statistics) for the largest input; the forward's C*R*S is shorter in the
    blocks we rewrite."""
    shapes = [t.shape for t in inputs if isinstance(t, TensorSpec) and len(t.shape) >= 2]
    return max((math.prod(s) // s[1] for s in shapes if s[1]), default=1) or 1


def _tolerance_dtype(signature: BlockSignature, device: torch.device) -> torch.dtype:
    """The dtype whose row of the tolerance table applies. fp32 convolutions on a GPU run in TF32 by default
    (``torch.backends.cudnn.allow_tf32``, which our kernels follow): 10-bit products, like fp16."""
    dtype = getattr(torch, signature.dtype, torch.float32)
    if dtype not in (torch.float16, torch.bfloat16):
        dtype = torch.float32
    tf32 = device.type == "cuda" and "conv" in signature.kind and torch.backends.cudnn.allow_tf32
    if dtype == torch.float32 and tf32:
        return torch.float16
    return dtype
