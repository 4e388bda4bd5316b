"""Fine-tuning: ``--model.weights PATH`` (a local state_dict) and ``--model.pretrained true`` (torchvision's
weights, from torch.hub's cache or a download), the head replaced for the data set's classes, offline
errors."""

from __future__ import annotations

import os
import sys
import urllib.error

import pytest
import torch

from lcv_vision.finetune import WeightsError
from lcv_vision.models import create_model
from lcv_vision.module import ClassificationModule

TINY = {"width": 4}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty torch.hub cache and no network: every download fails as it does offline."""
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))

    def offline(*args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(torch.hub, "urlopen", offline)
    return tmp_path / "hub"


def _source(num_classes: int = 1000, **kwargs) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return create_model("resnet18", num_classes=num_classes, **{**TINY, **kwargs}).state_dict()


def _assert_backbone_loaded_and_head_new(
    module: ClassificationModule, source: dict[str, torch.Tensor]
) -> None:
    state = module.model.state_dict()
    for name, value in source.items():
        if not name.startswith("fc."):
            torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)
    assert state["fc.weight"].shape == (3, 32)  # the data set's 3 classes, width 4 * 8
    for name, value in module.ema.module.state_dict().items():  # the EMA starts from the loaded weights
        torch.testing.assert_close(value, state[name], rtol=0, atol=0, msg=name)


def test_local_weights_file_loads_the_backbone_and_replaces_the_head(tmp_path):
    source = _source()
    path = tmp_path / "imagenet_tiny.pt"
    torch.save(source, path)
    module = ClassificationModule(
        "resnet18", num_classes=3, model_kwargs=TINY, weights=str(path), ema_decay=0.9
    )
    fresh_head = module.model.fc.weight.clone()
    module.setup("fit")
    _assert_backbone_loaded_and_head_new(module, source)
    torch.testing.assert_close(module.model.fc.weight, fresh_head)  # as initialised, not the file's
    module.setup("fit")  # a second fit in the same process continues from the trained weights
    assert module._initial_weights_loaded


def test_weights_file_with_the_same_head_keeps_it(tmp_path):
    source = _source(num_classes=3)
    torch.save({"state_dict": {f"model.{k}": v for k, v in source.items()}, "epoch": 3}, tmp_path / "x.ckpt")
    module = ClassificationModule(
        "resnet18", num_classes=3, model_kwargs=TINY, weights=str(tmp_path / "x.ckpt")
    )
    module.load_initial_weights()
    torch.testing.assert_close(module.model.state_dict()["fc.weight"], source["fc.weight"], rtol=0, atol=0)


def test_pretrained_loads_torchvision_weights_from_the_cache_offline(hub):
    import torchvision

    source = _source(width=64)  # torchvision's resnet18 layout and sizes
    url = torchvision.models.ResNet18_Weights.DEFAULT.url
    os.makedirs(hub / "checkpoints")
    torch.save(source, hub / "checkpoints" / os.path.basename(url))
    module = ClassificationModule("resnet18", num_classes=3, pretrained=True, ema_decay=0.9)
    report = module.load_initial_weights()
    assert report.startswith(
        f"loaded {len(source) - 2} tensors from torchvision ResNet18_Weights.IMAGENET1K_V1"
    )
    assert "new 3-class head fc (the weights' head has 1000 classes)" in report
    state = module.model.state_dict()
    torch.testing.assert_close(
        state["layer4.1.conv2.weight"], source["layer4.1.conv2.weight"], rtol=0, atol=0
    )


def test_pretrained_offline_without_the_file_says_what_to_do(hub):
    module = ClassificationModule("resnet18", num_classes=3, pretrained=True)
    with pytest.raises(
        WeightsError,
        match=r"could not download the pretrained weights of 'resnet18' "
        r"\(https://.*resnet18-.*\.pth\).*Offline\? .*put it at .*hub/checkpoints/"
        r"resnet18-.*\.pth, or .*--model\.weights PATH",
    ):
        module.setup("fit")


def test_models_without_pretrained_weights_and_files_that_do_not_fit(tmp_path):
    with pytest.raises(WeightsError, match=r"no pretrained weights known for model 'airbench94'"):
        ClassificationModule("airbench94", num_classes=3, pretrained=True).load_initial_weights()
    torch.save(_source(stem="cifar"), tmp_path / "cifar.pt")  # 3x3 stem: conv1 has another shape
    module = ClassificationModule(
        "resnet18", num_classes=3, model_kwargs=TINY, weights=str(tmp_path / "cifar.pt")
    )
    with pytest.raises(WeightsError, match=r"do not fit this model: 1 of another shape \(conv1\.weight\)"):
        module.load_initial_weights()
    with pytest.raises(WeightsError, match=r"--model\.weights '.*nope\.pt' does not exist"):
        ClassificationModule(
            "resnet18", num_classes=3, weights=str(tmp_path / "nope.pt")
        ).load_initial_weights()
    with pytest.raises(ValueError, match="choose one"):
        ClassificationModule("resnet18", num_classes=3, pretrained=True, weights="x.pt")


def test_lcv_fit_from_a_weights_file_and_offline_pretrained(
    tmp_path, monkeypatch, capfd, caplog, photo_folder, hub
):
    """Through ``lcv``: the file's backbone is trained on the photo folder's 2 classes; offline ``pretrained``
    is one error line."""
    import lcv_vision.data.compiled as compiled_data
    from lcv_vision.cli import main, run

    monkeypatch.setattr(sys, "argv", ["lcv"])
    monkeypatch.setattr(compiled_data, "BACKEND", "aot_eager")  # the data pipeline too: traced, not built
    monkeypatch.chdir(tmp_path)
    torch.save(_source(), tmp_path / "w.pt")
    args = [
        "fit",
        "--recipe",
        "imagefolder-small",
        "--data.root",
        photo_folder,
        "--model.model",
        "resnet18",
        "--model.model_kwargs",
        '{"width": 4}',
        "--model.whitening_images",
        "0",
        "--data.image_size",
        "24",
        "--data.storage_size",
        "27",
        "--data.batch_size",
        "4",
        "--trainer.max_epochs",
        "1",
        "--trainer.enable_progress_bar",
        "false",
        "--test_after_fit",
        "false",
        "--trainer.strategy.backend",
        "aot_eager",  # the weights file is the subject, not Inductor's code (no C++ compile: quick)
    ]
    fit = run([*args, "--model.weights", str(tmp_path / "w.pt")])
    assert "loaded 120 tensors from" in caplog.text and "new 2-class head fc" in caplog.text
    assert fit.model.model.fc.out_features == 2 and fit.trainer.global_step == 5
    with pytest.raises(SystemExit) as info:
        main([*args, "--model.pretrained", "true"])
    assert info.value.code == 1
    err = capfd.readouterr().err
    assert err.count("lcv: error:") == 1 and "Offline?" in err and "Traceback" not in err
