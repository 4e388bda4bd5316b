"""``import lightning_plugin`` leaves ``pytorch_lightning`` alone: a user's logging settings for
``lightning.pytorch`` hold, and our names reach ``pytorch_lightning``'s registry only where the user imports it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

TRAINER = textwrap.dedent(
    """
    import logging, sys
    import lightning.pytorch as L  # its import sets the level of its logger: the user's setting comes after
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    {before}
    import lightning_plugin
    L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    print("pytorch_lightning imported:", "pytorch_lightning" in sys.modules)
    {after}
    """
)
REGISTERED = (
    "import pytorch_lightning\n"
    "from pytorch_lightning.strategies import StrategyRegistry\n"
    "print('registered:', 'compiled' in StrategyRegistry and 'compiled_ddp' in StrategyRegistry)"
)


def _run(code: str, hide_pytorch_lightning: bool = False, tmp_path=None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if hide_pytorch_lightning:  # as if it were not installed
        (tmp_path / "pytorch_lightning").mkdir()
        (tmp_path / "pytorch_lightning" / "__init__.py").write_text(
            "raise ModuleNotFoundError(\"No module named 'pytorch_lightning'\", name='pytorch_lightning')\n"
        )
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("installed", [True, False], ids=["pytorch_lightning installed", "not installed"])
def test_the_users_logging_level_for_lightning_holds(installed, tmp_path):
    """Also: our import and a Trainer import no ``pytorch_lightning``; where it is installed, the user's own
    import of it afterwards finds our names registered (one process for both: each start pays Lightning's
    ~4 s import)."""
    if installed:
        pytest.importorskip("pytorch_lightning")
    code = TRAINER.format(before="", after=REGISTERED if installed else "")
    proc = _run(code, hide_pytorch_lightning=not installed, tmp_path=tmp_path)
    assert "pytorch_lightning imported: False" in proc.stdout
    assert "GPU available" not in proc.stdout + proc.stderr  # the Trainer's start-up lines stay silenced
    if installed:
        assert "registered: True" in proc.stdout


@pytest.mark.parametrize("order", ["after a probe of it", "user imported it before us"])
def test_our_names_reach_pytorch_lightning_when_the_user_imports_it(order):
    """The order "user imports it after us" is the installed case of the test above."""
    pytest.importorskip("pytorch_lightning")
    if order == "after a probe of it":  # Lightning's RequirementCache asks find_spec without importing
        code = "import importlib.util, lightning_plugin\nimportlib.util.find_spec('pytorch_lightning')\n"
    else:
        code = "import pytorch_lightning\nimport lightning_plugin\n"
    assert "registered: True" in _run(code + REGISTERED).stdout
