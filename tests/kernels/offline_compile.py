"""Compile Triton kernels for a GPU target on a machine without one.

The interpreter (``TRITON_INTERPRET=1``) never compiles a kernel, so GPU-only compile errors would go unseen in
CI; Triton can still compile for Hopper (sm90) offline. The test modules hand :func:`run_offline_compile` a
script that builds their kernels; the script runs in a fresh process (the interpreter is off there) and can
import :func:`pointer_offset_widths` from this module.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
_ADDPTR_TENSOR_OFFSET = re.compile(r"tt\.addptr .*: tensor<.*!tt\.ptr<\w+>>, tensor<[0-9x]*?(i\d+)>")


def pointer_offset_widths(ttir: str) -> list[str]:
    """Integer type (``i32``/``i64``) of every pointer-tensor offset in a kernel's Triton IR: a kernel that
    promises int64 indexing (tensors over 2**31 elements) must show only ``i64`` here."""
    return _ADDPTR_TENSOR_OFFSET.findall(ttir)


def run_offline_compile(script: str) -> None:
    """Run ``script`` in a fresh process with the interpreter off; it must print ``compiled``."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join((_ROOT, _HERE))}
    proc = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd=_ROOT,
        timeout=240,
    )
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("Triton's ptxas is not available")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compiled" in proc.stdout


# Pointer arguments of the conv kernel that hold fp32 (epilogue vectors and statistics buffers); the others
# (x, weight, y, residual) hold the activation dtype.
_CONV_FP32_POINTERS = ("bias_ptr", "scale_ptr", "shift_ptr", "count_ptr", "mean_part_ptr", "m2_part_ptr")


def compile_conv_kernel(config: tuple, io_dtype: str, dot_precision: str = "tf32", **constexprs):
    """Compile ``kernels.conv_bn_act._conv_bn_act_kernel`` for sm90 with one ``(BLOCK_M, BLOCK_N, BLOCK_K,
    num_stages, num_warps)`` config, ``io_dtype`` ("bf16", "fp16", "fp32") activations and the given flags."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.conv_bn_act import _conv_bn_act_kernel

    fn = _conv_bn_act_kernel.fn
    block_m, block_n, block_k, stages, warps = config
    consts = dict(constexprs, DOT_PRECISION=dot_precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    signature = {}
    for name in fn.arg_names:
        if name in consts:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*fp32" if name in _CONV_FP32_POINTERS else f"*{io_dtype}"
        else:
            signature[name] = "i32"
    return triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=consts),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps, "num_stages": stages},
    )
