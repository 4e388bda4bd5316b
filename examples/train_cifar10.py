"""Train a CIFAR-10 recipe with the Python API (the same objects ``lcv fit`` builds).

    python examples/train_cifar10.py --data-root data/ --download          # torchvision's CIFAR-10
    python examples/train_cifar10.py --zip ../shared/data/cifar10-jpeg.zip --epochs 3
    python examples/train_cifar10.py --recipe cifar10-resnet18 --data-root data/
    python examples/train_cifar10.py --smoke                                # one tiny step, synthetic images

The recipe (default ``cifar10-airbench``) fixes the model, augmentation, optimizer, schedule, EMA/lookahead
and TTA; the flags here override a few of them. On a GPU the Trainer uses ``strategy="compiled"`` and the
recipe's precision, on CPU eager fp32. Prints the final test accuracy (with the recipe's TTA).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--recipe", default="cifar10-airbench", help="a CIFAR-10 recipe (see `lcv recipes cifar10-*`)"
    )
    p.add_argument("--data-root", default=None, help="folder for torchvision's CIFAR-10")
    p.add_argument("--download", action="store_true", help="download CIFAR-10 into --data-root")
    p.add_argument(
        "--zip", default=None, help="zip (or folder) of JPEGs with train/<class>/ and test/<class>/"
    )
    p.add_argument("--epochs", type=int, default=None, help="default: the recipe's")
    p.add_argument("--batch-size", type=int, default=None, help="default: the recipe's")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate; default: the recipe's")
    p.add_argument(
        "--smoke", action="store_true", help="one training step of a tiny model on synthetic images"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    from lightning.pytorch.loggers import TensorBoardLogger

    from lcv_vision.recipes import build, build_trainer, default_callbacks, get_recipe

    recipe = get_recipe(args.recipe, epochs=args.epochs, batch_size=args.batch_size, optim={"lr": args.lr})
    if recipe.dataset != "cifar10":
        raise SystemExit(f"train_cifar10: recipe {recipe.name!r} trains on {recipe.dataset!r}, not CIFAR-10")
    data = {"root": args.data_root, "download": args.download, "zip_path": args.zip}
    model: dict = {}
    trainer_args: dict = {
        "logger": TensorBoardLogger("runs", name=recipe.name),
        "callbacks": default_callbacks(),
    }
    if args.smoke:
        from _smoke import synthetic_image_folder

        data = {"zip_path": synthetic_image_folder({"train": 4, "test": 2}, 10, [(32, 32)]), "batch_size": 8}
        model = (
            {"model_kwargs": {"widths": [8, 8, 8]}, "whitening_images": 16}
            if recipe.model.startswith("airbench")
            else {"model_kwargs": {"width": 4}}
        )
        trainer_args = {
            "fast_dev_run": 1,
            "logger": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
        }
    elif args.data_root is None and args.zip is None:
        raise SystemExit(
            "train_cifar10: give --data-root DIR (with --download to fetch CIFAR-10) or --zip FILE"
        )
    module, datamodule = build(recipe, data=data, model=model)
    trainer = build_trainer(recipe, **trainer_args)
    trainer.fit(module, datamodule)
    result = trainer.test(module, datamodule, verbose=False)[0]
    print(
        f"{recipe.name}: test accuracy {100 * result['test/acc']:.2f}% after {trainer.current_epoch} epoch(s)"
        f" ({trainer.global_step} steps)"
    )
    return result


if __name__ == "__main__":
    main()
