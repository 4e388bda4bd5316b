"""``lcv``: train, evaluate and predict with a named recipe, on Lightning's ``LightningCLI``.

    lcv fit --recipe cifar10-airbench --data.root data/ --data.download true
    lcv fit --recipe digits-small --trainer.max_epochs 3 --model.lr 0.1
    lcv fit --config run.yaml                      # a file with `recipe: NAME` and any overrides
    lcv test --ckpt_path runs/digits-small/version_0/checkpoints/last.ckpt
    lcv recipes                                    # the table of recipes; `lcv recipes NAME` shows one

How values combine: the recipe supplies the *defaults* of every ``--model.*``, ``--data.*`` and
``--trainer.*`` option; ``--config`` files and flags then override them, later ones winning. So a
value the user gives always beats the recipe's. (In Python, :func:`lcv_vision.recipes.get_recipe`
ignores ``None`` overrides; here ``null`` is an explicit value, e.g. ``--model.ema_decay null``
turns EMA off.)
"""

from __future__ import annotations

import difflib
import logging
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

from lcv_vision.callbacks import BestAndLastCheckpoint, ThroughputMeter
from lcv_vision.compiler_summary import CompilerSummary
from lcv_vision.data.datasets import DatasetError
from lcv_vision.deploy.cli import DEPLOY_SUBCOMMANDS
from lcv_vision.deploy.cli import main as deploy_main
from lcv_vision.finetune import WeightsError
from lcv_vision.module import ClassificationModule
from lcv_vision.recipes import (
    DATAMODULES,
    Recipe,
    UnknownRecipeError,
    get_recipe,
    list_recipes,
    recipe_defaults,
)
from lcv_vision.renamed_packages import upgrade_config_files
from lcv_vision.run_logs import HeldFinalize, prepare_hparams, weights_tagged
from lightning_plugin.trainer_attributes import runtime_attributes

__all__ = ["LcvCLI", "LcvError", "ThroughputMeter", "main", "run"]

_SUBCOMMANDS = ("fit", "validate", "test", "predict")
_HELP_RECIPE = "digits-small"  # whose options `lcv fit --help` shows when no --recipe is given
_USAGE = """usage: lcv {fit,validate,test,predict} --recipe NAME [--config FILE] [--model.* ...] \
[--data.* ...]
                                         [--trainer.* ...] [--ckpt_path CKPT]
       lcv recipes [NAME | PATTERN]
       lcv {export,classify,serve} ...           (lcv export --help: a checkpoint -> a served model)

  lcv recipes                                  list the recipes (`lcv recipes NAME` shows one in full)
  lcv fit --recipe digits-small                train the default recipe (offline, CPU ok)
  lcv fit --recipe cifar10-airbench --data.root data/ --data.download true --trainer.max_epochs 3
  lcv test --ckpt_path runs/digits-small/version_0/checkpoints/last.ckpt
  lcv fit --recipe NAME --help                 every option, with the recipe's values as defaults
  lcv export CKPT --out model.pt2 [--quantize int8]   one AOTInductor file (docs/deploy.md)
  lcv classify model.pt2 image.jpg             top-5 labels;  lcv serve model.pt2: an HTTP server"""


class LcvError(ValueError):
    """A usage error ``lcv`` reports in one line (exit status 2) instead of a traceback."""


#: Lightning info lines ``lcv`` does not show: an advertisement and notes about its own internals.
_NOT_SHOWN = (
    "litlogger",
    "GPU available: ",  # the device is in lcv's plan line
    "TPU available: ",
    "HPU available: ",
    "Seed set to ",  # the seed is in the saved config.yaml
    "Trainer already configured with model summary callbacks",
    "to estimate number of stepping batches",
)

#: model options that decide the architecture: a checkpoint's weights only fit its own values.
_ARCHITECTURE_OPTIONS = ("model", "model_kwargs")
_RUN_LOGGER = "lcv_vision.run_logs.RunLogger"
_RUNS_FOLDER = "runs"  # relative to --trainer.default_root_dir, else to the working folder
#: recipe model options that belong to the recipe's own architecture, with the module's defaults: a
#: ``--model.model`` of another architecture starts from these unless they are given too.
_OWN_ARCHITECTURE_DEFAULTS: dict[str, Any] = {
    "model_kwargs": None,
    "whitening_images": 0,
    "whitening_bias_epochs": None,
}


