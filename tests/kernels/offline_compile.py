"""Compile Triton kernels for a GPU target on a machine without one.

The interpreter (``TRITON_INTERPRET=1``) never compiles a kernel, so GPU-only compile errors would go unseen
in CI; Triton can still compile for Hopper (sm90) offline. The test modules hand :func:`run_offline_compile` a
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


def run_offline_compile(script: str, as_main: bool = False) -> str:
    """Run ``script`` in a fresh process with the interpreter off; it must print ``compiled``. With
    ``as_main`` it runs from a file as ``__main__`` (what a process pool in it needs). Returns its stdout."""
    import tempfile

    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join((_ROOT, _HERE))}
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "offline_compile_script.py")
        with open(path, "w") as f:
            f.write(script)
        command = [sys.executable, path] if as_main else [sys.executable, "-c", script]
        proc = subprocess.run(
            command, check=False, capture_output=True, text=True, env=env, cwd=_ROOT, timeout=600
        )
    print(proc.stdout[-2000:])
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("Triton's ptxas is not available")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compiled" in proc.stdout
    return proc.stdout


# Pointer arguments of the conv kernel that hold fp32 (epilogue vectors and statistics buffers); the others
# (x, weight, y, residual) hold the activation dtype.
_CONV_FP32_POINTERS = ("bias_ptr", "scale_ptr", "shift_ptr", "count_ptr", "mean_part_ptr", "m2_part_ptr")

#: Conv epilogues: everything on (a training block's tail with statistics), and nothing.
EPILOGUES = {
    "full": dict(HAS_BIAS=True, HAS_SCALE=True, HAS_SHIFT=True, HAS_RESIDUAL=True, ACTIVATION=2, STATS=True),
    "plain": dict(
        HAS_BIAS=False, HAS_SCALE=False, HAS_SHIFT=False, HAS_RESIDUAL=False, ACTIVATION=0, STATS=False
    ),
}


def conv_layer_args(n: int, h: int, w: int, c: int, k: int, r: int, stride: int, pad: int) -> dict:
    """The integer arguments the launcher passes for a channels_last layer (all tensors dense)."""
    from lcv_kernels.conv_bn_act import m_bucket, pow2_alignment

    p, q = (h + 2 * pad - r) // stride + 1, (w + 2 * pad - r) // stride + 1
    m = n * p * q
    values = dict(H=h, W=w, C=c, K=k, P=p, Q=q, M=m, M_BUCKET=m_bucket(m))
    values.update(sx_n=h * w * c, sx_h=w * c, sx_w=c, sx_c=1, sy_n=p * q * k, sy_h=q * k, sy_w=k, sy_k=1)
    values.update(sr_n=p * q * k, sr_h=q * k, sr_w=k, sr_k=1, STRIDE_H=stride, STRIDE_W=stride)
    values.update(PAD_H=pad, PAD_W=pad, DIL_H=1, DIL_W=1, R=r, S=r)
    values.update(
        X_ALIGN=pow2_alignment(c, h * w * c, w * c, c), Y_ALIGN=pow2_alignment(k, p * q * k, q * k, k)
    )
    return values


def compile_conv_kernel(config: tuple, io_dtype: str, layer: dict, dot_precision: str = "tf32", **constexprs):
    """Compile ``lcv_kernels.conv_bn_act._conv_bn_act_kernel`` for sm90 as a launch on ``layer`` (see
    :func:`conv_layer_args`) would: integers specialised as Triton's JIT does (1 becomes a constant, multiples
    of 16 are marked divisible, ``do_not_specialize`` honoured), pointers 16-byte aligned as PyTorch allocates
    them; one ``(BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps)`` config, ``io_dtype`` ("bf16", "fp16",
    "fp32") activations and the given flags."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    from lcv_kernels.conv_bn_act import _conv_bn_act_kernel

    fn = _conv_bn_act_kernel.fn
    block_m, block_n, block_k, stages, warps = config[:5]
    consts = dict(constexprs, DOT_PRECISION=dot_precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    for name in ("R", "S", "X_ALIGN", "Y_ALIGN"):
        consts.setdefault(name, layer[name])
    consts.setdefault("INDEX_64", False)
    signature, attrs = {}, {}
    for index, param in enumerate(fn.params):
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*fp32" if name in _CONV_FP32_POINTERS else f"*{io_dtype}"
            attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            kind, spec = native_specialize_impl(
                CUDABackend,
                layer[name],
                False,
                not param.do_not_specialize,
                not param.do_not_specialize_on_alignment,
            )
            if kind == "constexpr":
                signature[name] = "constexpr"
                consts[name] = spec
                continue
            signature[name] = kind
            if isinstance(spec, str) and "D" in spec:
                attrs[(index,)] = [["tt.divisibility", 16]]
    return triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps, "num_stages": stages},
    )


_PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def register_use_from_log(log: str) -> tuple[int, int] | None:
    """``(registers, spill bytes)`` a thread from a ``ptxas -v`` log, or None if it has none. Triton prints
    its own ``ptxas -v`` log (the flags a launch uses) when ``TRITON_DUMP_PTXAS_LOG=1``; a kernel that came
    from Triton's cache ran no ptxas and needs :func:`register_use`."""
    registers = _PTXAS_REGISTERS.findall(log)
    spills = _PTXAS_SPILLS.findall(log)
    if not registers or not spills:
        return None
    return int(registers[-1]), sum(int(b) for b in spills[-1])


def register_use(ptx: str) -> tuple[int, int]:
    """``(registers, spill bytes)`` a thread, from ``ptxas -v`` on ``ptx`` for sm_90a (Triton's own ptxas)."""
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "kernel.ptx")
        with open(source, "w") as f:
            f.write(ptx)
        proc = subprocess.run(
            [get_ptxas(90).path, "-v", "--gpu-name=sm_90a", source, "-o", source + ".o"],
            capture_output=True,
            text=True,
            check=True,
        )
    use = register_use_from_log(proc.stderr + proc.stdout)
    assert use is not None, "ptxas -v printed no register use"
    return use
