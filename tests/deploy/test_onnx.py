"""``lcv export --format onnx``: an ONNX file ONNX Runtime runs with the eager logits; its static int8."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from lcv_kernels.tolerances import bound, reduction_tolerance

pytest.importorskip("jsonargparse", reason="lcv needs jsonargparse (not on the GPU image)")
from lcv_vision.cli import main  # noqa: E402
from lcv_vision.deploy.export import InferenceModel, load_trained  # noqa: E402
from lcv_vision.deploy.onnx_export import onnx_logits  # noqa: E402
from lcv_vision.deploy.package import METADATA_KEY  # noqa: E402

pytestmark = pytest.mark.xdist_group("deploy")


def test_onnx_file_matches_eager_logits_in_onnx_runtime(digits_checkpoint, digits_test_set, tmp_path, capsys):
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    out = tmp_path / "digits-int8.onnx"
    main(["export", str(digits_checkpoint), "--out", str(out), "--format", "onnx", "--quantize", "int8"])
    assert "ONNX Runtime fp32 matches eager logits" in capsys.readouterr().out
    fp32_path = out.with_suffix(".fp32.onnx")
    props = {p.key: p.value for p in onnx.load(str(fp32_path)).metadata_props}
    assert json.loads(props[METADATA_KEY])["recipe"] == "digits-small"

    images, labels = digits_test_set
    trained = load_trained(digits_checkpoint)
    with torch.no_grad():
        reference = InferenceModel(trained.network, trained.mean, trained.std).eval()(images)
    fp32 = torch.from_numpy(onnx_logits(fp32_path, images))
    # Another runtime's fp32 kernels: same sums in another order; as far as rounding goes the chain of layers is
    # one sum of all their fan-ins (test_export's logits_tolerance), at the logits' scale.
    fan_ins = [
        m.weight[0].numel() for m in trained.network.modules() if isinstance(m, (nn.Conv2d, nn.Linear))
    ]
    assert (fp32 - reference).abs().max() <= bound(
        reduction_tolerance(torch.float32, sum(fan_ins)), reference
    )
    int8 = torch.from_numpy(onnx_logits(out, images))
    agreement = float((int8.argmax(1) == fp32.argmax(1)).float().mean())
    assert agreement >= 0.9  # quantized, not broken (chance is 0.1)
    assert float((int8.argmax(1) == labels).float().mean()) >= 0.85
