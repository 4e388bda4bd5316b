"""Bad input everywhere a user can reach it: each row is input -> exception type + message regex.

The regexes check that the message names the offending option and value, not just the type.
The second half exercises the compile-failure policy with a backend that always fails.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_plugin import CompileConfig, CompiledDDPStrategy, CompiledStrategy
from lightning_plugin.callbacks import (
    FaultTolerantCheckpoint,
    NonFiniteLossGuard,
    TorchCompile,
    TrainingMonitor,
)


def _trainer(**kw: Any) -> pl.Trainer:
    kw.setdefault("logger", False)
    return pl.Trainer(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False, **kw)


def _recipes() -> Any:
    from lcv_vision.recipes import _registry, library  # noqa: F401  (library registers the recipes)

    return _registry


# (id, call, exception type, message regex)
PLUGIN_CASES: list[tuple[str, Callable[[], Any], type[BaseException], str]] = [
    (
        "strategy name typo",
        lambda: _trainer(strategy="compiled_typo"),
        ValueError,
        r"invalid strategy name: `strategy='compiled_typo'`",
    ),
    (
        "compiled on 2 devices",
        lambda: _trainer(strategy="compiled", devices=2),
        ValueError,
        r"strategy='compiled' trains on one device, but the Trainer asked for 2.*compiled_ddp",
    ),
    (
        "unknown backend",
        lambda: CompiledStrategy(backend="tensorrt_typo"),
        ValueError,
        r"backend='tensorrt_typo' is not a registered torch.compile backend",
    ),
    (
        "backend not str/callable",
        lambda: CompileConfig(backend=0),
        ValueError,
        r"backend must be a backend name or a callable, got 0",
    ),
    ("unknown mode", lambda: CompiledStrategy(mode="fast"), ValueError, r"mode='fast' is not one of"),
    (
        "mode needs inductor",
        lambda: CompiledStrategy(backend="eager", mode="max-autotune"),
        ValueError,
        r"mode='max-autotune' needs backend='inductor'",
    ),
    (
        "fullgraph not bool",
        lambda: CompiledStrategy(fullgraph="yes"),
        TypeError,
        r"fullgraph must be a bool, got 'yes'",
    ),
    (
        "dynamic not bool",
        lambda: CompiledStrategy(dynamic="auto"),
        TypeError,
        r"dynamic must be None, True or False, got 'auto'",
    ),
    (
        "options keys",
        lambda: CompileConfig(options={1: True}),
        TypeError,
        r"options must be a dict with str keys",
    ),
    (
        "options with mode",
        lambda: CompileConfig(mode="max-autotune", options={"shape_padding": True}),
        ValueError,
        r"either `mode` or `options`, not both",
    ),
    (
        "unknown fallback",
        lambda: CompiledStrategy(fallback="ignore"),
        ValueError,
        r"fallback='ignore' is not one of \['eager', 'raise'\]",
    ),
    (
        "unknown kernel",
        lambda: CompiledStrategy(kernels=["conv_bn_act", "fancy_conv"]),
        ValueError,
        r"unknown substitution\(s\) \['fancy_conv'\]",
    ),
    (
        "kernels not a list",
        lambda: CompileConfig(kernels=5),
        TypeError,
        r"kernels must be a string or a list",
    ),
    (
        "config and kwargs",
        lambda: CompiledStrategy(config=CompileConfig(), fullgraph=True),
        ValueError,
        r"either as `config=CompileConfig\(...\)` or as keyword arguments, not both "
        r"\(got config and \['fullgraph'\]\)",
    ),
    (
        "config wrong type",
        lambda: CompiledStrategy(config="inductor"),
        TypeError,
        r"config must be a CompileConfig, got str",
    ),
    (
        "regional not bool",
        lambda: CompiledStrategy(regional=1),
        TypeError,
        r"CompileConfig.regional must be a bool, got 1",
    ),
    (
        "compile callback unknown setting",
        lambda: TorchCompile(fast=True),
        TypeError,
        r"TorchCompile got unknown compile setting\(s\) \['fast'\]",
    ),
    (
        "compile callback under compiled strategy",
        lambda: _trainer(strategy="compiled", callbacks=[TorchCompile(backend="eager")], max_steps=1).fit(
            _Net(), _loader()
        ),
        ValueError,
        r"TorchCompile is for strategies that do not compile; CompiledStrategy already compiles the module",
    ),
    (
        "ddp unknown backend",
        lambda: CompiledDDPStrategy(backend="nope"),
        ValueError,
        r"backend='nope' is not a registered",
    ),
    (
        "monitor interval 0",
        lambda: TrainingMonitor(log_every_n_steps=0),
        ValueError,
        r"log_every_n_steps must be a positive int or None, got 0",
    ),
    (
        "monitor peak flops < 0",
        lambda: TrainingMonitor(peak_flops=-1.0),
        ValueError,
        r"peak_flops must be a positive finite number or None, got -1.0",
    ),
    (
        "monitor flops nan",
        lambda: TrainingMonitor(flops_per_sample=float("nan")),
        ValueError,
        r"flops_per_sample must be a positive finite number",
    ),
    (
        "monitor mean without std",
        lambda: TrainingMonitor(mean=[0.5, 0.5, 0.5]),
        ValueError,
        r"pass both `mean` and `std`",
    ),
    (
        "monitor mean/std lengths",
        lambda: TrainingMonitor(mean=[0.5, 0.5], std=[0.2]),
        ValueError,
        r"same non-zero length",
    ),
    (
        "monitor std 0",
        lambda: TrainingMonitor(mean=[0.5], std=[0.0]),
        ValueError,
        r"std values must be positive",
    ),
    (
        "monitor num_images 0",
        lambda: TrainingMonitor(num_images=0),
        ValueError,
        r"num_images must be a positive int",
    ),
    (
        "monitor log_images not bool",
        lambda: TrainingMonitor(log_images="yes"),
        TypeError,
        r"TrainingMonitor: log_images must be a bool, got 'yes'",
    ),
    (
        "monitor batch_size_fn not callable",
        lambda: TrainingMonitor(batch_size_fn=8),
        TypeError,
        r"TrainingMonitor: batch_size_fn must be callable or None, got 8",
    ),
    (
        "guard action",
        lambda: NonFiniteLossGuard(action="ignore"),
        ValueError,
        r"action must be one of \['raise', 'stop'\], got 'ignore'",
    ),
    (
        "guard interval",
        lambda: NonFiniteLossGuard(check_every_n_steps=0),
        ValueError,
        r"check_every_n_steps must be a positive int, got 0",
    ),
    (
        "guard interval bool",
        lambda: NonFiniteLossGuard(check_every_n_steps=True),
        ValueError,
        r"check_every_n_steps must be a positive int, got True",
    ),
    (
        "checkpoint empty dir",
        lambda: FaultTolerantCheckpoint(""),
        ValueError,
        r"dirpath must be a non-empty path",
    ),
    (
        "checkpoint empty filename",
        lambda: FaultTolerantCheckpoint("ckpts", filename=""),
        ValueError,
        r"filename cannot be empty",
    ),
]

VISION_CASES: list[tuple[str, Callable[[], Any], type[BaseException], str]] = [
    (
        "recipe name",
        lambda: _recipes().get_recipe("resnet-nonexistent"),
        ValueError,
        r"unknown recipe 'resnet-nonexistent'.*Known recipes: .*cifar10",
    ),
    (
        "recipe override",
        lambda: _recipes().get_recipe("cifar10-resnet18", bogus=1),
        ValueError,
        r"recipe 'cifar10-resnet18' has no field 'bogus'",
    ),
    (
        "recipe epochs 0",
        lambda: _recipes().get_recipe("cifar10-resnet18", epochs=0),
        ValueError,
        r"recipe 'cifar10-resnet18': epochs must be >= 1, got 0",
    ),
    (
        "recipe tta",
        lambda: _recipes().get_recipe("cifar10-resnet18", tta="rotate"),
        ValueError,
        r"tta must be one of \['none', 'flip', 'flip_translate'\], got 'rotate'",
    ),
    (
        "recipe augment value",
        lambda: _recipes().get_recipe("cifar10-resnet18", augment={"flip": "sometimes"}),
        ValueError,
        r"augment.flip must be 'none', 'random' or 'alternating', got 'sometimes'",
    ),
    (
        "recipe augment field",
        lambda: _recipes().get_recipe("cifar10-resnet18", augment={"rotate": 10}),
        ValueError,
        r"cifar10-resnet18.augment: unknown field\(s\) \['rotate'\]",
    ),
    (
        "recipe compile setting",
        lambda: _recipes().get_recipe("cifar10-resnet18", compile={"turbo": True}),
        ValueError,
        r"recipe 'cifar10-resnet18': unknown compile settings \['turbo'\]",
    ),
    (
        "recipe ema and lookahead",
        lambda: _recipes().get_recipe("cifar10-resnet18", ema_decay=0.99, lookahead=True),
        ValueError,
        r"ema_decay and lookahead both set",
    ),
    (
        "model name",
        lambda: __import__("lcv_vision.models", fromlist=["x"]).create_model("resnet999", 10),
        ValueError,
        r"unknown model 'resnet999'.*Did you mean",
    ),
    (
        "model classes",
        lambda: __import__("lcv_vision.models", fromlist=["x"]).create_model("resnet18", 0),
        ValueError,
        r"num_classes must be a positive int, got 0",
    ),
    (
        "module optimizer",
        lambda: _module(optimizer="adam"),
        ValueError,
        r"optimizer must be 'sgd' or 'adamw', got 'adam'",
    ),
    ("module schedule", lambda: _module(schedule="linear"), ValueError, r"schedule must be .*got 'linear'"),
    ("module lr", lambda: _module(lr=-1.0), ValueError, r"lr must be > 0, got -1.0"),
    (
        "normalize lengths",
        lambda: _data("color").Normalize(mean=(0.5,), std=(0.5, 0.5)),
        ValueError,
        r"Normalize: mean has 1 values but std has 2",
    ),
    (
        "normalize std 0",
        lambda: _data("color").Normalize(mean=(0.5,), std=(0.0,)),
        ValueError,
        r"Normalize: std must be positive",
    ),
    (
        "jitter probability",
        lambda: _data("color").ColorJitter(p=2),
        ValueError,
        r"ColorJitter: probability p must be in \[0, 1\], got 2",
    ),
    (
        "crop padding mode",
        lambda: _data("geometry").RandomCrop(8, padding_mode="mirror"),
        ValueError,
        r"RandomCrop: padding_mode must be one of .*got 'mirror'",
    ),
    ("crop size 0", lambda: _data("geometry").RandomCrop(0), ValueError, r"size must be positive, got 0"),
    (
        "resized crop scale",
        lambda: _data("geometry").RandomResizedCrop(8, scale=(0.9, 0.1)),
        ValueError,
        r"scale must satisfy 0 < min <= max, got \(0.9, 0.1\)",
    ),
]


def conv_bn_act(*args: Any, **kw: Any) -> Any:
    from lcv_kernels.conv_bn_act import conv_bn_act as op

    return op(*args, **kw)


def _conv(x_shape=(1, 3, 5, 5), w_shape=(4, 3, 3, 3), channels_last=True, **kw: Any) -> Any:
    x = torch.randn(*x_shape)
    if channels_last and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    return conv_bn_act(x, kw.pop("weight", torch.randn(*w_shape)), **kw)


KERNEL_CASES: list[tuple[str, Callable[[], Any], type[BaseException], str]] = [
    (
        "conv x not channels_last",
        lambda: _conv(x_shape=(1, 3, 5, 6), channels_last=False),
        ValueError,
        r"x must be in channels_last \(NHWC\) memory format",
    ),
    ("conv x 3-D", lambda: _conv(x_shape=(3, 5, 5)), ValueError, r"x must be a 4-D .*got shape \(3, 5, 5\)"),
    (
        "conv channel mismatch",
        lambda: _conv(w_shape=(4, 2, 3, 3)),
        ValueError,
        r"x has 3 input channels but weight expects 2",
    ),
    ("conv stride 0", lambda: _conv(stride=0), ValueError, r"need stride >= 1.*got \[0, 0\]"),
    (
        "conv empty output",
        lambda: _conv(w_shape=(4, 3, 7, 7)),
        ValueError,
        r"output would be empty \(-1x-1\)",
    ),
    (
        "conv bias shape",
        lambda: _conv(bias=torch.randn(3)),
        ValueError,
        r"bias must be a 1-D tensor with one entry per output channel \(4\), got shape \(3,\)",
    ),
    ("conv activation", lambda: _conv(activation="tanh"), ValueError, r"unknown activation 'tanh'"),
    ("conv string padding", lambda: _conv(padding="same"), ValueError, r"padding='same': string padding"),
    (
        "conv int dtype",
        lambda: conv_bn_act(
            torch.ones(1, 3, 5, 5, dtype=torch.int32).contiguous(memory_format=torch.channels_last),
            torch.ones(4, 3, 3, 3, dtype=torch.int32),
        ),
        TypeError,
        r"x has dtype torch.int32; supported dtypes are float32, float16, bfloat16",
    ),
    (
        "conv dtype mismatch",
        lambda: _conv(weight=torch.randn(4, 3, 3, 3, dtype=torch.float64)),
        TypeError,
        r"weight dtype torch.float64 does not match x dtype torch.float32",
    ),
    ("conv groups 0", lambda: _conv(groups=0), ValueError, r"groups must be a positive int, got 0"),
    (
        "conv residual shape",
        lambda: _conv(residual=torch.randn(1, 4, 2, 2)),
        ValueError,
        r"residual must have the output's shape \(1, 4, 3, 3\), got \(1, 4, 2, 2\)",
    ),
    (
        "conv stride bool",
        lambda: _conv(stride=True),
        TypeError,
        r"stride must be an int or a pair of ints, got True",
    ),
    (
        "fused bn activation",
        lambda: _batch_norm_act_module().FusedBatchNormAct(4, activation="tanh"),
        ValueError,
        r"unknown activation 'tanh'; expected one of \('none', 'relu', 'gelu', 'silu'\)",
    ),
    (
        "fused bn from non-bn",
        lambda: _batch_norm_act_module().FusedBatchNormAct.from_module(nn.Linear(2, 2)),
        TypeError,
        r"from_module expects nn.BatchNorm2d, got Linear",
    ),
    (
        "fused bn unfusable activation",
        lambda: _batch_norm_act_module().FusedBatchNormAct.from_module(nn.BatchNorm2d(2), nn.Tanh()),
        ValueError,
        r"activation Tanh cannot be fused",
    ),
]


def _batch_norm_act_module() -> Any:
    import importlib

    return importlib.import_module("lcv_kernels.batch_norm_act")


def _module(**kw: Any) -> Any:
    from lcv_vision.module import ClassificationModule

    return ClassificationModule(model="resnet18", num_classes=10, **kw)


def _data(name: str) -> Any:
    import importlib

    return importlib.import_module(f"lcv_vision.data.{name}")


@pytest.mark.parametrize(
    ("call", "error", "match"), [c[1:] for c in PLUGIN_CASES], ids=[c[0] for c in PLUGIN_CASES]
)
def test_plugin_bad_input(call, error, match) -> None:
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize(
    ("call", "error", "match"), [c[1:] for c in VISION_CASES], ids=[c[0] for c in VISION_CASES]
)
def test_vision_bad_input(call, error, match) -> None:
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize(
    ("call", "error", "match"), [c[1:] for c in KERNEL_CASES], ids=[c[0] for c in KERNEL_CASES]
)
def test_kernel_bad_input(call, error, match) -> None:
    with pytest.raises(error, match=match):
        call()


# ----------------------------------------------------------------------------- compile failure policy


class _Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x):
        return self.body(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _exploding_backend(gm, example_inputs):
    raise RuntimeError("backend exploded on purpose")


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(5)
    return DataLoader(
        TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)), batch_size=8
    )


def _fit(strategy: Any, **kw: Any) -> nn.Module:
    torch.manual_seed(0)
    model = _Net()
    _trainer(strategy=strategy, max_epochs=1, enable_checkpointing=False, **kw).fit(model, _loader())
    return model


def test_failing_backend_falls_back_to_eager_and_is_reported(tmp_path) -> None:
    strategy = CompiledStrategy(backend=_exploding_backend, fallback="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = _fit(
            strategy,
            logger=TensorBoardLogger(str(tmp_path), name="run", version=0),
            callbacks=[TrainingMonitor(log_every_n_steps=1)],
            log_every_n_steps=1,
        )
    messages = [str(w.message) for w in caught]
    assert any(
        "torch.compile failed for _Net.forward (BackendCompilerFailed" in m and "eager" in m for m in messages
    )
    reference = _fit("auto")  # eager training from the same seed: the fallback must not change the result
    for got, want in zip(model.state_dict().values(), reference.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # exact: both ran the same eager code
    assert strategy.compile_stats.fell_back
    events = EventAccumulator(str(tmp_path / "run" / "version_0"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    card = events.Tensors("compile/report/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert "| fell back to eager |" in card and "BackendCompilerFailed" in card


def test_failing_backend_raises_with_fallback_raise() -> None:
    strategy = CompiledStrategy(backend=_exploding_backend, fallback="raise")
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="backend exploded on purpose"):
        _fit(strategy)


# ----------------------------------------------------------------------------- data paths and image files


@pytest.fixture(scope="module")
def image_tree(tmp_path_factory) -> Any:
    """An ImageFolder tree with one good PNG per class and one corrupt JPEG, plus zips good and bad."""
    import io
    import zipfile

    import numpy as np
    from PIL import Image

    root = tmp_path_factory.mktemp("images")
    png = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(png, "PNG")
    for split in ("train", "val"):
        for cls in ("cat", "dog"):
            (root / "tree" / split / cls).mkdir(parents=True)
            (root / "tree" / split / cls / "ok.png").write_bytes(png.getvalue())
    (root / "tree" / "train" / "cat" / "broken.jpg").write_bytes(b"this is not a jpeg")
    (root / "empty" / "train").mkdir(parents=True)
    with zipfile.ZipFile(root / "data.zip", "w") as z:
        z.writestr("train/cat/ok.png", png.getvalue())
        z.writestr("train/cat/bad.jpg", b"\xff\xd8\xff truncated")
    (root / "garbage.zip").write_bytes(b"PK\x03\x04garbage")
    return root


def _folder(root, *parts: str) -> str:
    return str(root.joinpath(*parts))


def _vd() -> Any:
    import lcv_vision.data

    return lcv_vision.data


def _loader_args(**kw: Any) -> dict[str, Any]:
    args = {
        "images": torch.zeros(4, 3, 8, 8, dtype=torch.uint8),
        "targets": torch.zeros(4),
        "batch_size": 2,
        "pipeline": _vd().Pipeline([_vd().Normalize((0.5,) * 3, (0.5,) * 3)]),
    }
    args.update(kw)
    return args


DATA_CASES: list[tuple[str, Callable[[Any], Any], type[BaseException], str]] = [
    (
        "folder missing",
        lambda r: _vd().load_image_folder(_folder(r, "nope"), "train"),
        FileNotFoundError,
        r"image folder or zip not found: '.*nope'",
    ),
    (
        "split missing",
        lambda r: _vd().load_image_folder(_folder(r, "tree"), "test"),
        FileNotFoundError,
        r"image folder split not found: '.*tree/test'",
    ),
    (
        "corrupt image in folder",
        lambda r: _vd().load_image_folder(_folder(r, "tree"), "train", storage_size=8),
        _vd().CorruptImageError,
        r"cannot decode image '.*broken\.jpg'",
    ),
    (
        "corrupt image in zip",
        lambda r: _vd().load_image_folder(_folder(r, "data.zip"), "train", storage_size=8),
        _vd().CorruptImageError,
        r"cannot decode image 'train/cat/bad\.jpg'",
    ),
    (
        "zip split missing",
        lambda r: _vd().load_image_folder(_folder(r, "data.zip"), "val"),
        FileNotFoundError,
        r"no images under 'val/<class>/' in zip",
    ),
    (
        "not a zip file",
        lambda r: _vd().load_image_folder(_folder(r, "garbage.zip"), "train"),
        ValueError,
        r"'.*garbage\.zip' is not a zip file \(File is not a zip file\); pass a folder or a zip",
    ),
    (
        "on_corrupt value",
        lambda r: _vd().load_image_folder(_folder(r, "tree"), "train", on_corrupt="ignore"),
        ValueError,
        r"on_corrupt must be 'raise' or 'skip', got 'ignore'",
    ),
    (
        "datamodule root missing",
        lambda r: _vd().ImageFolderDataModule(_folder(r, "nope")),
        FileNotFoundError,
        r"image folder or zip not found",
    ),
    (
        "datamodule no classes",
        lambda r: _vd().ImageFolderDataModule(_folder(r, "empty")),
        FileNotFoundError,
        r"no class folders under 'train'",
    ),
    (
        "datamodule corrupt on setup",
        lambda r: _vd().ImageFolderDataModule(_folder(r, "tree"), image_size=8, num_workers=0).setup(),
        _vd().CorruptImageError,
        r"broken\.jpg",
    ),
    (
        "cifar without source",
        lambda r: _vd().CIFAR10DataModule(),
        ValueError,
        r"give root='<dir>'.*or zip_path=",
    ),
    (
        "cifar zip missing",
        lambda r: _vd().CIFAR10DataModule(zip_path=_folder(r, "missing.zip")).setup(),
        FileNotFoundError,
        r"missing\.zip",
    ),
    (
        "loader float images",
        lambda r: _vd().DeviceLoader(**_loader_args(images=torch.rand(4, 3, 8, 8))),
        TypeError,
        r"DeviceLoader stores uint8 images .*got dtype torch.float32",
    ),
    (
        "loader empty",
        lambda r: _vd().DeviceLoader(
            **_loader_args(images=torch.zeros(0, 3, 8, 8, dtype=torch.uint8), targets=torch.zeros(0))
        ),
        ValueError,
        r"the data set is empty",
    ),
    (
        "loader batch 0",
        lambda r: _vd().DeviceLoader(**_loader_args(batch_size=0)),
        ValueError,
        r"batch_size must be >= 1, got 0",
    ),
    (
        "loader pipeline list",
        lambda r: _vd().DeviceLoader(**_loader_args(pipeline=[])),
        TypeError,
        r"pipeline must be a lcv_vision.data.Pipeline, got list",
    ),
    (
        "loader rank",
        lambda r: _vd().DeviceLoader(**_loader_args(), rank=2, world_size=2),
        ValueError,
        r"rank must be in \[0, world_size=2\), got 2",
    ),
    (
        "loader state from another batch size",
        lambda r: (
            _vd()
            .DeviceLoader(**_loader_args())
            .load_state_dict({"seed": 0, "epoch": 0, "position": 1, "batch_size": 4})
        ),
        ValueError,
        r"checkpoint has batch_size=4 but this loader has 2",
    ),
    (
        "digits image size",
        lambda r: _vd().DigitsDataModule(image_size=4).setup(),
        ValueError,
        r"image_size must be >= 8, got 4",
    ),
    (
        "digits batch 0",
        lambda r: _vd().DigitsDataModule(batch_size=0),
        ValueError,
        r"batch_size must be >= 1, got 0",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "match"), [c[1:] for c in DATA_CASES], ids=[c[0] for c in DATA_CASES]
)
def test_data_bad_input(image_tree, call, error, match) -> None:
    with pytest.raises(error, match=match):
        call(image_tree)


def test_corrupt_images_can_be_skipped(image_tree) -> None:
    with pytest.warns(UserWarning):
        images = _vd().load_image_folder(
            _folder(image_tree, "tree"), "train", storage_size=8, on_corrupt="skip"
        )
    assert len(images) == 2  # the two good PNGs; the corrupt JPEG is dropped
