"""``lcv_kernels.conv_hopper`` (persistent TMA conv for sm_90a) and its offline SASS check.

Correctness runs the kernel itself in the interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py): its
TMA tensor descriptors, their out-of-bounds zero fill (the padding and channels past C) and the persistent
tile loop all execute there, on tiny shapes, against ``F.conv2d`` in float64. The interpreter has no bf16, so
fp32 and fp16 are checked. The SASS test compiles one 1x1 and one 3x3 table entry for sm_90a in a fresh
process (the interpreter off) and checks issue 38's bar; ``benchmarks/conv_sass.py`` checks the whole table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from lcv_kernels._common import interpreter_enabled
from lcv_kernels.conv_hopper import (
    CONFIGS,
    MERGE_MIN_PROGRAMS,
    MODE_CONV,
    MODE_CONV_S2,
    MODE_GEMM,
    MODE_S2D,
    HopperConvConfig,
    check_config,
    conv_hopper,
    conv_hopper_stats,
    fold_columns,
    fold_weight,
    kernel_geometry,
    layer_mode,
    merge_grid,
    merge_stats,
    pack_weight,
    s2d_geometry,
    s2d_weight,
    select_config,
    space_to_depth,
)
from lcv_kernels.conv_hopper_sass import analyse_sass, bar_failures, ctas_per_sm
from lcv_kernels.tolerances import bound, reduction_tolerance, tolerance

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

requires_interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or not interpreter_enabled(), reason="runs the kernel in the Triton interpreter"
)


def _gemm(bm: int, bn: int, bk: int) -> HopperConvConfig:
    return HopperConvConfig(bm, bn, bk, 2, 4)


def _conv(tile: tuple[int, int, int], bn: int, bk: int) -> HopperConvConfig:
    return HopperConvConfig(tile[0] * tile[1] * tile[2], bn, bk, 2, 4, tile)


# (N, C, H, W, K, kernel, stride, padding, config): every mode; tiles that do not divide P, Q or K; a tile
# spanning two images (TN=2) with N odd; BLOCK_K past C (zero-filled channels); N=1; a 5x5 kernel; H=1.
CASES = [
    (2, 16, 5, 5, 24, 1, 1, 0, _gemm(16, 16, 16)),
    (1, 8, 3, 7, 8, 1, 1, 0, _gemm(16, 32, 16)),
    (2, 24, 5, 6, 24, 3, 1, 1, _conv((1, 2, 8), 16, 16)),
    (3, 24, 5, 6, 16, 3, 1, 1, _conv((2, 2, 4), 16, 32)),
    (1, 8, 6, 5, 16, 5, 1, 2, _conv((1, 4, 4), 16, 16)),
    (2, 16, 6, 8, 24, 3, 2, 1, _conv((2, 1, 8), 16, 16)),
    (1, 16, 6, 8, 16, 1, 2, 0, _conv((1, 2, 8), 16, 16)),
    (2, 8, 1, 6, 16, 3, 1, 1, _conv((2, 1, 8), 16, 16)),  # H=1: every row above and below is padding
    # the C=3 stem through space-to-depth (a 4x4/1 conv over C=16): N=1 with odd H and W; N=2, TN=2
    (1, 3, 7, 9, 8, 7, 2, 3, _conv((1, 2, 8), 16, 16)),
    (2, 3, 6, 5, 16, 7, 2, 3, _conv((2, 2, 4), 16, 32)),
]


@requires_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "N{}C{}H{}W{}K{}k{}s{}p{}".format(*c[:8]))
def test_matches_float64_conv2d_in_the_interpreter(case: tuple, dtype: torch.dtype) -> None:
    n, c, h, w, k, r, stride, pad, config = case
    gen = torch.Generator().manual_seed(n * 1000 + c * 10 + r)
    x = torch.randn(n, c, h, w, generator=gen).to(dtype).contiguous(memory_format=torch.channels_last)
    weight = torch.randn(k, c, r, r, generator=gen).to(dtype)
    # 3 programs: the persistent loop walks several tiles per program.
    y = conv_hopper(x, weight, stride, pad, config, num_programs=3)
    ref = F.conv2d(x.double(), weight.double(), stride=stride, padding=pad)
    assert y.shape == ref.shape and y.dtype == dtype
    assert y.is_contiguous(memory_format=torch.channels_last)
    limit = bound(reduction_tolerance(dtype, c * r * r), ref)
    err = (y.double() - ref).abs().max().item()
    assert err <= limit, f"max error {err} > {limit}"


@requires_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_bn_relu_prologue_matches_float64_in_the_interpreter(dtype: torch.dtype) -> None:
    """``prologue=(scale, shift)`` on the 1x1 path: ``conv(relu(x * scale + shift))`` against float64 eager,
    with shifts of both signs (some channels mostly zeroed by the ReLU), C=24 under BLOCK_K 32 (channels past
    C must stay 0) and M=50 rows under 16-row tiles (rows past M must not leak into y or the statistics)."""
    n, c, h, w, k = 2, 24, 5, 5, 16
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(n, c, h, w, generator=gen).to(dtype).contiguous(memory_format=torch.channels_last)
    weight = torch.randn(k, c, 1, 1, generator=gen).to(dtype)
    scale = torch.rand(c, generator=gen) * 2.0 + 0.25
    shift = torch.randn(c, generator=gen)
    config = HopperConvConfig(16, 16, 32, 2, 4)
    y, mean, var = conv_hopper_stats(x, weight, config=config, num_programs=3, prologue=(scale, shift))
    # the kernel rounds scale and shift to the input dtype once (as a bf16/fp16 BN output would be rounded)
    s64, b64 = scale.to(dtype).double(), shift.to(dtype).double()
    z = torch.relu(x.double() * s64[None, :, None, None] + b64[None, :, None, None])
    ref = F.conv2d(z, weight.double())
    # one extra rounding of the activated input (to the input dtype) before the reduction
    limit = bound(reduction_tolerance(dtype, c), ref) + bound(reduction_tolerance(dtype, 1), z) * c
    assert (y.double() - ref).abs().max().item() <= limit
    assert torch.allclose(y, conv_hopper(x, weight, config=config, num_programs=3, prologue=(scale, shift)))
    # statistics of the fp32 accumulator: every element within `limit` of ref, so the mean is too and the
    # variance within 2 * limit * max|ref - mean| + limit^2 (plus the BN tolerance of the merge)
    e_var, e_mean = torch.var_mean(ref, dim=(0, 2, 3), unbiased=False)
    spread = (ref - e_mean[None, :, None, None]).abs().amax(dim=(0, 2, 3))
    atol, rtol = tolerance("norm", torch.float32)
    assert ((mean.double() - e_mean).abs() <= limit + atol).all()
    assert ((var.double() - e_var).abs() <= 2 * limit * spread + limit**2 + atol + rtol * e_var).all()
    with pytest.raises(ValueError, match="1x1 stride-1"):
        conv_hopper(x, torch.zeros(k, c, 3, 3, dtype=dtype), padding=1, prologue=(scale, shift))
    with pytest.raises(ValueError, match="fp32"):
        conv_hopper(x, weight, prologue=(scale.double(), shift))


def test_modes_and_clear_errors() -> None:
    assert layer_mode((64, 56, 56, 256, 1, 1, 0)) == MODE_GEMM
    assert layer_mode((64, 56, 56, 64, 3, 1, 1)) == MODE_CONV
    assert layer_mode((128, 56, 56, 128, 3, 2, 1)) == MODE_CONV_S2
    assert layer_mode((3, 224, 224, 64, 7, 2, 3)) == MODE_S2D  # C=3 rows are not 16 bytes: space-to-depth
    stem = kernel_geometry((3, 224, 224, 64, 7, 2, 3))  # 4x4/1 pad 2 over C=16, column taps folded
    assert (stem.c, stem.h, stem.w, stem.r, stem.s, stem.pad_h, stem.pad_w) == (64, 112, 112, 4, 1, 2, 0)
    assert (stem.p, stem.q, stem.mode) == (112, 112, MODE_CONV)
    with pytest.raises(ValueError, match="C a multiple of 8"):
        layer_mode((3, 224, 224, 64, 3, 1, 1))
    with pytest.raises(ValueError, match="K a multiple of 8"):
        layer_mode((64, 56, 56, 3, 1, 1, 0))
    with pytest.raises(ValueError, match="even H and W"):
        layer_mode((64, 7, 7, 64, 3, 2, 1))
    with pytest.raises(ValueError, match="stride 3"):
        layer_mode((64, 9, 9, 64, 3, 3, 1))
    with pytest.raises(ValueError, match="C a multiple of block_k"):
        check_config((24, 8, 8, 32, 3, 2, 1), HopperConvConfig(128, 64, 32, 2, 4, (1, 8, 16)))
    with pytest.raises(ValueError, match="channels_last"):
        conv_hopper(torch.zeros(1, 8, 4, 4), torch.zeros(8, 8, 1, 1))


@pytest.mark.parametrize(
    "shape",
    # (N, C, H, W, K, R, padding), stride 2: the 7x7/3 stem at odd and even sizes and at H=1; other
    # kernels and paddings (3x3/1, 1x1/0, 5x5/2, 2x2/0) whose s2d tap count and padding differ
    [(1, 3, 7, 9, 4, 7, 3), (2, 3, 6, 5, 4, 7, 3), (1, 3, 1, 4, 4, 7, 3), (1, 5, 8, 7, 4, 3, 1),
     (1, 3, 5, 5, 4, 1, 0), (2, 2, 9, 6, 4, 5, 2), (1, 3, 6, 7, 4, 2, 0)],
    ids=lambda s: "N{}C{}H{}W{}K{}k{}p{}".format(*s),
)  # fmt: skip
def test_space_to_depth_rewrite_is_the_stride_2_conv(shape: tuple[int, ...]) -> None:
    """The exact index mapping of :func:`s2d_geometry`, in float64 eager (no kernel): the stride-1 conv of
    the rewritten weight over the space-to-depth input, cut to the original P x Q, is ``conv2d(stride=2)``."""
    n, c, h, w, k, r, pad = shape
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(n, c, h, w, generator=gen, dtype=torch.float64)
    weight = torch.randn(k, c, r, r, generator=gen, dtype=torch.float64)
    ref = F.conv2d(x, weight, stride=2, padding=pad)
    inner, p, q = s2d_geometry((c, h, w, k, r, 2, pad))
    z = space_to_depth(x)
    assert z.shape == (n, inner[0], inner[1], inner[2]) and z.is_contiguous(memory_format=torch.channels_last)
    assert inner[0] % 16 == 0 and (p, q) == ref.shape[2:]
    w2 = s2d_weight(weight, pad)
    assert w2.shape == (k, inner[0], inner[4], inner[4])
    y = F.conv2d(z, w2, padding=inner[6])[:, :, :p, :q]
    assert torch.allclose(y, ref, atol=1e-12, rtol=1e-12)
    # what the kernel runs: the column taps folded into channels, an R' x 1 conv padded on rows only
    folded = fold_columns(z, inner[4], inner[6], q)
    y = F.conv2d(folded, fold_weight(w2), padding=(inner[6], 0))[:, :, :p]
    assert folded.shape[1] == inner[4] * inner[0] and torch.allclose(y, ref, atol=1e-12, rtol=1e-12)


def test_table_is_valid_and_block_n_not_bounded_by_c() -> None:
    for shape, config in CONFIGS.items():
        check_config(shape, config)
        assert select_config(shape) is config
    # issue 38: BLOCK_N is no longer bounded by the reduction's channel count
    check_config((64, 56, 56, 256, 1, 1, 0), HopperConvConfig(128, 256, 64, 3, 8))
    assert any(config.block_n > shape[0] for shape, config in CONFIGS.items())


def test_packed_weight_is_cached_per_version() -> None:
    weight = torch.randn(8, 4, 3, 3)
    first = pack_weight(weight)
    assert pack_weight(weight) is first
    assert torch.equal(first, weight.permute(0, 2, 3, 1).reshape(8, -1))
    with torch.no_grad():
        weight.add_(1.0)
    second = pack_weight(weight)
    assert second is not first and torch.equal(second, weight.permute(0, 2, 3, 1).reshape(8, -1))


# A hand-written listing: setup, a K loop whose tile epilogue is skipped by a forward branch, an
# out-of-line barrier retry that jumps back (unconditionally: not a loop), and an exit.
_SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   UTMALDG.2D [UR8], [UR4] ;
        /*0020*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR9], R15 ;
        /*0030*/              @!P0 BRA 0x00d0 ;
        /*0040*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*0050*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24, gsb0 ;
        /*0060*/               @P1 BRA 0x0090 ;
        /*0070*/                   F2FP.BF16.F32.PACK_AB R24, R25, R24 ;
        /*0080*/                   UTMASTG.2D [UR4], [UR6] ;
        /*0090*/                   UTMALDG.2D [UR8], [UR4] ;
        /*00a0*/                   IADD3 R2, R2, 0x1, RZ ;
        /*00b0*/               @P2 BRA 0x0020 ;
        /*00c0*/                   EXIT ;
        /*00d0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR9], R15 ;
        /*00e0*/                   BRA 0x0040 ;
"""


