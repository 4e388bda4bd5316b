"""``lcv export --quantize int8``: PT2E int8 that keeps digits-small's accuracy and loads without torchao."""

from __future__ import annotations

import copy
import json
import sys
import zipfile

import pytest
import torch
from torch import nn

from deploy_helpers import INT8_EXPORT_WARNINGS, run_fresh
from lcv_kernels.tolerances import reduction_tolerance
from lcv_vision.deploy import MissingExtraError, load_package
from lcv_vision.deploy.capture import capture
from lcv_vision.deploy.export import InferenceModel, example_batch
from lcv_vision.deploy.quantize import (
    batch_norms_as_affine,
    int8_reduce_range,
    numeric_padding,
    quantize_int8,
)

pytestmark = pytest.mark.xdist_group("deploy")

#: Top-1 points int8 may lose against fp32 on digits-small's test split (359 images: 1 point ~ 3.6 images).
MAX_DROP_POINTS = 1.0


def accuracy(package, images: torch.Tensor, labels: torch.Tensor) -> float:
    model = load_package(package)
    return 100.0 * float((model(images).argmax(1) == labels).float().mean())


def test_int8_loses_at_most_a_point_of_top1_on_the_digits_test_set(
    fp32_package, int8_package, digits_test_set
):
    images, labels = digits_test_set
    fp32, int8 = accuracy(fp32_package, images, labels), accuracy(int8_package, images, labels)
    assert fp32 >= 90.0  # a trained model: the comparison means something
    assert fp32 - int8 <= MAX_DROP_POINTS, f"int8 {int8:.2f}% vs fp32 {fp32:.2f}%"
    assert load_package(int8_package).info.quantization == "int8"


def test_int8_package_runs_in_a_process_without_torchao(int8_package, digits_test_set, tmp_path):
    images = digits_test_set[0][:16]
    logits, report = run_fresh(int8_package, images, tmp_path)
    assert report["imported"] == []
    # The same compiled code; only the thread count (how reductions are split) may differ.
    torch.testing.assert_close(logits, load_package(int8_package)(images), rtol=1e-4, atol=1e-4)


def test_activations_take_7_bits_where_int8_kernels_run_without_vnni(monkeypatch):
    """u8 x s8 pairs summed into saturating int16 without VNNI: the digits package lost 3 points of top-1
    under an AVX2 cap with 8-bit activations."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: False)
    assert int8_reduce_range()
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: True)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert not int8_reduce_range()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")  # ATEN_CPU_CAPABILITY=avx2
    assert int8_reduce_range()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")
    assert int8_reduce_range()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_VNNI")
    assert not int8_reduce_range()


def test_same_padding_becomes_the_equal_numeric_padding():
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding="same"), nn.Conv2d(4, 4, (5, 3), padding="same", dilation=2)
    )
    x = torch.randn(2, 3, 11, 9)
    before = model(x)
    numeric_padding(model)
    assert [m.padding for m in model] == [(1, 1), (4, 2)]
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)


def test_missing_torchao_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.quantization.pt2e.quantize_pt2e", None)
    model = InferenceModel(nn.Sequential(nn.Conv2d(3, 2, 3), nn.Flatten()), (0.5,) * 3, (0.5,) * 3)
    with pytest.raises(MissingExtraError, match=r"pip install 'lightning-compiled-vision\[quantize\]'$"):
        quantize_int8(model, example_batch((8, 8)), example_batch((8, 8)), progress=False)


def test_int8_package_calls_onednn_int8_kernels(int8_package):
    """The mechanism of int8's speed: frozen weights let Inductor lower the quantized patterns to oneDNN's
    ``qconv_pointwise``; unfrozen, the package runs fp32 convolutions around dequantize nodes."""
    with zipfile.ZipFile(int8_package) as archive:
        wrapper = "".join(archive.read(n).decode() for n in archive.namelist() if n.endswith("wrapper.cpp"))
    assert "qconv_pointwise" in wrapper
    assert "aoti_torch_cpu_convolution(" not in wrapper


def test_int8_export_shows_no_warning_from_torchs_own_code(int8_package):
    """Inductor's int8 lowering triggers torch's copy-construct advice; the user cannot act on it."""
    shown = json.loads((int8_package.parent / INT8_EXPORT_WARNINGS).read_text())
    assert not [w for w in shown if "copy construct" in w], shown


def _conv_pool_norm(channels: int = 5) -> nn.Module:
    """airbench's block (conv -> pool -> BN -> GELU), whose BatchNorm ``prepare_pt2e`` cannot fold into the conv,
    and a conv -> BN pair, whose it can; statistics far from 0 and 1 so that a wrong map shows."""
    model = nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1),
        nn.MaxPool2d(2),
        nn.BatchNorm2d(channels),
        nn.GELU(),
        nn.Conv2d(channels, 4, 1),
        nn.BatchNorm2d(4, affine=False),
    )
    generator = torch.Generator().manual_seed(0)
    for norm in (model[2], model[5]):
        c = norm.num_features
        norm.running_mean.copy_(torch.randn(c, generator=generator) * 3)
        norm.running_var.copy_(torch.rand(c, generator=generator) * 4 + 0.1)
        if norm.affine:
            norm.weight.data.copy_(torch.randn(c, generator=generator))  # negative scales too
            norm.bias.data.copy_(torch.randn(c, generator=generator))
    return model.eval()


@pytest.mark.parametrize("shape", [(2, 3, 7, 9), (3, 3, 8, 8)])
def test_batch_norms_become_the_same_affine_map(shape):
    model = _conv_pool_norm()
    x = torch.randn(*shape)
    graph = capture(model, x, strict=True).module()
    batch_norms_as_affine(graph)
    left = [n for n in graph.graph.nodes if n.op == "call_function" and "batch_norm" in str(n.target)]
    assert not left, left
    with torch.no_grad():
        truth = copy.deepcopy(model).double()(x.double())
        got = graph(x).double()
    # the affine map rounds once or twice where BatchNorm rounds three times: fp32 steps of a short chain
    # whose longest sum is the first conv's 27 products
    torch.testing.assert_close(
        got, truth, **dict(zip(("atol", "rtol"), reduction_tolerance(torch.float32, 27 * 4)))
    )


def test_convert_sees_no_batch_norm_so_skips_torchaos_qat_pattern_search(monkeypatch):
    """torchao's conv-BN QAT fold exports 64 patterns whenever a BatchNorm is left (most of an int8 export's
    time); after the rewrite none is left, and the quantized model still answers like the float one."""
    from torchao.quantization.pt2e import quantize_pt2e

    seen: list[list[str]] = []
    real = quantize_pt2e._fold_conv_bn_qat

    def spy(graph):
        seen.append(
            [n.name for n in graph.graph.nodes if n.op == "call_function" and "batch_norm" in str(n.target)]
        )
        return real(graph)

    monkeypatch.setattr(quantize_pt2e, "_fold_conv_bn_qat", spy)
    torch.manual_seed(0)
    model = InferenceModel(nn.Sequential(_conv_pool_norm(), nn.Flatten()), (0.5,) * 3, (0.25,) * 3).eval()
    images = torch.randint(0, 256, (16, 3, 8, 8), dtype=torch.uint8)
    program = quantize_int8(model, images, images[:2], progress=False)
    assert seen == [[]]
    with torch.no_grad():
        reference, quantized = model(images), program.module()(images)
    # int8 activations: a few levels of each tensor's range, not rounding; the same answer for most images
    assert float((quantized.argmax(1) == reference.argmax(1)).float().mean()) >= 0.75
