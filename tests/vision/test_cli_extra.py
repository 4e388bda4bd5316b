"""``lcv validate``: the weights come from ``--ckpt_path`` and the recipe from the checkpoint itself."""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip(
    "jsonargparse", reason="the lcv CLI needs jsonargparse (a dependency of lightning[pytorch-extra])"
)

import lcv_vision.data.compiled as compiled_data
from lcv_args import TINY_QUIET
from lcv_vision.cli import run
from lcv_vision.models import create_model

#: The model and the data pipeline are traced (``aot_eager``), not built by Inductor: the checkpoint's
#: weights are the subject; tests/vision/test_quiet_main_job.py runs ``lcv fit`` through Inductor.
TINY = [*TINY_QUIET, "--trainer.strategy.backend", "aot_eager"]


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch):
    # run(args) is the in-process equivalent of the command line; pytest's own argv must not look like one.
    monkeypatch.setattr(sys, "argv", ["lcv"])


def _evaluate_checkpointed_weights(path: str, loader) -> tuple[float, float]:
    """Val (accuracy, mean cross-entropy) computed without Lightning: the EMA weights (what digits-small
    evaluates with) loaded from the checkpoint into a freshly built model."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    assert checkpoint["hyper_parameters"]["ema_decay"] is not None
    prefix = "ema.module."
    weights = {k[len(prefix) :]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    model = create_model("airbench94", num_classes=10, widths=[8, 8, 8])
    model.load_state_dict(weights, strict=True)
    model.eval()
    correct = total = 0
    loss = 0.0
    with torch.no_grad():
        for images, targets in loader:
            logits = model(images).double()
            correct += (logits.argmax(dim=1) == targets).sum().item()
            loss += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
            total += targets.numel()
    return correct / total, loss / total


def test_validate_from_the_last_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(compiled_data, "BACKEND", "aot_eager")
    fit = run(
        [
            "fit",
            "--recipe",
            "digits-small",
            "--trainer.max_epochs",
            "1",
            "--trainer.limit_train_batches",
            "6",
            "--test_after_fit",
            "false",
            *TINY,
        ]
    )
    # the fit's one (final) validation; the loss tells weights apart even where accuracies are near chance
    fitted = float(fit.trainer.callback_metrics["val/acc"])
    fitted_loss = float(fit.trainer.callback_metrics["val/loss"])
    assert float(fit.trainer.checkpoint_callback.best_model_score) == pytest.approx(fitted, abs=1e-6)
    last = os.path.join(fit.trainer.logger.log_dir, "checkpoints", "last.ckpt")
    assert os.path.isfile(last)

    validated = run(["validate", "--ckpt_path", last, "--trainer.enable_progress_bar", "false"])
    assert validated.model.hparams.recipe == "digits-small" and validated.model.hparams.model_kwargs == {
        "widths": [8, 8, 8]
    }
    metrics = validated.trainer.callback_metrics
    val_acc, val_loss = float(metrics["val/acc"]), float(metrics["val/loss"])
    assert "test/acc" not in metrics  # validate only: no test run
    assert val_acc == pytest.approx(fitted, abs=1e-6) and val_loss == pytest.approx(fitted_loss, rel=1e-5)
    direct_acc, direct_loss = _evaluate_checkpointed_weights(last, validated.datamodule.val_dataloader())
    assert val_acc == pytest.approx(direct_acc, abs=1e-6) and val_loss == pytest.approx(direct_loss, rel=1e-5)