def _quiet_lightning() -> None:
    """Drop the messages of Lightning and PyTorch that say nothing about the user's run."""
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated")

    class _NoTips(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not any(text in str(record.msg) for text in _NOT_SHOWN)

    for logger in ("lightning.pytorch", "lightning.fabric"):
        for handler in logging.getLogger(logger).handlers:
            if not any(isinstance(f, _NoTips) for f in handler.filters):
                handler.addFilter(_NoTips())


# ------------------------------------------------------------------------------------------- the CLI
class LcvCLI(LightningCLI):
    """``LightningCLI`` whose model/data/trainer defaults come from a :class:`Recipe`.

    Args:
        recipe: the recipe providing the defaults.
        gpu: whether a GPU is present (``strategy="compiled"`` and the recipe's precision by default);
            ``None`` = ``torch.cuda.is_available()``.
        kwargs: passed to ``LightningCLI`` (``args=``, ``run=`` ...).
    """

    def __init__(self, recipe: Recipe, gpu: bool | None = None, **kwargs: Any) -> None:
        self.recipe = recipe
        self.gpu = torch.cuda.is_available() if gpu is None else gpu
        self.throughput = ThroughputMeter()
        self.started = time.perf_counter()
        #: test metrics after ``fit`` per evaluated weights: ``{"EMA": {...}, "final": {...}}``
        self.test_results: dict[str, Mapping[str, float]] = {}
        self._argv = list(sys.argv[1:] if kwargs.get("args") is None else kwargs["args"])
        self._checkpoint_hparams: dict[str, Any] = {}
        self._held_finalize: HeldFinalize | None = None
        _quiet_lightning()
        kwargs.setdefault("parser_kwargs", {"prog": "lcv"})
        super().__init__(
            ClassificationModule,
            DATAMODULES[recipe.dataset],
            seed_everything_default=recipe.seed,
            save_config_kwargs={"overwrite": True},
            trainer_defaults={"callbacks": [self.throughput]},
            **kwargs,
        )

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--recipe",
            type=str,
            default=self.recipe.name,
            help=f"Recipe that sets the defaults of every option (known: {', '.join(list_recipes())}).",
        )
        parser.add_argument(
            "--test_after_fit",
            type=bool,
            default=True,
            help="fit only: test the final weights (and the EMA weights, when kept) after training and "
            "print a summary.",
        )
        parser.add_argument(
            "--predictions_path",
            type=str | None,
            default=None,
            help="predict only: save the predictions (probs, preds) to this .pt file.",
        )
        parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")
        defaults = recipe_defaults(self.recipe, self.gpu)
        flat: dict[str, Any] = {f"model.{k}": v for k, v in defaults["model"].items()}
        flat.update({f"data.{k}": v for k, v in defaults["data"].items()})
        flat.update({f"trainer.{k}": v for k, v in defaults["trainer"].items()})
        flat["trainer.logger"] = {
            "class_path": _RUN_LOGGER,
            "init_args": {"save_dir": _RUNS_FOLDER, "name": self.recipe.name},
        }
        flat["trainer.callbacks"] = [
            {
                "class_path": "lcv_vision.callbacks.BestAndLastCheckpoint",
                "init_args": {"monitor": "val/acc", "mode": "max", "filename": "best-{epoch}-{step}"},
            },
            {"class_path": "lightning_plugin.callbacks.FaultTolerantCheckpoint"},
            {"class_path": "lightning_plugin.callbacks.NonFiniteLossGuard"},
            {"class_path": "lightning_plugin.callbacks.TrainingMonitor"},
            {"class_path": "lcv_vision.callbacks.LcvProgressBar"},
            {"class_path": "lcv_vision.callbacks.LcvModelSummary"},
            {"class_path": "lcv_vision.callbacks.FitLoggingInterval"},
            {"class_path": "lcv_vision.compiler_summary.CompilerSummary"},
        ]
        flat["seed_everything"] = defaults["seed_everything"]
        parser.set_defaults(flat)

    @override
    def _parse_ckpt_path(self) -> None:
        """Lightning copies the checkpoint's model hyperparameters over the parsed options; here the
        checkpoint must come from this recipe, and model options given on the command line (or in a --config
        file) win, except the ones that decide the architecture, where a difference is an error."""
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return
        path = self.config[subcommand].get("ckpt_path")
        if not path:
            return
        if not Path(path).is_file():
            raise LcvError(f"--ckpt_path {path!r} does not exist")
        hparams = torch.load(path, map_location="cpu", weights_only=True).get("hyper_parameters", {})
        saved = hparams.get("recipe")
        if saved and saved != self.recipe.name:
            raise LcvError(
                f"--ckpt_path {path!r} was saved by recipe {saved!r}, not {self.recipe.name!r}: its model "
                f"does not fit recipe {self.recipe.name!r}. Leave out --recipe (the checkpoint's recipe is "
                f"then used) or give a checkpoint of {self.recipe.name!r}"
            )
        model = self.config[subcommand]["model"]
        given = {key: model[key] for key in self._given_model_options() if key in model}
        for key in _ARCHITECTURE_OPTIONS:
            if key in given and key in hparams and given[key] != hparams[key]:
                raise LcvError(
                    f"--model.{key} {given[key]!r} conflicts with --ckpt_path {path!r}, whose weights are "
                    f"for {key}={hparams[key]!r}; leave out --model.{key}"
                )
        super()._parse_ckpt_path()
        for key, value in given.items():
            self.config[subcommand]["model"][key] = value
        self._checkpoint_hparams = hparams

    def _reset_recipe_architecture(self, model: Any) -> None:
        """``--model.model X`` with another architecture than the recipe's: the recipe's ``model_kwargs`` and
        whitening layer were for its own (airbench's ``widths`` mean nothing to ``hf:<dir>``), so the ones
        not given on the command line go back to the module's defaults."""
        given = self._given_model_options()
        if "model" not in given or model.get("model") == self.recipe.model:
            return
        for key, default in _OWN_ARCHITECTURE_DEFAULTS.items():
            if key not in given:
                model[key] = default

    def _given_model_options(self) -> set[str]:
        """The ``--model.*`` options set on the command line or in a --config file."""
        keys = {
            arg[len("--model.") :].split("=", 1)[0].split(".", 1)[0]
            for arg in self._argv
            if arg.startswith("--model.")
        }
        for path in _option(self._argv, "--config", "-c"):
            loaded = yaml.safe_load(Path(path).read_text()) if Path(path).is_file() else None
            if isinstance(loaded, dict):
                for section in (loaded, loaded.get(self._argv[0] if self._argv else "", None)):
                    if isinstance(section, dict) and isinstance(section.get("model"), dict):
                        keys.update(section["model"])
        return keys

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        if config.get("recipe") != self.recipe.name:
            raise LcvError(  # only reachable when --recipe comes in a way main() could not see beforehand
                f"--recipe {config.get('recipe')!r} must be given on the command line or at the top of a "
                f"--config file (main saw {self.recipe.name!r})"
            )
        _check_data(self.recipe, config["data"])
        self._reset_recipe_architecture(config["model"])
        if self.subcommand == "fit":
            _check_run_length(config["trainer"])
        _drop_disabled_callbacks(config["trainer"])
        _runs_under_root_dir(config["trainer"])

    @override
    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (DatasetError, WeightsError):
            raise
        except (ValueError, MisconfigurationException) as err:  # the classes validate their arguments
            raise LcvError(f"invalid settings for recipe {self.recipe.name!r}: {err}") from err
        classes = self._checkpoint_hparams.get("num_classes")
        have = getattr(self.datamodule, "num_classes", None)
        if classes is not None and have is not None and int(classes) != int(have):
            raise LcvError(
                f"the checkpoint's model has {classes} classes but the data set has {have} "
                f"({', '.join(map(str, getattr(self.datamodule, 'class_names', [])))})"
            )

    # ------------------------------------------------------------------------------------- subcommands
    def before_fit(self) -> None:
        prepare_hparams(self.trainer)

    def after_fit(self) -> None:
        try:
            self._test_after_fit()
        finally:
            if self._held_finalize is not None:
                self._held_finalize.release()  # the run's TensorBoard event file closes here
                self._held_finalize = None
        if self.trainer.is_global_zero and not self.trainer.interrupted:
            print(self.fit_summary())

    def _test_after_fit(self) -> None:
        """Test each evaluated weights; their metrics go to the fit's event file as ``whole_run/test_<weights>_*``."""
        if self.trainer.interrupted or not self.config["fit"].get("test_after_fit", True):
            return
        module = self.model
        for name in module.evaluation_weights():
            with module.evaluating_with(name), weights_tagged(self.trainer, name):
                results = self.trainer.test(module, datamodule=self.datamodule, verbose=False)
            if results:
                self.test_results[name] = results[0]

    def fit(
        self, model: LightningModule, datamodule: Any = None, ckpt_path: Any = None, **kwargs: Any
    ) -> None:
        with warnings.catch_warnings():
            if ckpt_path is None:
                # With FaultTolerantCheckpoint among the callbacks, Lightning turns ckpt_path=None into "last"
                # and warns twice; a new lcv run has its own version folder, so there is nothing to resume.
                warnings.filterwarnings(
                    "ignore", message=r"`\.fit\(ckpt_path=None\)` was called without a model"
                )
                warnings.filterwarnings(
                    "ignore", message=r'\.fit\(ckpt_path="last"\) is set, but there is no last'
                )
            if self.trainer.is_global_zero:
                print(self.plan_line(model, datamodule, ckpt_path), flush=True)
            # Lightning closes the loggers when fit ends; the tests after it must write to the same file.
            self._held_finalize = HeldFinalize(self.trainer.loggers)
            try:
                self.trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path, **kwargs)
            except BaseException:
                self._held_finalize.release()
                self._held_finalize = None
                raise

    def plan_line(self, model: LightningModule, datamodule: Any, ckpt_path: Any) -> str:
        """One line before training: recipe, model, data, device and how the strategy compiles."""
        trainer = self.trainer
        hparams = getattr(model, "hparams", {})
        data = type(datamodule).__name__ if datamodule is not None else "the model's own loaders"
        root = getattr(datamodule, "root", None)
        if root:
            data += f" from {root}"
        config = getattr(trainer.strategy, "compile_config", None)
        if config is None:
            compiling = f"strategy {type(trainer.strategy).__name__} (not compiled by lcv)"
        elif config.compile == "auto":
            compiling = "compile='auto' (times compiled and eager steps at the start and keeps the faster)"
        else:
            compiling = f"compile={config.compile!r}"
        resume = f", resuming {ckpt_path}" if ckpt_path else ""
        return (
            f"lcv fit: recipe {self.recipe.name}, model {hparams.get('model', '?')}, {trainer.max_epochs} "
            f"epoch(s), data {data}, device {trainer.strategy.root_device}, precision {trainer.precision}; "
            f"{compiling}{resume}"
        )

    def predict(self, model: LightningModule, datamodule: Any = None, **kwargs: Any) -> None:
        kwargs.setdefault("return_predictions", True)
        outputs = self.trainer.predict(model, datamodule=datamodule, **kwargs) or []
        path = self.config["predict"].get("predictions_path")
        if outputs and path:
            merged = {k: torch.cat([o[k] for o in outputs]) for k in outputs[0]}
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            torch.save(merged, path)
            print(f"lcv: saved {merged['preds'].shape[0]} predictions to {path}")

    def fit_summary(self) -> str:
        """The lines ``lcv fit`` prints at the end: accuracy of each evaluated weights, the best and the last
        checkpoints, throughput, where the logs are."""
        trainer = self.trainer
        lines = [
            f"lcv fit --recipe {self.recipe.name}: done in {time.perf_counter() - self.started:.1f} s "
            f"(from parsing the options to the end, imports not included; {trainer.current_epoch} "
            f"epochs, {trainer.global_step} steps, device {trainer.strategy.root_device})"
        ]
        for name, result in self.test_results.items():
            text = f"  test accuracy ({name} weights): {100 * result['test/acc']:.2f}%"
            if "test/acc_top5" in result:
                text += f"  top-5 {100 * result['test/acc_top5']:.2f}%"
            lines.append(text)
        checkpoint = trainer.checkpoint_callback
        evaluated = self.model.evaluation_weights()[0]
        best = checkpoint.best() if isinstance(checkpoint, BestAndLastCheckpoint) else None
        if best is not None:
            lines.append(f"  best val/acc ({evaluated} weights): {100 * best[0]:.2f}%, checkpoint {best[1]}")
        last_path = getattr(checkpoint, "last_model_path", None)  # ModelCheckpoint's; None without one
        if last_path:
            lines.append(
                f"  last checkpoint (epoch {trainer.current_epoch}, step {trainer.global_step}): {last_path}"
            )
        overall = self.throughput.images_per_second()
        if overall is not None:
            text = f"  training throughput: {overall:,.0f} images/s (all epochs"
            steady = self.throughput.images_per_second(skip_first_epoch=True)
            text += f"; {steady:,.0f} images/s without the first epoch)" if steady else ")"
            lines.append(text)
        if trainer.logger is not None and getattr(trainer.logger, "log_dir", None):
            lines.append(f"  TensorBoard logs: {trainer.logger.log_dir}   (tensorboard --logdir runs)")
        lines += [
            line
            for c in runtime_attributes(trainer).callbacks
            if isinstance(c, CompilerSummary)
            for line in c.lines()
        ]
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------- checks
# Trainer flag that, when false, rules out these default callbacks (Lightning would refuse them).
_DISABLES = {
    "enable_progress_bar": ("RichProgressBar", "TQDMProgressBar", "LcvProgressBar"),
    "enable_checkpointing": ("ModelCheckpoint", "BestAndLastCheckpoint", "FaultTolerantCheckpoint"),
    "enable_model_summary": ("ModelSummary", "RichModelSummary", "LcvModelSummary"),
}


