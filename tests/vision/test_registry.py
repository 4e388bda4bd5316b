"""The recipe and model registries: duplicates, None overrides, fnmatch, clear errors."""

from __future__ import annotations

import sys

import pytest
import torch
import torchvision

import lcv_vision.models._registry as model_registry
import lcv_vision.recipes._registry as recipe_registry
from lcv_vision.models import create_model, list_models, register_model
from lcv_vision.recipes import (
    AugmentConfig,
    OptimConfig,
    Recipe,
    UnknownRecipeError,
    get_recipe,
    list_recipes,
    register_recipe,
)


@pytest.fixture
def isolated_recipes(monkeypatch):
    monkeypatch.setattr(recipe_registry, "_recipes", dict(recipe_registry._recipes))


def _recipe(name: str = "test-recipe", **kwargs) -> Recipe:
    return Recipe(name=name, description="a test", model="airbench94", dataset="digits", **kwargs)


def test_issue_recipes_are_registered():
    names = list_recipes()
    for name in ("cifar10-airbench", "cifar10-resnet18", "imagefolder-resnet50", "digits-small"):
        assert name in names
    assert any(get_recipe(n).model.startswith("vit") for n in names)


def test_duplicate_recipe_raises(isolated_recipes):
    register_recipe(_recipe())
    with pytest.raises(ValueError, match="already registered"):
        register_recipe(_recipe())


def test_register_as_decorator_and_validation(isolated_recipes):
    @register_recipe
    def _factory() -> Recipe:
        return _recipe("decorated", epochs=3)

    assert get_recipe("decorated").epochs == 3
    with pytest.raises(ValueError, match="epochs must be >= 1"):
        register_recipe(_recipe("bad", epochs=0))
    assert "bad" not in list_recipes()
    with pytest.raises(TypeError, match="needs a Recipe"):
        register_recipe(lambda: 3)


def test_none_overrides_keep_defaults():
    base = get_recipe("cifar10-airbench")
    same = get_recipe(
        "cifar10-airbench",
        epochs=None,
        batch_size=None,
        optim={"lr": None, "momentum": 0.5},
        augment={"cutout": None},
        model_kwargs={"widths": None},
    )
    assert same.epochs == base.epochs and same.batch_size == base.batch_size
    assert same.optim.lr == base.optim.lr and same.optim.momentum == 0.5
    assert same.augment == base.augment
    assert same.model_kwargs == base.model_kwargs


def test_overrides_win_and_registry_copy_is_untouched():
    changed = get_recipe("digits-small", epochs=2, optim={"lr": 0.05}, model_kwargs={"widths": [8, 8, 8]})
    assert (changed.epochs, changed.optim.lr, changed.model_kwargs["widths"]) == (2, 0.05, [8, 8, 8])
    fresh = get_recipe("digits-small")
    assert fresh.epochs != 2 and fresh.optim.lr != 0.05 and fresh.model_kwargs["widths"] != [8, 8, 8]


def test_bad_overrides_are_named():
    with pytest.raises(ValueError, match="has no field 'epoch'"):
        get_recipe("digits-small", epoch=3)
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['learning_rate'\]"):
        get_recipe("digits-small", optim={"learning_rate": 1.0})
    with pytest.raises(ValueError, match="ema_decay and lookahead"):
        get_recipe("cifar10-airbench", ema_decay=0.99)
    with pytest.raises(ValueError, match="unknown compile settings"):
        get_recipe("digits-small", compile={"mdoe": "max-autotune"})


def test_fnmatch_listing():
    assert list_recipes("cifar10-*") == sorted(n for n in list_recipes() if n.startswith("cifar10-"))
    assert list_recipes("*resnet*") == ["cifar10-resnet18", "imagefolder-resnet50"]
    assert list_recipes("nothing-*") == []


