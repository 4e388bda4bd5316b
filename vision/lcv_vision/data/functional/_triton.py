"""The bilinear resampling gather of the resizing ops as a Triton kernel, for CUDA.

Why a kernel of our own: Inductor lowers the four gathers of a bilinear resample (per channel) to
element-wise indirect loads, each with its own 64-bit index arithmetic and a bounds assert, recomputed for
every channel and tap.  Here a program owns a tile of output rows and columns of one sample: it loads that
tile's row and column taps once (``(N, h)`` / ``(N, w)`` tables built on the CPU, see
:func:`lcv_vision.data.functional.geometry.resample_tables`), reuses them for every channel, reads the uint8
source directly (any strides: NCHW, channels_last, a ragged canvas) and writes float32 once.  The arithmetic
is the one of :func:`~lcv_vision.data.functional.geometry.resample`, step for step.

It is a ``torch.library`` op (``lcv_data::resample_bilinear``), so a compiled pipeline calls it from inside
its graph; Inductor fuses the colour ops and the output conversion that follow into its own kernels.  Without
Triton (or on CPU) the PyTorch formula runs instead; tests run this kernel in the Triton interpreter.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lcv_kernels._common import cdiv, launch_context, triton_available
from lcv_kernels._triton import tl, triton

BLOCK_H = 8
BLOCK_W = 64


@triton.jit
def _resample_kernel(
    src,
    out,
    y0,
    y1,
    wy,
    x0,
    x1,
    wx,
    s_n,
    s_c,
    s_h,
    s_w,
    o_n,
    o_c,
    o_h,
    o_w,
    out_h,
    out_w,
    C: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    n = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)
    row_ok = rows < out_h
    col_ok = cols < out_w
    # The taps of this tile, loaded once for all channels.
    r0 = tl.load(y0 + n * out_h + rows, mask=row_ok, other=0).to(tl.int64)
    r1 = tl.load(y1 + n * out_h + rows, mask=row_ok, other=0).to(tl.int64)
    fy = tl.load(wy + n * out_h + rows, mask=row_ok, other=0.0)
    c0 = tl.load(x0 + n * out_w + cols, mask=col_ok, other=0).to(tl.int64)
    c1 = tl.load(x1 + n * out_w + cols, mask=col_ok, other=0).to(tl.int64)
    fx = tl.load(wx + n * out_w + cols, mask=col_ok, other=0.0)[None, :]
    fy = fy[:, None]
    ok = row_ok[:, None] & col_ok[None, :]
    at00 = r0[:, None] * s_h + c0[None, :] * s_w
    at01 = r0[:, None] * s_h + c1[None, :] * s_w
    at10 = r1[:, None] * s_h + c0[None, :] * s_w
    at11 = r1[:, None] * s_h + c1[None, :] * s_w
    dest = out + n.to(tl.int64) * o_n + rows[:, None].to(tl.int64) * o_h + cols[None, :].to(tl.int64) * o_w
    for c in tl.static_range(C):
        plane = src + n.to(tl.int64) * s_n + c * s_c
        a = tl.load(plane + at00, mask=ok, other=0).to(tl.float32)
        b = tl.load(plane + at01, mask=ok, other=0).to(tl.float32)
        d = tl.load(plane + at10, mask=ok, other=0).to(tl.float32)
        e = tl.load(plane + at11, mask=ok, other=0).to(tl.float32)
        upper = a + (b - a) * fx
        lower = d + (e - d) * fx
        tl.store(dest + c * o_c, upper + (lower - upper) * fy, mask=ok)


def resample_triton(
    images: Tensor, y0: Tensor, y1: Tensor, wy: Tensor, x0: Tensor, x1: Tensor, wx: Tensor
) -> Tensor:
    """Launch :func:`_resample_kernel`: uint8 (or float) ``(N, C, H, W)`` -> float32 ``(N, C, h, w)``."""
    n, c = int(images.shape[0]), int(images.shape[1])
    out_h, out_w = int(y0.shape[1]), int(x0.shape[1])
    out = torch.empty((n, c, out_h, out_w), dtype=torch.float32, device=images.device)
    y0, y1, wy, x0, x1, wx = (t.contiguous() for t in (y0, y1, wy.float(), x0, x1, wx.float()))
    grid = (n, cdiv(out_h, BLOCK_H), cdiv(out_w, BLOCK_W))
    with launch_context(images):
        _resample_kernel[grid](
            images,
            out,
            y0,
            y1,
            wy,
            x0,
            x1,
            wx,
            *images.stride(),
            *out.stride(),
            out_h,
            out_w,
            C=c,
            BLOCK_H=BLOCK_H,
            BLOCK_W=BLOCK_W,
        )
    return out


@torch.library.custom_op("lcv_data::resample_bilinear", mutates_args=())
def resample_bilinear(
    images: Tensor, y0: Tensor, y1: Tensor, wy: Tensor, x0: Tensor, x1: Tensor, wx: Tensor
) -> Tensor:
    """The bilinear resample of :func:`~lcv_vision.data.functional.geometry.resample`, on CUDA by the kernel."""
    return resample_triton(images, y0, y1, wy, x0, x1, wx)


@resample_bilinear.register_fake
def _(images: Tensor, y0: Tensor, y1: Tensor, wy: Tensor, x0: Tensor, x1: Tensor, wx: Tensor) -> Tensor:
    return images.new_empty((images.shape[0], images.shape[1], y0.shape[1], x0.shape[1]), dtype=torch.float32)


def use_resample_kernel(images: Tensor) -> bool:
    """The kernel runs on CUDA tensors when Triton is installed (the interpreter is for tests only)."""
    return images.is_cuda and triton_available()
