"""A ``.pt2`` package: its metadata, the checks before loading it, host preprocessing and prediction.

The metadata lives in the package itself (AOTInductor's ``aot_inductor.metadata``, one JSON string under
:data:`METADATA_KEY`), so one file is the whole model: a process with torch alone can read it with
``torch._inductor.aoti_load_package(path).get_metadata()``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from lcv_kernels.hardware import amx_supported, cpu_capability
from lcv_vision.deploy.errors import DeployError, IncompatiblePackageError
from lcv_vision.deploy.host_transform import HostTransform

__all__ = [
    "METADATA_KEY",
    "DeployedModel",
    "PackageInfo",
    "amx_supported",
    "check_compatible",
    "cpu_capability",
    "load_package",
]

#: The metadata key of the package's :class:`PackageInfo` (a JSON string).
METADATA_KEY = "lcv.info"

#: ATen's CPU capabilities, each a superset of the one before (x86).
_X86_LEVELS = ("DEFAULT", "AVX2", "AVX512")


@dataclasses.dataclass(frozen=True)
class PackageInfo:
    """What a package needs to be used correctly: labels, the host transform, and what it was built for.

    ``mean``/``std`` are in 0..1 units and applied inside the graph; ``device`` is ``cpu`` or ``cuda``;
    ``quantization`` is ``none`` or ``int8``; ``needs_amx`` is set for bf16 CPU packages."""

    class_names: tuple[str, ...]
    recipe: str
    input_size: tuple[int, int]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    precision: str
    quantization: str
    device: str
    torch_version: str
    cpu_capability: str
    needs_amx: bool
    transform: HostTransform

    def to_metadata(self) -> dict[str, str]:
        """The ``aot_inductor.metadata`` dict (string values only)."""
        fields = dataclasses.asdict(self)
        fields["transform"] = self.transform.to_json()
        return {METADATA_KEY: json.dumps(fields)}

    @classmethod
    def from_metadata(cls, metadata: dict[str, str], source: str = "the package") -> PackageInfo:
        if METADATA_KEY not in metadata:
            raise DeployError(
                f"{source} has no {METADATA_KEY!r} metadata: it was not written by `lcv export`"
            )
        try:
            fields = json.loads(metadata[METADATA_KEY])
            fields["transform"] = HostTransform.from_json(fields["transform"])
            for name in ("class_names", "input_size", "mean", "std"):
                fields[name] = tuple(fields[name])
            return cls(**fields)
        except (KeyError, TypeError, ValueError) as err:
            raise DeployError(f"{source} has unreadable {METADATA_KEY!r} metadata ({err})") from err


def check_compatible(
    info: PackageInfo, source: str, torch_version: str | None = None, capability: str | None = None
) -> None:
    """:class:`IncompatiblePackageError` when this process cannot run the package as built.

    Why refuse instead of trying: an AOTInductor package is native code for one torch ABI and one
    instruction set; another torch may fail to load it, and a missing instruction crashes the process
    (SIGILL) at the first call. ``torch_version``/``capability`` default to this process's."""
    have_torch = torch_version if torch_version is not None else torch.__version__
    if have_torch.split("+")[0] != info.torch_version.split("+")[0]:
        raise IncompatiblePackageError(
            f"{source} was built with torch {info.torch_version}, this is torch {have_torch}: export it again "
            "with this torch (lcv export CKPT)"
        )
    if info.device != "cpu":
        if not torch.cuda.is_available():
            raise IncompatiblePackageError(f"{source} was built for {info.device}, and this machine has none")
        return
    have = capability if capability is not None else cpu_capability()
    if not _covers(have, info.cpu_capability):
        raise IncompatiblePackageError(
            f"{source} was compiled for CPUs with {info.cpu_capability}, but this CPU has {have} only: "
            f"export it again on this machine (or one like it)"
        )
    if info.needs_amx and capability is None and not amx_supported():
        raise IncompatiblePackageError(
            f"{source} is bf16 for CPUs with AMX, and this CPU has none: use an fp32 or int8 package"
        )


