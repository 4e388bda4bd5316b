"""Offline SASS evidence for the Hopper conv (:mod:`lcv_kernels.conv_hopper`): compile for sm_90a, read the loop.

Why: no GPU is at hand, and the old kernel's problems (per-element address math, ``cp.async`` of the
activations, unpipelined K loops, spills, shared memory that halves occupancy) are all visible in the
machine code. :func:`compile_config` compiles one table entry as a launch would (Triton's own ptxas, no
GPU needed); :func:`analyse_sass` finds the innermost loop that issues HGMMA and counts what one K step
executes; :func:`bar_failures` says which of issue 38's limits a row breaks. Works with triton 3.6 and 3.8.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile
from typing import Any

from lcv_kernels.conv_hopper import HOPPER_SMS, HopperConvConfig, Shape, check_config, kernel_geometry

#: The bar from issue 38 for every table row.
MAX_INSTRUCTIONS_PER_8_HGMMA = 140
#: H100/H200 per-SM limits: shared memory (bytes, with 1 KB reserved per CTA), registers, warps.
SM_SHARED_BYTES = 228 * 1024
CTA_RESERVED_SHARED = 1024
MAX_SHARED_PER_CTA = 227 * 1024
SM_REGISTERS = 65536
SM_WARPS = 64

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)\s*([^;]*);")
_BRANCH_TARGET = re.compile(r"0x([0-9a-f]+)")
_RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


@dataclasses.dataclass
class Instruction:
    address: int
    predicate: str
    opcode: str
    operands: str


def parse_sass(text: str) -> list[Instruction]:
    """The instructions of a ``cuobjdump -sass`` listing (one kernel), in address order."""
    out = []
    for match in _LINE.finditer(text):
        address, predicate, opcode, operands = match.groups()
        out.append(Instruction(int(address, 16), (predicate or "").strip(), opcode, operands.strip()))
    return out


def _target(ins: Instruction) -> int | None:
    if not ins.opcode.startswith("BRA"):
        return None
    found = _BRANCH_TARGET.search(ins.operands)
    return int(found.group(1), 16) if found else None


def _count(instructions: list[Instruction], prefix: str) -> int:
    return sum(1 for ins in instructions if ins.opcode.startswith(prefix))


def analyse_sass(text: str) -> dict[str, Any]:
    """Counts for the innermost loop that issues HGMMA (the K loop).

    ``loop_*`` count every instruction between the loop's head and its back edge, once each. ``step_*``
    follow one K step: forward branches that skip HGMMA-free code inside the loop (the persistent loop's
    tile advance and epilogue, which run once a tile) are taken, branches out of the loop (barrier retry
    paths) are not; ``instructions_per_8_hgmma`` is that path's length per 8 HGMMA."""
    instructions = parse_sass(text)
    by_address = {ins.address: i for i, ins in enumerate(instructions)}
    loops = []
    for i, ins in enumerate(instructions):
        target = _target(ins)
        # A loop's latch is a conditional branch back; the unconditional jumps back from out-of-line
        # barrier-retry blocks are not loops.
        if target is not None and target <= ins.address and target in by_address and ins.predicate:
            start = by_address[target]
            body = instructions[start : i + 1]
            if any(b.opcode.startswith("HGMMA") for b in body):
                loops.append((i + 1 - start, start, i))
    totals = {
        "hgmma_total": _count(instructions, "HGMMA"),
        "utmaldg_total": _count(instructions, "UTMALDG"),
        "ldgsts_total": _count(instructions, "LDGSTS"),
        "utmastg_total": _count(instructions, "UTMASTG"),
        "spill_instructions": _count(instructions, "STL") + _count(instructions, "LDL"),
        "instructions_total": len(instructions),
    }
    if not loops:
        return {**totals, "loop_found": False}
    _, start, end = min(loops)
    loop = instructions[start : end + 1]
    lo, hi = loop[0].address, loop[-1].address
    path: list[Instruction] = []
    i = start
    while i <= end:
        ins = instructions[i]
        path.append(ins)
        target = _target(ins)
        if target is not None and lo <= target <= hi and target > ins.address and i != end:
            skipped = instructions[i + 1 : by_address[target]]
            if not any(s.opcode.startswith("HGMMA") for s in skipped):
                i = by_address[target]
                continue
        i += 1
    step_hgmma = _count(path, "HGMMA")
    return {
        **totals,
        "loop_found": True,
        "loop_instructions": len(loop),
        "loop_hgmma": _count(loop, "HGMMA"),
        "loop_utmaldg": _count(loop, "UTMALDG"),
        "loop_ldgsts": _count(loop, "LDGSTS"),
        "loop_ldg": sum(
            1 for ins in loop if ins.opcode.startswith("LDG") and not ins.opcode.startswith("LDGSTS")
        ),
        "loop_ldsm": _count(loop, "LDSM"),
        "step_instructions": len(path),
        "step_hgmma": step_hgmma,
        "instructions_per_8_hgmma": round(len(path) * 8 / step_hgmma, 1) if step_hgmma else None,
        "hgmma_shape": next((ins.opcode for ins in loop if ins.opcode.startswith("HGMMA")), None),
        "hgmma_a_from_registers": any(
            ins.opcode.startswith("HGMMA") and re.match(r"R\d+, R\d+,", ins.operands) for ins in loop
        ),
    }


