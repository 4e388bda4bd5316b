"""Where ``lcv fit`` writes its run folder: ``runs/`` in the working folder, or under
``--trainer.default_root_dir``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "jsonargparse", reason="the lcv CLI needs jsonargparse (a dependency of lightning[pytorch-extra])"
)

from lcv_args import TINY_QUIET
from lcv_vision.cli import _runs_under_root_dir, run

TINY = [
    *TINY_QUIET,
    "--trainer.max_epochs",
    "1",
    "--trainer.limit_train_batches",
    "2",
    "--trainer.limit_val_batches",
    "1",
    "--test_after_fit",
    "false",
    "--trainer.strategy.compile",
    "never",
]


def test_default_root_dir_holds_the_logs_config_and_checkpoints(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lcv"])
    monkeypatch.chdir(tmp_path)
    fit = run(["fit", "--recipe", "digits-small", "--trainer.default_root_dir", "out", *TINY])
    assert fit is not None
    log_dir = Path(fit.trainer.logger.log_dir).resolve()
    assert log_dir == (tmp_path / "out" / "runs" / "digits-small" / "version_0").resolve()
    assert (log_dir / "config.yaml").is_file() and (log_dir / "checkpoints" / "last.ckpt").is_file()
    assert list(log_dir.glob("events.out.tfevents.*"))
    assert not (tmp_path / "runs").exists()  # nothing in the working folder


RUN_LOGGER = {"class_path": "lcv_vision.run_logs.RunLogger", "init_args": {"name": "r"}}


@pytest.mark.parametrize(
    ("root", "save_dir", "expected"),
    [
        (None, "runs", "runs"),  # no root: the working folder's runs/
        ("/data/out", "runs", "/data/out/runs"),
        ("/data/out", "/elsewhere", "/elsewhere"),  # the user's own save_dir stands
    ],
)
def test_only_the_default_save_dir_follows_the_root(root, save_dir, expected):
    logger = {**RUN_LOGGER, "init_args": {**RUN_LOGGER["init_args"], "save_dir": save_dir}}
    trainer = {"default_root_dir": root, "logger": logger}
    _runs_under_root_dir(trainer)
    assert trainer["logger"]["init_args"]["save_dir"] == expected


def test_another_logger_is_left_alone():
    logger = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "runs"}}
    trainer = {"default_root_dir": "/data/out", "logger": logger}
    _runs_under_root_dir(trainer)
    assert trainer["logger"]["init_args"]["save_dir"] == "runs"
