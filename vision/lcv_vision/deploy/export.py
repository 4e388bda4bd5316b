"""``lcv export``: a checkpoint -> ``torch.export`` -> AOTInductor -> one ``.pt2`` file with its metadata.

The graph takes what a client has after decoding and sizing: uint8 ``[N, 3, H, W]`` at the recipe's eval size,
``N`` dynamic. The dtype conversion and the normalisation are in the graph (:class:`InferenceModel`), so the
host does no float work and cannot normalise with the wrong constants.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import tempfile
import warnings
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from lcv_vision.deploy.capture import capture
from lcv_vision.deploy.errors import DeployError, UnsupportedPrecisionError
from lcv_vision.deploy.host_transform import HostTransform
from lcv_vision.deploy.package import PackageInfo, amx_supported, cpu_capability
from lcv_vision.deploy.prepack import PrepackConvWeights

__all__ = [
    "InferenceModel",
    "Precision",
    "TrainedModel",
    "calibration_images",
    "check_precision",
    "compile_package",
    "export_package",
    "load_trained",
    "package_info",
]

Precision = Literal["fp32", "bf16"]

#: Example batch of the export: >= 2, so the batch dimension stays symbolic.
EXAMPLE_BATCH = 4


@dataclasses.dataclass
class TrainedModel:
    """A checkpoint's evaluated network and what a package needs to know about its data."""

    network: nn.Module
    recipe: str
    datamodule: Any
    class_names: tuple[str, ...]
    transform: HostTransform

    @property
    def mean(self) -> tuple[float, ...]:
        return tuple(float(m) for m in self.datamodule.mean)

    @property
    def std(self) -> tuple[float, ...]:
        return tuple(float(s) for s in self.datamodule.std)


def load_trained(checkpoint: str | Path, data_root: str | None = None) -> TrainedModel:
    """The network the recipe evaluates (the EMA copy when the module keeps a plain EMA, as
    ``ClassificationModule.forward`` does in eval mode), in eval mode on the CPU.

    The checkpoint is trusted input (it holds pickled hyperparameters, as for Lightning's own loading).
    A sharded checkpoint folder (``strategy="compiled_fsdp"``) is consolidated first, in a temporary file.
    ``data_root`` replaces the data set's folder/zip saved in the checkpoint (for the class names of
    ImageFolder data and for int8 calibration)."""
    from lightning_plugin.strategies.fsdp_checkpoint import consolidate_checkpoint, is_sharded_checkpoint

    path = Path(checkpoint)
    if path.is_dir() and is_sharded_checkpoint(path):
        with tempfile.TemporaryDirectory() as tmp:
            consolidated = Path(tmp) / "consolidated.ckpt"
            consolidate_checkpoint(path, consolidated)
            return load_trained(consolidated, data_root)
    if not path.is_file():
        raise DeployError(f"checkpoint {str(path)!r} does not exist")
    return _load_trained_file(path, data_root)


def _load_trained_file(path: Path, data_root: str | None) -> TrainedModel:
    from lcv_vision.module import ClassificationModule
    from lcv_vision.recipes import DATAMODULES, build_datamodule, get_recipe

    saved = torch.load(path, map_location="cpu", weights_only=False)
    hparams = saved.get("hyper_parameters", {})
    if not hparams.get("recipe"):
        raise DeployError(
            f"checkpoint {str(path)!r} was not written by `lcv fit` (no recipe in its hyperparameters)"
        )
    recipe = get_recipe(hparams["recipe"])
    module = ClassificationModule.load_from_checkpoint(path, map_location="cpu", weights_only=False)
    module.eval()
    assert module.model is not None  # built from the saved num_classes by on_load_checkpoint
    network = module.ema.module if module.evaluation_weights()[0] == "EMA" and module.ema else module.model
    data_hparams = dict(saved.get("datamodule_hyper_parameters") or {})
    if data_root is not None:  # the data moved: replace where the checkpoint says it was
        data_hparams.pop("zip_path", None)
        data_hparams.pop("root", None)
        zipped = recipe.dataset == "cifar10" and data_root.lower().endswith(".zip")
        data_hparams["zip_path" if zipped else "root"] = data_root
    known = inspect.signature(DATAMODULES[recipe.dataset]).parameters
    data_hparams = {k: v for k, v in data_hparams.items() if k in known}
    try:
        datamodule = build_datamodule(recipe, **data_hparams)
    except (ValueError, OSError) as err:
        raise DeployError(
            f"cannot set up the data of recipe {recipe.name!r} ({err}); give --data-root"
        ) from err
    names = tuple(str(n) for n in datamodule.class_names)
    if len(names) != int(hparams["num_classes"]):
        raise DeployError(
            f"the data has {len(names)} classes but the checkpoint's model {hparams['num_classes']}"
        )
    transform = HostTransform.from_datamodule(datamodule)
    return TrainedModel(network.eval().requires_grad_(False), recipe.name, datamodule, names, transform)


