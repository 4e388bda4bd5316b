"""``lcv export``, ``lcv classify`` and ``lcv serve``: the deploy subcommands of ``lcv``.

Plain argparse (not LightningCLI): none of them trains, and a package must be usable without Lightning.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lcv_vision.deploy.errors import DeployError

__all__ = ["DEPLOY_SUBCOMMANDS", "main"]

DEPLOY_SUBCOMMANDS = ("export", "classify", "serve")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lcv", description="Export, classify with and serve a trained model."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    export = sub.add_parser("export", help="checkpoint -> one AOTInductor .pt2 (or an .onnx file)")
    export.add_argument(
        "checkpoint", help="a checkpoint written by `lcv fit` (a file, or a compiled_fsdp sharded folder)"
    )
    export.add_argument("--out", required=True, help="the file to write (model.pt2, or model.onnx)")
    export.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    export.add_argument("--quantize", choices=("none", "int8"), default="none", help="int8: PT2E, calibrated")
    export.add_argument("--calibration-images", type=int, default=256, help="training images for int8")
    export.add_argument("--format", choices=("pt2", "onnx"), default="pt2")
    export.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the package runs")
    export.add_argument("--data-root", default=None, help="the data set's folder or zip, if it has moved")

    classify = sub.add_parser("classify", help="top-k labels of image files with a .pt2 package")
    classify.add_argument("package")
    classify.add_argument("images", nargs="+")
    classify.add_argument("--top-k", type=int, default=5)
    classify.add_argument("--json", action="store_true", help="one JSON object per image")

    serve = sub.add_parser("serve", help="an HTTP server (LitServe) classifying posted images")
    serve.add_argument("package")
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0: every one)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-batch-size", type=int, default=8)
    serve.add_argument("--batch-timeout", type=float, default=0.01, help="seconds to wait to fill a batch")
    serve.add_argument("--top-k", type=int, default=5)
    serve.add_argument("--max-image-bytes", type=int, default=None)
    serve.add_argument("--workers", type=int, default=1, help="model copies (processes) on the device")
    return parser


def main(argv: list[str]) -> None:
    """Run one deploy subcommand; a :class:`DeployError` is one line on stderr and exit status 1."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "export":
            _export(args)
        elif args.command == "classify":
            _classify(args)
        else:
            _serve(args)
    except DeployError as err:
        print(f"lcv: error: {err}", file=sys.stderr)
        raise SystemExit(1) from err


def _export(args: argparse.Namespace) -> None:
    quantize = None if args.quantize == "none" else args.quantize
    if args.format == "onnx":
        from lcv_vision.deploy.onnx_export import export_onnx

        report = export_onnx(
            args.checkpoint,
            args.out,
            quantize=quantize,
            calibration_count=args.calibration_images,
            data_root=args.data_root,
        )
        print(f"lcv export: wrote {args.out} ({report})")
        return
    from lcv_vision.deploy.export import export_package

    info = export_package(
        args.checkpoint,
        args.out,
        precision=args.precision,
        quantize=quantize,
        calibration_count=args.calibration_images,
        data_root=args.data_root,
        device=args.device,
    )
    kind = "int8" if info.quantization == "int8" else info.precision
    target = f"cpu {info.cpu_capability}" if info.device == "cpu" else info.device
    print(
        f"lcv export: wrote {args.out} ({kind}, recipe {info.recipe}, uint8 input [N, 3, {info.input_size[0]}, "
        f"{info.input_size[1]}], {len(info.class_names)} classes, {target}, torch {info.torch_version})"
    )


def _classify(args: argparse.Namespace) -> None:
    from lcv_vision.deploy.images import decode_image
    from lcv_vision.deploy.package import load_package

    model = load_package(args.package)
    images = []
    for path in args.images:
        if not Path(path).is_file():
            raise DeployError(f"image {path!r} does not exist")
        images.append(decode_image(Path(path).read_bytes(), name=f"image {path!r}"))
    for path, prediction in zip(args.images, model.predict(images, args.top_k)):
        if args.json:
            print(json.dumps({"image": path, **prediction.as_dict()}))
        else:
            ranked = ", ".join(
                f"{label} {p:.1%}" for label, p in zip(prediction.labels, prediction.probabilities)
            )
            print(f"{path}: {ranked}")


def _serve(args: argparse.Namespace) -> None:
    from lcv_vision.deploy.serve import serve

    serve(
        args.package,
        host=args.host,
        port=args.port,
        max_batch_size=args.max_batch_size,
        batch_timeout=args.batch_timeout,
        top_k=args.top_k,
        max_image_bytes=args.max_image_bytes,
        workers=args.workers,
    )