def _check_run_length(trainer: Any) -> None:
    """Refuse runs that would train nothing, or that never end (the learning-rate schedule needs their
    length)."""
    get = trainer.get if hasattr(trainer, "get") else lambda k, d=None: getattr(trainer, k, d)
    epochs, steps, limit = get("max_epochs"), get("max_steps"), get("limit_train_batches")
    if epochs == 0:
        raise LcvError("--trainer.max_epochs 0 trains nothing; give at least 1")
    if steps == 0:
        raise LcvError("--trainer.max_steps 0 trains nothing; give at least 1 (or -1 for no step limit)")
    if limit is not None and limit == 0:
        raise LcvError(
            "--trainer.limit_train_batches 0 trains nothing; give a positive number of batches or fraction"
        )
    if epochs is not None and epochs < 0 and (steps is None or steps < 0):
        raise LcvError(
            f"--trainer.max_epochs {epochs} trains until stopped, but the learning-rate schedule needs the "
            "run's length: give --trainer.max_steps N (or a number of epochs)"
        )


def _drop_disabled_callbacks(trainer: Any) -> None:
    """``--trainer.enable_progress_bar false`` / ``--trainer.enable_checkpointing false`` remove the default
    progress bar / checkpoint callbacks instead of making Lightning reject the combination."""
    callbacks = trainer.get("callbacks") or []
    for flag, names in _DISABLES.items():
        if trainer.get(flag) is False:
            callbacks = [c for c in callbacks if str(c.get("class_path", "")).rsplit(".", 1)[-1] not in names]
    trainer["callbacks"] = callbacks


