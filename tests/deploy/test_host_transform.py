"""The package's host transform gives the pixels the recipe's DataModule evaluates on."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from lcv_vision.deploy.host_transform import HostTransform
from lcv_vision.recipes import build_datamodule

pytestmark = pytest.mark.xdist_group("deploy")


def _rgb_photos(photo_folder: str, root: Path) -> Path:
    """``photo_folder`` without the files PIL and torchvision decode differently (16-bit, CMYK, GIF)."""
    for file in Path(photo_folder).rglob("*"):
        if file.is_file() and file.suffix in (".jpg", ".png", ".webp"):
            with Image.open(file) as image:
                if image.mode != "RGB":
                    continue
            target = root / file.relative_to(photo_folder)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(file, target)
    return root


@pytest.mark.parametrize(
    "data",
    [
        {"storage": "uint8"},  # stored squares, centre crop, resize
        {"storage": "uint8", "storage_size": 40, "eval_image_size": 28},  # FixRes crop
        {"storage": "encoded"},  # one fractional resample per image
    ],
)
def test_host_transform_gives_the_datamodules_eval_pixels(photo_folder, tmp_path, data, monkeypatch):
    import lcv_vision.data.compiled as compiled

    # The pipeline's ops and segments as compiled, run eagerly: the ops are under test here, Inductor's code for
    # them in tests/data/test_data_compiled.py (integer ops bitwise, float ops within rounding).
    monkeypatch.setattr(compiled, "BACKEND", "eager")
    root = _rgb_photos(photo_folder, tmp_path / "photos")
    datamodule = build_datamodule("imagefolder-small", root=str(root), image_size=32, num_workers=0, **data)
    transform = HostTransform.from_datamodule(datamodule)
    assert HostTransform.from_json(transform.to_json()) == transform
    datamodule.setup("test")
    loaded = torch.cat([batch[0] for batch in datamodule.test_dataloader()])
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in (datamodule.mean, datamodule.std))
    expected = (loaded.float() * std + mean) * 255.0  # the DataModule's pixels before normalisation
    files = sorted(
        (root / "val").rglob("*.*"), key=lambda f: (f.parent.relative_to(root / "val").parts[0], str(f))
    )
    ours = torch.stack([transform(Image.open(f)) for f in files])
    assert ours.dtype == torch.uint8 and ours.shape == expected.shape
    # 0.5: rounding a fractional resample to the package's uint8 input; ~1e-4: the float round trip above
    limit = 0.5 + 1e-3 if data["storage"] == "encoded" else 1e-3
    assert (ours.float() - expected).abs().max() <= limit
