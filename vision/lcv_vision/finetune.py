"""Start training from existing weights: torchvision's/timm's pretrained ones, or a local file.

Users training on their own photos start from pretrained weights: the backbone is loaded and the
classification head, sized for another label set, is replaced by the model's own freshly initialised head for
the data set's classes. Any other difference between the weights and the model is an error that names the
keys, because loading only part of a backbone silently trains a different network.
"""

from __future__ import annotations

import os
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

__all__ = ["WeightsError", "load_initial_weights", "pretrained_state_dict", "read_weights_file"]

_NAMES_SHOWN = 5


class WeightsError(ValueError):
    """Weights that cannot be had (offline download, missing file) or do not fit the model: one clear line."""


def pretrained_state_dict(name: str) -> tuple[dict[str, Tensor], str]:
    """The default pretrained weights of model ``name`` and where they come from.

    torchvision's weights are tried first (they fit this project's ResNets, which share torchvision's layout),
    then timm's. Both download once into their cache (``torch.hub.get_dir()``; Hugging Face's cache for timm)
    and load from there afterwards, offline too.
    """
    import torchvision

    if name.lower() in torchvision.models.list_models():
        try:
            weights = torchvision.models.get_model_weights(name.lower()).DEFAULT
        except ValueError:
            weights = None
        if weights is not None:
            cached = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(weights.url))
            try:
                return weights.get_state_dict(progress=True), f"torchvision {weights}"
            except (OSError, RuntimeError) as err:  # URLError is an OSError
                raise WeightsError(
                    f"could not download the pretrained weights of {name!r} ({weights.url}): {err}. Offline? "
                    f"Fetch that file elsewhere and put it at {cached}, or pass a state_dict file with "
                    "--model.weights PATH"
                ) from err
    try:
        import timm
    except ImportError:
        timm = None  # type: ignore[assignment]  # timm is an optional extra: None when not installed
    if timm is not None and timm.is_model(name) and timm.is_model_pretrained(name):
        try:
            model = timm.create_model(name, pretrained=True)
        except Exception as err:  # noqa: BLE001 - huggingface_hub raises many kinds when offline
            raise WeightsError(
                f"could not download timm's pretrained weights of {name!r}: {type(err).__name__}: {err}. "
                "Offline? Pass a state_dict file with --model.weights PATH"
            ) from err
        return model.state_dict(), f"timm {name}"
    raise WeightsError(
        f"no pretrained weights known for model {name!r} (neither torchvision nor timm has them); train from "
        "scratch, or pass a state_dict file with --model.weights PATH"
    )


def read_weights_file(path: str) -> dict[str, Tensor]:
    """A ``state_dict`` saved with ``torch.save`` (a plain one, or a Lightning checkpoint of this project's
    ``ClassificationModule``, whose ``model.*`` entries are taken)."""
    if not os.path.isfile(path):
        raise WeightsError(f"--model.weights {path!r} does not exist")
    try:
        loaded: Any = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - pickle, zip and torch errors
        raise WeightsError(
            f"--model.weights {path!r} is not a state_dict saved with torch.save: {err}"
        ) from err
    if isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
        loaded = loaded["state_dict"]
    if not isinstance(loaded, dict) or not all(isinstance(v, Tensor) for v in loaded.values()):
        raise WeightsError(f"--model.weights {path!r} does not hold a state_dict (a dict of tensors)")
    if any(k.startswith("model.") for k in loaded):
        loaded = {k[len("model.") :]: v for k, v in loaded.items() if k.startswith("model.")}
    return loaded


@runtime_checkable
class _HasClassifier(Protocol):
    """A timm model: ``get_classifier()`` returns its head."""

    def get_classifier(self) -> nn.Module: ...


def classifier_prefixes(model: nn.Module, num_classes: int) -> list[str]:
    """Names of the modules that form the classification head: timm's ``get_classifier()``, else the last
    ``nn.Linear`` with ``num_classes`` outputs."""
    if isinstance(model, _HasClassifier):
        head = model.get_classifier()
        for name, module in model.named_modules():
            if module is head:
                return [name]
    last = [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and m.out_features == num_classes
    ]
    return last[-1:]


def load_initial_weights(model: nn.Module, state: dict[str, Tensor], num_classes: int, source: str) -> str:
    """Copy ``state`` into ``model``; the head is replaced (kept as initialised) when its shape differs.

    Returns a one-line report. Raises :class:`WeightsError` naming the keys when anything but the head
    is missing, unexpected or of another shape.
    """
    own = model.state_dict()
    heads = classifier_prefixes(model, num_classes)

    def in_head(key: str) -> bool:
        return any(key.startswith(prefix + ".") for prefix in heads)

    shape = [k for k in state if k in own and tuple(state[k].shape) != tuple(own[k].shape)]
    missing = [k for k in own if k not in state and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in state if k not in own]
    problems = []
    for what, keys in (("of another shape", shape), ("missing", missing), ("unexpected", unexpected)):
        outside = [k for k in keys if not in_head(k)]
        if outside:
            more = f" and {len(outside) - _NAMES_SHOWN} more" if len(outside) > _NAMES_SHOWN else ""
            problems.append(f"{len(outside)} {what} ({', '.join(outside[:_NAMES_SHOWN])}{more})")
    if problems:
        raise WeightsError(f"the weights from {source} do not fit this model: " + "; ".join(problems))
    matching = {k: v for k, v in state.items() if k in own and k not in shape}
    model.load_state_dict(matching, strict=False)
    replaced = [k for k in own if in_head(k) and k not in matching]
    report = f"loaded {len(matching)} tensors from {source}"
    if replaced:
        theirs = next((tuple(state[k].shape) for k in shape if in_head(k)), None)
        their_classes = f" (the weights' head has {theirs[0]} classes)" if theirs else ""
        report += f"; new {num_classes}-class head {', '.join(heads)}{their_classes}"
    return report
