"""``benchmarks/serve_load.py``'s options are checked before any image is read or a server started."""

from __future__ import annotations

import sys

import pytest

from script_loader import load_script


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--upscale", "0", "256"], "--upscale needs a positive width and height; got 0 256"),
        (["--upscale", "320", "-1"], "--upscale needs a positive width and height; got 320 -1"),
        (["--clients", "8", "0"], "--max-batch-size and --workers must be >= 1"),
        (["--images", "0"], "--max-batch-size and --workers must be >= 1"),
        (["--workers", "0"], "--max-batch-size and --workers must be >= 1"),
    ],
)
def test_bad_sizes_and_counts_are_one_line_at_start(argv, message, monkeypatch, capsys, tmp_path):
    bench = load_script("benchmarks/serve_load.py")
    missing_zip = tmp_path / "no.zip"  # read only after the checks: a FileNotFoundError would mean it was not
    monkeypatch.setattr(sys, "argv", ["serve_load.py", "model.pt2", "--zip-path", str(missing_zip), *argv])
    with pytest.raises(SystemExit) as stopped:
        bench.main()
    said = capsys.readouterr()
    assert stopped.value.code == 2
    last = said.err.strip().splitlines()[-1]
    assert last.startswith("serve_load.py: error: ") and last.endswith(message)
