"""Measured decisions on disk (kernel selection, compile or eager), so a second run or a resume does not
measure again.

One JSON file of entries keyed by *where* a measurement holds (GPU name, torch and Triton versions) and by the
block signature. A new GPU or a version change misses the cache, because either changes both sides of the
comparison; entries of other machines stay, so one cache directory can serve several GPUs. A file that cannot
be read costs one warning and a new measurement, never a crash: the cache only saves time.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

#: Environment variable naming the directory of the cache file.
CACHE_DIR_ENV = "LCV_KERNEL_CACHE_DIR"

CACHE_FILE_NAME = "kernel_decisions.json"

#: Bumped when the entry format changes; a file of another version counts as empty.
CACHE_FORMAT = 1


def default_cache_dir() -> Path:
    """``$LCV_KERNEL_CACHE_DIR``, else ``lightning-compiled-vision`` in the user cache (XDG, ``~/.cache``)."""
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lightning-compiled-vision"


def machine_fingerprint(device: torch.device) -> str:
    """What a measurement depends on besides the block: the device model and the compiler stack's versions."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{device.type}:{platform.machine()}"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - triton ships with torch on Linux
        triton_version = "none"
    return f"{name}|torch {torch.__version__}|triton {triton_version}"


class DecisionCache:
    """Read-modify-write access to the measurements in one JSON file."""

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        file_name: str = CACHE_FILE_NAME,
        owner: str = "kernel selection",
    ) -> None:
        folder = Path(directory).expanduser() if directory is not None else default_cache_dir()
        self.path = folder / file_name
        self.owner = owner  # who measured, named in warnings
        self._warned = False

    def lookup(self, fingerprint: str, signatures: list[str]) -> dict[str, dict[str, Any]]:
        """The stored measurements of ``signatures`` on this machine (absent ones are missing)."""
        entries = self._load()
        found = {}
        for signature in signatures:
            entry = entries.get(_entry_key(fingerprint, signature))
            if isinstance(entry, dict):
                found[signature] = entry
        return found

    def store(self, fingerprint: str, measurements: dict[str, dict[str, Any]]) -> None:
        """Add measurements, keeping what other runs wrote since this one read the file."""
        if not measurements:
            return
        entries = self._load()
        entries.update({_entry_key(fingerprint, s): m for s, m in measurements.items()})
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Written beside the target and renamed: a reader never sees half a file.
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.stem}.", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"format": CACHE_FORMAT, "entries": entries}, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError as err:
            warnings.warn(
                f"{self.owner}: could not write the decision cache {self.path} ({err}); the next run "
                f"will measure again. Set {CACHE_DIR_ENV} to a writable directory.",
                stacklevel=2,
            )

    def _load(self) -> dict[str, Any]:
        if not self.path.exists():
            return {}
        try:
            with open(self.path) as f:
                data = json.load(f)
            if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
                raise ValueError("not a decision cache (no 'entries' table)")
        except (OSError, ValueError) as err:  # json.JSONDecodeError is a ValueError
            self._warn_once(f"{type(err).__name__}: {err}")
            return {}
        if data.get("format") != CACHE_FORMAT:
            return {}
        return data["entries"]

    def _warn_once(self, problem: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"{self.owner}: ignoring the unreadable decision cache {self.path} ({problem}); "
                "measuring again and rewriting it.",
                stacklevel=3,
            )


def _entry_key(fingerprint: str, signature: str) -> str:
    return f"{fingerprint}::{signature}"