class InferenceModel(nn.Module):
    """uint8 ``[N, 3, H, W]`` -> float32 logits: convert, normalise, run the network in ``dtype``.

    A ``dtype`` other than the network's runs a copy: the caller's network keeps its weights and dtype (a
    bf16 model built beside an fp32 one from the same network once turned both into bf16)."""

    offset: torch.Tensor  # mean * 255, (1, C, 1, 1)
    scale: torch.Tensor  # 1 / (std * 255)

    def __init__(
        self,
        network: nn.Module,
        mean: tuple[float, ...],
        std: tuple[float, ...],
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if any(
            t.is_floating_point() and t.dtype != dtype for t in (*network.parameters(), *network.buffers())
        ):
            network = copy.deepcopy(network).to(dtype)  # ``Module.to`` converts in place: leave the caller's
        self.network = network
        self.dtype = dtype
        self.register_buffer("offset", torch.tensor(mean).view(1, -1, 1, 1) * 255.0)
        self.register_buffer("scale", 1.0 / (torch.tensor(std).view(1, -1, 1, 1) * 255.0))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = (images.float() - self.offset) * self.scale
        x = x.to(self.dtype).contiguous(memory_format=torch.channels_last)
        return self.network(x).float()


def check_precision(precision: str, device: str) -> torch.dtype:
    """The dtype of ``precision``; :class:`UnsupportedPrecisionError` where it would not pay off."""
    if precision == "fp32":
        return torch.float32
    if precision != "bf16":
        raise UnsupportedPrecisionError(f"precision must be fp32 or bf16, got {precision!r}")
    if device == "cuda" or amx_supported():
        return torch.bfloat16
    raise UnsupportedPrecisionError(
        f"bf16 is fast on CPUs with AMX tiles and on CUDA GPUs; this CPU ({cpu_capability()}) has no AMX, "
        "where bf16 runs slower than fp32: use --precision fp32, or --quantize int8"
    )


def calibration_images(trained: TrainedModel, count: int) -> torch.Tensor:
    """``count`` training images (a seeded random draw) as the package's uint8 input, for int8 calibration."""
    datamodule = trained.datamodule
    datamodule.setup("fit")
    images = datamodule.sample_train_images(count).float()  # the eval pipeline's output: normalised
    mean = torch.tensor(trained.mean).view(1, -1, 1, 1)
    std = torch.tensor(trained.std).view(1, -1, 1, 1)
    return ((images * std + mean) * 255.0).round().clamp(0, 255).to(torch.uint8).contiguous()


def compile_package(program: torch.export.ExportedProgram, out: str | Path, info: PackageInfo) -> Path:
    """AOTInductor-compile ``program`` into the single file ``out``, with ``info`` as its metadata."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    configs: dict[str, Any] = {"aot_inductor.metadata": info.to_metadata()}
    if info.device == "cpu":
        configs["freezing"] = True  # weights become constants: prepacked oneDNN convs, fused int8 patterns
        # ... but Inductor packs fp32 conv weights only for a static batch: pack them for our dynamic one.
        configs["post_grad_custom_pre_pass"] = PrepackConvWeights()
    # Inductor freezes (and lowers int8 patterns to oneDNN) only without autograd.
    with torch.no_grad(), warnings.catch_warnings():
        # Inductor's int8 conv lowering (mkldnn_lowerings.py) builds its scales with torch.tensor(tensor):
        # torch's advice about torch's own code, which a user of `lcv export --quantize int8` cannot act on.
        warnings.filterwarnings("ignore", message="To copy construct from a tensor", category=UserWarning)
        path = torch._inductor.aoti_compile_and_package(
            program, package_path=str(out), inductor_configs=configs
        )
    return Path(path)


def export_package(
    checkpoint: str | Path,
    out: str | Path,
    precision: str = "fp32",
    quantize: str | None = None,
    calibration_count: int = 256,
    data_root: str | None = None,
    device: str = "cpu",
) -> PackageInfo:
    """Checkpoint -> ``.pt2``; returns the package's metadata. ``quantize="int8"``: PT2E post-training
    quantization calibrated on ``calibration_count`` training images (CPU, fp32 activations around)."""
    if quantize not in (None, "none", "int8"):
        raise DeployError(f"--quantize must be int8 (or none), got {quantize!r}")
    if quantize == "int8" and (precision != "fp32" or device != "cpu"):
        raise UnsupportedPrecisionError(
            "--quantize int8 is for the CPU, from an fp32 model (leave --precision)"
        )
    dtype = check_precision(precision, device)
    trained = load_trained(checkpoint, data_root)
    model = InferenceModel(trained.network, trained.mean, trained.std, dtype).to(device).eval()
    example = example_batch(trained.transform.size, device)
    if quantize == "int8":
        from lcv_vision.deploy.quantize import quantize_int8

        program = quantize_int8(model, calibration_images(trained, calibration_count), example)
    else:
        program = capture(model, example)
    info = package_info(trained, precision, "int8" if quantize == "int8" else "none", device)
    compile_package(program, out, info)
    return info


def package_info(trained: TrainedModel, precision: str, quantization: str, device: str) -> PackageInfo:
    """The metadata of a package of ``trained`` built in this process."""
    return PackageInfo(
        class_names=trained.class_names,
        recipe=trained.recipe,
        input_size=trained.transform.size,
        mean=trained.mean,
        std=trained.std,
        precision=precision,
        quantization=quantization,
        device=device,
        torch_version=torch.__version__,
        cpu_capability=cpu_capability(),
        needs_amx=precision == "bf16" and device == "cpu",
        transform=trained.transform,
    )


def example_batch(size: tuple[int, int], device: str = "cpu") -> torch.Tensor:
    """A uint8 batch of :data:`EXAMPLE_BATCH` images at ``size`` (values only shape the trace)."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (EXAMPLE_BATCH, 3, *size), dtype=torch.uint8, generator=generator)
    return images.to(device)
