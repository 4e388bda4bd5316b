"""CPU inference of one model through every deploy path: images/s and latency at batch 1 and 32.

    python benchmarks/inference.py --checkpoint runs/cifar10-resnet18/version_0/checkpoints/last.ckpt
    python benchmarks/inference.py --checkpoint CKPT --image-size 224 --repeats 3 --out-name inference-cpu-224
    python benchmarks/inference.py --recipe cifar10-resnet18          # untrained weights: speed only

Sides, all in this one process: eager fp32, our ``.pt2`` fp32 (``torch.export`` + AOTInductor), ``.pt2`` int8
(PT2E), ``.pt2`` bf16 (only with AMX), ONNX Runtime fp32 and int8 (static QDQ), OpenVINO fp32 (f32 forced), its
default precision, and OpenVINO + NNCF int8. A side whose package is not installed (``pip install '.[bench]'``)
is skipped with a message. Each side is warmed up, then the sides alternate call by call for ``--repeats``
rounds (a load change from the machine's other users hits every side alike); the median is reported. With a
checkpoint, every side also classifies the same ``--test-images`` real test images (top-1), and the int8 sides
are calibrated on the same real training images. ``--image-size`` other than the checkpoint's runs the same
weights at that size (images resized bilinearly on the host). Writes ``benchmarks/results/<--out-name>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import ResultStream, machine_info, print_table, write_results  # noqa: E402

BATCHES = (1, 32)

Runner = Callable[[torch.Tensor], Any]


def trained_or_built(args: argparse.Namespace) -> Any:
    """``TrainedModel`` of a checkpoint (at ``--image-size`` when given), or of the recipe's model with its
    initial weights."""
    from lcv_vision.deploy.export import TrainedModel, load_trained
    from lcv_vision.deploy.host_transform import HostTransform
    from lcv_vision.recipes import build_module

    if args.checkpoint:
        trained = load_trained(args.checkpoint, args.data_root)
        if args.image_size and (args.image_size, args.image_size) != tuple(trained.transform.size):
            size = (args.image_size, args.image_size)
            transform = dataclasses.replace(
                trained.transform, storage_size=args.image_size, ops=(), size=size
            )
            trained = dataclasses.replace(trained, transform=transform)
        return trained
    module = build_module(args.recipe, num_classes=10).eval()
    size = args.image_size or 32
    datamodule = argparse.Namespace(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    transform = HostTransform(storage_size=size, ops=(), size=(size, size))
    classes = tuple(str(i) for i in range(10))
    return TrainedModel(
        module.model.eval().requires_grad_(False), args.recipe, datamodule, classes, transform
    )


def resized(images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """uint8 images at ``size`` (bilinear; unchanged when already there)."""
    if tuple(images.shape[-2:]) == tuple(size):
        return images.contiguous()
    out = [
        F.interpolate(chunk.float(), size=size, mode="bilinear", align_corners=False)
        .round()
        .clamp(0, 255)
        .to(torch.uint8)
        for chunk in images.split(64)
    ]
    return torch.cat(out).contiguous()


def real_images(trained: Any, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(calibration, test images, test labels)``: real images of the checkpoint's data at the package size,
    the test images a seeded draw of ``--test-images`` from the test split."""
    from lcv_vision.deploy.export import calibration_images

    size = tuple(trained.transform.size)
    calibration = resized(calibration_images(trained, args.calibration_images), size)
    datamodule = trained.datamodule
    datamodule.setup("test")
    split = datamodule._splits["test"]
    generator = torch.Generator().manual_seed(0)
    pick = torch.randperm(len(split.targets), generator=generator)[: args.test_images]
    images = torch.as_tensor(split.images)[pick]
    if images.dtype != torch.uint8:
        raise SystemExit(f"the test split holds {images.dtype} images, expected uint8")
    return calibration, resized(images, size), torch.as_tensor(split.targets)[pick]


def sides(trained: Any, calibration: torch.Tensor, folder: Path, stream: ResultStream) -> dict[str, Runner]:
    """``name -> fn(uint8 batch) -> logits`` for every side that can be built here."""
    from lcv_vision.deploy.capture import capture
    from lcv_vision.deploy.export import InferenceModel, compile_package, example_batch, package_info
    from lcv_vision.deploy.package import amx_supported, load_package

    size = trained.transform.size
    eager = InferenceModel(trained.network, trained.mean, trained.std).eval()
    out: dict[str, Runner] = {"eager fp32": torch.no_grad()(eager)}
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
        stream.skip("pt2 bf16", "no AMX on this CPU (lcv export --precision bf16 refuses it here)")
    out.update(_onnx_sides(eager, example, calibration, folder, stream))
    return out


