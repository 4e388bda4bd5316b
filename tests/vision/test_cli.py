"""``lcv`` in-process: listing, errors, how recipe defaults and overrides combine, and a fit/test/predict
round trip."""

from __future__ import annotations

import glob
import os
import sys

import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_plugin import CompiledStrategy
from lightning_plugin.callbacks import FaultTolerantCheckpoint, NonFiniteLossGuard, TrainingMonitor

pytest.importorskip(
    "jsonargparse", reason="the lcv CLI needs jsonargparse (a dependency of lightning[pytorch-extra])"
)

import lcv_vision.data.compiled as compiled_data
from lcv_args import TINY_QUIET
from lcv_vision.cli import LcvCLI, _recipe_name, main, run
from lcv_vision.recipes import get_recipe, list_recipes


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch):
    # main(args) is the in-process equivalent of the command line; pytest's own argv must not look like one.
    monkeypatch.setattr(sys, "argv", ["lcv"])


def _error(capsys, args: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    return capsys.readouterr().err


def test_recipes_lists_every_recipe(capsys):
    main(["recipes"])
    out = capsys.readouterr().out
    for name in list_recipes():
        assert name in out and get_recipe(name).description in out
    main(["recipes", "cifar10-*"])
    out = capsys.readouterr().out
    assert "cifar10-airbench" in out and "digits-small" not in out
    main(["recipes", "digits-small"])
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["name"] == "digits-small" and shown["epochs"] == get_recipe("digits-small").epochs
    assert shown["augment"]["crop_padding"] == 2


def test_unknown_recipe_lists_known_and_suggests(capsys):
    err = _error(capsys, ["fit", "--recipe", "cifar10-airbnch"])
    assert err.startswith("lcv: error: unknown recipe 'cifar10-airbnch'. Did you mean 'cifar10-airbench'?")
    assert all(name in err for name in list_recipes())
    assert "Did you mean 'digits-small'" in _error(capsys, ["recipes", "digit-small"])


def test_usage_errors(capsys):
    assert "needs --recipe NAME" in _error(capsys, ["fit"])
    assert "unknown subcommand 'tset'. Did you mean 'test'?" in _error(
        capsys, ["tset", "--recipe", "digits-small"]
    )
    assert "--config 'nope.yaml' does not exist" in _error(capsys, ["fit", "--config", "nope.yaml"])
    with pytest.raises(SystemExit) as info:  # a misspelt option: jsonargparse's own error, also status 2
        main(["fit", "--recipe", "digits-small", "--model.lrr", "0.1"])
    assert info.value.code == 2


def test_missing_data_root(capsys, tmp_path):
    err = _error(capsys, ["fit", "--recipe", "cifar10-airbench"])
    assert "trains on CIFAR-10: give --data.root DIR" in err and "--data.zip_path FILE" in err
    err = _error(capsys, ["fit", "--recipe", "cifar10-resnet18", "--data.root", str(tmp_path / "nothing")])
    assert "is not a directory; add --data.download true" in err
    assert "--data.zip_path" in _error(
        capsys, ["fit", "--recipe", "cifar10-vit", "--data.zip_path", "no.zip"]
    )
    assert "give --data.root DIR" in _error(capsys, ["fit", "--recipe", "imagefolder-resnet50"])


def test_incompatible_overrides(capsys, tiny_cifar):
    err = _error(
        capsys,
        ["fit", "--recipe", "cifar10-airbench", "--data.zip_path", tiny_cifar, "--model.ema_decay", "0.9"],
    )
    assert "invalid settings for recipe 'cifar10-airbench'" in err and "turn on only one" in err
    # the recipe's airbench kwargs and whitening layer stay with airbench; given ones are the user's and checked
    cli = LcvCLI(get_recipe("digits-small"), gpu=False, run=False, args=["--model.model", "resnet18"])
    assert cli.model.hparams.model_kwargs is None and cli.model.hparams.whitening_images == 0
    widths = ["--model.model", "resnet18", "--model.model_kwargs", '{"widths": [8]}']
    err = _error(capsys, ["fit", "--recipe", "digits-small", *widths])
    assert "model 'resnet18' does not accept model_kwargs={'widths': [8]}" in err
    assert "--model.model_kwargs '{}'" in err
    err = _error(
        capsys,
        ["fit", "--recipe", "digits-small", "--model.model", "resnet18", "--model.whitening_images", "9"],
    )
    assert (
        "whitening_images=9 needs a model with a whitening layer" in err
        and "--model.whitening_images 0" in err
    )


def test_recipe_defaults_then_config_then_flags(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {"model": {"lr": 0.05, "momentum": 0.8}, "trainer": {"max_epochs": 3}, "data": {"batch_size": 16}}
        )
    )
    cli = LcvCLI(
        get_recipe("digits-small"),
        gpu=False,
        run=False,
        args=["--config", str(config), "--model.lr", "0.07", "--data.augment.crop_padding", "3"],
    )
    hp = cli.model.hparams
    recipe = get_recipe("digits-small")
    assert hp.lr == 0.07 and hp.momentum == 0.8  # flag beats config beats recipe
    assert hp.nesterov == recipe.optim.nesterov and hp.ema_decay == recipe.ema_decay  # untouched: recipe's
    assert hp.model_kwargs == recipe.model_kwargs and hp.recipe == "digits-small" and hp.num_classes == 10
    assert cli.trainer.max_epochs == 3 and cli.datamodule.batch_size == 16
    assert cli.datamodule.augment.crop_padding == 3 and cli.datamodule.augment.flip == recipe.augment.flip
    assert isinstance(cli.trainer.strategy, CompiledStrategy) and cli.trainer.precision == "32-true"
    kinds = (ModelCheckpoint, TrainingMonitor, RichProgressBar, FaultTolerantCheckpoint, NonFiniteLossGuard)
    assert all(any(isinstance(c, kind) for c in cli.trainer.callbacks) for kind in kinds)
    assert isinstance(cli.trainer.logger, TensorBoardLogger) and cli.trainer.logger.name == "digits-small"
    assert cli.trainer.checkpoint_callback.monitor == "val/acc" and cli.trainer.checkpoint_callback.save_last


