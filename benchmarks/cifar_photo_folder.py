"""A small photo folder (``train/<class>/*.jpg``, ``val/<class>/*.jpg``) cut from the CIFAR-10 JPEG zip: what the
224-px serving and inference checks train their ``imagefolder-*`` package on.

    python benchmarks/cifar_photo_folder.py --out /tmp/photos                 # 16 train + 4 val JPEGs per class
    lcv fit --recipe imagefolder-resnet50 --model.model resnet18 --data.root /tmp/photos --trainer.max_epochs 1
    lcv export runs/imagefolder-resnet50/version_0/checkpoints/last.ckpt --out r18-224-int8.pt2 --quantize int8
    python benchmarks/serve_load.py r18-224-int8.pt2 --upscale 320 256 --out-name serve-cpu-224

The files are copied byte for byte (the recipe resizes them); training images come from the zip's ``train/``,
validation images from its ``test/``, the first files of each class in name order, so two runs give the same
folder. A model trained on it for one epoch is a speed check, not a classifier.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import SHARED_ZIP  # noqa: E402

SPLITS = {"train": "train", "val": "test"}  # folder written <- split read from the zip


def write_cifar_photo_folder(zip_path: str, out: Path, per_class: dict[str, int]) -> dict[str, int]:
    """Copy ``per_class[split]`` JPEGs of each class into ``out/split/<class>/``; the count written per split."""
    written = {}
    with zipfile.ZipFile(zip_path) as archive:
        names = sorted(n for n in archive.namelist() if n.endswith(".jpg"))
        for split, source in SPLITS.items():
            taken: collections.Counter[str] = collections.Counter()
            for name in names:
                parts = name.split("/")
                if len(parts) != 3 or parts[0] != source or taken[parts[1]] >= per_class[split]:
                    continue
                target = out / split / parts[1] / parts[2]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(archive.read(name))
                taken[parts[1]] += 1
            if not taken:
                raise SystemExit(f"{zip_path} has no {source}/<class>/*.jpg files")
            written[split] = sum(taken.values())
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zip-path", default=SHARED_ZIP, help="CIFAR-10 JPEG zip (train|test/<class>/*.jpg)")
    parser.add_argument(
        "--out", required=True, type=Path, help="folder to write (must not exist, or be empty)"
    )
    parser.add_argument("--train-per-class", type=int, default=16)
    parser.add_argument("--val-per-class", type=int, default=4)
    args = parser.parse_args()
    if args.train_per_class < 1 or args.val_per_class < 1:
        parser.error("--train-per-class and --val-per-class must be >= 1")
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"--out {args.out} is not empty: give a new folder")
    if not Path(args.zip_path).is_file():
        parser.error(f"--zip-path {args.zip_path} does not exist")
    written = write_cifar_photo_folder(
        args.zip_path, args.out, {"train": args.train_per_class, "val": args.val_per_class}
    )
    print(f"wrote {written['train']} training and {written['val']} validation JPEGs to {args.out}")


if __name__ == "__main__":
    main()
