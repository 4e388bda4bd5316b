"""Hugging Face ``transformers`` image classifiers as models of this project: ``hf:<dir>`` or ``hf:<config>``.

``create_model("hf:...")`` builds an ``AutoModelForImageClassification`` from a local directory
(``save_pretrained`` output), from one of :data:`BUILTIN_CONFIGS` (random weights, nothing downloaded), or from
a hub name when it is cached or can be downloaded. :class:`HuggingFaceClassifier` wraps it so that it is a
model like the others: images in, logits out (not a ``ModelOutput``), ``config.problem_type`` set up front (its
loss code sets it on its first call otherwise, a recompile under ``torch.compile``) and the model's own input
normalisation: the recipes' DataModules normalise with their mean/std, and the wrapper maps those inputs to
the image processor's mean/std with one per-channel affine map (:meth:`~HuggingFaceClassifier.adapt_to_data`).

``transformers`` is imported only here, and this module only when an ``hf:`` name is built.
"""

from __future__ import annotations

import difflib
import inspect
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["BUILTIN_CONFIGS", "HF_PREFIX", "BuiltinConfig", "HuggingFaceClassifier", "create_hf_model"]

HF_PREFIX = "hf:"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
HALF = (0.5, 0.5, 0.5)
PROCESSOR_FILE = "preprocessor_config.json"


@dataclass(frozen=True)
class BuiltinConfig:
    """A config the factory builds without a download: ``model_type``, the values that differ from that
    config class's defaults, and the mean/std of the checkpoints of that size on the hub."""

    model_type: str
    values: dict[str, Any] = field(default_factory=dict)
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD


#: ``hf:<name>`` -> config: the sizes of the hub's checkpoints of the same name (``google/vit-*`` normalise
#: with 0.5; the others with ImageNet's mean/std). ``model_kwargs`` override any config value
#: (``{"num_hidden_layers": 1}``).
BUILTIN_CONFIGS: dict[str, BuiltinConfig] = {
    "vit-tiny": BuiltinConfig(
        "vit", {"hidden_size": 192, "num_attention_heads": 3, "intermediate_size": 768}, HALF, HALF
    ),
    "vit-small": BuiltinConfig(
        "vit", {"hidden_size": 384, "num_attention_heads": 6, "intermediate_size": 1536}, HALF, HALF
    ),
    "vit-base": BuiltinConfig("vit", {}, HALF, HALF),
    "convnext-tiny": BuiltinConfig("convnext"),
    "resnet-18": BuiltinConfig(
        "resnet",
        {"layer_type": "basic", "hidden_sizes": [64, 128, 256, 512], "depths": [2, 2, 2, 2]},
    ),
    "resnet-50": BuiltinConfig("resnet"),
    "swin-tiny": BuiltinConfig("swin"),
    "dinov2-small": BuiltinConfig("dinov2", {"hidden_size": 384, "num_attention_heads": 6}),
}


class HuggingFaceClassifier(nn.Module):
    """A ``transformers`` image classifier that maps normalised images to logits.

    Args:
        model: a ``PreTrainedModel`` for image classification (its ``config.num_labels`` is the head size).
        mean, std: the normalisation its image processor applies to 0..1 images (what it was trained on).

    The buffers ``input_scale``/``input_shift`` (saved with the weights) turn inputs normalised with another
    mean/std into the model's: identity until :meth:`adapt_to_data` says what the data uses.
    """

    input_scale: torch.Tensor
    input_shift: torch.Tensor

    def __init__(self, model: nn.Module, mean: Sequence[float], std: Sequence[float]) -> None:
        super().__init__()
        config: Any = model.config
        config.problem_type = "single_label_classification"  # set lazily by its loss code otherwise
        self.hf: Any = model  # a PreTrainedModel (transformers is imported only when one is built)
        self.image_mean, self.image_std = tuple(float(m) for m in mean), tuple(float(s) for s in std)
        self.register_buffer("input_scale", torch.ones(1, len(self.image_mean), 1, 1))
        self.register_buffer("input_shift", torch.zeros(1, len(self.image_mean), 1, 1))
        # ViT and Swin check the image size against their config unless told to interpolate the position
        # embeddings; with it any data size works (DINOv2 always interpolates).
        accepts = inspect.signature(type(model).forward).parameters
        self._forward_kwargs = (
            {"interpolate_pos_encoding": True} if "interpolate_pos_encoding" in accepts else {}
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        pixel_values = images * self.input_scale.to(images.dtype) + self.input_shift.to(images.dtype)
        return self.hf(pixel_values=pixel_values, **self._forward_kwargs).logits

    @property
    def config(self) -> Any:
        """The wrapped model's ``PretrainedConfig``."""
        return self.hf.config

    def adapt_to_data(
        self, mean: Sequence[float], std: Sequence[float], class_names: Sequence[str] | None = None
    ) -> None:
        """Take inputs normalised with ``mean``/``std`` (0..1 units), and name the labels ``class_names``.

        ``(x * std + mean - m) / s`` for the model's ``m``/``s`` is ``x * (std / s) + (mean - m) / s``."""
        data_mean, data_std = _channels(mean, "mean"), _channels(std, "std")
        own_mean, own_std = torch.tensor(self.image_mean), torch.tensor(self.image_std)
        if data_mean.numel() != own_mean.numel():
            raise ValueError(
                f"the data has {data_mean.numel()} channels but the model's processor {own_mean.numel()}"
            )
        with torch.no_grad():
            self.input_scale.copy_((data_std / own_std).view_as(self.input_scale))
            self.input_shift.copy_(((data_mean - own_mean) / own_std).view_as(self.input_shift))
        if class_names is not None:
            if len(class_names) != self.config.num_labels:
                raise ValueError(
                    f"{len(class_names)} class names for a head of {self.config.num_labels} labels"
                )
            self.config.id2label = {i: str(name) for i, name in enumerate(class_names)}
            self.config.label2id = {str(name): i for i, name in enumerate(class_names)}

    def save_pretrained(self, directory: str | os.PathLike[str]) -> None:
        """``save_pretrained`` of the wrapped model plus a ``preprocessor_config.json`` with its mean/std, so
        that ``hf:<directory>`` builds it again with the same normalisation (the data's map is not saved:
        the next run's data sets it)."""
        self.hf.save_pretrained(directory)
        processor = {
            "do_normalize": True,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
        }
        processor |= {"do_rescale": True, "rescale_factor": 1 / 255}
        (Path(directory) / PROCESSOR_FILE).write_text(json.dumps(processor, indent=2) + "\n")


def _channels(values: Sequence[float], what: str) -> torch.Tensor:
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float32)
    if what == "std" and not bool((tensor > 0).all()):
        raise ValueError(f"std must be > 0, got {list(values)}")
    return tensor


