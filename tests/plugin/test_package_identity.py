"""A foreign top-level ``kernels`` or ``vision`` (Hugging Face's ``kernels`` is on PyPI) fails at import.

Each case runs in a fresh interpreter with a planted package earlier on ``sys.path`` (``PYTHONPATH``), as a
second installed distribution or a local directory of the same name would be.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _import(statement: str, *front: Path) -> subprocess.CompletedProcess:
    path = os.pathsep.join([*map(str, front), str(ROOT)])
    env = {**os.environ, "PYTHONPATH": path}
    cwd = front[0] if front else ROOT
    return subprocess.run(
        [sys.executable, "-c", statement], capture_output=True, text=True, env=env, cwd=cwd, timeout=300
    )


def _plant(root: Path, name: str) -> Path:
    package = root / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('"""Someone else\'s package."""\n__version__ = "0.0.1"\n')
    return package


def _last_line(proc: subprocess.CompletedProcess) -> str:
    return proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("statement", ["import lightning_plugin", "import vision.recipes"])
def test_a_foreign_kernels_earlier_on_the_path_is_named_with_ours(tmp_path, statement):
    foreign = _plant(tmp_path, "kernels")
    proc = _import(statement, tmp_path)
    assert proc.returncode != 0
    line = _last_line(proc)
    assert line.startswith("lightning_plugin.package_identity.ForeignPackageError: "), line
    assert f"'kernels' at {foreign}" in line
    assert f"expected at {ROOT / 'kernels'}" in line
    assert "pip uninstall kernels" in line


def test_a_foreign_vision_earlier_on_the_path_is_named_with_ours(tmp_path):
    foreign = _plant(tmp_path, "vision")
    proc = _import("import lightning_plugin", tmp_path)
    assert proc.returncode != 0
    line = _last_line(proc)
    assert f"'vision' at {foreign}" in line and f"expected at {ROOT / 'vision'}" in line, line


def test_a_foreign_init_over_ours_in_the_same_directory_is_reported(tmp_path):
    """Two distributions installed into one site-packages mix their files: the location alone cannot tell."""
    for name in ("kernels", "lightning_plugin", "vision"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "kernels" / "__init__.py").write_text('"""Hugging Face\'s kernels."""\n')
    proc = _import("import lightning_plugin", tmp_path)
    assert proc.returncode != 0
    line = _last_line(proc)
    assert f"'kernels' at {tmp_path / 'kernels'}" in line and "mixed" in line, line


def test_our_own_packages_import_cleanly_from_another_checkout(tmp_path):
    """The check goes by our marker, not the location: a copy of this tree (another checkout) is ours."""
    for name in ("kernels", "lightning_plugin", "vision"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    proc = _import("import vision.recipes, lightning_plugin, kernels; print(kernels.__file__)", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "kernels" / "__init__.py")
