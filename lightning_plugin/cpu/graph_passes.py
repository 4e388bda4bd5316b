"""What the strategy changes in Inductor's graphs for CPU training, where torch's defaults lose to eager.

**Max-pool backward over non-overlapping windows in channels_last** (a decomposition). torch 2.14 decomposes
``max_pool2d_with_indices_backward`` into a ``scatter_add`` over an NCHW-flattened zero buffer and then
converts the result to the input's memory format. For a channels_last model that is three passes through
NCHW order: the indices are transposed to NCHW, the gradient is scattered there (``aten.scatter_reduce_``,
an extern call Inductor cannot fuse) and transposed back, and the BatchNorm/GELU backward that feeds it is
dragged into NCHW buffers as well. When windows do not overlap (stride = kernel size, no padding or
dilation: airbench's and VGG's ``MaxPool2d(2)``) every input position belongs to at most one window, so the
gradient is a gather, not a scatter: ``grad_input[h, w] = grad_output[h // k, w // k]`` where that window's
saved index is ``h·W + w``, else 0. One pointwise kernel in the input's own layout, and exactly the
scatter's values (each position receives one value or none: no sums). Other pools, and NCHW inputs (there
the scatter is faster: the gather's index along the contiguous W axis is ``w // k``, which does not
vectorise), keep torch's decomposition. In the forward the same pools' values are realised once: Inductor
otherwise inlined the max into both the BatchNorm statistics pass and the normalisation pass after it, so
each read the 4x larger conv output (``digits-small``'s first BatchNorm kernel: 1.57 -> 1.15 ms). The
indices the backward compares against are computed from the pool's 1-byte window offsets by vectorised
shifts and masks; torch's own conversion is a lowering that Inductor evaluates one element at a time
(``digits-small``'s first pool backward kernel: 1.18 -> 0.87 ms).

**A bias-only conv backward is a sum** (a decomposition). A conv whose weight is frozen and whose input
needs no gradient (airbench's whitening layer, whose bias trains) still went to an extern
``convolution_backward`` for its bias gradient: 0.9 ms for a 64x24x31x31 gradient on the test CPU, eager
too. As ``grad_output.sum((0, 2, 3))`` Inductor fuses it into the kernel that makes ``grad_output`` (+0.3 ms
there).

**A bias gradient through the next conv without its input gradient** (a joint-graph pass). The whitening
bias's gradient is ``Σ dx·t`` per channel, where ``dx`` is the next conv's input gradient and ``t`` GELU's
derivative; nothing else uses ``dx``. Since ``dx`` is the transpose of the conv applied to ``dy``, the same
sum is ``Σ W ⊙ ∂⟨conv(t, W), dy⟩/∂W``: a second *weight* gradient, with ``t`` in place of the input. On
``digits-small``'s first conv (24 -> 32 channels, 31x31) the input gradient took 3.2 ms against 2.4 ms for
a weight gradient, and the elementwise reduction over ``dx`` another 0.6 ms; the step is 1.7 ms shorter.

**A wide conv's weight gradient on a tiny map is a matrix product** (a decomposition). ResNet-18's last stage
at 64 px runs 512-channel 3x3 convs on 2x2 maps, where oneDNN's weight gradient ran at a third of its
forward's speed (6.1 ms against 2.3 ms as ``unfold`` + ``mm``, batch 32): on at most
:data:`MATMUL_WEIGHT_GRADIENT_MAX_POSITIONS` output positions with at least
:data:`MATMUL_WEIGHT_GRADIENT_MIN_TAPS` input channels x taps it is one GEMM of the unfolded input with
``grad_output``; input and bias gradients as before (torchvision resnet18, plain step: 1.10x -> 1.21x eager).

**GELU's erf is saved, not recomputed** (a joint-graph pass). Inductor's partitioner recomputes cheap
pointwise ops in the backward rather than saving them; GELU's ``erf`` is not cheap on a CPU (a division and
an exponential per element), and the decomposed forward and backward each compute their own
``erf(x/√2)``, so a compiled step evaluated it three times per GELU where eager does twice. The pass merges
the two identical ``erf`` nodes and marks the one left ``MUST_SAVE``: the forward stores it (one more
activation-sized buffer per GELU), the backward reads it. Same values, bitwise.

Measured on ``digits-small``'s network (airbench 32/64/64, 64 images of 32 px, fwd+bwd+SGD, 2-core x86
CPU with AVX-512, Inductor caches off, both ways in one process, median of 5-7): compiled vs eager 0.91x
with torch's defaults, 0.97x with the pool backward, 1.04x with the saved erf too, 1.08x with the realised
pool forward as well; then (another day of the machine, eager 25-26 ms) 1.02-1.04x before and 1.09-1.10x
after the bias gradient without the input gradient; the vectorised pool indices took 0.45 ms more off the
kernels' time.

Inductor's AOTAutograd cache key leaves the decomposition table out, so :class:`CPUTrainingGraphPass`
(installed as ``joint_custom_pre_pass``) carries a hash of this file as its ``uuid``: graphs compiled with
these changes never share cache entries with graphs compiled without them.
"""

