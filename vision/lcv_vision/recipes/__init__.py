"""Named training recipes (timm-style registry) and how they become Lightning objects.

>>> from lcv_vision.recipes import list_recipes, get_recipe, build
>>> module, datamodule = build("digits-small")
"""

from lcv_vision.data.geometry import AlternatingFlipCrop
from lcv_vision.data.trivial_augment import TrivialAugmentWide
from lcv_vision.recipes import library  # noqa: F401  (registers the built-in recipes)
from lcv_vision.recipes._build import (
    build,
    build_datamodule,
    build_module,
    build_trainer,
    data_kwargs,
    default_callbacks,
    module_kwargs,
    recipe_defaults,
    trainer_kwargs,
)
from lcv_vision.recipes._data import DATAMODULES, CIFAR10Data, DigitsData, ImageFolderData
from lcv_vision.recipes._pipeline import build_train_pipeline
from lcv_vision.recipes._recipe import DATASETS, AugmentConfig, OptimConfig, Recipe
from lcv_vision.recipes._registry import UnknownRecipeError, get_recipe, list_recipes, register_recipe

__all__ = [
    "AlternatingFlipCrop",
    "AugmentConfig",
    "CIFAR10Data",
    "DATAMODULES",
    "DATASETS",
    "DigitsData",
    "ImageFolderData",
    "OptimConfig",
    "Recipe",
    "TrivialAugmentWide",
    "UnknownRecipeError",
    "build",
    "build_datamodule",
    "build_module",
    "build_train_pipeline",
    "build_trainer",
    "data_kwargs",
    "default_callbacks",
    "get_recipe",
    "list_recipes",
    "module_kwargs",
    "recipe_defaults",
    "register_recipe",
    "trainer_kwargs",
]
