"""One trained digits checkpoint and its fp32 and int8 packages per test run (training and AOTInductor compiles
are the expensive part; every deploy test shares them).

The deploy files are marked ``xdist_group("deploy")``, so ``make test`` (``--dist loadgroup``) runs them on one
worker and the session fixtures are built once. The file lock keeps that true where the group is not honoured
(plain ``-n 2``, or a pytest that pytest-xdist's loadgroup does not understand; tests/test_xdist_groups.py):
the artefacts live in the run's shared temporary folder, the first worker builds each one under the lock and
the other waits and reuses it.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from deploy_helpers import INT8_EXPORT_WARNINGS

#: Epochs of digits-small for the shared checkpoint: ~98% test accuracy in seconds, so an int8 drop of a
#: point is a real difference, not noise around chance.
EPOCHS = 3

#: Training images that calibrate the shared int8 package.
CALIBRATION_IMAGES = 128


def _built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """``name`` in this run's folder shared by the xdist workers, built by whichever worker asks first."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        path = tmp_path_factory.mktemp("deploy") / name
        build(path)
        return path
    folder = tmp_path_factory.getbasetemp().parent / "deploy-shared"  # one per run: pytest-N/
    folder.mkdir(exist_ok=True)
    path = folder / name
    with FileLock(str(path) + ".lock"):
        if not path.exists():
            partial = folder / f"partial-{os.environ['PYTEST_XDIST_WORKER']}-{name}"
            build(partial)
            partial.replace(path)  # complete or absent, never half-written
    return path


@contextmanager
def _eager_data_pipelines() -> Iterator[None]:
    """The DataModule's augmentation graphs traced by dynamo but run eagerly (no Inductor compile, ~12 s of a
    cold-cache run): the shared checkpoint and the int8 calibration batch are inputs of the deploy tests, not
    their subject (tests/data/test_data_compiled.py checks the compiled pipelines against eager)."""
    import lcv_vision.data.compiled as compiled

    saved = compiled.BACKEND
    compiled.BACKEND = "eager"
    try:
        yield
    finally:
        compiled.BACKEND = saved


def _train_digits(path: Path) -> None:
    import lightning.pytorch as pl

    from lcv_vision.recipes import build

    pl.seed_everything(0, verbose=False)
    module, datamodule = build("digits-small")
    trainer = pl.Trainer(
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(path.parent),
        precision="32-true",
    )
    with _eager_data_pipelines():
        trainer.fit(module, datamodule=datamodule)
    trainer.save_checkpoint(path)


@pytest.fixture(scope="session")
def digits_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _built_once(tmp_path_factory, "digits.ckpt", _train_digits)


@pytest.fixture(scope="session")
def fp32_package(digits_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Written by the command itself (``lcv export CKPT --out ...``), so the CLI path costs no extra compile."""
    from lcv_vision.cli import main

    return _built_once(
        tmp_path_factory,
        "digits-fp32.pt2",
        lambda out: main(["export", str(digits_checkpoint), "--out", str(out)]),
    )


@pytest.fixture(scope="session")
def int8_package(digits_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torchao", reason="int8 export needs torchao (the [quantize] extra)")
    from lcv_vision.deploy.export import export_package

    def build(out: Path) -> None:
        with warnings.catch_warnings(record=True) as caught, _eager_data_pipelines():
            warnings.simplefilter("always")
            export_package(digits_checkpoint, out, quantize="int8", calibration_count=CALIBRATION_IMAGES)
        shown = [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught]
        (out.parent / INT8_EXPORT_WARNINGS).write_text(json.dumps(shown))

    return _built_once(tmp_path_factory, "digits-int8.pt2", build)


@pytest.fixture(scope="session")
def digits_test_set() -> tuple[torch.Tensor, torch.Tensor]:
    """digits-small's test split: uint8 images (N, 3, 32, 32) and labels, as the recipe tests on them."""
    from lcv_vision.recipes import build_datamodule

    datamodule = build_datamodule("digits-small")
    split = datamodule._build()["test"]
    return split.images, split.targets
