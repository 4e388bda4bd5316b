"""Train on any ImageFolder tree with torchvision's ResNet-50 recipe knobs, or any other backbone.

    python examples/train_imagefolder.py --root /data/imagenette        # train/<class>/*, val/<class>/*
    python examples/train_imagefolder.py --root photos.zip --model resnet18 --epochs 30 --batch-size 64
    python examples/train_imagefolder.py --root DIR --model mobilenet_v3_small   # any torchvision/timm name
    python examples/train_imagefolder.py --smoke                         # one tiny step, synthetic images

The ``imagefolder-resnet50`` recipe follows torchvision's reference recipe (SGD 0.5 per 1024 images, cosine
with 5-epoch warmup, label smoothing 0.1, mixup 0.2 / cutmix 1.0, TrivialAugment, random erasing 0.1, EMA,
no weight decay on norms, FixRes: train 176 / evaluate 224 from 232 px copies); its 600 epochs are for
ImageNet, so pass --epochs for smaller sets. The learning rate is scaled linearly with --batch-size.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=None, help="ImageFolder root (or .zip) with train/ and val/")
    p.add_argument("--model", default=None, help="backbone name: ours (resnet50...), torchvision's or timm's")
    p.add_argument("--epochs", type=int, default=None, help="default: the recipe's 600")
    p.add_argument("--batch-size", type=int, default=None, help="per device; default: the recipe's 128")
    p.add_argument("--image-size", type=int, default=None, help="training crop; default 176")
    p.add_argument("--eval-size", type=int, default=None, help="evaluation crop; default 224")
    p.add_argument("--storage-size", type=int, default=None, help="side of the stored copies; default 232")
    p.add_argument(
        "--smoke", action="store_true", help="one training step of a tiny model on synthetic images"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    from lightning.pytorch.loggers import TensorBoardLogger

    from lcv_vision.recipes import build, build_trainer, default_callbacks, get_recipe

    base = get_recipe("imagefolder-resnet50")
    batch = args.batch_size or base.batch_size
    recipe = get_recipe(
        "imagefolder-resnet50",
        epochs=args.epochs,
        batch_size=batch,
        model=args.model,
        optim={"lr": base.optim.lr * batch / base.batch_size},
        data_kwargs={
            "image_size": args.image_size,
            "eval_image_size": args.eval_size,
            "storage_size": args.storage_size,
        },
    )
    data: dict = {"root": args.root}
    model: dict = {}
    trainer_args: dict = {
        "logger": TensorBoardLogger("runs", name=f"imagefolder-{recipe.model}"),
        "callbacks": default_callbacks(),
    }
    if args.smoke:
        from _smoke import synthetic_image_folder

        root = synthetic_image_folder({"train": 4, "val": 2}, 3, [(40, 48), (36, 36)])
        data = {"root": root, "image_size": 32, "storage_size": 40, "eval_image_size": 36, "batch_size": 6}
        model = {"model_kwargs": {"width": 4}} if recipe.model in ("resnet18", "resnet34", "resnet50") else {}
        trainer_args = {
            "fast_dev_run": 1,
            "logger": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
        }
    elif args.root is None:
        raise SystemExit(
            "train_imagefolder: give --root DIR (or .zip) with train/<class>/* and val/<class>/*"
        )
    module, datamodule = build(recipe, data=data, model=model)
    trainer = build_trainer(recipe, **trainer_args)
    trainer.fit(module, datamodule)
    result = trainer.test(module, datamodule, verbose=False)[0]
    print(
        f"{recipe.model} on {data['root']}: top-1 {100 * result['test/acc']:.2f}% after "
        f"{trainer.current_epoch} epoch(s) ({trainer.global_step} steps)"
    )
    return result


if __name__ == "__main__":
    main()
