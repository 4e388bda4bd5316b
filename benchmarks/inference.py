"""CPU inference of one model through every deploy path: images/s and latency at batch 1 and 32.

    python benchmarks/inference.py --checkpoint runs/cifar10-resnet18/version_0/checkpoints/last.ckpt
    python benchmarks/inference.py --recipe cifar10-resnet18          # untrained weights: speed only

Sides, all in this one process, each warmed up and timed ``--repeats`` times (median): eager fp32, our
``.pt2`` fp32 (``torch.export`` + AOTInductor), ``.pt2`` int8 (PT2E), ``.pt2`` bf16 (only with AMX), ONNX
Runtime fp32 and int8 (static QDQ), OpenVINO fp32 (f32 forced) and int8 (NNCF). A side whose package is not
installed (``pip install '.[bench]'``) is skipped with a message. Writes ``benchmarks/results/inference-cpu.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ResultStream, machine_info, print_table, time_ms, write_results  # noqa: E402

BATCHES = (1, 32)


def trained_or_built(args: argparse.Namespace) -> Any:
    """``TrainedModel`` of a checkpoint, or of the recipe's model with its initial weights."""
    from lcv_vision.deploy.export import TrainedModel, load_trained
    from lcv_vision.deploy.host_transform import HostTransform
    from lcv_vision.recipes import build_module

    if args.checkpoint:
        return load_trained(args.checkpoint, args.data_root)
    module = build_module(args.recipe, num_classes=10).eval()
    size = args.image_size
    datamodule = argparse.Namespace(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    transform = HostTransform(storage_size=size, ops=(), size=(size, size))
    classes = tuple(str(i) for i in range(10))
    return TrainedModel(
        module.model.eval().requires_grad_(False), args.recipe, datamodule, classes, transform
    )


def sides(trained: Any, calibration: torch.Tensor, folder: Path, stream: ResultStream) -> dict[str, Callable]:
    """``name -> fn(uint8 batch) -> logits`` for every side that can be built here."""
    from lcv_vision.deploy.capture import capture
    from lcv_vision.deploy.export import InferenceModel, compile_package, example_batch, package_info
    from lcv_vision.deploy.package import amx_supported, load_package

    size = trained.transform.size
    eager = InferenceModel(trained.network, trained.mean, trained.std).eval()
    out: dict[str, Callable] = {"eager fp32": torch.no_grad()(eager)}
    example = example_batch(size)
    compile_package(
        capture(eager, example), folder / "fp32.pt2", package_info(trained, "fp32", "none", "cpu")
    )
    out["pt2 fp32"] = load_package(folder / "fp32.pt2")
    try:
        from lcv_vision.deploy.quantize import quantize_int8

        program = quantize_int8(eager, calibration, example)
        compile_package(program, folder / "int8.pt2", package_info(trained, "fp32", "int8", "cpu"))
        out["pt2 int8"] = load_package(folder / "int8.pt2")
    except ImportError as err:
        stream.skip("pt2 int8", str(err))
    if amx_supported():
        bf16 = InferenceModel(trained.network, trained.mean, trained.std, torch.bfloat16).eval()
        compile_package(
            capture(bf16, example), folder / "bf16.pt2", package_info(trained, "bf16", "none", "cpu")
        )
        out["pt2 bf16"] = load_package(folder / "bf16.pt2")
    else:
        stream.skip("pt2 bf16", "no AMX on this CPU")
    out.update(_onnx_sides(eager, example, calibration, folder, stream))
    return out


def _onnx_sides(
    eager: torch.nn.Module,
    example: torch.Tensor,
    calibration: torch.Tensor,
    folder: Path,
    stream: ResultStream,
) -> dict[str, Callable]:
    out: dict[str, Callable] = {}
    try:
        import onnxruntime as ort
        from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    except ImportError as err:
        for name in ("onnxruntime fp32", "onnxruntime int8", "openvino fp32", "openvino int8"):
            stream.skip(name, f"{err} (pip install '.[bench]')")
        return out
    path = folder / "model.onnx"
    batch = torch.export.Dim("batch", min=1, max=4096)
    program = torch.onnx.export(
        eager, (example,), dynamo=True, dynamic_shapes=({0: batch},), input_names=["images"]
    )
    assert program is not None
    program.save(str(path))

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter(calibration.split(32))

        def get_next(self) -> dict[str, np.ndarray] | None:
            b = next(self.batches, None)
            return None if b is None else {"images": b.numpy()}

    quantize_static(
        str(path),
        str(folder / "int8.onnx"),
        Reader(),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
    )
    for name, file in (("onnxruntime fp32", path), ("onnxruntime int8", folder / "int8.onnx")):
        session = ort.InferenceSession(str(file), providers=["CPUExecutionProvider"])
        out[name] = lambda x, s=session: s.run(None, {"images": x.numpy()})[0]
    try:
        import nncf
        import openvino as ov
    except ImportError as err:
        for name in ("openvino fp32", "openvino int8"):
            stream.skip(name, f"{err} (pip install '.[bench]')")
        return out
    core = ov.Core()
    model = ov.convert_model(str(path))
    fp32 = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    out["openvino fp32"] = lambda x, m=fp32: m(x.numpy())[0]
    quantized = nncf.quantize(model, nncf.Dataset([b.numpy() for b in calibration.split(32)]))
    int8 = core.compile_model(quantized, "CPU")
    out["openvino int8"] = lambda x, m=int8: m(x.numpy())[0]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--checkpoint", default=None, help="an `lcv fit` checkpoint (default: --recipe untrained)"
    )
    parser.add_argument("--recipe", default="cifar10-resnet18")
    parser.add_argument("--image-size", type=int, default=32, help="without --checkpoint")
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--calibration-images", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out-name", default="inference-cpu")
    args = parser.parse_args()

    stream = ResultStream("inference")
    trained = trained_or_built(args)
    generator = torch.Generator().manual_seed(0)
    size = trained.transform.size
    # Random pixels calibrate the int8 sides the same way for every runtime (speed does not depend on them).
    calibration = torch.randint(
        0, 256, (args.calibration_images, 3, *size), dtype=torch.uint8, generator=generator
    )
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        runners = sides(trained, calibration, Path(tmp), stream)
        for name, run in runners.items():
            for batch in BATCHES:
                images = calibration[:batch].contiguous()
                ms = time_ms(lambda run=run, images=images: run(images), args.warmup, args.repeats)
                stream.add(
                    {
                        "side": name,
                        "batch": batch,
                        "ms": round(ms, 3),
                        "images_per_s": round(1000 * batch / ms, 1),
                    }
                )
                print(
                    f"{name:18s} batch {batch:3d}: {ms:8.3f} ms  {1000 * batch / ms:10.1f} images/s",
                    flush=True,
                )
    print_table(stream.rows, ["side", "batch", "ms", "images_per_s"])
    path = write_results(
        args.out_name,
        {
            "model": args.checkpoint or f"{args.recipe} (initial weights)",
            "input": [3, *size],
            "threads": torch.get_num_threads(),
            "warmup": args.warmup,
            "repeats": args.repeats,
            "rows": stream.rows,
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "machine": machine_info(),
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
