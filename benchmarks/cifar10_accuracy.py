"""Proof on real data: train the ``cifar10-airbench`` recipe on the CIFAR-10 JPEGs and report test accuracy.

The full recipe (airbench94: widths 64/256/256, 10 epochs, batch 1024, TTA) aims at 94% on the original
CIFAR-10 and >= 93.5% on the JPEG copy. On a CPU that takes hours, so the flags below shrink the run;
every reduction is recorded in the JSON next to the accuracy.

    python benchmarks/cifar10_accuracy.py                                   # the full recipe
    OMP_NUM_THREADS=1 python benchmarks/cifar10_accuracy.py --threads 1 --epochs 3 --widths 32 64 64

Writes ``benchmarks/results/cifar10_accuracy-<cpu|gpu>[-<tag>].json``: test accuracy (with the recipe's
TTA), epochs, wall times (data loading, training, testing), device, versions and every setting.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # our packages, uninstalled
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vision"))

import torch  # noqa: E402

from benchmarks._common import SHARED_ZIP, ResultStream, machine_info, write_results  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--zip", default=SHARED_ZIP, help="CIFAR-10 JPEG zip (ImageFolder layout)")
    p.add_argument("--recipe", default="cifar10-airbench")
    p.add_argument("--epochs", type=int, default=None, help="train this many epochs (default: the recipe's)")
    p.add_argument(
        "--widths", type=int, nargs=3, default=None, help="airbench group widths (default: recipe's)"
    )
    p.add_argument("--batch-size", type=int, default=None, help="default: the recipe's")
    p.add_argument("--limit-per-class", type=int, default=None, help="use only this many images per class")
    p.add_argument(
        "--tta", default=None, choices=["none", "flip", "flip_translate"], help="default: recipe's"
    )
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument(
        "--compile-backend",
        default=None,
        help="torch.compile backend instead of the recipe's (Inductor); 'aot_eager' in dry runs: the same "
        "Trainer, strategy and graphs, without generating and building C++",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="", help="suffix of the result file name")
    p.add_argument("--no-write", action="store_true", help="do not write the JSON (smoke tests)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not os.path.exists(args.zip):
        raise SystemExit(f"cifar10_accuracy: {args.zip} not found; pass --zip PATH to the CIFAR-10 JPEG zip")

    import lightning.pytorch as pl

    from lcv_vision.recipes import build, build_trainer, get_recipe, trainer_kwargs

    recipe = get_recipe(args.recipe)
    gpu = torch.cuda.is_available()
    model_overrides = {"tta": args.tta}
    if args.widths:
        model_overrides["model_kwargs"] = {**recipe.model_kwargs, "widths": list(args.widths)}
    data = {
        "zip_path": args.zip,
        "limit_per_class": args.limit_per_class,
        "batch_size": args.batch_size,
        "num_workers": max(1, torch.get_num_threads()),
    }
    strategy = {}
    if args.compile_backend:  # built before the data, so a backend torch does not know fails at once
        from lightning_plugin import CompiledStrategy

        settings = trainer_kwargs(recipe, gpu, backend=args.compile_backend)["strategy"]["init_args"]
        strategy = {"strategy": CompiledStrategy(**settings)}
    pl.seed_everything(args.seed, workers=True)
    started = time.perf_counter()
    module, datamodule = build(recipe, data=data, model=model_overrides)
    datamodule.setup("fit")  # decode the JPEGs now, so loading is timed on its own
    loaded = time.perf_counter()
    run_dir = tempfile.mkdtemp(prefix="lcv-cifar10-accuracy-")  # the strategy's compile cache goes here
    atexit.register(shutil.rmtree, run_dir, ignore_errors=True)
    trainer = build_trainer(
        recipe,
        gpu=gpu,
        **strategy,
        default_root_dir=run_dir,
        max_epochs=args.epochs or recipe.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,  # no validation during the run: the test at the end is the measurement
    )
    trainer.fit(module, datamodule)
    trained = time.perf_counter()
    result = trainer.test(module, datamodule, verbose=False)[0]
    tested = time.perf_counter()

    full = {
        "epochs": recipe.epochs,
        "widths": list(recipe.model_kwargs.get("widths", [64, 256, 256])),
        "batch_size": recipe.batch_size,
        "images_per_class": "all (5000 train / 1000 test)",
        "tta": recipe.tta,
    }
    used = {
        "epochs": trainer.current_epoch,
        "widths": list(module.hparams.model_kwargs.get("widths", [64, 256, 256])),
        "batch_size": datamodule.batch_size,
        "images_per_class": args.limit_per_class or "all (5000 train / 1000 test)",
        "tta": module.hparams.tta,
    }
    payload = {
        "recipe": recipe.name,
        "data": os.path.basename(args.zip),
        "test_accuracy": float(result["test/acc"]),
        "test_accuracy_top5": float(result.get("test/acc_top5", float("nan"))),
        "train_images": datamodule.train_dataloader().num_samples,
        "test_images": datamodule.test_dataloader().num_samples,
        "steps": trainer.global_step,
        "seconds": {
            "load_data": loaded - started,
            "train": trained - loaded,
            "test": tested - trained,
            "total": tested - started,
        },
        "device": machine_info()["device"],
        "precision": trainer.precision,
        "strategy": type(trainer.strategy).__name__,
        "compile_backend": args.compile_backend or "the recipe's (inductor)",
        "settings_used": used,
        "full_recipe": full,
        "reduced": {k: {"full": full[k], "used": used[k]} for k in full if full[k] != used[k]},
        "command": "python benchmarks/cifar10_accuracy.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    print(
        f"{recipe.name}: test accuracy {100 * payload['test_accuracy']:.2f}% after {used['epochs']} epochs "
        f"({payload['steps']} steps) in {payload['seconds']['total']:.0f} s on {payload['device']}"
    )
    if payload["reduced"]:
        print(f"reduced from the full recipe: {payload['reduced']}")
    if not args.no_write:
        ResultStream("cifar10_accuracy").add(
            {
                key: payload[key]
                for key in ("recipe", "test_accuracy", "steps", "seconds", "precision", "reduced")
            }
            | {"reached_94": payload["test_accuracy"] >= 0.94}
        )
        name = f"cifar10_accuracy-{'gpu' if gpu else 'cpu'}" + (f"-{args.tag}" if args.tag else "")
        print(f"wrote {write_results(name, payload)}")
    return payload


if __name__ == "__main__":
    main()
