"""ClassificationModule: schedules, parameter groups, EMA/lookahead in a real fit, whitening, validation."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from lcv_kernels.tolerances import bound, network_length, reduction_tolerance, trajectory_tolerance
from lcv_vision.module import ClassificationModule, lr_factor
from lcv_vision.recipes import DigitsData, build_module


def _hp(**kwargs) -> SimpleNamespace:
    base = dict(
        warmup_fraction=0.0,
        warmup_start_factor=0.01,
        schedule="cosine",
        final_lr_factor=0.0,
        step_epochs=30,
        step_gamma=0.1,
    )
    return SimpleNamespace(**{**base, **kwargs})


@pytest.mark.parametrize(
    "total", [97, 12]
)  # 0.23 x 12 = 2.76: airbench floors it to 2, rounding would give 3
def test_triangle_schedule_is_airbench_interpolation(total):
    hp = _hp(schedule="triangle", warmup_fraction=0.23, warmup_start_factor=0.2, final_lr_factor=0.07)
    warmup = int(0.23 * total)  # airbench's triangle(): xp = [0, int(peak * steps), steps]
    expected = np.interp(np.arange(total + 1), [0, warmup, total], [0.2, 1.0, 0.07])
    # float64, a few elementwise operations of values up to 1
    atol = reduction_tolerance(torch.float64, 4)[0]
    np.testing.assert_allclose([lr_factor(s, total, 10, hp) for s in range(total + 1)], expected, atol=atol)


def test_cosine_schedule_matches_torch_cosine_annealing():
    total = 50
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    reference = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total, eta_min=0.1)
    values = []
    for _ in range(total + 1):
        values.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        reference.step()
    hp = _hp(final_lr_factor=0.1)
    # torch's scheduler is recursive: each of the 50 steps multiplies by a ratio whose denominator
    # ``1 + cos(pi (t - 1) / T)`` cancels down to ~(pi / T)^2 / 2 at the end, which magnifies its rounding
    amplification = 1 / (1 + math.cos(math.pi * (total - 1) / total))
    atol = trajectory_tolerance(torch.float64, 4, total)[0] * amplification
    np.testing.assert_allclose([lr_factor(s, total, 5, hp) for s in range(total + 1)], values, atol=atol)


def test_step_schedule():
    hp = _hp(schedule="step", step_epochs=2, step_gamma=0.5)
    assert [lr_factor(s, 100, 10, hp) for s in (0, 19, 20, 39, 40)] == [1.0, 1.0, 0.5, 0.5, 0.25]


def test_airbench_parameter_groups():
    module = build_module("cifar10-airbench", num_classes=10)
    module.trainer = SimpleNamespace(estimated_stepping_batches=100, max_epochs=10)  # what configure needs
    optimizer = module.configure_optimizers()["optimizer"]
    weights, norms = optimizer.param_groups
    model = module.model
    bn_biases = {id(m.bias) for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)}
    assert {id(p) for p in norms["params"]} == bn_biases  # BN scales are frozen, so not in any group
    assert id(model.whiten.bias) in {id(p) for p in weights["params"]}
    assert id(model.whiten.weight) not in {id(p) for p in weights["params"]}  # frozen filters
    hp = module.hparams
    assert norms["initial_lr"] == pytest.approx(64 * hp.lr)
    assert norms["weight_decay"] == pytest.approx(hp.weight_decay / 64)
    assert norms["initial_lr"] * norms["weight_decay"] == pytest.approx(
        weights["initial_lr"] * weights["weight_decay"]
    )
    assert weights["lr"] == pytest.approx(0.2 * hp.lr)  # the schedule starts at 0.2x
    assert optimizer.defaults["nesterov"] and optimizer.defaults["momentum"] == 0.85
    assert hp.lr == pytest.approx(1.5, rel=1e-3)  # airbench's 11.5 "per 1024 examples" for a mean loss


def test_airbench_recipe_updates_match_airbench_summed_loss_sgd():
    """Our mean-loss lr / weight decay step the weights exactly as airbench94's own SGD set-up does.

    airbench: loss summed over the batch, ``kilostep = 1024 * (1 + 1 / (1 - 0.85))``, ``lr = 11.5 /
    kilostep``, ``wd = 0.0153 * batch / kilostep``, BN biases at 64x lr, and PyTorch ``weight_decay = wd /
    group_lr``.
    """
    torch.manual_seed(0)
    module = build_module(
        "cifar10-airbench", num_classes=10, model_kwargs={"widths": [8, 8, 8]}, channels_last=False
    )
    module.trainer = SimpleNamespace(estimated_stepping_batches=100, max_epochs=10)
    ours = module.configure_optimizers()["optimizer"]
    for group in ours.param_groups:  # compare at the peak lr (both sides share the schedule's multiplier)
        group["lr"] = group["initial_lr"]
    reference_model = copy.deepcopy(module.model)
    batch, kilostep = 1024, 1024 * (1 + 1 / (1 - 0.85))
    lr, wd = 11.5 / kilostep, 0.0153 * batch / kilostep
    norm_biases = [p for n, p in reference_model.named_parameters() if p.requires_grad and "norm" in n]
    others = [p for n, p in reference_model.named_parameters() if p.requires_grad and "norm" not in n]
    reference = torch.optim.SGD(
        [
            dict(params=norm_biases, lr=lr * 64, weight_decay=wd / (lr * 64)),
            dict(params=others, lr=lr, weight_decay=wd / lr),
        ],
        momentum=0.85,
        nesterov=True,
    )
    images, labels = torch.randn(batch, 3, 16, 16), torch.randint(0, 10, (batch,))
    for _ in range(3):
        ours.zero_grad()
        torch.nn.functional.cross_entropy(module.model(images), labels, label_smoothing=0.2).backward()
        ours.step()
        reference.zero_grad()
        torch.nn.functional.cross_entropy(
            reference_model(images), labels, label_smoothing=0.2, reduction="sum"
        ).backward()
        reference.step()
    # mean loss against summed loss: the same 3 steps, the batch's sums in another order and scale
    tol = trajectory_tolerance(torch.float32, network_length(reference_model, images.shape), 3)
    for (name, got), want in zip(module.model.named_parameters(), reference_model.parameters()):
        torch.testing.assert_close(got, want, atol=bound(tol, want), rtol=0, msg=name)


def test_eval_uses_the_ema_weights():
    module = ClassificationModule(
        model="airbench94", num_classes=3, model_kwargs={"widths": [4, 4, 4]}, ema_decay=0.5
    )
    with torch.no_grad():
        module.ema.module.head.weight.mul_(-1.0)
    x = torch.randn(2, 3, 16, 16)
    module.eval()
    torch.testing.assert_close(module(x), module.ema.module(x))
    module.train()
    torch.testing.assert_close(module(x), module.model(x))
    assert not torch.allclose(module.ema.module(x), module.model.eval()(x))


def test_whitening_needs_a_whitening_model():
    with pytest.raises(ValueError, match="whitening_images=10 needs a model with a whitening layer"):
        ClassificationModule(model="resnet18", num_classes=10, whitening_images=10, model_kwargs={"width": 4})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ema_decay": 0.9, "lookahead": True}, "turn on only one"),
        ({"lr": 0.0}, "lr must be > 0"),
        ({"optimizer": "lamb"}, "optimizer must be"),
        ({"label_smoothing": 1.0}, "label_smoothing"),
        ({"tta": "rotate"}, "tta must be one of"),
    ],
)
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ClassificationModule(**kwargs)


def _fit(module: ClassificationModule, epochs: int, batches: int) -> pl.Trainer:
    trainer = pl.Trainer(
        max_epochs=epochs,
        limit_train_batches=batches,
        limit_val_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, DigitsData(batch_size=32, image_size=16))
    return trainer


def test_lookahead_ends_on_the_average_and_whitening_bias_freezes():
    module = ClassificationModule(
        model="airbench94",
        model_kwargs={"widths": [8, 8, 8]},
        lookahead=True,
        ema_every_n_steps=2,
        whitening_images=64,
        whitening_bias_epochs=1,
        lr=0.05,
    )
    biases = []

    class RecordBias(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            biases.append(pl_module.model.whiten.bias.detach().clone())

    trainer = pl.Trainer(
        max_epochs=2,
        limit_train_batches=3,
        limit_val_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[RecordBias()],
    )
    data = DigitsData(batch_size=32, image_size=16)
    trainer.fit(module, data)
    assert trainer.global_step == 6
    for name, value in module.model.state_dict().items():
        torch.testing.assert_close(value, module.ema.module.state_dict()[name], msg=name)
    # whitening filters come from the data: they whiten the first 64 (normalised) training images
    from lcv_vision.models import whitening_weights

    torch.testing.assert_close(
        module.model.whiten.weight, whitening_weights(data.sample_train_images(64).float())
    )
    assert not module.model.whiten.bias.requires_grad
    # epoch 1 (the second) trained without the bias: only lookahead averaging could move it, and the
    # average of an unchanged value is the value
    torch.testing.assert_close(biases[1], biases[0])


def test_whitening_without_a_datamodule_names_the_problem():
    """fit(train_dataloaders=...) has no loader yet at on_fit_start, where the whitening images are taken."""
    images = torch.rand(16, 3, 16, 16)
    dataset = torch.utils.data.TensorDataset(images, torch.arange(16) % 10)
    loader = torch.utils.data.DataLoader(dataset, batch_size=8)
    module = ClassificationModule(
        model="airbench94", num_classes=10, model_kwargs={"widths": [8, 8, 8]}, whitening_images=8
    )
    trainer = pl.Trainer(
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(ValueError, match=r"whitening_images=8 needs the training images .* datamodule"):
        trainer.fit(module, train_dataloaders=loader)


@pytest.mark.parametrize("channels_last", [True, False])
def test_a_cpu_fit_in_eager_mode_subsamples_the_few_channel_strided_shortcuts_and_restores_them(
    channels_last,
):
    """oneDNN's AVX2 weight gradient of a strided 1x1 convolution with < 8 input channels overruns its workspace
    (lightning_plugin/cpu/strided_pointwise_conv.py); an eager fit (no compiled strategy) of a width-4 ResNet met
    it with either memory format, and crashed CI workers on AVX2 machines. During the fit such a shortcut is the
    subsampled stride-1 convolution; every other convolution keeps its class; after the fit all are back."""
    from lightning.pytorch.callbacks import Callback
    from torch import nn

    from lcv_vision.data import DigitsDataModule
    from lightning_plugin.cpu.strided_pointwise_conv import SubsampledPointwiseConv2d

    module = ClassificationModule(
        "resnet18", num_classes=10, model_kwargs={"width": 4, "stem": "cifar"}, channels_last=channels_last
    )
    convs = [m for m in module.model.modules() if isinstance(m, nn.Conv2d)]
    few_channel_shortcuts = [
        c for c in convs if c.kernel_size == (1, 1) and c.stride != (1, 1) and c.in_channels < 8
    ]
    assert few_channel_shortcuts, "the width-4 ResNet-18 no longer has the layer this test is about"
    during: list[list[type]] = []

    class Probe(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            during.append([type(c) for c in convs])

    trainer = pl.Trainer(
        max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Probe()],
    )  # fmt: skip
    trainer.fit(module, datamodule=DigitsDataModule(batch_size=8, image_size=8))
    want = [SubsampledPointwiseConv2d if c in few_channel_shortcuts else nn.Conv2d for c in convs]
    assert during == [want]
    assert [type(c) for c in convs] == [nn.Conv2d] * len(convs)
