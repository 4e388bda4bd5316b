"""Saved ``lcv`` configs from before the rename of our import packages still run.

Until 2026-12 the packages were named ``vision`` and ``kernels``; both names belong to other distributions too
(Hugging Face's ``kernels`` comes with transformers), so they became ``lcv_vision`` and ``lcv_kernels``. A
``config.yaml`` that ``lcv fit`` saved before names class paths such as ``vision.callbacks.BestAndLastCheckpoint``;
``lcv`` reads such a file with the new names and says once what to change, instead of failing on an import.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import tempfile
from pathlib import Path

#: old top-level package -> its new name
RENAMED: dict[str, str] = {"vision": "lcv_vision", "kernels": "lcv_kernels"}

_OLD_PATH = re.compile(r"(?<![\w.])(" + "|".join(RENAMED) + r")(?=\.[A-Za-z_])")


def upgrade_text(text: str) -> tuple[str, list[str]]:
    """``text`` with old dotted module paths renamed, and the old package names that were found."""
    found: list[str] = []

    def rename(match: re.Match[str]) -> str:
        if match.group(1) not in found:
            found.append(match.group(1))
        return RENAMED[match.group(1)]

    return _OLD_PATH.sub(rename, text), found


def upgrade_config_files(argv: list[str]) -> list[str]:
    """``argv`` with every ``--config``/``-c`` file that names an old package replaced by an upgraded copy.

    Prints one line per such file saying what to change; files without old names are left as given."""
    upgraded = list(argv)
    for i, arg in enumerate(argv):
        if arg in ("--config", "-c") and i + 1 < len(argv):
            index, path, prefix = i + 1, argv[i + 1], ""
        elif arg.startswith("--config="):
            index, path, prefix = i, arg.split("=", 1)[1], "--config="
        else:
            continue
        file = Path(path)
        if not file.is_file():
            continue  # the CLI reports a missing file itself
        text, found = upgrade_text(file.read_text())
        if not found:
            continue
        with tempfile.NamedTemporaryFile("w", suffix="-" + file.name, delete=False) as copy:
            copy.write(text)
        atexit.register(os.unlink, copy.name)
        changes = ", ".join(f"'{old}.' with '{RENAMED[old]}.'" for old in found)
        print(
            f"lcv: {path} uses the old package names: replace {changes} in it (read renamed this time)",
            file=sys.stderr,
        )
        upgraded[index] = prefix + copy.name
    return upgraded
