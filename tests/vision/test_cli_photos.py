"""``lcv fit`` on a folder of real photos, as a new user runs it: every failure is one line naming the problem
(no TypeError from the checkpoint callback, no checkpoint of untrained weights), checkpoints and the summary
mean what they say, and nothing the user has to read past.

The folder is ``tests/photo_folder.py``'s (scikit-learn's photos in 10 file formats, two classes); the model
is the ``imagefolder-small`` recipe shrunk to a few thousand parameters at 24 px.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys

import pytest
import torch

pytest.importorskip(
    "jsonargparse", reason="the lcv CLI needs jsonargparse (a dependency of lightning[pytorch-extra])"
)

from lcv_vision.cli import main, run

SMALL = [
    "--recipe",
    "imagefolder-small",
    "--model.model_kwargs",
    '{"widths": [8, 8, 8]}',
    "--model.whitening_images",
    "8",
    "--data.image_size",
    "24",
    "--data.storage_size",
    "27",
    "--data.batch_size",
    "4",
    "--data.num_workers",
    "1",
    "--trainer.enable_progress_bar",
    "false",
]


@pytest.fixture(autouse=True)
def _in_tmp(monkeypatch, tmp_path):
    # run(args) is the in-process equivalent of the command line; pytest's own argv must not look like one.
    monkeypatch.setattr(sys, "argv", ["lcv"])
    monkeypatch.chdir(tmp_path)


def _fails(capfd, args: list[str], status: int = 1) -> str:
    """Run ``lcv``; it must exit with ``status`` after one ``lcv: error:`` line (no traceback) and leave no
    checkpoint behind."""
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == status
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("lcv: error:")]
    assert len(errors) == 1 and "Traceback" not in err and "TypeError" not in err, err
    assert not glob.glob("runs/**/*.ckpt", recursive=True)  # nothing trained: no interrupted.ckpt
    return errors[0]


def test_truncated_jpeg_is_one_line_naming_the_file(capfd, photo_copy):
    good = (photo_copy / "train" / "china" / "0.jpg").read_bytes()
    (photo_copy / "train" / "china" / "cut.jpg").write_bytes(good[: len(good) // 2])
    line = _fails(capfd, ["fit", *SMALL, "--data.root", str(photo_copy)])
    assert "cannot decode image" in line and "china/cut.jpg" in line


def test_dangling_link_is_one_line_naming_it(capfd, photo_copy):
    os.symlink(photo_copy / "gone.jpg", photo_copy / "val" / "flower" / "link.jpg")
    line = _fails(capfd, ["fit", *SMALL, "--data.root", str(photo_copy)])
    assert "cannot read image file" in line and "flower/link.jpg" in line


def test_class_mismatch_is_one_line(capfd, photo_copy):
    (photo_copy / "val" / "china").rename(photo_copy / "val" / "China")
    line = _fails(capfd, ["fit", *SMALL, "--data.root", str(photo_copy)])
    assert "only in train: ['china'], only in val: ['China']" in line


def test_missing_val_folder_is_one_line(capfd, photo_copy):
    shutil.rmtree(photo_copy / "val")
    assert "--data.val_split 0.2" in _fails(capfd, ["fit", *SMALL, "--data.root", str(photo_copy)])


def test_batch_larger_than_the_train_set_is_one_line(capfd, photo_folder):
    line = _fails(capfd, ["fit", *SMALL, "--data.root", photo_folder, "--data.batch_size", "128"])
    assert "has 20 images, fewer than batch_size=128" in line and "--data.drop_last false" in line


@pytest.mark.parametrize(
    ("option", "value", "match"),
    [
        ("--trainer.max_epochs", "0", "--trainer.max_epochs 0 trains nothing"),
        ("--trainer.max_epochs", "-1", "give --trainer.max_steps N"),
        ("--trainer.limit_train_batches", "0", "--trainer.limit_train_batches 0 trains nothing"),
        ("--ckpt_path", "missing.ckpt", "--ckpt_path 'missing.ckpt' does not exist"),
    ],
)
def test_runs_that_train_nothing_are_refused(capfd, photo_folder, option, value, match):
    assert match in _fails(capfd, ["fit", *SMALL, "--data.root", photo_folder, option, value], status=2)


def test_val_split_fraction_from_the_command_line(capfd, photo_copy):
    from lcv_vision.cli import LcvCLI
    from lcv_vision.recipes import get_recipe

    shutil.rmtree(photo_copy / "val")
    cli = LcvCLI(
        get_recipe("imagefolder-small"),
        gpu=False,
        run=False,
        args=[*SMALL[2:], "--data.root", str(photo_copy), "--data.val_split", "0.2"],
    )
    assert cli.datamodule.val_fraction == pytest.approx(0.2)
    cli.datamodule.setup("fit")
    assert len(cli.datamodule._splits["val"]) == 4 and len(cli.datamodule._splits["train"]) == 16


def test_fit_summary_checkpoints_and_quiet_output(capfd, caplog, photo_folder):
    """Two epochs: last.ckpt holds the end of epoch 2, the summary names the evaluated weights (EMA and
    final), the best checkpoint, the throughput; none of Lightning's noise is printed."""
    with pytest.warns() as caught:
        fit = run(["fit", *SMALL, "--data.root", photo_folder, "--trainer.max_epochs", "2"])
    out, err = capfd.readouterr()
    text = out + err + caplog.text + "\n".join(str(w.message) for w in caught)
    trainer = fit.trainer
    assert trainer.global_step == 10 and trainer.current_epoch == 2  # 20 images / 4, two epochs
    last = torch.load(trainer.checkpoint_callback.last_model_path, map_location="cpu", weights_only=False)
    assert last["global_step"] == 10 and last["epoch"] == 1  # the last state, not the best epoch's
    for weights in ("EMA", "final"):
        acc = fit.test_results[weights]["test/acc"]
        assert f"test accuracy ({weights} weights): {100 * acc:.2f}%" in out
    best = float(trainer.checkpoint_callback.best_model_score)
    assert (
        f"best val/acc (EMA weights): {100 * best:.2f}%, checkpoint "
        f"{trainer.checkpoint_callback.best_model_path}" in out
    )
    assert f"last checkpoint (epoch 2, step 10): {trainer.checkpoint_callback.last_model_path}" in out
    assert "train: 20 images in 2 classes decoded to 27x27 in" in caplog.text
    assert "moving average of `model`'s weights" in caplog.text  # the EMA copy explained in the model summary
    for noise in (
        "litlogger",
        "LeafSpec",
        "weights_only",
        "Total FLOPs",
        "v_num",
        "smaller than the logging interval",
        "Trainer already configured",
        "estimate number of stepping",
    ):
        assert noise not in text, noise
    assert trainer.log_every_n_steps == 5
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(trainer.logger.log_dir)
    events.Reload()
    assert len(events.Scalars("train/loss")) == 2  # once an epoch although an epoch is shorter than 50 steps
    hparams = dict(fit.datamodule.hparams)
    assert hparams["root"] == photo_folder and hparams["batch_size"] == 4  # logged as data/* by the monitor