def test_sass_analysis_counts_one_k_step() -> None:
    counts = analyse_sass(_SASS)
    assert counts["loop_found"] and counts["loop_instructions"] == 10  # 0x0020..0x00b0
    assert counts["loop_hgmma"] == 2 and counts["loop_utmaldg"] == 1 and counts["loop_ldgsts"] == 0
    # one K step: the epilogue (0x70, 0x80) skipped, the retry branch not taken: 8 instructions, 2 HGMMA
    assert counts["step_instructions"] == 8 and counts["step_hgmma"] == 2
    assert counts["instructions_per_8_hgmma"] == 32.0
    row = {**counts, "spill_bytes": 0, "ctas_per_sm": 1}
    assert bar_failures(row) == []
    assert bar_failures({**row, "loop_ldgsts": 3}) and bar_failures({**row, "instructions_per_8_hgmma": 141})
    assert ctas_per_sm(200 * 1024, 128, 8) == 1 and ctas_per_sm(100 * 1024, 90, 4) == 2
    assert ctas_per_sm(228 * 1024, 64, 4) == 0


_SASS_SCRIPT = """
import json
from lcv_kernels.conv_hopper import CONFIGS
from lcv_kernels.conv_hopper_sass import sass_row
for shape, stats in [((64, 56, 56, 64, 1, 1, 0), False), ((128, 28, 28, 128, 3, 1, 1), False),
                     ((128, 28, 28, 128, 3, 1, 1), True), ((3, 224, 224, 64, 7, 2, 3), False)]:
    print(json.dumps(sass_row(shape, CONFIGS[shape], stats=stats)))
"""


