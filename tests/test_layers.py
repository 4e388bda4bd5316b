"""The import layers (``lcv_kernels`` <- ``lightning_plugin`` <- ``lcv_vision``) and no module-level import cycles.

The rules and why function-level imports are left out of the cycle check: ``tests/import_layers.py``. The
planted trees below show the check fails when it should."""

from __future__ import annotations

import textwrap
from pathlib import Path

from import_layers import (
    FOLDERS,
    LAYERS,
    Import,
    folder_violations,
    import_cycles,
    imports,
    layer_violations,
    module_names,
)

REPO = Path(__file__).resolve().parent.parent


def test_the_packages_respect_the_layers():
    assert layer_violations(REPO) == []


def test_the_plugins_folders_import_only_what_they_may():
    assert folder_violations(REPO) == []


def test_a_planted_folder_violation_is_reported(tmp_path):
    root = _plant(
        tmp_path,
        {
            "lightning_plugin/cpu/__init__.py": "",
            "lightning_plugin/cpu/memory.py": "from lightning_plugin.strategies import single_device\n",
            "lightning_plugin/strategies/__init__.py": "",
            "lightning_plugin/strategies/single_device.py": "from lightning_plugin.cpu import memory\n",
        },
    )
    problems = folder_violations(root)
    assert len(problems) == 1 and problems[0].startswith("lightning_plugin.cpu.memory (line 1) imports"), (
        problems
    )


def test_no_module_level_import_cycles():
    assert import_cycles(REPO) == []


def test_no_import_cycles_at_all_not_even_through_lazy_imports():
    """A lazy import cannot meet a half-initialised module, but a pair of modules that import each other is
    still one concern split in two (``lcv_kernels._common`` and ``_triton`` were such a pair)."""
    assert import_cycles(REPO, include_lazy=True) == []


def test_a_planted_lazy_cycle_is_found_only_when_asked(tmp_path):
    root = _plant(
        tmp_path,
        {
            "kernels/lcv_kernels/a.py": "def f():\n    from lcv_kernels import b\n",
            "kernels/lcv_kernels/b.py": "from lcv_kernels import a\n",
        },
    )
    assert import_cycles(root) == []
    assert import_cycles(root, include_lazy=True) == [["lcv_kernels.a", "lcv_kernels.b"]]


def test_the_checker_sees_the_real_imports():
    """A parser that found nothing would pass the two tests above; it must see known edges of every kind."""
    assert len(module_names(REPO)) > 50
    found = set(imports(REPO))
    assert (
        Import("lightning_plugin.strategies.single_device", "lightning_plugin.compile.mixin", 21, True)
        in found
    )
    # ``from lightning_plugin.compile import dynamo_cache`` names a module, not an attribute of the package
    assert any(
        i.importer == "lightning_plugin.compile.compiler"
        and i.imported == "lightning_plugin.compile.dynamo_cache"
        for i in found
    )
    # lazy imports are parsed too (they are held to the layers)
    assert any(
        i.importer == "lightning_plugin.compile.compiler"
        and i.imported == "lightning_plugin.kernel_choice.substitution"
        and not i.module_level
        for i in found
    )
    assert any(
        i.importer == "lcv_vision.recipes._build" and i.imported.startswith("lightning_plugin") for i in found
    )


def _plant(root: Path, files: dict[str, str]) -> Path:
    for name in LAYERS:
        (root / FOLDERS.get(name, name)).mkdir(parents=True, exist_ok=True)
        (root / FOLDERS.get(name, name) / "__init__.py").touch()
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_planted_layer_violations_are_reported(tmp_path):
    root = _plant(
        tmp_path,
        {
            "kernels/lcv_kernels/op.py": "import lightning_plugin.config\n",  # module level, one layer up
            "lightning_plugin/config.py": """
            def load():
                from lcv_vision.models import resnet  # lazy, still against the layers
                return resnet
        """,
            "lightning_plugin/sub/__init__.py": "",
            "lightning_plugin/sub/deep.py": "from ..config import load\n",  # relative, same layer: allowed
            # downward: allowed
            "vision/lcv_vision/models.py": "import lcv_kernels.op\nimport lightning_plugin.config\n",
        },
    )
    problems = layer_violations(root)
    assert len(problems) == 2, problems
    assert problems[0].startswith("lcv_kernels.op (line 1, module level) imports lightning_plugin.config")
    assert "lcv_kernels may not import lightning_plugin" in problems[0]
    assert problems[1].startswith(
        "lightning_plugin.config (line 3, inside a function) imports lcv_vision.models"
    )


def test_a_relative_import_is_resolved_before_the_layer_check(tmp_path):
    root = _plant(
        tmp_path, {"lightning_plugin/x.py": "from ..lcv_vision import y\n", "vision/lcv_vision/y.py": ""}
    )
    # ``..`` from lightning_plugin.x is the top level: the import is ``lcv_vision.y``
    assert [i.imported for i in imports(root)] == ["lcv_vision.y"]
    assert len(layer_violations(root)) == 1


def test_planted_cycles_are_reported(tmp_path):
    root = _plant(
        tmp_path,
        {
            "lightning_plugin/a.py": "from lightning_plugin import b\n",
            "lightning_plugin/b.py": "try:\n    import lightning_plugin.c\nexcept ImportError:\n    pass\n",
            # class bodies run at import
            "lightning_plugin/c.py": "class C:\n    from lightning_plugin.a import thing\n",
            # not cycles: a lazy import, and a TYPE_CHECKING-only one
            "vision/lcv_vision/p.py": "import lcv_vision.q\n",
            "vision/lcv_vision/q.py": """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                import lcv_vision.p
            def f():
                import lcv_vision.p
        """,
            # a package whose __init__ imports a submodule that imports a name from the package
            "kernels/lcv_kernels/__init__.py": "from lcv_kernels.op import run\n",
            "kernels/lcv_kernels/op.py": "from lcv_kernels import INT_LIMIT\n",
        },
    )
    assert import_cycles(root) == [
        ["lcv_kernels", "lcv_kernels.op"],
        ["lightning_plugin.a", "lightning_plugin.b", "lightning_plugin.c"],
    ]
