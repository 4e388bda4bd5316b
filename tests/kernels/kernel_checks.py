"""What every op's tests share: tolerances, inputs in each layout users hand us, vector variants, launch
counting and the fake-vs-real stride check.

Imported by the ``tests/kernels/test_<op>.py`` modules (pytest puts this folder on ``sys.path``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from lcv_kernels._common import interpreter_enabled
from lcv_kernels.tolerances import tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: The Triton kernels run (on CUDA, or in the interpreter on CPU), not the references.
TRITON_PATH = torch.cuda.is_available() or interpreter_enabled()
requires_triton_path = pytest.mark.skipif(
    not TRITON_PATH, reason="needs the Triton path (CUDA or TRITON_INTERPRET=1)"
)
requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU; none on this machine"
)


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    family: str,
    dtype: torch.dtype = torch.float32,
    scale: float = 1.0,
    msg: str = "",
) -> None:
    """Compare in float64 with the tolerance table's ``(family, dtype)`` entry, scaled by ``scale``."""
    atol, rtol = tolerance(family, dtype)
    torch.testing.assert_close(
        actual.double(), expected.double(), atol=atol * scale, rtol=rtol * scale, msg=lambda m: f"{msg}: {m}"
    )


# ---------------------------------------------------------------------------------------------------------
# Layouts


