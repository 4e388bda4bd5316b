"""`ClassificationModule`: the one LightningModule every recipe builds.

Every knob is a plain constructor argument (so ``lcv fit --model.lr 0.1`` works and
``save_hyperparameters`` records a complete, reloadable configuration); the recipe only
chooses their values. Evaluation uses the EMA weights when EMA is on, and test-time
augmentation in ``test``/``predict`` only (validation stays cheap and comparable).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Literal, Protocol, cast, runtime_checkable

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from lcv_vision.data.loader import first_images
from lcv_vision.ema import ModelEMA, ema_warmup_decay, lookahead_decay
from lcv_vision.finetune import load_initial_weights, pretrained_state_dict, read_weights_file
from lcv_vision.models import create_model
from lcv_vision.tta import TTA_MODES, predict_with_tta
from lightning_plugin.cpu.strided_pointwise_conv import restore_convs, subsample_strided_pointwise_convs
from lightning_plugin.trainer_attributes import runtime_attributes

__all__ = ["ClassificationModule", "lr_factor"]

# The EMA copy is a submodule kept in eval mode on purpose (it is only ever evaluated, with its averaged BN
# statistics); Lightning's generic "modules in eval mode at the start of training" warning is expected here.
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")

Schedule = Literal["cosine", "triangle", "step", "constant"]


@runtime_checkable
class _Whitened(Protocol):
    """A model with a data-initialised whitening layer (airbench's), set up by ``whitening_images``."""

    def init_whitening(self, images: torch.Tensor) -> None: ...


@runtime_checkable
class _DataAdapted(Protocol):
    """A model that takes the data's normalisation and class names (``hf:`` models map the data's mean/std to
    their image processor's, :mod:`lcv_vision.models.hf`)."""

    def adapt_to_data(
        self, mean: Sequence[float], std: Sequence[float], class_names: Sequence[str] | None = None
    ) -> None: ...


class ClassificationModule(pl.LightningModule):
    """Image classification with soft-target cross-entropy, top-1/top-5 metrics, EMA/lookahead and TTA.

    Args:
        model: a name for :func:`lcv_vision.models.create_model` (ours, torchvision's, timm's, or
            ``hf:<local dir or config>`` for Hugging Face ``transformers``, whose ``model_kwargs`` override its
            config; it then takes the datamodule's mean/std and class names at setup).
        num_classes: head size; ``None`` takes it from the datamodule's ``num_classes`` at setup.
        model_kwargs: extra architecture arguments (e.g. ``{"widths": [64, 256, 256]}``).
        optimizer: ``"sgd"`` or ``"adamw"``.
        lr: peak learning rate of the weight group.
        momentum, nesterov: SGD momentum (AdamW uses it as beta1).
        weight_decay: decay of every trainable parameter outside normalisation layers (biases included, as in
            airbench and torchvision's reference scripts).
        norm_weight_decay: decay of normalisation-layer parameters (torchvision's ``--norm-weight-decay``);
            ``None`` = ``weight_decay``.
        bias_lr_scale: learning-rate multiplier of the normalisation-layer parameters; their weight decay is
            divided by the same factor so the per-step decay ``lr * wd`` is unchanged (airbench's 64x BN-bias
            learning rate).
        schedule: ``"cosine"``, ``"triangle"`` (linear up, linear down), ``"step"`` or ``"constant"``, per
            step.
        warmup_fraction: fraction of all steps spent warming up linearly from ``warmup_start_factor``.
        warmup_start_factor: lr factor at step 0.
        final_lr_factor: lr factor at the last step (cosine and triangle).
        step_epochs, step_gamma: for ``"step"``: multiply by ``step_gamma`` every ``step_epochs`` epochs.
        label_smoothing: cross-entropy label smoothing (works with soft mixup/cutmix targets too).
        ema_decay: keep an EMA of the weights with this decay and evaluate with it; ``None`` = off. The decay
            of the k-th update is ``min(ema_decay, (1 + k) / (10 + k))`` (the warm-up of TensorFlow's
            ``ExponentialMovingAverage(num_updates=)``), so the average follows the weights of short runs
            instead of staying at the initial ones; the last training step always updates it.
        ema_every_n_steps: update the EMA (or lookahead) every n optimizer steps.
        lookahead: airbench's scheme instead of a plain EMA: every ``ema_every_n_steps`` the average moves
            with decay ``0.95**n * progress**3`` and the live model is reset to it. Not together with
            ``ema_decay``.
        tta: test-time augmentation for ``test``/``predict``: ``"none"``, ``"flip"`` or ``"flip_translate"``.
        whitening_images: for models with ``init_whitening`` (airbench): how many training images set the
            whitening filters at the start of fit; 0 = leave them.
        whitening_bias_epochs: train the whitening bias only for the first n epochs (airbench: 3); ``None`` =
            always.
        channels_last: convert the model to channels_last memory format.
        recipe: name of the recipe these settings came from. Informational, but saved with the
            hyperparameters so that ``lcv test --ckpt_path X`` can find the data set without ``--recipe``.
        pretrained: start ``fit`` from the model's pretrained weights (torchvision's, else timm's; downloaded
            once into their cache), with a new head for ``num_classes``.
        weights: start ``fit`` from a ``state_dict`` file (``torch.save``; a checkpoint of this module works
            too), with a new head when the file's head has another number of classes. Not with ``pretrained``.
            Either is loaded when a ``fit`` begins without a checkpoint to resume (a resumed one overwrites
            them).
    """

    def __init__(
        self,
        model: str = "resnet18",
        num_classes: int | None = None,
        model_kwargs: dict[str, Any] | None = None,
        optimizer: Literal["sgd", "adamw"] = "sgd",
        lr: float = 0.1,
        momentum: float = 0.9,
        nesterov: bool = False,
        weight_decay: float = 5e-4,
        norm_weight_decay: float | None = None,
        bias_lr_scale: float = 1.0,
        schedule: Schedule = "cosine",
        warmup_fraction: float = 0.0,
        warmup_start_factor: float = 0.01,
        final_lr_factor: float = 0.0,
        step_epochs: int = 30,
        step_gamma: float = 0.1,
        label_smoothing: float = 0.0,
        ema_decay: float | None = None,
        ema_every_n_steps: int = 1,
        lookahead: bool = False,
        tta: Literal["none", "flip", "flip_translate"] = "none",
        whitening_images: int = 0,
        whitening_bias_epochs: int | None = None,
        channels_last: bool = True,
        recipe: str | None = None,
        pretrained: bool = False,
        weights: str | None = None,
    ) -> None:
        super().__init__()
        _validate(locals())
        self.save_hyperparameters()
        self.model: nn.Module | None = None
        self.ema: ModelEMA | None = None
        self._evaluate_with: str | None = None  # "EMA" or "final"; None = the default (EMA when kept)
        self._initial_weights_loaded = False
        self._subsampled_convs: list[nn.Conv2d] = []  # during a CPU fit: see on_fit_start
        if num_classes is not None:
            self._build(num_classes)

    @property
    def _hp(self) -> AttributeDict:
        """``hparams`` with attribute access typed: ``save_hyperparameters`` stores an ``AttributeDict``,
        which Lightning's ``hparams`` property declares as any ``MutableMapping``."""
        return cast(AttributeDict, self.hparams)

    # ----------------------------------------------------------------------------------------- building
    def _build(self, num_classes: int) -> None:
        hp = self._hp
        try:
            model = create_model(hp.model, num_classes=num_classes, **(hp.model_kwargs or {}))
        except TypeError as err:  # typically model_kwargs meant for another architecture
            raise ValueError(
                f"model {hp.model!r} does not accept model_kwargs={hp.model_kwargs!r} ({err}); when changing "
                "the "
                "model, set its kwargs too (lcv: --model.model_kwargs '{}')"
            ) from err
        if hp.whitening_images and not hasattr(model, "init_whitening"):
            raise ValueError(
                f"whitening_images={hp.whitening_images} needs a model with a whitening layer (airbench*), "
                f"but {hp.model!r} has none; set whitening_images=0 (lcv: --model.whitening_images 0)"
            )
        if hp.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.model = model
        self._hp.num_classes = num_classes
        if hp.ema_decay is not None or hp.lookahead:
            self.ema = ModelEMA(model, decay=hp.ema_decay if hp.ema_decay is not None else 0.0)
        metric_kwargs: dict[str, Any] = {"num_classes": num_classes, "average": "micro"}
        for stage in ("val", "test"):
            setattr(self, f"{stage}_acc", MulticlassAccuracy(top_k=1, **metric_kwargs))
            if num_classes > 5:
                setattr(self, f"{stage}_acc_top5", MulticlassAccuracy(top_k=5, **metric_kwargs))

    @override
    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if self.model is None:
            num_classes = getattr(datamodule, "num_classes", None)
            if num_classes is None:
                raise ValueError(
                    "ClassificationModule(num_classes=None) needs a datamodule with a `num_classes` "
                    "attribute; pass num_classes explicitly"
                )
            self._build(int(num_classes))
        self._adapt_to_data(datamodule)
        if stage == "fit" and (self._hp.pretrained or self._hp.weights) and not self._initial_weights_loaded:
            self.load_initial_weights()

    def _adapt_to_data(self, datamodule: Any) -> None:
        """Tell a model that wants them the datamodule's mean/std and class names (before it is compiled)."""
        mean, std = getattr(datamodule, "mean", None), getattr(datamodule, "std", None)
        if mean is None or std is None:
            return
        names = getattr(datamodule, "class_names", None)
        for model in (self.model, None if self.ema is None else self.ema.module):
            if isinstance(model, _DataAdapted):
                model.adapt_to_data(mean, std, names)

    def load_initial_weights(self) -> str:
        """Load the ``pretrained`` or ``weights`` file weights into the model (and its EMA); returns the
        report.

        Called at the start of the first ``fit`` (before compiling), so fine-tuning needs no extra step."""
        hp = self._hp
        if self.model is None:
            raise RuntimeError("the model is not built yet: pass num_classes or run inside a Trainer")
        if hp.weights:
            state, source = read_weights_file(hp.weights), repr(hp.weights)
        else:
            state, source = pretrained_state_dict(hp.model)
        report = load_initial_weights(self.model, state, int(hp.num_classes), source)
        if self.ema is not None:
            self.ema.module.load_state_dict(self.model.state_dict())
        self._initial_weights_loaded = True
        rank_zero_info(f"{type(self).__name__}: {report}")
        return report

    # ------------------------------------------------------------------------------------- evaluation weights
    def evaluation_weights(self) -> list[str]:
        """The weights this module can evaluate, the default first: ``["EMA", "final"]`` with a plain EMA,
        else ``["final"]`` (with lookahead the final weights are the average)."""
        return ["EMA", "final"] if self.ema is not None and not self._hp.lookahead else ["final"]

    @contextlib.contextmanager
    def evaluating_with(self, weights: str) -> Iterator[None]:
        """Evaluate (validate/test/predict) with ``weights`` ("EMA" or "final") inside the block."""
        if weights not in self.evaluation_weights():
            raise ValueError(f"weights must be one of {self.evaluation_weights()}, got {weights!r}")
        previous, self._evaluate_with = self._evaluate_with, weights
        try:
            yield
        finally:
            self._evaluate_with = previous

    # ----------------------------------------------------------------------------------------- forward
    @override
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.model is None:
            raise RuntimeError(
                "the model is not built yet: pass num_classes or run inside a Trainer with a datamodule"
            )
        # Evaluate with the plain EMA; with lookahead the live model is itself the average at eval time.
        if not self.training and self.evaluation_weights()[0] == "EMA" and self._evaluate_with != "final":
            assert self.ema is not None  # "EMA" is offered only when it is kept
            return self.ema(images)
        return self.model(images)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy for int64 class targets (N,) or soft float targets (N, num_classes) from
        mixup/cutmix."""
        return F.cross_entropy(logits.float(), targets, label_smoothing=self._hp.label_smoothing)

    # ----------------------------------------------------------------------------------------- steps
    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, targets = _split(batch)
        logits = self(images)
        loss = self.loss(logits, targets)
        hard = targets.argmax(dim=1) if targets.is_floating_point() else targets
        self.log("train/loss", loss.detach(), prog_bar=True)
        # The epoch's batch-size-weighted mean of batch accuracies is the micro accuracy a torchmetrics metric
        # would compute (synced across processes at the epoch's end); a tensor keeps the step one graph
        # (compile_step=True), where a Metric's Python update count would recompile it every step.
        correct = (logits.detach().argmax(dim=1) == hard).float().mean()
        self.log("train/acc", correct, on_step=False, on_epoch=True, sync_dist=True, batch_size=hard.shape[0])
        return loss

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        images, targets = _split(batch)
        self._evaluate("val", self(images), targets)

    @override
    def test_step(self, batch: Any, batch_idx: int) -> None:
        images, targets = _split(batch)
        self._evaluate("test", predict_with_tta(self, images, self._hp.tta), targets)

    @override
    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> dict[str, torch.Tensor]:
        images = batch[0] if isinstance(batch, (list, tuple)) else batch
        probs = predict_with_tta(self, images, self._hp.tta).float().softmax(dim=1)
        return {"probs": probs, "preds": probs.argmax(dim=1)}

    def _evaluate(self, stage: str, logits: torch.Tensor, targets: torch.Tensor) -> None:
        hard = targets.argmax(dim=1) if targets.is_floating_point() else targets
        self.log(f"{stage}/loss", F.cross_entropy(logits.float(), hard), prog_bar=stage == "val")
        accuracy = getattr(self, f"{stage}_acc")
        accuracy(logits, hard)
        self.log(f"{stage}/acc", accuracy, prog_bar=True)
        top5 = getattr(self, f"{stage}_acc_top5", None)
        if top5 is not None:
            top5(logits, hard)
            self.log(f"{stage}/acc_top5", top5)

    # ----------------------------------------------------------------------------------------- hooks
    @override
    def on_fit_start(self) -> None:
        if self.device.type == "cpu":
            # oneDNN's AVX2 weight gradient of a strided 1x1 convolution with < 8 input channels overruns its
            # workspace (segfault, endless spin or a wrong gradient), in eager training too, whatever the
            # model's memory format: the small models' shortcuts. A compiled strategy does the same itself.
            self._subsampled_convs = subsample_strided_pointwise_convs(self)
        n = self._hp.whitening_images
        if n and isinstance(self.model, _Whitened):
            images = _first_images(self.trainer, n)
            self.model.init_whitening(images.to(self.device))
            if self.ema is not None:  # a copy of the model, so it has the same layer
                cast(_Whitened, self.ema.module).init_whitening(images.to(self.device))

    @override
    def on_fit_end(self) -> None:
        restore_convs(self._subsampled_convs)  # the model leaves ``fit`` with the classes it came with
        self._subsampled_convs = []

    @override
    def on_train_epoch_start(self) -> None:
        epochs = self._hp.whitening_bias_epochs
        whiten = getattr(self.model, "whiten", None)
        if epochs is not None and whiten is not None and whiten.bias is not None:
            whiten.bias.requires_grad_(self.current_epoch < epochs)

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.ema is None:
            return
        hp = self._hp
        assert self.model is not None  # built together with the EMA
        step = self.global_step
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        if hp.lookahead:
            if step % hp.ema_every_n_steps == 0:
                self.ema.update(self.model, lookahead_decay(step, total, hp.ema_every_n_steps))
                self.ema.copy_to(self.model)
            if step >= total:  # airbench ends on the average itself
                self.ema.copy_to(self.model)
        elif step % hp.ema_every_n_steps == 0 or step == total:  # the last step too: the EMA ends up to date
            updates_before = (step - 1) // hp.ema_every_n_steps  # from the step alone, so resuming is exact
            self.ema.update(self.model, ema_warmup_decay(hp.ema_decay, updates_before))

    @override
    def configure_optimizers(self) -> Any:
        hp = self._hp
        assert self.model is not None  # built in setup, which Lightning runs first
        weights, norms = _split_parameters(self.model)
        norm_wd = hp.weight_decay if hp.norm_weight_decay is None else hp.norm_weight_decay
        groups = [
            {"params": weights, "lr": hp.lr, "weight_decay": hp.weight_decay},
            {"params": norms, "lr": hp.lr * hp.bias_lr_scale, "weight_decay": norm_wd / hp.bias_lr_scale},
        ]
        groups = [g for g in groups if g["params"]]
        optimizer: torch.optim.Optimizer
        if hp.optimizer == "sgd":
            optimizer = torch.optim.SGD(groups, lr=hp.lr, momentum=hp.momentum, nesterov=hp.nesterov)
        else:
            optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=(hp.momentum, 0.999))
        estimated = self.trainer.estimated_stepping_batches
        if math.isinf(estimated):
            raise ValueError(
                "the learning-rate schedule needs the run's length, but the Trainer runs until stopped "
                "(max_epochs=-1 and no max_steps); set max_steps (lcv: --trainer.max_steps N)"
            )
        total = max(int(estimated), 1)
        max_epochs = self.trainer.max_epochs if self.trainer.max_epochs and self.trainer.max_epochs > 0 else 1
        steps_per_epoch = max(total // max_epochs, 1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, total, steps_per_epoch, hp)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # checkpoints keep the built architecture: num_classes is saved in hparams by _build
    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.model is None:
            self._build(int(checkpoint["hyper_parameters"]["num_classes"]))


def lr_factor(step: int, total_steps: int, steps_per_epoch: int, hp: Any) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step`` of ``total_steps``."""
    warmup = int(hp.warmup_fraction * total_steps)  # floored, as airbench's triangle()
    if step < warmup:
        return hp.warmup_start_factor + (1.0 - hp.warmup_start_factor) * step / warmup
    if hp.schedule == "constant":
        return 1.0
    if hp.schedule == "step":
        return hp.step_gamma ** ((step // steps_per_epoch) // hp.step_epochs)
    progress = min((step - warmup) / max(total_steps - warmup, 1), 1.0)
    if hp.schedule == "triangle":
        return 1.0 + (hp.final_lr_factor - 1.0) * progress
    return hp.final_lr_factor + (1.0 - hp.final_lr_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))


_NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm)


def _split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(other parameters, normalisation-layer parameters), leaving out frozen ones (airbench's BN scales).

    Called from ``configure_optimizers``, before ``whitening_bias_epochs`` can freeze the whitening bias,
    so that bias keeps its place in the optimizer (its gradient is simply ``None`` once frozen)."""
    norm_ids = {
        id(p) for m in model.modules() if isinstance(m, _NORM_TYPES) for p in m.parameters(recurse=False)
    }
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [p for p in trainable if id(p) not in norm_ids], [p for p in trainable if id(p) in norm_ids]


def _split(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(batch, (list, tuple)) or len(batch) != 2:
        raise ValueError(f"expected batches of (images, targets), got {type(batch).__name__}")
    return batch[0], batch[1]


def _first_images(trainer: pl.Trainer, n: int) -> torch.Tensor:
    """Up to ``n`` training images (for data-dependent init).

    A datamodule with ``sample_train_images`` (the recipe DataModules) gives a seeded random sample of
    unaugmented images without touching its train loader; otherwise they come from the start of the train
    loader."""
    datamodule = runtime_attributes(trainer).datamodule
    if datamodule is not None and hasattr(datamodule, "sample_train_images"):
        return datamodule.sample_train_images(n).float()
    loader = datamodule.train_dataloader() if datamodule is not None else trainer.train_dataloader
    if loader is None:  # fit(train_dataloaders=...): Lightning builds that loader only after on_fit_start
        raise ValueError(
            f"whitening_images={n} needs the training images when fit starts, before Lightning has loaded "
            "the train_dataloaders passed to fit: pass a datamodule (trainer.fit(module, datamodule=...)) "
            "or set whitening_images=0"
        )
    images = first_images(loader, n)
    if images is None:
        raise ValueError("the training loader is empty: cannot initialise the whitening layer")
    return images.float()


def _validate(args: dict[str, Any]) -> None:
    """Fail at construction on settings that would only break (or silently mislead) later."""
    if args["optimizer"] not in ("sgd", "adamw"):
        raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {args['optimizer']!r}")
    if args["schedule"] not in ("cosine", "triangle", "step", "constant"):
        raise ValueError(f"schedule must be cosine/triangle/step/constant, got {args['schedule']!r}")
    if args["tta"] not in TTA_MODES:
        raise ValueError(f"tta must be one of {list(TTA_MODES)}, got {args['tta']!r}")
    if not args["lr"] > 0:
        raise ValueError(f"lr must be > 0, got {args['lr']!r}")
    if args["bias_lr_scale"] <= 0:
        raise ValueError(f"bias_lr_scale must be > 0, got {args['bias_lr_scale']!r}")
    if not 0.0 <= args["warmup_fraction"] < 1.0:
        raise ValueError(f"warmup_fraction must be in [0, 1), got {args['warmup_fraction']!r}")
    if not 0.0 <= args["label_smoothing"] < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {args['label_smoothing']!r}")
    if args["ema_decay"] is not None and args["lookahead"]:
        raise ValueError("ema_decay and lookahead are two ways of averaging weights: turn on only one")
    if args["ema_decay"] is not None and not 0.0 <= args["ema_decay"] < 1.0:
        raise ValueError(f"ema_decay must be in [0, 1), got {args['ema_decay']!r}")
    if args["ema_every_n_steps"] < 1:
        raise ValueError(f"ema_every_n_steps must be >= 1, got {args['ema_every_n_steps']!r}")
    if args["pretrained"] and str(args["model"]).startswith("hf:"):
        raise ValueError("hf: models load their own weights (hf:<saved directory>): drop pretrained=True")
    if args["pretrained"] and args["weights"]:
        raise ValueError("pretrained=True and weights= both give starting weights: choose one")
    if args["num_classes"] is not None and args["num_classes"] < 1:
        raise ValueError(f"num_classes must be >= 1, got {args['num_classes']!r}")