def _runs_under_root_dir(trainer: Any) -> None:
    """``--trainer.default_root_dir DIR`` puts the run folder (logs, config, checkpoints) in ``DIR/runs``, as
    Lightning's own logger would follow it, instead of ``runs/`` in the working folder. A ``save_dir`` the user
    set themselves stands."""
    root = trainer.get("default_root_dir")
    logger = trainer.get("logger")
    if not root or not hasattr(logger, "get") or logger.get("class_path") != _RUN_LOGGER:
        return
    init_args = logger.get("init_args")
    if init_args is not None and init_args.get("save_dir") == _RUNS_FOLDER:
        init_args["save_dir"] = str(Path(root) / _RUNS_FOLDER)


def _check_data(recipe: Recipe, data: Any) -> None:
    """Fail before anything is built when the data set the recipe needs is not where the options say."""
    get = data.get if hasattr(data, "get") else lambda k, d=None: getattr(data, k, d)
    if recipe.dataset == "cifar10":
        root, zip_path, download = get("root"), get("zip_path"), get("download")
        if root is None and zip_path is None:
            raise LcvError(
                f"recipe {recipe.name!r} trains on CIFAR-10: give --data.root DIR (torchvision's CIFAR-10 "
                "there; add --data.download true to fetch it) or --data.zip_path FILE (JPEGs in ImageFolder "
                "layout with train/ and test/)"
            )
        if zip_path is not None and not Path(zip_path).exists():
            raise LcvError(f"--data.zip_path {zip_path!r} does not exist")
        if zip_path is None and not download and not Path(root).is_dir():
            raise LcvError(
                f"--data.root {root!r} is not a directory; add --data.download true to download CIFAR-10 "
                "there"
            )
    elif recipe.dataset == "imagefolder":
        root = get("root")
        if root is None:
            raise LcvError(
                f"recipe {recipe.name!r} trains on an ImageFolder tree: give --data.root DIR (or a .zip) "
                "with train/<class>/* and val/<class>/*"
            )
        if not Path(root).exists():
            raise LcvError(
                f"--data.root {root!r} does not exist (expected train/<class>/* and val/<class>/*)"
            )


