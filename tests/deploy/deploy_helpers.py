"""Helpers of the deploy tests (a module of its own: ``conftest`` is a name every test folder uses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import torch

#: Beside the shared int8 package: the warnings its export showed (what a user of the command would see).
INT8_EXPORT_WARNINGS = "digits-int8-export-warnings.json"


def cifar_jpegs(zip_path: str, count: int) -> list[bytes]:
    """The first ``count`` CIFAR-10 test JPEGs of the shared zip, spread over its classes."""
    with zipfile.ZipFile(zip_path) as archive:
        names = sorted(n for n in archive.namelist() if n.startswith("test/") and n.endswith(".jpg"))
        step = max(1, len(names) // count)
        return [archive.read(name) for name in names[::step][:count]]


SHARED_CIFAR_ZIP = os.path.join(
    os.path.dirname(__file__), "..", "..", "..", "shared", "data", "cifar10-jpeg.zip"
)

#: Run with ``python -I`` (no PYTHONPATH, no current folder): torch alone loads and runs the package.
FRESH_PROCESS = """
import json, sys
import torch, torch._inductor
model = torch._inductor.aoti_load_package(sys.argv[1])
logits = model(torch.load(sys.argv[2]))
torch.save(logits, sys.argv[3])
ours = sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_plugin",
              "lcv_vision", "lcv_kernels", "torchao"))
print(json.dumps({"metadata": dict(model.get_metadata()), "imported": ours}))
"""


def run_fresh(package: Path, images: torch.Tensor, tmp_path: Path) -> tuple[torch.Tensor, dict]:
    """Logits of ``package`` for ``images`` and ``{"metadata", "imported"}`` from a torch-only process."""
    torch.save(images, tmp_path / "images.pt")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    done = subprocess.run(
        [sys.executable, "-I", "-c", FRESH_PROCESS, str(package), "images.pt", "logits.pt"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(tmp_path / "logits.pt"), json.loads(done.stdout.strip().splitlines()[-1])
