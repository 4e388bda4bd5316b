"""``lcv export --format onnx``: the same uint8-in, logits-out graph as an ONNX file, checked in ONNX Runtime.

For runtimes other than PyTorch (ONNX Runtime, OpenVINO, TensorRT). ``torch.onnx.export(dynamo=True)`` starts
from ``torch.export``, so what cannot be exported fails the same way as for a ``.pt2``. The package's metadata
is in the model's ``metadata_props`` (key ``lcv.info``). ``--quantize int8`` is ONNX Runtime's static QDQ
quantization, calibrated on training images like the PT2E path.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lcv_vision.deploy.capture import MAX_BATCH, describe_failure
from lcv_vision.deploy.errors import DeployError, UnexportableModelError, import_extra
from lcv_vision.deploy.export import (
    InferenceModel,
    calibration_images,
    example_batch,
    load_trained,
    package_info,
)

__all__ = ["export_onnx", "onnx_logits"]

#: Relative bound of ONNX Runtime's fp32 logits against eager ones (``max|diff| / (1 + max|eager|)``): many
#: fp32 reductions in another order; a wrong graph is off by O(1).
FP32_CHECK = 1e-3


def export_onnx(
    checkpoint: str | Path,
    out: str | Path,
    quantize: str | None = None,
    calibration_count: int = 256,
    data_root: str | None = None,
) -> str:
    """Write ``out`` (.onnx), run it in ONNX Runtime against the eager model; returns what was checked."""
    onnx = import_extra("onnx", "onnx", "--format onnx")
    import_extra("onnxscript", "onnx", "--format onnx")
    trained = load_trained(checkpoint, data_root)
    model = InferenceModel(trained.network, trained.mean, trained.std).eval()
    example = example_batch(trained.transform.size)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fp32_path = out if quantize is None else out.with_suffix(".fp32.onnx")
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    try:
        program = torch.onnx.export(
            model,
            (example,),
            dynamo=True,
            dynamic_shapes=({0: batch},),
            input_names=["images"],
            output_names=["logits"],
            verbose=False,
        )
    except Exception as err:  # torch.onnx wraps the torch.export error
        cause = err.__cause__ if err.__cause__ is not None else err
        raise UnexportableModelError(describe_failure(cause, model)) from err
    assert program is not None  # dynamo=True returns the ONNXProgram
    program.save(str(fp32_path))
    info = package_info(trained, "fp32", "int8" if quantize == "int8" else "none", "cpu")
    _set_metadata(onnx, fp32_path, info.to_metadata())
    with torch.no_grad():
        reference = model(example)
    error = float(np.abs(onnx_logits(fp32_path, example) - reference.numpy()).max())
    if error > FP32_CHECK * (1.0 + float(reference.abs().max())):
        raise DeployError(f"ONNX Runtime's logits differ from the eager model's by {error:.3g}: not written")
    report = f"ONNX Runtime fp32 matches eager logits within {error:.2g}"
    if quantize == "int8":
        _quantize_static(fp32_path, out, calibration_images(trained, calibration_count))
        _set_metadata(onnx, out, info.to_metadata())
        agree = float((onnx_logits(out, example).argmax(1) == reference.numpy().argmax(1)).mean())
        report += (
            f"; int8 (ONNX Runtime static QDQ) written, top-1 agreement on the example batch {agree:.0%}"
        )
    return report


def onnx_logits(path: str | Path, images: torch.Tensor) -> np.ndarray:
    """Logits of an exported ONNX model in ONNX Runtime (CPU) for uint8 ``images``."""
    ort = import_extra("onnxruntime", "onnx", "running an ONNX model")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(["logits"], {"images": images.numpy()})[0])


def _set_metadata(onnx: Any, path: Path, metadata: dict[str, str]) -> None:
    model = onnx.load(str(path))
    onnx.helper.set_model_props(model, metadata)
    onnx.save(model, str(path))


def _quantize_static(source: Path, out: Path, calibration: torch.Tensor) -> None:
    quantization = import_extra("onnxruntime.quantization", "onnx", "--format onnx --quantize int8")

    class Reader(quantization.CalibrationDataReader):  # type: ignore[name-defined]  # untyped extra
        def __init__(self) -> None:
            self.batches = iter(calibration.split(32))

        def get_next(self) -> dict[str, np.ndarray] | None:
            batch = next(self.batches, None)
            return None if batch is None else {"images": batch.numpy()}

    root = logging.getLogger()
    level = root.level
    root.setLevel(
        logging.ERROR
    )  # its advice to pre-process and per-axis notes on BN vectors, on the root logger
    try:
        quantization.quantize_static(
            str(source),
            str(out),
            Reader(),
            quant_format=quantization.QuantFormat.QDQ,
            per_channel=True,
            activation_type=quantization.QuantType.QInt8,
            weight_type=quantization.QuantType.QInt8,
        )
    finally:
        root.setLevel(level)