def _covers(have: str, needed: str) -> bool:
    if have in _X86_LEVELS and needed in _X86_LEVELS:
        return _X86_LEVELS.index(have) >= _X86_LEVELS.index(needed)
    return have == needed or needed == "DEFAULT"


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Top-k labels of one image, most probable first."""

    labels: tuple[str, ...]
    indices: tuple[int, ...]
    probabilities: tuple[float, ...]

    def as_dict(self) -> dict[str, Any]:
        return {
            "predictions": [
                {"label": label, "index": index, "probability": round(p, 6)}
                for label, index, p in zip(self.labels, self.indices, self.probabilities)
            ]
        }


class DeployedModel:
    """A loaded package: ``model(uint8 [N, 3, H, W]) -> float32 logits``, plus preprocessing and top-k."""

    def __init__(self, runner: Any, info: PackageInfo) -> None:
        self._runner = runner
        self.info = info

    def preprocess(self, image: Image.Image | torch.Tensor) -> torch.Tensor:
        """The recipe's evaluation transform: a PIL image -> uint8 ``(3, H, W)`` at the package's size."""
        return self.info.transform(image)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        expected = (3, *self.info.input_size)
        if images.dtype != torch.uint8 or images.ndim != 4 or tuple(images.shape[1:]) != expected:
            raise DeployError(
                f"the package takes uint8 images of shape [N, {', '.join(map(str, expected))}], got "
                f"{images.dtype} {list(images.shape)} (use .preprocess(image) for each image)"
            )
        device = "cuda" if self.info.device == "cuda" else "cpu"
        outputs = self._runner(images.contiguous().to(device))
        logits = outputs[0] if isinstance(outputs, (list, tuple)) else outputs
        return logits.float().cpu()

    def predict(self, images: Sequence[Image.Image | torch.Tensor], top_k: int = 5) -> list[Prediction]:
        """Top-``top_k`` labels and softmax probabilities of each image (PIL images or uint8 tensors)."""
        if not images:
            return []
        batch = torch.stack([self.preprocess(image) for image in images])
        return self.top_k(self(batch), top_k)

    def top_k(self, logits: torch.Tensor, top_k: int) -> list[Prediction]:
        k = max(1, min(int(top_k), len(self.info.class_names)))
        probabilities, indices = logits.softmax(dim=1).topk(k, dim=1)
        return [
            Prediction(
                tuple(self.info.class_names[i] for i in row.tolist()), tuple(row.tolist()), tuple(p.tolist())
            )
            for row, p in zip(indices, probabilities)
        ]


def read_info(path: str | Path) -> tuple[Any, PackageInfo]:
    """``(loaded AOTInductor model, PackageInfo)``, without the compatibility checks."""
    source = f"package {str(path)!r}"
    if not Path(path).is_file():
        raise DeployError(f"{source} does not exist")
    try:
        runner = torch._inductor.aoti_load_package(str(path))
    except Exception as err:  # a zip that is not an AOTInductor package, or a truncated file
        raise DeployError(f"{source} is not a loadable .pt2 package ({type(err).__name__}: {err})") from err
    return runner, PackageInfo.from_metadata(dict(runner.get_metadata()), source)


def load_package(path: str | Path) -> DeployedModel:
    """Load a package written by ``lcv export``; one-line errors for a wrong torch or CPU (see
    :func:`check_compatible`)."""
    source = f"package {str(path)!r}"
    metadata = read_metadata(path)
    if metadata is not None:  # check before the native code is loaded
        check_compatible(PackageInfo.from_metadata(metadata, source), source)
    runner, info = read_info(path)
    check_compatible(info, source)
    return DeployedModel(runner, info)


def read_metadata(path: str | Path) -> dict[str, str] | None:
    """The package's metadata read from its zip (``*.wrapper_metadata.json``) without loading its native code;
    ``None`` when the layout is not the expected one (then the loader's own ``get_metadata`` answers)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            for name in archive.namelist():
                if name.endswith(".wrapper_metadata.json") or name.endswith("/metadata.json"):
                    data = json.loads(archive.read(name))
                    if isinstance(data, dict) and METADATA_KEY in data:
                        return {str(k): str(v) for k, v in data.items()}
    except (OSError, zipfile.BadZipFile, ValueError):
        return None
    return None
