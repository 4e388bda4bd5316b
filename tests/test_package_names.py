"""Our import packages have names no other distribution uses, so Hugging Face's ``kernels`` lives beside them.

``kernels/`` and ``vision/`` are plain folders of the repository that hold ``lcv_kernels`` and ``lcv_vision``:
a ``kernels/__init__.py`` at the root would shadow Hugging Face's ``kernels`` for anyone who runs Python from
the repository root, and an installed ``kernels``/``vision`` package of ours would overwrite another one."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

BOTH = (
    "import kernels, lcv_kernels, lightning_plugin, lcv_vision.cli; "
    "print(kernels.__file__); print(lcv_kernels.__file__); print(hasattr(kernels, 'kernelize'))"
)
# transformers 5 imports Hugging Face's `kernels` from this module; it failed where a `kernels` of ours came first.
TRANSFORMERS = "; import transformers, transformers.integrations.hub_kernels; print(transformers.__version__)"


@pytest.mark.parametrize("folder", ["kernels", "vision"])
def test_the_folders_are_not_import_packages(folder):
    assert (ROOT / folder).is_dir()
    assert not (ROOT / folder / "__init__.py").exists(), (
        f"{folder}/__init__.py would shadow another '{folder}'"
    )


def test_no_import_package_is_named_kernels_or_vision():
    import setuptools

    found = setuptools.find_packages(str(ROOT)) + [
        p for where in ("kernels", "vision") for p in setuptools.find_packages(str(ROOT / where))
    ]
    tops = {name.split(".")[0] for name in found}
    assert {"lcv_kernels", "lcv_vision", "lightning_plugin"} <= tops
    assert not tops & {"kernels", "vision"}, tops


@pytest.mark.parametrize("where", ["repository root", "elsewhere"])
def test_hugging_faces_kernels_and_ours_import_together(where, tmp_path):
    """``python -c`` puts the working folder first on ``sys.path``, as ``python -m pytest`` from the root does."""
    pytest.importorskip("kernels", reason="Hugging Face's kernels is in the dev extra")
    with_transformers = importlib.util.find_spec("transformers") is not None  # in the dev and hf extras
    cwd = ROOT if where == "repository root" else tmp_path
    code = BOTH + (TRANSFORMERS if with_transformers else "")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, check=False, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    theirs, ours, has_api, *version = proc.stdout.split()
    assert len(version) == int(with_transformers), proc.stdout  # `import transformers` ran after ours
    assert "site-packages" in theirs and not Path(theirs).is_relative_to(ROOT / "kernels"), theirs
    assert Path(ours) == ROOT / "kernels" / "lcv_kernels" / "__init__.py"
    assert has_api == "True"  # Hugging Face's module, not a folder of ours seen as a namespace package


def test_no_test_helper_shares_a_module_name_with_a_script():
    """A script of ``benchmarks/`` or ``examples/`` puts its folder first on ``sys.path`` (and ``load_script``
    registers it by its file name), so a helper of ``tests/`` with the same file name is shadowed by it in the
    same pytest worker: ``benchmarks/photo_folder.py`` once broke 18 tests that imported ``tests/photo_folder.py``.
    """
    helpers = {
        path.stem: path
        for path in (ROOT / "tests").rglob("*.py")
        if not path.name.startswith("test_") and path.name not in ("conftest.py", "__init__.py")
    }
    scripts = {
        path.stem: path for folder in ("benchmarks", "examples") for path in (ROOT / folder).glob("*.py")
    }
    clashes = sorted(
        f"{helpers[name].relative_to(ROOT)} and {scripts[name].relative_to(ROOT)}"
        for name in helpers.keys() & scripts.keys()
    )
    assert not clashes, "same module name: " + "; ".join(clashes)
