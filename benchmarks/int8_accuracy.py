"""Top-1 of the int8 package against the fp32 package of the same checkpoint, on the recipe's test split.

    python benchmarks/int8_accuracy.py                                   # digits-small, its full 12 epochs
    python benchmarks/int8_accuracy.py --recipe cifar10-resnet18 --zip-path ../shared/data/cifar10-jpeg.zip \\
        --epochs 4 --limit-per-class 500 --batch-size 128 --lr 0.1

Trains the recipe eagerly (fp32, no logger) unless ``--checkpoint`` is given, exports both packages with
``lcv_vision.deploy``, and classifies the test split with each (the plain evaluation: no test-time
augmentation). Writes ``benchmarks/results/int8_accuracy-<recipe>.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import write_results  # noqa: E402


def train(recipe: str, epochs: int, data: dict, model: dict, folder: Path) -> tuple[Path, float]:
    import lightning.pytorch as pl

    from lcv_vision.recipes import build

    pl.seed_everything(0, verbose=False)
    module, datamodule = build(recipe, data=data, model=model)
    trainer = pl.Trainer(
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=str(folder),
        precision="32-true",
    )
    started = time.perf_counter()
    trainer.fit(module, datamodule=datamodule)
    path = folder / f"{recipe}.ckpt"
    trainer.save_checkpoint(path)
    return path, time.perf_counter() - started


def top1(package: Path, images: torch.Tensor, labels: torch.Tensor) -> float:
    from lcv_vision.deploy import load_package

    model = load_package(package)
    correct = sum(
        int((model(batch).argmax(1) == target).sum())
        for batch, target in zip(images.split(256), labels.split(256))
    )
    return 100.0 * correct / len(labels)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default="digits-small")
    parser.add_argument(
        "--checkpoint", default=None, help="an existing `lcv fit` checkpoint (skips training)"
    )
    parser.add_argument("--epochs", type=int, default=None, help="default: the recipe's")
    parser.add_argument("--zip-path", default=None, help="CIFAR-10 JPEG zip (cifar10 recipes)")
    parser.add_argument("--limit-per-class", type=int, default=None, help="images per class, train and test")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument(
        "--lr", type=float, default=None, help="peak learning rate (scale it with --batch-size)"
    )
    parser.add_argument("--calibration-images", type=int, default=256)
    parser.add_argument("--keep-dir", default=None, help="copy the checkpoint and both packages here")
    args = parser.parse_args()

    from lcv_vision.deploy.export import export_package, load_trained
    from lcv_vision.recipes import get_recipe

    recipe = get_recipe(args.recipe)
    data = {
        k: v
        for k, v in {
            "zip_path": args.zip_path,
            "limit_per_class": args.limit_per_class,
            "batch_size": args.batch_size,
        }.items()
        if v is not None
    }
    epochs = args.epochs or recipe.epochs
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        train_s = None
        checkpoint = Path(args.checkpoint) if args.checkpoint else None
        if checkpoint is None:
            checkpoint, train_s = train(
                recipe.name, epochs, data, {} if args.lr is None else {"lr": args.lr}, folder
            )
        started = time.perf_counter()
        export_package(checkpoint, folder / "fp32.pt2")
        fp32_s = time.perf_counter() - started
        started = time.perf_counter()
        export_package(
            checkpoint, folder / "int8.pt2", quantize="int8", calibration_count=args.calibration_images
        )
        int8_s = time.perf_counter() - started
        datamodule = load_trained(checkpoint).datamodule
        datamodule.setup("test")
        split = datamodule._splits["test"]
        fp32 = top1(folder / "fp32.pt2", split.images, split.targets)
        int8 = top1(folder / "int8.pt2", split.images, split.targets)
        if args.keep_dir:
            keep = Path(args.keep_dir)
            keep.mkdir(parents=True, exist_ok=True)
            for file in (checkpoint, folder / "fp32.pt2", folder / "int8.pt2"):
                shutil.copy(file, keep / f"{recipe.name}-{file.name}")
    result = {
        "recipe": recipe.name,
        "epochs": None if args.checkpoint else epochs,
        "data": {k: v for k, v in data.items()},
        "lr": args.lr,
        "test_images": len(split.targets),
        "calibration_images": args.calibration_images,
        "evaluation": "plain eval transform, no test-time augmentation",
        "fp32_top1": round(fp32, 2),
        "int8_top1": round(int8, 2),
        "drop_points": round(fp32 - int8, 2),
        "train_s": None if train_s is None else round(train_s, 1),
        "export_fp32_s": round(fp32_s, 1),
        "export_int8_s": round(int8_s, 1),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "note": "2-core machine shared with other workers: the times are not benchmarks, the accuracies are",
    }
    path = write_results(f"int8_accuracy-{recipe.name}", result)
    print(f"{recipe.name}: fp32 {fp32:.2f}%  int8 {int8:.2f}%  drop {fp32 - int8:.2f} points -> {path}")


if __name__ == "__main__":
    main()
