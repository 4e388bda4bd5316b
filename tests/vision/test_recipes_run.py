"""Every registered recipe builds and trains one step on tiny data (tiny widths, 32 px, a few images)."""

from __future__ import annotations

import pytest
import torch

import lcv_vision.data.compiled as compiled_data
from lcv_vision.recipes import build, build_trainer, get_recipe, list_recipes


@pytest.fixture(autouse=True)
def _traced_pipelines(monkeypatch):
    """The data pipelines traced by dynamo and AOTAutograd like the models (``_traced_only``), not compiled by
    Inductor (a C++ build per pipeline): the recipes' wiring is the subject here; the pipelines' Inductor code
    is tested in tests/data/test_data_compiled.py."""
    monkeypatch.setattr(compiled_data, "BACKEND", "aot_eager")


def _tiny_model(model: str) -> dict:
    if model.startswith("airbench"):
        return {"model_kwargs": {"widths": [8, 8, 8]}, "whitening_images": 16}
    if "resnet" in model:
        return {"model_kwargs": {"width": 4}}
    if model.startswith("vit"):
        return {"model_kwargs": {"dim": 16, "depth": 1, "num_heads": 2}}
    raise AssertionError(f"no tiny settings for model {model!r}: add them here")


def _tiny_data(dataset: str, tiny_cifar: str, tiny_imagefolder: str) -> dict:
    if dataset == "digits":
        return {"batch_size": 16}
    if dataset == "cifar10":
        return {"zip_path": tiny_cifar, "batch_size": 8, "num_workers": 1}
    if dataset == "imagefolder":
        return {
            "root": tiny_imagefolder,
            "image_size": 32,
            "storage_size": 40,
            "eval_image_size": 36,
            "batch_size": 6,
            "num_workers": 1,
        }
    raise AssertionError(f"no tiny data for {dataset!r}")


def _traced_only(recipe):
    """The recipe's CPU strategy with ``aot_eager``: dynamo and AOTAutograd trace every recipe's model (graph
    breaks and tracing errors show), without Inductor's C++ compile of each (minutes for the ResNet-50)."""
    from lcv_vision.recipes._build import trainer_kwargs
    from lightning_plugin import CompiledStrategy

    settings = trainer_kwargs(recipe, gpu=False, backend="aot_eager")["strategy"]["init_args"]
    # no compile cache: with logger=False it would be written into the working directory
    return CompiledStrategy(**{**settings, "cache": False})


@pytest.mark.parametrize("name", list_recipes())
def test_recipe_trains_one_step_and_tests(name, tiny_cifar, tiny_imagefolder):
    recipe = get_recipe(name)
    module, datamodule = build(
        recipe, data=_tiny_data(recipe.dataset, tiny_cifar, tiny_imagefolder), model=_tiny_model(recipe.model)
    )
    assert module.hparams.recipe == name and module.hparams.num_classes == datamodule.num_classes
    before = {k: v.clone() for k, v in module.model.state_dict().items()}
    trainer = build_trainer(
        recipe,
        gpu=False,
        fast_dev_run=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        strategy=_traced_only(recipe),
    )
    assert trainer.precision == "32-true"
    trainer.fit(module, datamodule)
    assert trainer.global_step == 1
    after = module.model.state_dict()
    changed = [k for k in before if before[k].is_floating_point() and not torch.equal(before[k], after[k])]
    assert changed, "one optimizer step changed no weight"
    assert all(torch.isfinite(v).all() for v in after.values() if v.is_floating_point())
    result = trainer.test(module, datamodule, verbose=False)[0]
    assert 0.0 <= result["test/acc"] <= 1.0


def test_gpu_defaults_pick_the_compiled_strategy_and_recipe_precision():
    from lightning_plugin import CompiledStrategy

    trainer = build_trainer("cifar10-airbench", gpu=True, accelerator="cpu", logger=False)
    assert isinstance(trainer.strategy, CompiledStrategy)
    config = trainer.strategy.compile_config
    assert config.channels_last and config.mode == "max-autotune-no-cudagraphs" and trainer.max_epochs == 10
    assert trainer.precision == "bf16-mixed"
    cpu = build_trainer("cifar10-airbench", gpu=False, logger=False)
    assert isinstance(cpu.strategy, CompiledStrategy) and cpu.precision == "32-true"
    assert cpu.strategy.compile_config.compile == "auto" and not cpu.strategy.compile_config.compile_eval


def test_imagefolder_fixres_sizes(tiny_imagefolder):
    _, datamodule = build(
        "imagefolder-resnet50",
        data={
            "root": tiny_imagefolder,
            "storage_size": 40,
            "image_size": 24,
            "eval_image_size": 36,
            "batch_size": 4,
        },
    )
    datamodule.setup()
    train_x, train_y = next(iter(datamodule.train_dataloader()))
    val_x, _ = next(iter(datamodule.val_dataloader()))
    assert train_x.shape[-2:] == (24, 24) and val_x.shape[-2:] == (36, 36)
    assert train_y.shape == (4, 3) and train_y.is_floating_point()  # mixup/cutmix soft targets
    with pytest.raises(ValueError, match="eval_image_size=50"):
        build(
            "imagefolder-resnet50", data={"root": tiny_imagefolder, "storage_size": 40, "eval_image_size": 50}
        )


def test_imagefolder_encoded_storage_trains_and_evaluates(tiny_imagefolder):
    module, datamodule = build(
        "imagefolder-resnet50",
        data={
            "root": tiny_imagefolder,
            "image_size": 24,
            "storage_size": 40,
            "eval_image_size": 32,
            "batch_size": 6,
            "storage": "encoded",
            "num_workers": 1,
        },
        model={"model_kwargs": {"width": 4}},
    )
    val_x, _ = next(iter(datamodule.val_dataloader()))
    assert val_x.shape[-2:] == (32, 32)
    trainer = build_trainer(
        "imagefolder-resnet50",
        gpu=False,
        fast_dev_run=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        # eager: the encoded storage is the subject; test_recipe_trains_one_step_and_tests traces this model
        strategy="auto",
    )
    trainer.fit(module, datamodule)
    assert trainer.global_step == 1


def test_whitening_images_are_a_seeded_sample_across_classes(tiny_cifar):
    _, datamodule = build(
        "cifar10-airbench", data={"zip_path": tiny_cifar, "batch_size": 8, "num_workers": 1}
    )
    datamodule.setup()
    sample = datamodule.sample_train_images(12)
    again = datamodule.sample_train_images(12)
    torch.testing.assert_close(sample, again)
    # which training images were drawn: match them against the whole (class-sorted) normalised split
    everything = torch.cat([x for x, _ in datamodule._loader("train", train=False)])
    labels = torch.cat([y for _, y in datamodule._loader("train", train=False)])
    drawn = [int((everything - s).abs().flatten(1).sum(1).argmin()) for s in sample]
    assert len(set(drawn)) == 12 and len(set(labels[drawn].tolist())) >= 4  # not just the first class


def test_runs_keep_the_portable_compile_cache_on():
    """``lcv fit`` compiles once per run, on a GPU and on the CPU: a resume or another rank loads the saved
    artifacts."""
    from lcv_vision.recipes._build import trainer_kwargs

    for gpu in (True, False):
        strategy = trainer_kwargs("digits-small", gpu=gpu)["strategy"]
        assert strategy["class_path"] == "lightning_plugin.CompiledStrategy"
        assert strategy["init_args"]["cache"] is True
