"""One trained digits checkpoint and its fp32 and int8 packages per test session (training and AOTInductor
compiles are the expensive part; every deploy test shares them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
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


def cifar_jpegs(zip_path: str, count: int) -> list[bytes]:
    """The first ``count`` CIFAR-10 test JPEGs of the shared zip, spread over its classes."""
    with zipfile.ZipFile(zip_path) as archive:
        names = sorted(n for n in archive.namelist() if n.startswith("test/") and n.endswith(".jpg"))
        step = max(1, len(names) // count)
        return [archive.read(name) for name in names[::step][:count]]


SHARED_CIFAR_ZIP = os.path.join(
    os.path.dirname(__file__), "..", "..", "..", "shared", "data", "cifar10-jpeg.zip"
)

#: Run with ``python -I`` (no PYTHONPATH, no current folder): torch alone loads and runs the package.
FRESH_PROCESS = """
import json, sys
import torch, torch._inductor
model = torch._inductor.aoti_load_package(sys.argv[1])
logits = model(torch.load(sys.argv[2]))
torch.save(logits, sys.argv[3])
ours = sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_plugin",
              "lcv_vision", "lcv_kernels", "torchao"))
print(json.dumps({"metadata": dict(model.get_metadata()), "imported": ours}))
"""


def run_fresh(package: Path, images: torch.Tensor, tmp_path: Path) -> tuple[torch.Tensor, dict]:
    """Logits of ``package`` for ``images`` and ``{"metadata", "imported"}`` from a torch-only process."""
    torch.save(images, tmp_path / "images.pt")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    done = subprocess.run(
        [sys.executable, "-I", "-c", FRESH_PROCESS, str(package), "images.pt", "logits.pt"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(tmp_path / "logits.pt"), json.loads(done.stdout.strip().splitlines()[-1])
