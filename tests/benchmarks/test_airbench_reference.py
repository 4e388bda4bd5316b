"""The airbench yardstick runs the published ``train94`` on a JPEG zip, on the CPU, and leaves torch as it
was.

A small synthetic ImageFolder zip (1,024 train images: one airbench step of batch 1,024) keeps it offline.
"""

from __future__ import annotations

import io
import json
import os
import zipfile

import numpy as np
import pytest
import torch
from PIL import Image

from script_loader import load_script

# One xdist worker runs the whole file (`make test` uses --dist loadgroup): its module fixture writes
# a 1,026-image zip, once.
pytestmark = pytest.mark.xdist_group("test_airbench_reference")

pytest.importorskip("airbench", reason="airbench is in the dev extra: pip install -e '.[dev]'")

CLASSES = ["cat", "dog", "ship"]


def _load():
    return load_script("benchmarks/airbench_reference.py")


def _jpeg(rng: np.random.Generator, label: int) -> bytes:
    image = rng.integers(0, 256, size=(32, 32, 3), dtype=np.uint8)
    image[..., label] = 255 - image[..., label] // 4  # a class signal: one bright channel
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def jpeg_zip(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("zip") / "tiny-cifar.zip"
    rng = np.random.default_rng(0)
    with zipfile.ZipFile(path, "w") as zf:
        for split, per_class in (("train", 342), ("test", 20)):  # 3 x 342 = 1,026 train images
            for label, name in enumerate(CLASSES):
                for i in range(per_class):
                    zf.writestr(f"{split}/{name}/{i:04d}.jpg", _jpeg(rng, label))
    return str(path)


def test_tensors_match_pillow_and_train_order_is_shuffled(jpeg_zip, tmp_path):
    bench = _load()
    assert bench.write_airbench_tensors(jpeg_zip, str(tmp_path)) == CLASSES
    train = torch.load(tmp_path / "train.pt")
    test = torch.load(tmp_path / "test.pt")
    assert train["images"].shape == (1026, 32, 32, 3) and train["images"].dtype == torch.uint8
    assert test["images"].shape == (60, 32, 32, 3) and test["labels"].tolist() == sorted(
        test["labels"].tolist()
    )
    # airbench whitens on the first 5,000 train images: they must not all be one class
    assert len(set(train["labels"][:100].tolist())) == len(CLASSES)
    assert sorted(train["labels"].tolist()) == sorted([c for c in range(3) for _ in range(342)])
    with zipfile.ZipFile(jpeg_zip) as zf:
        for i in (0, 500, 1025):  # every image is the Pillow decode of a member of its class folder
            label = CLASSES[int(train["labels"][i])]
            decoded = [
                np.asarray(Image.open(io.BytesIO(zf.read(f"train/{label}/{k:04d}.jpg"))).convert("RGB"))
                for k in range(342)
            ]
            assert any(np.array_equal(train["images"][i].numpy(), d) for d in decoded)


def test_cpu_redirect_is_undone():
    bench = _load()
    import airbench.utils as ab_utils
    from airbench.lib_airbench94 import make_net94

    before = (
        torch.cuda.Event,
        torch.Tensor.half,
        torch.nn.Module.half,
        ab_utils.CifarLoader.__init__.__defaults__,
    )
    with bench.airbench_on_cpu():
        net = make_net94()
        assert {p.dtype for p in net.parameters()} == {torch.float32}
        assert {p.device.type for p in net.parameters()} == {"cpu"}
        assert torch.ones(2).half().dtype == torch.float32
    assert (
        torch.cuda.Event,
        torch.Tensor.half,
        torch.nn.Module.half,
        ab_utils.CifarLoader.__init__.__defaults__,
    ) == before
    assert torch.ones(2).half().dtype == torch.float16


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU path; a GPU machine runs airbench as published"
)
def test_one_step_end_to_end(jpeg_zip, tmp_path, monkeypatch):
    bench = _load()
    monkeypatch.setattr("benchmarks._common.RESULTS_DIR", str(tmp_path / "results"))
    cwd = os.getcwd()
    result = bench.main(
        ["--zip", jpeg_zip, "--epochs", "1", "--cache", str(tmp_path / "cache"), "--tag", "t"]
    )
    assert os.getcwd() == cwd
    written = json.loads((tmp_path / "results" / "airbench_reference-cpu-t.json").read_text())
    assert written["test_accuracy"] == result["test_accuracy"]
    assert set(written["test_accuracy_by_tta_level"]) == {"tta0", "tta2"}
    assert all(0.0 <= a <= 1.0 for a in written["test_accuracy_by_tta_level"].values())
    assert "eval" in written["airbench_log"] and written["epochs"] == 1.0
    assert torch.ones(1).half().dtype == torch.float16  # the CPU redirect ended with the run


def test_bad_arguments_are_named(jpeg_zip, tmp_path):
    bench = _load()
    with pytest.raises(SystemExit, match="not found; pass --zip PATH"):
        bench.main(["--zip", str(tmp_path / "missing.zip")])
    with pytest.raises(SystemExit, match="--epochs must be > 0, got 0.0"):
        bench.main(["--zip", jpeg_zip, "--epochs", "0"])