def ctas_per_sm(shared_bytes: int, registers: int, num_warps: int) -> int:
    """Resident CTAs per SM on H100/H200 from shared memory, registers (allocated per warp in 256s) and
    warps; 0 when one CTA's shared memory exceeds the per-CTA limit."""
    if shared_bytes > MAX_SHARED_PER_CTA:
        return 0
    by_shared = SM_SHARED_BYTES // (shared_bytes + CTA_RESERVED_SHARED)
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = SM_REGISTERS // (per_warp * num_warps) if registers else 32
    return int(min(by_shared, by_registers, SM_WARPS // num_warps, 32))


def _tool(name: str) -> str:
    """A binary shipped next to Triton's ptxas (``cuobjdump``), for triton 3.6 and 3.8 alike."""
    from triton.backends.nvidia import compiler

    try:
        ptxas = compiler.get_ptxas(90).path
    except TypeError:
        ptxas = compiler.get_ptxas().path
    return os.path.join(os.path.dirname(ptxas), name)


def _constexprs(shape: Shape, config: HopperConvConfig, num_programs: int) -> dict[str, Any]:
    g = kernel_geometry(shape)  # the stem: the space-to-depth conv with its column taps folded
    tn, th, tw = config.tile
    return dict(
        H=g.h, W=g.w, C=g.c, K=g.k, R=g.r, S=g.s, PAD_H=g.pad_h, PAD_W=g.pad_w, P=g.p, Q=g.q, MODE=g.mode,
        TN=tn, TH=th, TW=tw, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        NUM_PROGRAMS=num_programs, STAGES=config.num_stages,
    )  # fmt: skip


def compile_config(
    shape: Shape,
    config: HopperConvConfig,
    dtype: str = "bf16",
    num_programs: int = HOPPER_SMS,
    stats: bool = False,
    prologue: bool = False,
) -> Any:
    """Compile the kernel for sm_90a as :func:`lcv_kernels.conv_hopper.conv_hopper` would launch it (the
    batch ``N`` a runtime 16-divisible integer, pointers 16-byte aligned)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lcv_kernels.conv_hopper import _conv_hopper_kernel

    check_config(shape, config)
    consts = _constexprs(shape, config, num_programs)
    consts["STATS"] = stats
    consts["PROLOGUE"] = prologue
    consts["ASM_PROLOGUE"] = prologue  # as a compiled launch runs it
    signature = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "y_ptr": f"*{dtype}"}
    signature.update({"count_ptr": "*fp32", "mean_part_ptr": "*fp32", "m2_part_ptr": "*fp32"})
    signature.update({"ss_ptr": f"*{dtype}", "N": "i32"})
    signature.update({name: "constexpr" for name in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(8)}
    source = ASTSource(fn=_conv_hopper_kernel, signature=signature, constexprs=consts, attrs=attrs)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def sass_of(compiled: Any) -> tuple[str, dict[str, int]]:
    """The SASS listing and ``cuobjdump -res-usage`` numbers (REG, STACK, SHARED, LOCAL) of a compile."""
    with tempfile.TemporaryDirectory() as folder:
        cubin = os.path.join(folder, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run(
            [_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True
        )
        usage = subprocess.run(
            [_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True, check=True
        )
    found = _RESOURCES.search(usage.stdout)
    if found is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {usage.stdout[-300:]}")
    reg, stack, shared, local = (int(v) for v in found.groups())
    return sass.stdout, {"REG": reg, "STACK": stack, "SHARED": shared, "LOCAL": local}


def sass_row(
    shape: Shape,
    config: HopperConvConfig,
    dtype: str = "bf16",
    stats: bool = False,
    prologue: bool = False,
) -> dict[str, Any]:
    """One table row: the shape, config, triton version and every count the bar needs (``stats``: with
    the BatchNorm statistics epilogue; ``prologue``: with the previous BN + ReLU on the loaded input)."""
    import triton

    compiled = compile_config(shape, config, dtype, stats=stats, prologue=prologue)
    sass, usage = sass_of(compiled)
    counts = analyse_sass(sass)
    shared = int(compiled.metadata.shared) + usage["SHARED"]
    row = {
        "shape": list(shape),
        "config": config.describe(),
        "dtype": dtype,
        "stats": stats,
        "prologue": prologue,
        "triton": triton.__version__,
        "registers": usage["REG"],
        "spill_bytes": usage["LOCAL"] + usage["STACK"],
        "shared_bytes": shared,
        "ctas_per_sm": ctas_per_sm(shared, usage["REG"], config.num_warps),
        **counts,
    }
    row["bar_failures"] = bar_failures(row)
    return row


def bar_failures(row: dict[str, Any]) -> list[str]:
    """Which of issue 38's limits a row breaks (empty when it meets the bar)."""
    failures = []
    if not row.get("loop_found"):
        return ["no K loop with HGMMA found"]
    if row["loop_utmaldg"] == 0:
        failures.append("no UTMALDG in the main loop")
    if row["loop_ldgsts"] or row["loop_ldg"]:
        failures.append(f"global loads in the main loop (LDGSTS {row['loop_ldgsts']}, LDG {row['loop_ldg']})")
    if row["spill_bytes"] or row["spill_instructions"]:
        failures.append(f"spills ({row['spill_bytes']} bytes, {row['spill_instructions']} STL/LDL)")
    per8 = row["instructions_per_8_hgmma"]
    if per8 is None or per8 > MAX_INSTRUCTIONS_PER_8_HGMMA:
        failures.append(f"{per8} instructions per 8 HGMMA (> {MAX_INSTRUCTIONS_PER_8_HGMMA})")
    if row["ctas_per_sm"] < 1:
        failures.append("no CTA fits on an SM")
    return failures