def test_checkpoint_of_another_recipe_is_refused_and_command_line_wins(capfd, photo_folder, monkeypatch):
    """Trained eagerly, model and data pipeline: the checkpoint's recipe and settings are the subject;
    test_fit_summary_checkpoints_and_quiet_output runs this recipe compiled."""
    from lcv_vision.data.pipeline import Pipeline

    init = Pipeline.__init__
    monkeypatch.setattr(
        Pipeline, "__init__", lambda self, *a, **kw: init(self, *a, **{**kw, "compile": False})
    )
    eager = ["--trainer.strategy.compile", "never", "--test_after_fit", "false"]
    fit = run(["fit", *SMALL, "--data.root", photo_folder, "--trainer.max_epochs", "1", *eager])
    last = fit.trainer.checkpoint_callback.last_model_path
    capfd.readouterr()
    line = _fails_keeping(capfd, ["test", "--recipe", "digits-small", "--ckpt_path", last])
    assert "was saved by recipe 'imagefolder-small', not 'digits-small'" in line
    line = _fails_keeping(
        capfd, ["test", "--ckpt_path", last, "--model.model_kwargs", '{"widths": [8, 8, 16]}']
    )
    assert "--model.model_kwargs" in line and "conflicts with --ckpt_path" in line
    tested = run(
        [
            "test",
            "--ckpt_path",
            last,
            "--model.tta",
            "flip",
            "--data.root",
            photo_folder,
            "--trainer.enable_progress_bar",
            "false",
        ]
    )
    assert tested.model.hparams.tta == "flip" and tested.model.hparams.model_kwargs == {"widths": [8, 8, 8]}


def _fails_keeping(capfd, args: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    return capfd.readouterr().err.strip().splitlines()[-1]
