"""``benchmarks/cpp_wrapper.py`` refuses bad arguments before it compiles anything (its timings are the
benchmark's business; compiling both wrappers for a structure test would cost a C++ build a run)."""

from __future__ import annotations

import pytest

from script_loader import load_script


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--depths", "-1"], "--depths must be >= 0"),
        (["--repeats", "0"], "--repeats >= 1"),
        (["--calls", "5"], "--calls >= 10"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(argv, words, capsys):
    bench = load_script("benchmarks/cpp_wrapper.py")
    with pytest.raises(SystemExit) as stop:
        bench.main(argv)
    assert stop.value.code == 2 and words in capsys.readouterr().err
