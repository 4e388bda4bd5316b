"""One trained digits checkpoint and its fp32 and int8 packages per test session (training and AOTInductor
compiles are the expensive part; every deploy test shares them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

#: Epochs of digits-small for the shared checkpoint: ~98% test accuracy in seconds, so an int8 drop of a
#: point is a real difference, not noise around chance.
EPOCHS = 3

#: Training images that calibrate the shared int8 package.
CALIBRATION_IMAGES = 128


@pytest.fixture(scope="session")
def digits_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import lightning.pytorch as pl

    from lcv_vision.recipes import build

    root = tmp_path_factory.mktemp("deploy_fit")
    pl.seed_everything(0, verbose=False)
    module, datamodule = build("digits-small")
    trainer = pl.Trainer(
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        precision="32-true",
    )
    trainer.fit(module, datamodule=datamodule)
    path = root / "digits.ckpt"
    trainer.save_checkpoint(path)
    return path


@pytest.fixture(scope="session")
def fp32_package(digits_checkpoint: Path) -> Path:
    """Written by the command itself (``lcv export CKPT --out ...``), so the CLI path costs no extra compile."""
    from lcv_vision.cli import main

    out = digits_checkpoint.parent / "digits-fp32.pt2"
    main(["export", str(digits_checkpoint), "--out", str(out)])
    return out


@pytest.fixture(scope="session")
def int8_package(digits_checkpoint: Path) -> Path:
    pytest.importorskip("torchao", reason="int8 export needs torchao (the [quantize] extra)")
    from lcv_vision.deploy.export import export_package

    out = digits_checkpoint.parent / "digits-int8.pt2"
    export_package(digits_checkpoint, out, quantize="int8", calibration_count=CALIBRATION_IMAGES)
    return out


@pytest.fixture(scope="session")
def digits_test_set() -> tuple[torch.Tensor, torch.Tensor]:
    """digits-small's test split: uint8 images (N, 3, 32, 32) and labels, as the recipe tests on them."""
    from lcv_vision.recipes import build_datamodule

    datamodule = build_datamodule("digits-small")
    split = datamodule._build()["test"]
    return split.images, split.targets
