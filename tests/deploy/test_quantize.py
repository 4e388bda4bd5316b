"""``lcv export --quantize int8``: PT2E int8 that keeps digits-small's accuracy and loads without torchao."""

from __future__ import annotations

import json
import sys
import zipfile

import pytest
import torch
from torch import nn

from deploy_helpers import INT8_EXPORT_WARNINGS, run_fresh
from lcv_vision.deploy import MissingExtraError, load_package
from lcv_vision.deploy.export import InferenceModel, example_batch
from lcv_vision.deploy.quantize import int8_reduce_range, numeric_padding, quantize_int8

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