def _onnx_sides(
    eager: torch.nn.Module,
    example: torch.Tensor,
    calibration: torch.Tensor,
    folder: Path,
    stream: ResultStream,
) -> dict[str, Runner]:
    out: dict[str, Runner] = {}
    threads = torch.get_num_threads()
    try:
        import onnxruntime as ort
        from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    except ImportError as err:
        for name in (
            "onnxruntime fp32",
            "onnxruntime int8",
            "openvino fp32",
            "openvino default",
            "openvino int8",
        ):
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
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    for name, file in (("onnxruntime fp32", path), ("onnxruntime int8", folder / "int8.onnx")):
        session = ort.InferenceSession(str(file), options, providers=["CPUExecutionProvider"])
        out[name] = lambda x, s=session: s.run(None, {"images": x.numpy()})[0]
    try:
        import nncf
        import openvino as ov
    except ImportError as err:
        for name in ("openvino fp32", "openvino default", "openvino int8"):
            stream.skip(name, f"{err} (pip install '.[bench]')")
        return out
    core = ov.Core()
    model = ov.convert_model(str(path))
    config = {"INFERENCE_NUM_THREADS": threads}
    compiled = {
        "openvino fp32": core.compile_model(model, "CPU", {**config, "INFERENCE_PRECISION_HINT": "f32"}),
        "openvino default": core.compile_model(model, "CPU", config),
    }
    quantized = nncf.quantize(model, nncf.Dataset([b.numpy() for b in calibration.split(32)]))
    compiled["openvino int8"] = core.compile_model(quantized, "CPU", config)
    for name, network in compiled.items():
        precision = str(network.get_property("INFERENCE_PRECISION_HINT"))
        print(f"{name}: OpenVINO inference precision {precision}", flush=True)
        request = network.create_infer_request()
        out[name] = lambda x, r=request: r.infer([x.numpy()])[0]
    return out


def as_logits(output: Any) -> torch.Tensor:
    """A side's output (tensor, array, or a sequence holding one) as a float tensor."""
    if isinstance(output, (list, tuple)):
        output = output[0]
    return torch.as_tensor(np.asarray(output) if not isinstance(output, torch.Tensor) else output).float()


def top1(run: Runner, images: torch.Tensor, labels: torch.Tensor) -> float:
    """Percent of ``images`` whose arg-max logit is the label (batches of 32)."""
    correct = sum(
        int((as_logits(run(batch.contiguous())).argmax(1) == target).sum())
        for batch, target in zip(images.split(32), labels.split(32))
    )
    return 100.0 * correct / len(labels)


def alternate(
    runners: dict[str, Runner], images: torch.Tensor, warmup: int, repeats: int
) -> dict[str, float]:
    """Median ms of one call of each side on ``images``: ``warmup`` calls per side, then ``repeats`` rounds of
    one call per side in turn (so the machine's other load falls on every side alike)."""
    for run in runners.values():
        for _ in range(warmup):
            run(images)
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            started = time.perf_counter()
            run(images)
            samples[name].append((time.perf_counter() - started) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--checkpoint", default=None, help="an `lcv fit` checkpoint (default: --recipe untrained)"
    )
    parser.add_argument("--recipe", default="cifar10-resnet18")
    parser.add_argument(
        "--image-size", type=int, default=None, help="default: the checkpoint's size (32 without one)"
    )
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--calibration-images", type=int, default=256)
    parser.add_argument("--test-images", type=int, default=1000, help="real test images for top-1")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out-name", default="inference-cpu")
    args = parser.parse_args()

    stream = ResultStream("inference")
    trained = trained_or_built(args)
    size = tuple(trained.transform.size)
    if args.checkpoint:
        calibration, test_images, test_labels = real_images(trained, args)
    else:  # random pixels: speed only (it does not depend on the values)
        generator = torch.Generator().manual_seed(0)
        calibration = torch.randint(
            0, 256, (args.calibration_images, 3, *size), dtype=torch.uint8, generator=generator
        )
        test_images, test_labels = calibration, None
    load_before = os.getloadavg()
    accuracy: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        runners = sides(trained, calibration, Path(tmp), stream)
        if test_labels is not None:
            for name, run in runners.items():
                accuracy[name] = round(top1(run, test_images, test_labels), 2)
                print(
                    f"{name:18s} top-1 {accuracy[name]:6.2f}% on {len(test_labels)} test images", flush=True
                )
        for batch in BATCHES:
            images = test_images[:batch].contiguous()
            for name, ms in alternate(runners, images, args.warmup, args.repeats).items():
                stream.add(
                    {
                        "side": name,
                        "batch": batch,
                        "ms": round(ms, 3),
                        "images_per_s": round(1000 * batch / ms, 1),
                        "top1": accuracy.get(name),
                    }
                )
                print(
                    f"{name:18s} batch {batch:3d}: {ms:8.3f} ms  {1000 * batch / ms:10.1f} images/s",
                    flush=True,
                )
    print_table(stream.rows, ["side", "batch", "ms", "images_per_s", "top1"])
    path = write_results(
        args.out_name,
        {
            "model": args.checkpoint or f"{args.recipe} (initial weights)",
            "recipe": trained.recipe,
            "input": [3, *size],
            "test_images": None if test_labels is None else len(test_labels),
            "calibration_images": args.calibration_images,
            "threads": torch.get_num_threads(),
            "warmup": args.warmup,
            "repeats": args.repeats,
            "timing": "sides alternate call by call in one process; median of the repeats",
            "rows": stream.rows,
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "note": "2-core machine shared with other agents (see the load averages): ratios between sides "
            "measured in this run are what to read; absolute times vary run to run",
            "machine": machine_info(),
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