def test_representative_configs_meet_the_sass_bar_for_sm90a() -> None:
    """One 1x1 (TMA GEMM) and one 3x3 (4-D TMA boxes) table entry, the 3x3 with the statistics epilogue,
    and the stem (space-to-depth, column taps folded: 4x1 over 64 channels), compiled for sm_90a with the
    local triton: HGMMA and UTMALDG in the K loop, no LDGSTS/LDG there, no spills, <= 140 instructions per
    8 HGMMA, at least one CTA per SM."""
    env = {
        **os.environ,
        "TRITON_INTERPRET": "0",
        "PYTHONPATH": os.pathsep.join((_ROOT, os.path.join(_ROOT, "kernels"))),
    }
    proc = subprocess.run(
        [sys.executable, "-c", _SASS_SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        cwd=_ROOT,
        timeout=300,
        check=False,
    )
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("Triton's ptxas is not available")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 4
    for row in rows:
        assert row["loop_hgmma"] > 0 and row["loop_utmaldg"] > 0, row
        assert row["bar_failures"] == [], (row["shape"], row["config"], row["bar_failures"])


@requires_interpreter
@pytest.mark.parametrize("offset", [0.0, 30.0, 300.0, 1000.0])
@pytest.mark.parametrize(
    "case", [CASES[0], CASES[3], CASES[5], CASES[-1]], ids=["gemm", "conv", "conv_s2", "stem_s2d"]
)
def test_epilogue_statistics_match_float64_at_large_means(case: tuple, offset: float) -> None:
    """Per-tile (count, mean, M2) from the epilogue, merged in two fixed-order levels: the mean (relative to
    the spread) and the biased variance within the BN tolerance at means of 0 to 1000, bit-identical on a
    second run. Channel 0 of x is 1 and its centre tap carries the offset (a bias the conv cannot see)."""
    n, c, h, w, k, r, stride, pad, config = case
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(n, c, h, w, generator=gen)
    x[:, 0] = 1.0
    x = x.contiguous(memory_format=torch.channels_last)
    weight = torch.randn(k, c, r, r, generator=gen)
    weight[:, 0] = 0.0
    weight[:, 0, r // 2, r // 2] = offset + torch.randn(k, generator=gen)
    y, mean, var = conv_hopper_stats(x, weight, stride, pad, config, num_programs=3)
    z = F.conv2d(x.double(), weight.double(), stride=stride, padding=pad)
    e_var, e_mean = torch.var_mean(z, dim=(0, 2, 3), unbiased=False)
    atol, rtol = tolerance("norm", torch.float32)
    assert ((mean.double() - e_mean) / e_var.sqrt()).abs().max().item() <= atol
    assert torch.allclose(var.double(), e_var, atol=atol, rtol=rtol)
    again = conv_hopper_stats(x, weight, stride, pad, config, num_programs=3)
    assert all(torch.equal(a, b) for a, b in zip((y, mean, var), again))


@requires_interpreter
def test_two_level_merge_spreads_over_a_wave_and_matches_float64() -> None:
    groups, channel_blocks, span = merge_grid(3136, 64)  # ResNet-50 layer1 at batch 256, 256-row tiles
    assert groups * channel_blocks >= MERGE_MIN_PROGRAMS and (groups - 1) * span < 3136 <= groups * span
    assert merge_grid(5, 64)[0] == 5  # fewer parts than a wave: one group each
    gen = torch.Generator().manual_seed(3)
    parts, channels = 300, 5
    values = [
        torch.randn(int(cnt), channels, generator=gen, dtype=torch.float64) + 300.0
        for cnt in range(1, parts + 1)
    ]
    counts = torch.tensor([float(v.shape[0]) for v in values])
    mean_parts = torch.stack([v.mean(0) for v in values]).float()
    m2_parts = torch.stack([((v - v.mean(0)) ** 2).sum(0) for v in values]).float()
    mean, var = merge_stats(counts, mean_parts, m2_parts)
    everything = torch.cat(values)
    e_var, e_mean = torch.var_mean(everything, dim=0, unbiased=False)
    atol, rtol = tolerance("norm", torch.float32)
    assert ((mean.double() - e_mean) / e_var.sqrt()).abs().max().item() <= atol
    assert torch.allclose(var.double(), e_var, atol=atol, rtol=rtol)


def test_packed_weight_cache_never_serves_another_tensor() -> None:
    """Successive weights (freed memory may be reused at the same version count) each get their own
    packing. The key was (data_ptr, version) at first: the statistics test above got a stale packing from
    an earlier test's weight and failed; this loop does not reproduce that reliably, that test does."""
    for value in range(20):
        weight = torch.randn(16, 24, 3, 3)
        weight[:, 0] = float(value)
        assert torch.equal(pack_weight(weight), weight.permute(0, 2, 3, 1).reshape(16, -1))
        del weight


def test_gpu_benchmark_script_checks_the_table_configs_in_the_interpreter(tmp_path) -> None:
    """``benchmarks/conv_hopper.py --tiny`` runs the table's own configs (2x8x8 and 16x4x4 boxes, BLOCK_K
    128, the deep 1x1) at batch 1 in the interpreter and checks them against float64: the script the GPU
    call will run works before a GPU sees it."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "LCV_RESULTS_DIR": str(tmp_path)}
    env.pop("LCV_RESULTS_JSONL", None)
    proc = subprocess.run(
        [sys.executable, os.path.join(_ROOT, "benchmarks", "conv_hopper.py"), "--tiny"],
        capture_output=True,
        text=True,
        env=env,
        cwd=_ROOT,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    with open(tmp_path / "conv_hopper-interpreter-tiny.json") as f:
        result = json.load(f)
    assert result["timing"].startswith("not measured on GPU")
    assert len(result["rows"]) == 4 and all(row["ok"] for row in result["rows"])