def test_gpu_defaults_and_their_override():
    cli = LcvCLI(
        get_recipe("cifar10-airbench"),
        gpu=True,
        run=False,
        args=["--data.root", ".", "--trainer.accelerator", "cpu"],
    )
    assert isinstance(cli.trainer.strategy, CompiledStrategy) and cli.trainer.precision == "bf16-mixed"
    assert cli.trainer.strategy.compile_config.mode == "max-autotune-no-cudagraphs"
    cli = LcvCLI(
        get_recipe("cifar10-airbench"),
        gpu=True,
        run=False,
        args=[
            "--data.root",
            ".",
            "--trainer.accelerator",
            "cpu",
            "--trainer.strategy",
            "auto",
            "--trainer.precision",
            "32-true",
            "--trainer.enable_progress_bar",
            "false",
        ],
    )
    assert not isinstance(cli.trainer.strategy, CompiledStrategy) and cli.trainer.precision == "32-true"
    assert not any(isinstance(c, RichProgressBar) for c in cli.trainer.callbacks)


def test_recipe_found_in_config_and_checkpoint(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("recipe: cifar10-vit\n")
    assert _recipe_name(["fit", "--config", str(config)]) == "cifar10-vit"
    assert _recipe_name(["fit", "--config", str(config), "--recipe=digits-small"]) == "digits-small"
    ckpt = tmp_path / "x.ckpt"
    torch.save({"hyper_parameters": {"recipe": "cifar10-resnet18"}}, ckpt)
    assert _recipe_name(["test", "--ckpt_path", str(ckpt)]) == "cifar10-resnet18"


def test_fit_test_predict_round_trip(tmp_path, monkeypatch, capsys):
    """The model and the data pipeline traced (``aot_eager``), not built by Inductor: the commands' round trip
    is the subject; tests/vision/test_quiet_main_job.py runs ``lcv fit`` through Inductor."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(compiled_data, "BACKEND", "aot_eager")
    tiny = [*TINY_QUIET, "--trainer.strategy.backend", "aot_eager"]
    fit = run(
        [
            "fit",
            "--recipe",
            "digits-small",
            "--trainer.max_epochs",
            "1",
            "--trainer.limit_train_batches",
            "4",
            *tiny,
        ]
    )
    out = capsys.readouterr().out
    fitted = fit.test_results["EMA"]["test/acc"]
    log_dir = fit.trainer.logger.log_dir
    last = os.path.join(log_dir, "checkpoints", "last.ckpt")
    assert os.path.isfile(last) and glob.glob(os.path.join(log_dir, "checkpoints", "best-*.ckpt"))
    assert f"test accuracy (EMA weights): {100 * fitted:.2f}%" in out
    assert (
        f"TensorBoard logs: {log_dir}" in out
        and f"step {fit.trainer.global_step}): {last}" in out
        and "images/s" in out
    )
    assert glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))

    # test: the recipe comes from the saved config, the weights from the checkpoint
    tested = run(["test", "--config", os.path.join(log_dir, "config.yaml"), "--ckpt_path", last])
    result = tested.trainer.callback_metrics
    assert float(result["test/acc"]) == pytest.approx(fitted, abs=1e-6)

    # predict: the recipe comes from the checkpoint itself
    path = tmp_path / "preds.pt"
    predicted = run(
        [
            "predict",
            "--ckpt_path",
            last,
            "--predictions_path",
            str(path),
            "--trainer.enable_progress_bar",
            "false",
        ]
    )
    saved = torch.load(path)
    labels = torch.cat([y for _, y in predicted.datamodule.test_dataloader()])
    assert saved["preds"].shape == labels.shape and saved["probs"].shape == (labels.numel(), 10)
    assert (saved["preds"] == labels).float().mean().item() == pytest.approx(fitted, abs=1e-6)
    torch.testing.assert_close(saved["probs"].sum(1), torch.ones(labels.numel()))