def with_strides(t: torch.Tensor, strides: Sequence[int]) -> torch.Tensor:
    """``t``'s values in a tensor with the given strides (a copy, so any valid dense stride set works)."""
    out = torch.empty_strided(t.shape, tuple(strides), dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out.requires_grad_(t.requires_grad)


def size1_restrides(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """Views of ``t`` that differ from it only in the strides of size-1 dims (what a compiled graph may hand
    an op instead of the strides it traced): same memory, same contiguity, other stride values."""
    choices = []
    for size, stride in zip(t.shape, t.stride()):
        choices.append(
            [stride] if size != 1 else sorted({stride, 1, max(t.numel(), 1), 7 * max(t.numel(), 1)})
        )
    for strides in itertools.product(*choices):
        if tuple(strides) != tuple(t.stride()):
            yield t.detach().as_strided(t.shape, strides)


LAYOUTS = {"nchw": torch.contiguous_format, "nhwc": torch.channels_last}


def in_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t.contiguous(memory_format=LAYOUTS[layout])


def vector_variants(values: torch.Tensor) -> dict[str, torch.Tensor]:
    """One per-channel vector as users pass it: contiguous, every second element of a longer tensor
    (``t[::2]``) and, for a constant vector, a stride-0 ``expand`` of one element."""
    c = values.shape[0]
    wide = torch.empty(2 * c, dtype=values.dtype, device=values.device)
    wide[::2] = values
    wide[1::2] = float("nan")  # read by a kernel that ignores the stride: the test fails loudly
    return {
        "contiguous": values.clone(),
        "strided": wide[::2],
        "expanded": values[:1].expand(c),
    }


# ---------------------------------------------------------------------------------------------------------
# Fake vs real


def assert_fake_strides_match_real(
    op: Callable[..., Any], args: Sequence[Any], real_args: Sequence[Any] | None = None
) -> None:
    """The op's fake outputs have exactly (every dim, size-1 dims included) the sizes, strides and dtypes of
    its real outputs. ``real_args`` (default ``args``) may hold other stride variants of the same tensors: the
    real run must still produce what the fake promised from ``args``, as it must in a compiled graph."""
    real_out = op(*(args if real_args is None else real_args))
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake_args = tree_map(lambda a: mode.from_tensor(a) if isinstance(a, torch.Tensor) else a, list(args))
        fake_out = op(*fake_args)
    real_flat = real_out if isinstance(real_out, (tuple, list)) else (real_out,)
    fake_flat = fake_out if isinstance(fake_out, (tuple, list)) else (fake_out,)
    assert len(real_flat) == len(fake_flat)
    for i, (r, f) in enumerate(zip(real_flat, fake_flat)):
        assert (tuple(r.shape), tuple(r.stride()), r.dtype) == (tuple(f.shape), tuple(f.stride()), f.dtype), (
            f"output {i}: real {tuple(r.shape)} {tuple(r.stride())} {r.dtype} vs "
            f"fake {tuple(f.shape)} {tuple(f.stride())} {f.dtype}"
        )


def count_calls(monkeypatch: pytest.MonkeyPatch, module: Any, *names: str) -> list[str]:
    """Record each call of ``module.<name>`` (still calling it): proves a test ran the Triton launcher."""
    calls: list[str] = []
    for name in names:
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    return calls


# ---------------------------------------------------------------------------------------------------------
# Inputs, float64 oracles and gradients (added for the normalization op tests)

#: The epilogue activations as eager PyTorch computes them (the float64 oracle).
EAGER_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "none": lambda t: t,
    "relu": torch.nn.functional.relu,
    "gelu": torch.nn.functional.gelu,
    "silu": torch.nn.functional.silu,
}
#: The activation modules ``from_module`` accepts, by epilogue name.
ACTIVATION_MODULES: dict[str, type[torch.nn.Module]] = {
    "none": torch.nn.Identity,
    "relu": torch.nn.ReLU,
    "gelu": torch.nn.GELU,
    "silu": torch.nn.SiLU,
}


def make(
    shape: Sequence[int],
    layout: str = "nchw",
    offset: float = 0.0,
    scale: float = 1.0,
    requires_grad: bool = True,
    dtype: torch.dtype = torch.float32,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``randn·scale + offset`` on :data:`DEVICE`, a leaf; 4-D tensors get the strides ``torch.empty`` gives
    in ``layout`` (so a tensor whose H=W=1 or C=1, contiguous in both orders, still gets that order's
    strides)."""
    t = torch.randn(tuple(shape), generator=generator) * scale + offset
    fmt = LAYOUTS[layout] if len(shape) == 4 else torch.contiguous_format
    out = torch.empty(tuple(shape), dtype=dtype, device=DEVICE, memory_format=fmt)
    out.copy_(t)
    return out.requires_grad_(requires_grad)


def leaves64(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Float64 leaves with the same values (None stays None): the inputs of the eager float64 oracle."""
    return [None if t is None else t.detach().double().requires_grad_() for t in tensors]


def grads_of(
    out: torch.Tensor, inputs: Sequence[torch.Tensor | None], probe: torch.Tensor
) -> list[torch.Tensor | None]:
    """``d <out, probe> / d input`` for each input that is not None (None for the others)."""
    present = [t for t in inputs if t is not None]
    it = iter(torch.autograd.grad(out, present, probe))
    return [None if t is None else next(it) for t in inputs]


def as_leaf(v: torch.Tensor | None) -> torch.Tensor | None:
    """A leaf that requires grad and keeps ``v``'s strides (``t[::2]`` stays strided, an expand stays stride
    0): how a strided or expanded per-channel parameter reaches an op."""
    return None if v is None else v.detach().requires_grad_()


# ---------------------------------------------------------------------------------------------------------
# Layouts for the fake-vs-real stride checks

#: name → (shape, layout the input is made in): NCHW, channels_last, N=1 in both, H=W=1 and C=1 (where NCHW
#: and channels_last coincide: made in each order, so both stride sets reach the op).
STRIDE_CASES: dict[str, tuple[tuple[int, int, int, int], str]] = {
    "nchw": ((2, 4, 3, 5), "nchw"),
    "nhwc": ((2, 4, 3, 5), "nhwc"),
    "n1_nchw": ((1, 4, 3, 5), "nchw"),
    "n1_nhwc": ((1, 4, 3, 5), "nhwc"),
    "hw1_nchw": ((3, 4, 1, 1), "nchw"),
    "hw1_nhwc": ((3, 4, 1, 1), "nhwc"),
    "c1_nchw": ((2, 1, 3, 5), "nchw"),
    "c1_nhwc": ((2, 1, 3, 5), "nhwc"),
}


def restrided_args(args: Sequence[Any], limit: int | None = None) -> Iterator[list[Any]]:
    """``args`` with the 4-D tensors re-strided: for each :func:`size1_restrides` variant of the first 4-D
    tensor, every 4-D tensor argument with that tensor's shape and strides gets the variant's strides (same
    memory, same values). At most ``limit`` variants, spread over the list."""
    first = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() == 4), None)
    if first is None:
        return
    variants = [v.stride() for v in size1_restrides(first)]
    if limit is not None and len(variants) > limit:
        step = len(variants) / limit
        variants = [variants[int(i * step)] for i in range(limit)]
    for strides in variants:
        yield [
            a.detach().as_strided(a.shape, strides)
            if isinstance(a, torch.Tensor) and a.shape == first.shape and a.stride() == first.stride()
            else a
            for a in args
        ]


