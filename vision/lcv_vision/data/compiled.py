"""Running a run of a pipeline's ops as one ``torch.compile`` graph.

The parameters are drawn and turned into tables on the CPU before (see :mod:`lcv_vision.data.ops`); what is
compiled is the ops' ``apply`` chain, from the uint8 batch (or the store and the batch's indices) to the
output in its final dtype and memory format.  Inductor fuses it into a few loops that read the uint8 pixels
once and write the output once, where the eager ops materialise a float copy of the batch per op.

One compile per pipeline and input/output size: the batch dimension of every input is marked dynamic
(a batch of one runs eagerly: PyTorch specialises sizes 0 and 1), and so are the height and width of a
ragged canvas, whose size changes from batch to batch.
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch
from torch import Tensor

from lcv_kernels.cpp_extension_notice import quiet_cpp_extension_notice
from lcv_vision.data.ops import BatchOp, Params

quiet_cpp_extension_notice()  # the C++ wrapper's first build logs a CUDA notice that concerns no CPU graph

#: The torch.compile backend (tests put a failing one here to check the eager fallback).
BACKEND: str | Callable[..., Any] = "inductor"
_ids = itertools.count()

RunOps = Callable[..., tuple[Tensor, Tensor | None]]


class _GatheringOp(Protocol):
    """An op with ``fuses_gather``: its ``apply`` picks the batch's rows (``index``) out of a larger store."""

    def apply(self, images: Tensor, params: Params, index: Tensor | None = None) -> Tensor: ...


def ops_runner(ops: Sequence[BatchOp], finish: Callable[[Tensor], Tensor] | None) -> RunOps:
    """``run(x, params, index, targets, out=None) -> (x, targets)``: the ops' ``apply`` in order; the first
    gets ``index`` (the batch's rows of a store) when given; ``finish`` converts the last op's output, which
    is written into ``out`` when given (compiled, the last kernel stores straight into it)."""

    def run(
        x: Any, params: list[Params], index: Tensor | None, targets: Tensor | None, out: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        for i, (op, p) in enumerate(zip(ops, params)):
            gathers = i == 0 and index is not None  # index goes only to a first op that fuses_gather
            if out is not None and i == len(ops) - 1 and not gathers and not op.mixes_targets:
                if op.apply_into(x, p, out):
                    return out, targets  # the op stored its output in ``out`` itself (no copy)
            if gathers:
                x = cast(_GatheringOp, op).apply(x, p, index=index)
            else:
                x = op.apply(x, p)
            if targets is not None and op.mixes_targets:
                targets = op.apply_targets(targets, p)
        if finish is not None:
            x = finish(x)
        if out is not None:
            out.copy_(x)
            x = out
        return x, targets

    return run


def _own_code(fn: Callable, name: str) -> Callable:
    """``fn`` with a code object of its own.

    Dynamo keeps its compiled graphs per code object, with a limit of 8: every pipeline's runner shares the
    code of ``ops_runner.run``, so without this a process with more than 8 pipelines (or sizes) would
    silently run the rest uncompiled.
    """
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


#: Inductor options for graphs that run on the CPU.  Inductor's C++ wrapper releases the GIL while its
#: kernels run; with the default Python wrapper a kernel holds it, and the pipeline's worker threads (see
#: ``Pipeline._map_rows``) took turns: a 2-thread pool augmented no faster than one thread.
CPU_OPTIONS: dict[str, Any] = {"cpp_wrapper": True}


class CompiledOps:
    """A :func:`ops_runner` compiled on its first call, with the batch dimension dynamic."""

    def __init__(self, run: RunOps, device: torch.device | None = None):
        name = f"vision_data_pipeline_{next(_ids)}"
        options = (
            dict(CPU_OPTIONS)
            if BACKEND == "inductor" and device is not None and device.type == "cpu"
            else None
        )
        self._compiled = torch.compile(
            _own_code(run, name), backend=BACKEND, dynamic=False, fullgraph=True, options=options
        )

    def __call__(
        self,
        x: Tensor,
        params: list[Params],
        index: Tensor | None,
        targets: Tensor | None,
        ragged: bool,
        out: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        if out is not None:
            torch._dynamo.mark_dynamic(out, 0)
        for p in params:
            for t in p.values():
                if t.ndim:
                    torch._dynamo.mark_dynamic(t, 0)
        if index is not None:
            torch._dynamo.mark_dynamic(index, 0)
        else:
            torch._dynamo.mark_dynamic(x, 0)
            if ragged:  # the canvas is as large as the batch's largest image
                torch._dynamo.maybe_mark_dynamic(x, 2)
                torch._dynamo.maybe_mark_dynamic(x, 3)
        if targets is not None:
            torch._dynamo.mark_dynamic(targets, 0)
        images, labels = self._compiled(x, params, index, targets, out)
        return _static_for_the_model(images), None if labels is None else _static_for_the_model(labels)


#: What dynamo reads on a tensor to compile its dims as dynamic: our own marks (``mark_dynamic`` sets the
#: indices, ``_specialize_on`` and the ``_has_dynamo_dim_marking`` flag) and the ones torch >= 2.14 stamps on
#: every output of a dynamic-shape graph, for the next compiled graph to read. All of them go: the flag left
#: without the indices fails dynamo's guard check on the very graph compiled from the tensor.
_DYNAMIC_MARKS = (
    "_dynamo_dynamic_indices",
    "_dynamo_dynamic_range",
    "_dynamo_hint_overrides",
    "_dynamo_weak_dynamic_indices",
    "_dynamo_propagated_dynamic_indices",
    "_dynamo_unbacked_indices",
    "_dynamo_strict_unbacked_indices",
    "_dynamo_unbacked_bounds",
    "_dynamo_shape_ids",
    "_specialize_on",
    "_has_dynamo_dim_marking",
)


def _static_for_the_model(t: Tensor) -> Tensor:
    """``t`` without dynamo's dynamic-dimension marks. The pipeline's graph has a dynamic batch (one compile
    for every batch size), and its marks would otherwise make any model compiled on its batches dynamic in the
    batch too, from the first compile: on a 2-core CPU ``digits-small``'s compiled kernels took 16% longer
    with a symbolic batch (5.2 against 4.4 ms a step). A model's batch turns dynamic when it changes."""
    for mark in _DYNAMIC_MARKS:
        if mark in t.__dict__:
            delattr(t, mark)
    return t
