"""A user's work survives the rename of our packages (``vision`` -> ``lcv_vision``, ``kernels`` -> ``lcv_kernels``).

The fixtures were written by ``lcv fit --recipe digits-small`` (1 epoch of 2 steps) on main before the rename:
the checkpoint and the ``config.yaml`` saved beside it, whose class paths name ``vision.callbacks...``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("jsonargparse", reason="lcv needs jsonargparse (not on the GPU image)")
from lcv_vision.cli import run  # noqa: E402
from lcv_vision.module import ClassificationModule  # noqa: E402
from lcv_vision.renamed_packages import upgrade_text  # noqa: E402

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
OLD_CKPT = FIXTURES / "digits-small-before-rename.ckpt"
OLD_CONFIG = FIXTURES / "digits-small-before-rename.yaml"


def test_the_old_config_names_the_old_packages():
    """Guards the fixture: without old class paths the tests below would not test the upgrade."""
    assert "class_path: vision.callbacks.BestAndLastCheckpoint" in OLD_CONFIG.read_text()


def test_old_module_paths_are_renamed_and_nothing_else():
    text = "a: vision.callbacks.X\nb: lightning_plugin.CompiledStrategy\nc: torchvision.models.x\nd: kernels.op\n"
    new, found = upgrade_text(text + "e: computer vision. kernels/x\n")
    assert new == (
        "a: lcv_vision.callbacks.X\nb: lightning_plugin.CompiledStrategy\nc: torchvision.models.x\n"
        "d: lcv_kernels.op\ne: computer vision. kernels/x\n"
    )
    assert found == ["vision", "kernels"]


def test_an_old_checkpoint_loads_with_its_weights():
    saved = torch.load(OLD_CKPT, map_location="cpu", weights_only=True)
    module = ClassificationModule.load_from_checkpoint(OLD_CKPT, map_location="cpu")
    state = module.state_dict()
    assert set(state) == set(saved["state_dict"])
    for name, tensor in saved["state_dict"].items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0)


def test_an_old_config_and_checkpoint_resume_training(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)  # the config logs to runs/ under the working folder
    fit = run(
        [
            "fit",
            "--config",
            str(OLD_CONFIG),
            "--ckpt_path",
            str(OLD_CKPT),
            "--trainer.max_epochs",
            "2",
            "--trainer.limit_train_batches",
            "2",
            "--trainer.limit_val_batches",
            "1",
            "--trainer.limit_test_batches",
            "1",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.strategy.compile",
            "never",
        ]
    )
    lines = [line for line in capfd.readouterr().err.splitlines() if "old package names" in line]
    assert len(lines) == 1 and "replace 'vision.' with 'lcv_vision.'" in lines[0], lines
    assert fit.trainer.current_epoch == 2 and fit.trainer.global_step == 4  # resumed after step 2, not from 0
    assert any(type(c).__module__ == "lcv_vision.callbacks" for c in fit.trainer.callbacks)