def test_unknown_recipe_lists_known_and_suggests_nearest():
    with pytest.raises(UnknownRecipeError) as info:
        get_recipe("cifar10-airbenc")
    message = str(info.value)
    assert "Did you mean 'cifar10-airbench'?" in message
    for name in list_recipes():
        assert name in message


def test_recipe_dataclasses_validate():
    with pytest.raises(ValueError, match="flip"):
        AugmentConfig(flip="sometimes").validate()
    with pytest.raises(ValueError, match="rrc_scale"):
        AugmentConfig(rrc_scale=(0.5, 0.1)).validate()
    with pytest.raises(ValueError, match="whitening_images needs a model with a whitening layer"):
        Recipe(name="x", description="", model="resnet18", dataset="digits", whitening_images=10).validate()
    assert OptimConfig().optimizer == "sgd"


# ------------------------------------------------------------------------------------------- models
def test_model_registry_duplicate_raises(monkeypatch):
    monkeypatch.setattr(model_registry, "_model_entrypoints", dict(model_registry._model_entrypoints))

    def resnet18(num_classes: int = 10):
        return torch.nn.Linear(1, num_classes)

    with pytest.raises(ValueError, match="already registered"):
        register_model(resnet18)


def test_create_model_drops_none_kwargs():
    model = create_model("airbench94", num_classes=7, widths=None, logit_scale=None)
    assert model.head.out_features == 7
    assert model.layer1.conv1.out_channels == 64 and model.logit_scale == pytest.approx(1 / 9)


def test_create_model_falls_back_to_torchvision():
    assert "squeezenet1_1" not in list_models()
    model = create_model("squeezenet1_1", num_classes=5)
    assert isinstance(model, torchvision.models.SqueezeNet)
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 5)


def test_create_model_timm_when_installed():
    timm = pytest.importorskip("timm", reason="timm is not installed; the timm fallback is optional")
    model = create_model("resnet10t", num_classes=3)
    assert isinstance(model, timm.models.ResNet)


def test_unknown_model_error():
    with pytest.raises(ValueError, match="unknown model 'resnet19'.*Did you mean"):
        create_model("resnet19", num_classes=10)
    with pytest.raises(ValueError, match="num_classes must be a positive int"):
        create_model("resnet18", num_classes=0)


def test_create_model_routes_unknown_names_to_timm(monkeypatch):
    """The timm fallback without timm installed: a stand-in module records what create_model asks of it."""
    import types

    calls = []
    made = torch.nn.Linear(2, 4)

    def fake_create_model(name, pretrained=True, num_classes=1000, **kwargs):  # timm's default is pretrained
        calls.append((name, pretrained, num_classes, kwargs))
        return made

    fake = types.ModuleType("timm")
    fake.is_model = lambda name: name in ("fake_timm_net", "resnet18")
    fake.create_model = fake_create_model
    fake.list_models = lambda pattern="*": ["fake_timm_net", "resnet18"]
    monkeypatch.setitem(sys.modules, "timm", fake)

    model = create_model("fake_timm_net", num_classes=4, drop_rate=0.25, drop_path_rate=None)
    assert model is made
    # pretrained weights are never downloaded; None-valued options are dropped, the rest are passed on
    assert calls == [("fake_timm_net", False, 4, {"drop_rate": 0.25})]

    # our own registry wins over timm for a name both know
    assert "resnet18" in list_models()
    assert isinstance(create_model("resnet18", num_classes=4), torch.nn.Module) and len(calls) == 1
    # torchvision is asked before timm
    assert isinstance(create_model("squeezenet1_1", num_classes=4), torchvision.models.SqueezeNet)
    assert len(calls) == 1

    # a name that timm does not know either: the usual error, and timm.create_model is never called
    with pytest.raises(
        ValueError,
        match=r"unknown model 'not_a_timm_net': not in the vision registry, "
        r"torchvision or timm",
    ):
        create_model("not_a_timm_net", num_classes=4)
    assert len(calls) == 1
