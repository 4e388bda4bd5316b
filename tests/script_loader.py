"""Load a script of the repository (``examples/``, ``benchmarks/``) as a module, by its path.

Those folders are not packages; the tests call a script's functions instead of spawning a process.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_script(relative: str) -> ModuleType:
    """Execute ``ROOT/relative`` as a module named after the file (registered in ``sys.modules``, where
    dataclasses look their module up)."""
    name = os.path.splitext(os.path.basename(relative))[0]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relative))
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module
