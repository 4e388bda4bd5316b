"""The data package imports without Lightning: a loader user, or a DataLoader worker started with ``spawn``
(which imports the dataset's module again), does not pay Lightning's import (~5 s in a fresh process)."""

from __future__ import annotations

import subprocess
import sys

import lightning.pytorch as pl
import pytest

import lcv_vision.data as data

IMPORTS = (
    "import sys; import lcv_vision.data as data; "
    "from lcv_vision.data import DeviceLoader, Pipeline, RandomCrop, load_image_folder; "
    "import lcv_vision.data.compiled, lcv_vision.data.functional.color_jitter_cpu; "
    "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning', 'torchmetrics')))"
)


def test_the_data_package_imports_without_lightning():
    proc = subprocess.run(
        [sys.executable, "-c", IMPORTS], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout


@pytest.mark.parametrize("name", ["CIFAR10DataModule", "DigitsDataModule", "ImageFolderDataModule"])
def test_the_datamodules_import_on_first_use(name):
    module = getattr(data, name)
    assert issubclass(module, pl.LightningDataModule)
    assert name in data.__all__ and name in dir(data)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="NoSuchOp"):
        data.NoSuchOp  # noqa: B018
