"""How a :class:`Recipe` becomes Lightning objects: the only place that knows the mapping.

Two spellings of the same mapping: :func:`recipe_defaults` gives the ``model``/``data``/``trainer``
settings as plain config values (what ``lcv`` installs as parser defaults, so any flag or ``--config``
file overrides them), and :func:`build` / :func:`build_trainer` give ready objects for Python scripts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import lightning.pytorch as pl
import torch

from lcv_vision.recipes._data import DATAMODULES, RecipeData
from lcv_vision.recipes._recipe import Recipe
from lcv_vision.recipes._registry import get_recipe

__all__ = [
    "build",
    "build_datamodule",
    "build_module",
    "build_trainer",
    "data_kwargs",
    "default_callbacks",
    "module_kwargs",
    "recipe_defaults",
    "trainer_kwargs",
]


def _resolve(recipe: Recipe | str) -> Recipe:
    return get_recipe(recipe) if isinstance(recipe, str) else recipe


def module_kwargs(recipe: Recipe | str) -> dict[str, Any]:
    """``ClassificationModule`` arguments (without ``num_classes``, which comes from the data)."""
    recipe = _resolve(recipe)
    return {
        **recipe.module_kwargs(),
        "channels_last": bool(recipe.compile.get("channels_last", False)),
        "recipe": recipe.name,
    }


def data_kwargs(recipe: Recipe | str) -> dict[str, Any]:
    """Arguments of the recipe's DataModule (``augment`` is an ``AugmentConfig``)."""
    recipe = _resolve(recipe)
    return {
        "batch_size": recipe.batch_size,
        "seed": recipe.seed,
        "augment": dataclasses.replace(recipe.augment),
        **recipe.data_kwargs,
    }


def trainer_kwargs(
    recipe: Recipe | str, gpu: bool | None = None, backend: str | None = None
) -> dict[str, Any]:
    """``Trainer`` settings the recipe decides: epochs, precision, and the strategy.

    ``strategy="compiled"`` with the recipe's compile settings on a GPU and on the CPU alike, with
    ``compile="auto"`` (the strategy times a few training steps compiled and eager after compiling, and
    trains eagerly where compiling does not pay, saying so), and the portable compile cache on (saved next
    to the checkpoints: a resume or another rank loads it instead of compiling). The recipe's precision on a
    GPU; fp32 on the CPU, where bf16 autocast is slow. On the CPU evaluation runs eagerly
    (``compile_eval=False``): an evaluation of a few batches never wins back the compile of its graph (two
    with the smaller last batch).

    ``backend``: another ``torch.compile`` backend than the recipe's (Inductor), e.g. ``"aot_eager"`` to
    trace the same graphs without generating and building code; Inductor's ``mode`` is then dropped.
    """
    recipe = _resolve(recipe)
    gpu = torch.cuda.is_available() if gpu is None else gpu
    settings = {"cache": True, **({} if gpu else {"compile_eval": False}), **recipe.compile}
    if backend is not None:
        settings["backend"] = backend
        if backend != "inductor":
            settings["mode"] = None  # Inductor's modes mean nothing to another backend
    return {
        "max_epochs": recipe.epochs,
        "precision": recipe.precision if gpu else "32-true",
        "strategy": {"class_path": "lightning_plugin.CompiledStrategy", "init_args": settings},
    }


def recipe_defaults(recipe: Recipe | str, gpu: bool | None = None) -> dict[str, Any]:
    """``{"model": ..., "data": ..., "trainer": ..., "seed_everything": ...}`` for ``lcv``'s parser."""
    recipe = _resolve(recipe)
    return {
        "model": module_kwargs(recipe),
        "data": data_kwargs(recipe),
        "trainer": trainer_kwargs(recipe, gpu),
        "seed_everything": recipe.seed,
    }


def build_datamodule(recipe: Recipe | str, **overrides: Any) -> RecipeData:
    """The recipe's DataModule; ``overrides`` (e.g. ``root=``, ``batch_size=``) win, ``None`` values are
    ignored."""
    recipe = _resolve(recipe)
    kwargs = {**data_kwargs(recipe), **{k: v for k, v in overrides.items() if v is not None}}
    return DATAMODULES[recipe.dataset](**kwargs)


def build_module(recipe: Recipe | str, num_classes: int, **overrides: Any) -> pl.LightningModule:
    """The recipe's ``ClassificationModule``; ``overrides`` win, ``None`` values are ignored."""
    from lcv_vision.module import ClassificationModule

    kwargs = {**module_kwargs(recipe), **{k: v for k, v in overrides.items() if v is not None}}
    return ClassificationModule(num_classes=num_classes, **kwargs)


def build(
    recipe: Recipe | str, data: dict[str, Any] | None = None, model: dict[str, Any] | None = None
) -> tuple[pl.LightningModule, pl.LightningDataModule]:
    """``(module, datamodule)`` for ``recipe`` with optional overrides of each."""
    datamodule = build_datamodule(recipe, **(data or {}))
    module = build_module(recipe, int(datamodule.num_classes), **(model or {}))
    return module, datamodule


def default_callbacks(monitor: bool = True, progress_bar: bool = True) -> list[pl.Callback]:
    """The callbacks ``lcv fit`` adds: best-and-last checkpoints (``last.ckpt`` always the latest state), a
    checkpoint of an interrupted run (``interrupted.ckpt``), a NaN/Inf loss guard, the ``TrainingMonitor``, a
    logging interval that fits short epochs, a short model summary, what the compiler did (for the run
    summary) and a progress bar."""
    from lcv_vision.callbacks import (
        BestAndLastCheckpoint,
        FitLoggingInterval,
        LcvModelSummary,
        LcvProgressBar,
    )
    from lcv_vision.compiler_summary import CompilerSummary
    from lightning_plugin.callbacks import FaultTolerantCheckpoint, NonFiniteLossGuard

    callbacks: list[pl.Callback] = [
        BestAndLastCheckpoint(monitor="val/acc", mode="max", filename="best-{epoch}-{step}"),
        FaultTolerantCheckpoint(),
        NonFiniteLossGuard(),
        FitLoggingInterval(),
        LcvModelSummary(),
        CompilerSummary(),
    ]
    if monitor:
        from lightning_plugin.callbacks import TrainingMonitor

        callbacks.append(TrainingMonitor())
    if progress_bar:
        callbacks.append(LcvProgressBar())
    return callbacks


def build_trainer(recipe: Recipe | str, gpu: bool | None = None, **overrides: Any) -> pl.Trainer:
    """A ``Trainer`` with the recipe's epochs/precision/strategy; ``overrides`` are ``Trainer`` arguments."""
    import lightning_plugin  # noqa: F401  (registers strategy="compiled")

    kwargs = trainer_kwargs(recipe, gpu)
    strategy = kwargs["strategy"]
    if isinstance(strategy, dict):
        from lightning_plugin import CompiledStrategy

        kwargs["strategy"] = CompiledStrategy(**strategy["init_args"])
    kwargs.update(overrides)
    return pl.Trainer(**kwargs)