from __future__ import annotations

import functools
import hashlib
import operator
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import CustomGraphPass

__all__ = [
    "CPUTrainingGraphPass",
    "bias_gradient_without_input_gradient",
    "graph_pass_options",
    "max_pool2d_backward_gather",
    "save_erf",
    "source_hash",
    "training_decompositions",
]

aten = torch.ops.aten


def _pair(value: Any, default: tuple[int, int]) -> tuple[int, int]:
    """An int or a 1- or 2-element list as ``(h, w)``; empty or None gives ``default``."""
    if value is None or (isinstance(value, (list, tuple)) and len(value) == 0):
        return default
    if isinstance(value, int):
        return (value, value)
    items = [int(v) for v in value]
    return (items[0], items[0]) if len(items) == 1 else (items[0], items[1])


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` realised in its own memory format: its consumers then read it from one buffer instead of each
    recomputing it (a pool window's max before BatchNorm's two passes; the BatchNorm/GELU backward before
    the gather, which would otherwise run once per input position)."""
    force = getattr(torch.ops.prims, "inductor_force_stride_order", None)
    if force is None:  # an older torch: correct without it, only slower
        return t
    memory_format = torch._prims_common.suggest_memory_format(t)
    return force(t, torch.empty_like(t, memory_format=memory_format).stride())


def _tiles_channels_last(x: torch.Tensor, kernel_size: Any, stride: Any, padding: Any, dilation: Any) -> bool:
    """A max-pool whose windows tile a channels_last floating-point input (stride = kernel size, no padding,
    no dilation): where the changes below apply."""
    kernel = _pair(kernel_size, (1, 1))
    tiles = _pair(stride, kernel) == kernel and _pair(padding, (0, 0)) == (0, 0)
    tiles = tiles and _pair(dilation, (1, 1)) == (1, 1)
    channels_last = x.dim() == 4 and torch._prims_common.suggest_memory_format(x) == torch.channels_last
    return tiles and channels_last and x.is_floating_point()


def max_pool2d_forward_realized(
    x: torch.Tensor,
    kernel_size: list[int],
    stride: list[int] | tuple[()] = (),
    padding: int | list[int] = 0,
    dilation: int | list[int] = 1,
    ceil_mode: bool = False,
) -> Any:
    """torch's decomposition of ``aten.max_pool2d_with_indices`` with its values realised, for tiling
    windows of a channels_last input; ``NotImplemented`` (torch's decomposition as is) otherwise."""
    if not _tiles_channels_last(x, kernel_size, stride, padding, dilation):
        return NotImplemented
    kernel = _pair(kernel_size, (1, 1))
    with_offsets = getattr(torch.ops.prims, "_low_memory_max_pool_with_offsets", None)
    from torch._inductor import lowering

    falls_back = getattr(lowering, "should_fallback_max_pool_with_indices", None)
    if with_offsets is None or falls_back is None or falls_back(list(kernel), n_dim=2):
        return NotImplemented  # torch's decomposition (or its fallback) as is; an older torch: unchanged
    values, offsets = with_offsets(x, list(kernel), list(kernel), [0, 0], [1, 1], ceil_mode)
    return _dense(values), _window_offsets_to_indices(offsets, kernel, x.shape[-1])


def _window_offsets_to_indices(offsets: torch.Tensor, kernel: tuple[int, int], width: int) -> torch.Tensor:
    """Flat input indices (``h·W + w``) of tiling windows' maxima from their offsets within the window
    (``dh·kw + dw``, int8), as pointwise arithmetic that Inductor vectorises (torch's conversion is a lowering
    it evaluates one element at a time). Inductor saves the 1-byte offsets for the backward and converts them
    there, once per window: inlined into the gather, once per input position, it cost more than it saved."""
    kh, kw = kernel
    offset = offsets.to(torch.int64)
    if kw & (kw - 1) == 0:  # a power of two, 2 above all: shifts and masks vectorise, division does not
        shift = kw.bit_length() - 1
        row, col = offset >> shift, offset & (kw - 1)
    else:
        row = torch.div(offset, kw, rounding_mode="floor")
        col = offset - row * kw
    ho, wo = offsets.shape[-2:]
    top = (torch.arange(ho, device=offsets.device) * kh).view(-1, 1)
    left = (torch.arange(wo, device=offsets.device) * kw).view(1, -1)
    return (top + row) * width + left + col


def max_pool2d_backward_gather(
    grad_output: torch.Tensor,
    x: torch.Tensor,
    kernel_size: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    ceil_mode: bool,
    indices: torch.Tensor,
) -> Any:
    """``aten.max_pool2d_with_indices_backward`` as a gather for non-overlapping windows of a channels_last
    input; ``NotImplemented`` (torch's decomposition) for everything else."""
    if not _tiles_channels_last(x, kernel_size, stride, padding, dilation):
        return NotImplemented  # the table's own entry
    kh, kw = _pair(kernel_size, (1, 1))
    n, c, h, w = x.shape
    ho, wo = grad_output.shape[-2:]
    covered_h, covered_w = min(h, ho * kh), min(w, wo * kw)

    def per_input_position(t: torch.Tensor) -> torch.Tensor:
        """A window's value at each input position it covers (the last window of ceil_mode cropped)."""
        tiled = t[:, :, :, None, :, None].expand(n, c, ho, kh, wo, kw).reshape(n, c, ho * kh, wo * kw)
        return tiled[:, :, :covered_h, :covered_w]

    grad, argmax = per_input_position(_dense(grad_output)), per_input_position(_dense(indices))
    rows = torch.arange(covered_h, device=x.device).view(-1, 1)
    cols = torch.arange(covered_w, device=x.device).view(1, -1)
    grad_input = torch.where(argmax == rows * w + cols, grad, 0)
    if covered_h < h or covered_w < w:  # positions no window covers (floor mode) get no gradient
        grad_input = torch.constant_pad_nd(grad_input, (0, w - covered_w, 0, h - covered_h), 0.0)
    return grad_input.contiguous(memory_format=torch.channels_last)


def convolution_backward_bias_only(
    grad_output: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias_sizes: Any,
    stride: Any,
    padding: Any,
    dilation: Any,
    transposed: bool,
    output_padding: Any,
    groups: int,
    output_mask: list[bool],
) -> Any:
    """``aten.convolution_backward`` when only the bias gradient is wanted (a frozen conv on an input that
    needs no gradient: airbench's whitening layer) as the sum it is, over every dim but the channels, which
    Inductor fuses into the kernel that makes ``grad_output``; ``NotImplemented`` (torch's entry)
    otherwise."""
    if list(output_mask) != [False, False, True] or grad_output.dtype not in (torch.float32, torch.float64):
        return NotImplemented
    return None, None, _bias_gradient(grad_output)


def _bias_gradient(grad_output: torch.Tensor) -> torch.Tensor:
    """A conv's bias gradient: ``grad_output`` summed over every dim but the channels."""
    return grad_output.sum([0, *range(2, grad_output.dim())])


#: A weight gradient goes to a matrix product when the conv's output has at most this many positions...
MATMUL_WEIGHT_GRADIENT_MAX_POSITIONS = 4
#: ...and each output value sums at least this many products (input channels x kernel taps).
MATMUL_WEIGHT_GRADIENT_MIN_TAPS = 4096


def convolution_backward_weight_as_matmul(
    grad_output: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias_sizes: Any,
    stride: Any,
    padding: Any,
    dilation: Any,
    transposed: bool,
    output_padding: Any,
    groups: int,
    output_mask: list[bool],
) -> Any:
    """The weight gradient of a wide conv on a tiny map (ResNet's last stage: 512 channels, 3x3, a 2x2 map at
    64 px) as one matrix product of the unfolded input with ``grad_output``, the rest as before. oneDNN's
    weight gradient is slow there: on the 2-core test CPU, batch 32, 512 -> 512 channels on 2x2 took 6.1 ms
    against 2.3 ms as ``unfold`` + ``mm`` (``benchmarks/conv_weight_gradient.py``: 1.75-2.58x for 512
    channels on 1-4 positions, batch 32-128; slower from 16 positions or at 64-128 channels, so those keep
    oneDNN). ``NotImplemented`` (oneDNN) otherwise."""
    if not output_mask[1] or transposed or groups != 1 or x.dim() != 4 or weight.dim() != 4:
        return NotImplemented
    if x.dtype not in (torch.float32, torch.float64):
        return NotImplemented
    co, ci, kh, kw = weight.shape
    n, (ho, wo) = x.shape[0], grad_output.shape[-2:]
    if ho * wo > MATMUL_WEIGHT_GRADIENT_MAX_POSITIONS or ci * kh * kw < MATMUL_WEIGHT_GRADIENT_MIN_TAPS:
        return NotImplemented
    columns = F.unfold(
        x,
        (kh, kw),
        dilation=_pair(dilation, (1, 1)),
        padding=_pair(padding, (0, 0)),
        stride=_pair(stride, (1, 1)),
    )  # (n, ci*kh*kw, ho*wo)
    rows = grad_output.reshape(n, co, ho * wo).permute(1, 0, 2).reshape(co, n * ho * wo)
    grad_weight = torch.mm(rows, columns.permute(0, 2, 1).reshape(n * ho * wo, ci * kh * kw))
    grad_weight = grad_weight.view(co, ci, kh, kw).contiguous(
        memory_format=torch._prims_common.suggest_memory_format(weight)
    )
    grad_input = None
    if output_mask[0]:
        grad_input = aten.convolution_backward.default(
            grad_output,
            x,
            weight,
            None,
            stride,
            padding,
            dilation,
            transposed,
            output_padding,
            groups,
            [True, False, False],
        )[0]
    grad_bias = _bias_gradient(grad_output) if output_mask[2] else None
    return grad_input, grad_weight, grad_bias


def convolution_backward_on_cpu(*args: Any) -> Any:
    """``aten.convolution_backward``: :func:`convolution_backward_bias_only`, else
    :func:`convolution_backward_weight_as_matmul`, else ``NotImplemented`` (oneDNN)."""
    result = convolution_backward_bias_only(*args)
    return convolution_backward_weight_as_matmul(*args) if result is NotImplemented else result


#: Our replacements, by the op they decompose; where one returns ``NotImplemented``, the table's own entry
#: runs.
REPLACEMENTS: dict[Any, Callable[..., Any]] = {
    aten.max_pool2d_with_indices.default: max_pool2d_forward_realized,
    aten.max_pool2d_with_indices_backward.default: max_pool2d_backward_gather,
    aten.convolution_backward.default: convolution_backward_on_cpu,
}


class _DecompositionTable(dict[Any, Callable[..., Any]]):
    """The table, pickled as a call of :func:`training_decompositions`: Inductor pickles the table it is
    given into its cache key, and some of torch's entries are C++ functions that do not pickle, which made
    Inductor bypass its caches for every graph compiled with it."""

    def __reduce__(self) -> tuple[Callable[[], _DecompositionTable], tuple[()]]:
        return (training_decompositions, ())


def _inductor_table() -> dict[Any, Callable[..., Any]]:
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


@functools.cache
def training_decompositions() -> _DecompositionTable:
    """Inductor's decomposition table with :data:`REPLACEMENTS` tried first for their ops."""
    table = _DecompositionTable(_inductor_table())
    for op, ours in REPLACEMENTS.items():
        table[op] = _before(ours, table.get(op))
    return table


def _before(ours: Callable[..., Any], theirs: Callable[..., Any] | None) -> Callable[..., Any]:
    """``ours``, falling back to the table's ``theirs`` where it returns ``NotImplemented``."""
    if theirs is None:
        return ours

    @functools.wraps(ours)
    def decompose(*args: Any, **kwargs: Any) -> Any:
        result = ours(*args, **kwargs)
        return theirs(*args, **kwargs) if result is NotImplemented else result

    return decompose


def save_erf(graph: torch.fx.Graph) -> int:
    """Merge the ``erf`` nodes of a joint graph that compute the same thing and mark each one left
    ``MUST_SAVE`` for the partitioner, unless activation checkpointing already gave it a policy; returns how
    many were marked."""
    from torch.utils.checkpoint import CheckpointPolicy

    first: dict[Any, torch.fx.Node] = {}
    marked = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.erf.default:
            continue
        key = _computation_key(node.args[0])
        if key is not None and key in first:  # later in topological order: reuse the earlier one
            node.replace_all_uses_with(first[key])
            graph.erase_node(node)
            continue
        if key is not None:
            first[key] = node
        if "recompute" in node.meta:  # inside activation checkpointing: the user's policy decides
            continue
        node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        marked += 1
    return marked


def _computation_key(value: Any) -> Any:
    """What identifies the input of an ``erf`` (GELU's ``x * 0.7071...``): its op and arguments, or the
    node itself; None for a constant."""
    if not isinstance(value, torch.fx.Node):
        return None
    if value.op == "call_function":
        return (value.target, _hashable(value.args), _hashable(sorted(value.kwargs.items())))
    return value


def _hashable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    return value


def bias_gradient_without_input_gradient(graph: torch.fx.Graph) -> int:
    """Where a conv's input gradient ``dx`` is used only as ``(dx * t).sum(every dim but the channels)`` (the
    bias gradient of the layer before: airbench's whitening conv, whose bias trains and whose weight and
    input do not), compute that sum from a weight gradient instead: for every channel ``c``,
    ``Σ dx[:, c]·t[:, c] = Σ W[:, c] ⊙ (∂/∂W of ⟨conv(t, W), dy⟩)[:, c]``, since the input gradient is the
    transpose of the linear map ``x ↦ conv(x, W)``. The conv's backward then skips its input gradient
    (the costlier half on narrow inputs) and the elementwise reduction over it. Returns how many were
    rewritten."""
    rewritten = 0
    for node in list(graph.nodes):
        match = _reduced_input_gradient(node)
        if match is None:
            continue
        input_gradient, product, reduction, t = match
        grad_output, _, weight, _, stride, padding, dilation, _, output_padding, groups, mask = node.args
        with graph.inserting_before(reduction):
            weight_gradients = _call(
                graph,
                aten.convolution_backward.default,
                grad_output,
                t,
                weight,
                None,
                stride,
                padding,
                dilation,
                False,
                output_padding,
                groups,
                [False, True, False],
            )
            weight_gradient = _call(graph, operator.getitem, weight_gradients, 1)
            weighted = _call(graph, aten.mul.Tensor, weight_gradient, weight)
            dims = [0, *range(2, weight.meta["val"].dim())]  # all but the input channels
            bias_gradient = _call(graph, aten.sum.dim_IntList, weighted, dims)
        reduction.replace_all_uses_with(bias_gradient)
        for dead in (reduction, product, input_gradient):
            graph.erase_node(dead)
        if all(not user.users for user in node.users):  # nothing else of it is used (or nothing at all)
            for user in list(node.users):
                graph.erase_node(user)
            graph.erase_node(node)
        else:
            node.update_arg(10, [False, *mask[1:]])
            values = node.meta.get("val")
            if isinstance(values, (tuple, list)):
                node.meta["val"] = (None, *values[1:])
        rewritten += 1
    return rewritten


def _reduced_input_gradient(node: torch.fx.Node) -> tuple[torch.fx.Node, ...] | None:
    """``(dx, dx * t, its channel sum, t)`` when ``node`` is a conv backward whose input gradient is used
    only that way (float32/float64, no groups, not transposed); None otherwise."""
    if node.op != "call_function" or node.target is not aten.convolution_backward.default:
        return None
    if len(node.args) != 11 or node.kwargs:
        return None
    transposed, groups, mask = node.args[7], node.args[9], node.args[10]
    if transposed or groups != 1 or not isinstance(mask, (list, tuple)) or not mask[0]:
        return None
    input_gradient = next((u for u in node.users if u.target is operator.getitem and u.args[1] == 0), None)
    if input_gradient is None or len(input_gradient.users) != 1:
        return None
    product = next(iter(input_gradient.users))
    if product.target is not aten.mul.Tensor or product.kwargs or len(product.users) != 1:
        return None
    t = product.args[1] if product.args[0] is input_gradient else product.args[0]
    if not isinstance(t, torch.fx.Node) or t is input_gradient:
        return None
    reduction = next(iter(product.users))
    if reduction.target is not aten.sum.dim_IntList or reduction.kwargs.get("dtype") is not None:
        return None
    dx, tv = input_gradient.meta.get("val"), t.meta.get("val")
    if not isinstance(dx, torch.Tensor) or not isinstance(tv, torch.Tensor) or tv.shape != dx.shape:
        return None
    grad_output, weight = node.args[0], node.args[2]
    for arg in (grad_output, weight):  # the new nodes' fake values are made from theirs
        if not isinstance(arg, torch.fx.Node) or not isinstance(arg.meta.get("val"), torch.Tensor):
            return None
    if dx.dtype not in (torch.float32, torch.float64) or tv.dtype != dx.dtype:
        return None
    keepdim = reduction.args[2] if len(reduction.args) > 2 else reduction.kwargs.get("keepdim", False)
    reduced = reduction.args[1]
    if keepdim or not isinstance(reduced, (list, tuple)):
        return None
    if {int(d) % dx.dim() for d in reduced} != set(range(dx.dim())) - {1}:  # type: ignore[arg-type]  # ints
        return None
    return input_gradient, product, reduction, t


def _call(graph: torch.fx.Graph, target: Any, *args: Any) -> torch.fx.Node:
    """A new node with its fake value (``meta["val"]``), which the partitioner and Inductor read."""
    node = graph.call_function(target, args)
    values = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in args]
    fake_mode = torch._guards.detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    if fake_mode is None:
        node.meta["val"] = target(*values)
    else:
        with fake_mode:
            node.meta["val"] = target(*values)
    return node


class CPUTrainingGraphPass(CustomGraphPass):
    """The joint-graph pass of CPU training (:func:`save_erf`, :func:`bias_gradient_without_input_gradient`);
    its ``uuid``, a hash of this file, also keys Inductor's caches to :func:`training_decompositions`."""

    def __call__(self, graph: torch.fx.graph.Graph) -> None:
        save_erf(graph)
        bias_gradient_without_input_gradient(graph)

    def uuid(self) -> str:
        return source_hash()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CPUTrainingGraphPass)

    def __hash__(self) -> int:
        return hash(source_hash())


@functools.cache
def source_hash() -> str:
    """A hash of this file and of its module path: Inductor's cached graphs pickle references to this module,
    so a cache written before a move (``lightning_plugin.cpu_graph_passes``) must not be looked up after it."""
    digest = hashlib.sha256(Path(__file__).read_bytes() + __name__.encode())
    return "lcv-cpu-training-" + digest.hexdigest()[:16]


def graph_pass_options() -> dict[str, Any]:
    """The Inductor config patch that installs :class:`CPUTrainingGraphPass` (``joint_custom_pre_pass``; a
    user's own ``options`` switch this tuning off altogether, so it never replaces theirs)."""
    return {"joint_custom_pre_pass": CPUTrainingGraphPass()}