def create_hf_model(name: str, num_classes: int, **config_values: Any) -> HuggingFaceClassifier:
    """Build ``hf:<name>`` with a ``num_classes``-way head; ``config_values`` override the config.

    ``name`` is a local directory (``save_pretrained`` output; its head is replaced when its size differs),
    a key of :data:`BUILTIN_CONFIGS`, or a hub name (from the cache, else downloaded).
    """
    spec = name[len(HF_PREFIX) :] if name.startswith(HF_PREFIX) else name
    if not spec:
        raise ValueError(f"{name!r}: give hf:<local directory> or hf:<config>, one of {_builtins()}")
    labels = {"id2label": {i: f"LABEL_{i}" for i in range(num_classes)}}
    if Path(spec).expanduser().is_dir():
        return _from_directory(Path(spec).expanduser(), labels, config_values)
    if spec in BUILTIN_CONFIGS:
        return _from_builtin(spec, labels, config_values)
    if spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        close = difflib.get_close_matches(spec, list(BUILTIN_CONFIGS), n=2)
        hint = f" Did you mean {' or '.join(f'hf:{c}' for c in close)}?" if close else ""
        raise ValueError(
            f"{name!r} is neither a directory nor a built-in config ({_builtins()}).{hint} "
            "For a hub model pass hf:<org>/<name>, or a directory it was saved to"
        )
    return _from_directory(_hub_snapshot(spec), labels, config_values)


def _builtins() -> str:
    return ", ".join(f"hf:{n}" for n in BUILTIN_CONFIGS)


def _from_builtin(spec: str, labels: dict[str, Any], config_values: dict[str, Any]) -> HuggingFaceClassifier:
    from transformers import AutoConfig, AutoModelForImageClassification

    builtin = BUILTIN_CONFIGS[spec]
    fields = AutoConfig.for_model(builtin.model_type).to_dict()
    unknown = sorted(set(config_values) - set(fields))
    if unknown:
        raise ValueError(
            f"hf:{spec}: model_kwargs {unknown} are not fields of {builtin.model_type}'s config; "
            f"model_kwargs override the config (e.g. {{'num_hidden_layers': 2}})"
        )
    # given to the constructor, not set afterwards: values derived from them (stage names) follow
    config = AutoConfig.for_model(builtin.model_type, **{**builtin.values, **config_values}, **labels)
    model = AutoModelForImageClassification.from_config(config)
    return HuggingFaceClassifier(model, builtin.mean, builtin.std)


def _from_directory(
    directory: Path, labels: dict[str, Any], config_values: dict[str, Any]
) -> HuggingFaceClassifier:
    from transformers import AutoModelForImageClassification

    if not (directory / "config.json").is_file():
        raise ValueError(f"hf:{directory} has no config.json: pass a directory written by save_pretrained")
    mean, std = processor_normalisation(directory)
    model = AutoModelForImageClassification.from_pretrained(
        directory, ignore_mismatched_sizes=True, **labels, **config_values
    )
    # from_pretrained returns the model in eval mode, and Lightning trains modules in the mode it finds them:
    # a fine-tune would run with BatchNorm's statistics frozen and dropout off. Built as every other model is.
    model.train()
    return HuggingFaceClassifier(model, mean, std)


def processor_normalisation(directory: str | os.PathLike[str]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(mean, std)`` in 0..1 units that the image processor saved in ``directory`` applies; ImageNet's when
    it saved none. Processors that do more than rescale by 1/255 and normalise are refused."""
    path = Path(directory) / PROCESSOR_FILE
    if not path.is_file():
        return IMAGENET_MEAN, IMAGENET_STD
    settings = json.loads(path.read_text())
    unsupported = [k for k in ("flip_channel_order", "rescale_offset") if settings.get(k)]
    factor = settings.get("rescale_factor", 1 / 255) if settings.get("do_rescale", True) else 1.0
    if unsupported or abs(factor * 255 - 1) > 1e-6:
        what = unsupported or [f"rescale_factor={factor}"]
        raise ValueError(f"{path}: {', '.join(what)} is not supported (only rescale by 1/255 and normalise)")
    if not settings.get("do_normalize", True):
        return (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    mean, std = settings.get("image_mean", IMAGENET_MEAN), settings.get("image_std", IMAGENET_STD)
    return tuple(float(m) for m in mean), tuple(float(s) for s in std)


def _hub_snapshot(repo_id: str) -> Path:
    """The hub repository's files in the local cache, downloaded when missing; one line when that fails."""
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except Exception:  # not cached: download below
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as err:  # offline, unknown repository, gated ...: one line either way
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"hf:{repo_id}: could not load it from the Hugging Face hub ({reason}); without network access, "
            f"save it elsewhere with save_pretrained and pass hf:<that directory>"
        ) from None