# ------------------------------------------------------------------------------------------- main
def _option(argv: list[str], *names: str) -> list[str]:
    """Every value given for ``names`` in ``argv`` (``--name value`` and ``--name=value``), in order."""
    values = []
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                values.append(argv[i + 1])
            elif arg.startswith(name + "="):
                values.append(arg.split("=", 1)[1])
    return values


def _recipe_name(argv: list[str]) -> str | None:
    """The recipe: ``--recipe``, else a ``--config`` file's ``recipe:``, else the checkpoint's
    hyperparameters."""
    given = _option(argv, "--recipe")
    if given:
        return given[-1]
    for path in reversed(_option(argv, "--config", "-c")):
        if not Path(path).is_file():
            raise LcvError(f"--config {path!r} does not exist")
        loaded = yaml.safe_load(Path(path).read_text()) or {}
        if isinstance(loaded, dict) and loaded.get("recipe"):
            return str(loaded["recipe"])
    for path in _option(argv, "--ckpt_path"):
        if Path(path).is_file():
            hparams = torch.load(path, map_location="cpu", weights_only=True).get("hyper_parameters", {})
            if hparams.get("recipe"):
                return str(hparams["recipe"])
    return None


def _recipes_command(argv: list[str]) -> None:
    """``lcv recipes [PATTERN|NAME]``: a table, or one recipe in full."""
    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        raise LcvError("usage: lcv recipes [NAME | PATTERN]")
    pattern = argv[0] if argv else "*"
    if pattern in list_recipes():
        print(yaml.safe_dump(_as_plain(get_recipe(pattern)), sort_keys=False, width=120).rstrip())
        return
    names = list_recipes(pattern)
    if not names:
        get_recipe(pattern)  # raises UnknownRecipeError with the nearest name
    rows = [("recipe", "data set", "model", "epochs", "batch", "description")]
    for name in names:
        r = get_recipe(name)
        rows.append((r.name, r.dataset, r.model, str(r.epochs), str(r.batch_size), r.description))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[5])