def check_fake_vs_real(op: Callable[..., Any], args: Sequence[Any], limit: int | None = 3) -> int:
    """:func:`assert_fake_strides_match_real` with ``args``, then with each :func:`restrided_args` variant (at
    most ``limit``) as the real arguments; the first variant's real outputs must also equal those of ``args``
    (re-striding size-1 dims changes no value). Returns how many re-strided variants were checked."""
    assert_fake_strides_match_real(op, args)
    checked = 0
    for real_args in restrided_args(args, limit):
        assert_fake_strides_match_real(op, args, real_args)
        if checked == 0:
            for i, (got, want) in enumerate(zip(op(*real_args), op(*args), strict=True)):
                torch.testing.assert_close(got, want, atol=0, rtol=0, msg=lambda m, i=i: f"output {i}: {m}")
        checked += 1
    return checked


#: The differentiable inputs of every norm op, in the order of its backward op's outputs.
GRAD_NAMES = ("x", "weight", "bias", "residual")


def probe_for(x: torch.Tensor, layout: str | None = None, seed: int = 0) -> torch.Tensor:
    """A random upstream gradient in ``x``'s dtype (so its float64 copy holds the same values), with ``x``'s
    strides, or the strides ``torch.empty`` gives in ``layout``."""
    g = torch.randn(tuple(x.shape), generator=torch.Generator().manual_seed(seed))
    if layout is None:
        out = torch.empty_like(x, requires_grad=False)
    else:
        out = torch.empty(tuple(x.shape), dtype=x.dtype, device=x.device, memory_format=LAYOUTS[layout])
    return out.copy_(g)


def assert_grads_close(
    grads: Sequence[torch.Tensor | None],
    grads64: Sequence[torch.Tensor | None],
    reference_grads: Sequence[torch.Tensor | None],
    *,
    dtype: torch.dtype,
    count: int,
    grad_family: str = "norm",
) -> None:
    """Each gradient an op returned vs float64 autograd (``grad_family`` for fp32, ``"norm"`` for the half
    types, which have no gradient entry) and vs the op's backward reference (``"norm"``). dγ and dβ are sums
    over ``count`` elements, so their tolerance is scaled by sqrt(count)."""
    for name, got, want, ref in zip(GRAD_NAMES, grads, grads64, reference_grads, strict=True):
        if got is None:
            assert ref is None, f"d{name}: the op returned no gradient but the reference did"
            continue
        scale = count**0.5 if name in ("weight", "bias") else 1.0
        family = grad_family if dtype == torch.float32 else "norm"
        assert_close(got, want, family, dtype, scale, msg=f"d{name} vs float64 autograd")
        assert_close(got, ref, "norm", dtype, scale, msg=f"d{name} vs the op's backward reference")


def note_case(case: dict[str, Any]) -> None:
    """Record a property-test case's features as hypothesis events, so ``pytest --hypothesis-show-statistics``
    shows what the fixed examples cover (activations, dtypes, layouts, vector variants, odd shapes)."""
    from hypothesis import event

    n, c, h, w = case["shape"]
    for key in ("activation", "dtype", "layout", "weight", "bias", "residual", "training", "running"):
        if key in case:
            event(f"{key}={case[key]}")
    event(f"C={c}")
    if n == 1:
        event("N=1")
    if h == 1 or w == 1:
        event("H or W = 1")
    if (h, w) == (13, 11):
        event("13x11")
