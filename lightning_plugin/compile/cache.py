"""A portable compile cache: compile a model once, not once per process or machine.

Inductor already caches compiled graphs on local disk, but only for the same machine and
cache directory. ``torch.compiler.save_cache_artifacts()`` packs what this process compiled
(or loaded from that cache) into bytes that ``load_cache_artifacts`` writes into another
process's caches: a resume, another DDP rank or node, a rerun. On the CPU those artifacts
hold the generated C++ but not the compiled kernels, and a fresh process spends most of its
"cached" compile in the C++ compiler; so the file also carries the kernel binaries this
process loaded and Inductor's CPU instruction-set probes (``*.so`` next to a ``.load_ok``
marker). GPU (Triton) kernels are bundled by torch itself.

File layout: a magic line, one JSON header line (the environment it was made in, the size of
each part), then the parts' bytes. A file made with another torch, Triton, Python or device
is skipped with one warning line: its artifacts would only miss, or worse, load kernels
built for another machine.
"""

from __future__ import annotations

import glob
import json
import os
import platform
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

#: File name used with ``CompileConfig(cache=True)``, next to the run's checkpoints.
CACHE_FILE_NAME = "torch_compile_cache.bin"
_MAGIC = b"LCV-COMPILE-CACHE 1\n"
_TORCH_ARTIFACTS = "torch_artifacts"

#: Files already loaded in this process (path, modification time): each is loaded once.
_LOADED: set[tuple[str, float]] = set()


def environment(device: torch.device) -> dict[str, str | None]:
    """What the cached artifacts depend on beyond the graphs themselves."""
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        device_name = f"cuda {torch.cuda.get_device_name(index)} sm_{major}{minor}"
    else:
        device_name = f"{device.type} {platform.machine()} {torch.backends.cpu.get_cpu_capability()}"
    return {
        "torch": torch.__version__,
        "triton": triton_version,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "device": device_name,
    }


def save_compile_cache(path: str | os.PathLike[str], device: torch.device) -> bool:
    """Write what this process compiled to ``path`` (atomically); False when there is nothing to write."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return False
    parts = {_TORCH_ARTIFACTS: saved[0]}
    root = _inductor_cache_dir()
    parts.update({f"inductor/{rel}": data for rel, data in _kernel_binaries(root)})
    header = {"environment": environment(device), "parts": {name: len(data) for name, data in parts.items()}}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, b"".join([_MAGIC, json.dumps(header).encode() + b"\n", *parts.values()]), mode=0o644)
    return True


def load_compile_cache(path: str | os.PathLike[str], device: torch.device) -> bool:
    """Load ``path`` into this process's compile caches; False (and one warning line) when it cannot serve."""
    path = Path(path)
    key = (str(path.resolve()), path.stat().st_mtime)
    if key in _LOADED:
        return True
    try:
        header, parts = _read(path)
    except (OSError, ValueError) as err:
        warnings.warn(
            f"compile cache {path} is unreadable ({err}); not loaded, compiling from scratch", stacklevel=2
        )
        return False
    made_in, here = header.get("environment", {}), environment(device)
    differs = [f"{k} {made_in.get(k)!s} here {here[k]!s}" for k in here if made_in.get(k) != here[k]]
    if differs:
        warnings.warn(
            f"compile cache {path} was made elsewhere ({'; '.join(differs)}); "
            "not loaded, compiling from scratch",
            stacklevel=2,
        )
        return False
    root = _inductor_cache_dir()
    for name, data in parts.items():
        if name.startswith("inductor/"):
            target = root / name.removeprefix("inductor/")
            if target.resolve().is_relative_to(root.resolve()) and not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                _write_atomic(target, data, mode=0o755)
    if _TORCH_ARTIFACTS in parts:
        torch.compiler.load_cache_artifacts(parts[_TORCH_ARTIFACTS])
    _LOADED.add(key)
    return True


def _read(path: Path) -> tuple[dict[str, Any], dict[str, bytes]]:
    with open(path, "rb") as f:
        if f.readline() != _MAGIC:
            raise ValueError("not a compile cache file")
        header = json.loads(f.readline())
        parts = {}
        for name, size in header["parts"].items():
            data = f.read(size)
            if len(data) != size:
                raise ValueError(f"truncated at part {name!r}")
            parts[name] = data
    return header, parts


def _inductor_cache_dir() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def _kernel_binaries(root: Path) -> Iterator[tuple[str, bytes]]:
    """C++ kernels this process loaded, and Inductor's instruction-set probe results, relative to ``root``."""
    try:
        from torch._inductor.codecache import CppCodeCache
    except ImportError:  # pragma: no cover - a torch without the C++ backend
        return
    keys: set[str] = set()
    pending = [CppCodeCache]
    while pending:
        cls = pending.pop()
        keys.update(getattr(cls, "cache", {}))
        pending.extend(cls.__subclasses__())
    paths = {p for key in keys for p in glob.glob(str(root / key[1:3] / f"{key}*.so"))}
    probes = glob.glob(str(root / "*" / "*.so.load_ok"))
    paths |= set(probes) | {p.removesuffix(".load_ok") for p in probes}
    for p in sorted(paths):
        if os.path.isfile(p):
            yield os.path.relpath(p, root), Path(p).read_bytes()


def cache_locations(setting: bool | str | os.PathLike[str], trainer: Any) -> tuple[list[Path], Path]:
    """Where to look for a compile cache, in order, and where to write it.

    A path setting is both. ``True`` writes next to the run's checkpoints (the checkpoint
    callback's folder, else ``default_root_dir``) and looks first next to the checkpoint the
    run resumes from, then in its own folder.
    """
    if not isinstance(setting, bool):
        return [Path(setting)], Path(setting)
    checkpoint = getattr(trainer, "checkpoint_callback", None)
    save = Path(getattr(checkpoint, "dirpath", None) or trainer.default_root_dir) / CACHE_FILE_NAME
    resumed_from = trainer.ckpt_path
    if resumed_from and os.path.isfile(resumed_from):
        return [Path(resumed_from).parent / CACHE_FILE_NAME, save], save
    return [save], save


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