def _as_plain(recipe: Recipe) -> dict[str, Any]:
    import dataclasses

    def plain(value: Any) -> Any:
        if isinstance(value, tuple):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value

    return plain(dataclasses.asdict(recipe))


def main(args: list[str] | None = None) -> None:
    """Entry point of ``lcv`` (the console script); ``args`` replaces ``sys.argv[1:]``.

    Usage errors print ``lcv: error: ...`` and exit with status 2; problems with the user's files (a corrupt
    image, a missing folder, classes that differ between train and val, weights that cannot be downloaded or
    do not fit) print the same one line and exit with status 1.
    """
    run(args)


def run(args: list[str] | None = None, gpu: bool | None = None) -> LcvCLI | None:
    """:func:`main` returning the :class:`LcvCLI` that ran (``None`` for ``lcv recipes``/help), for
    in-process use; ``gpu`` overrides the GPU detection that picks the default strategy and precision."""
    argv = list(sys.argv[1:] if args is None else args)
    try:
        upgraded = upgrade_config_files(argv)
        if upgraded != argv and args is None:
            sys.argv[1:] = upgraded  # LightningCLI reads sys.argv itself when run as the console script
        argv = upgraded
        if argv and argv[0] == "recipes":
            _recipes_command(argv[1:])
            return None
        if not argv or argv[0] in ("-h", "--help"):
            print(_USAGE)
            return None
        if argv[0] in DEPLOY_SUBCOMMANDS:
            deploy_main(argv)
            return None
        if argv[0] not in _SUBCOMMANDS:
            known = [*_SUBCOMMANDS, "recipes", *DEPLOY_SUBCOMMANDS]
            close = difflib.get_close_matches(argv[0], known, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise LcvError(f"unknown subcommand {argv[0]!r}.{hint} Choose from {', '.join(known)}")
        name = _recipe_name(argv)
        if name is None:
            if "-h" in argv or "--help" in argv:
                name = _HELP_RECIPE
            else:
                raise LcvError(
                    f"lcv {argv[0]} needs --recipe NAME (or a --config file with `recipe: NAME`, or a "
                    f"--ckpt_path saved by lcv). Known recipes: {', '.join(list_recipes())}"
                )
        recipe = get_recipe(name)
        # From the console script, let LightningCLI read sys.argv itself (it warns when given both).
        return LcvCLI(recipe, gpu=gpu, args=None if args is None else argv)
    except (LcvError, UnknownRecipeError) as err:
        print(f"lcv: error: {err}", file=sys.stderr)
        raise SystemExit(2) from err
    except (DatasetError, WeightsError) as err:  # the user's files: the message names the file or folder
        print(f"lcv: error: {err}", file=sys.stderr)
        raise SystemExit(1) from err


if __name__ == "__main__":
    main()
