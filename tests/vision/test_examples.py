"""Every example script runs one tiny step (its ``--smoke`` mode), and the accuracy benchmark runs end to
end."""

from __future__ import annotations

import json

import pytest

from script_loader import load_script


@pytest.fixture(autouse=True)
def _run_in_a_temporary_folder(tmp_path, monkeypatch):
    """The examples write their run folders (checkpoints, the compile cache) into the working directory: keep
    them out of the repository."""
    monkeypatch.chdir(tmp_path)


def _load(relative: str):
    module = load_script(relative)
    assert (
        module.__doc__ and "python " + relative in module.__doc__
    )  # documented at the top, with the command
    return module


@pytest.fixture
def traced_only(monkeypatch):
    """Recipes' strategies with ``aot_eager`` (dynamo and AOTAutograd trace, nothing is built in C++): for the
    examples whose subject is a flag, not Inductor's code (``test_train_cifar10_smoke`` keeps Inductor)."""
    from lcv_vision.recipes import _build

    real = _build.trainer_kwargs

    monkeypatch.setattr(
        _build, "trainer_kwargs", lambda recipe, gpu=None: real(recipe, gpu, backend="aot_eager")
    )


def test_train_cifar10_smoke(capsys):
    result = _load("examples/train_cifar10.py").main(["--smoke"])
    assert 0.0 <= result["test/acc"] <= 1.0
    assert "cifar10-airbench: test accuracy" in capsys.readouterr().out


def test_train_cifar10_other_recipe_and_errors(traced_only):
    example = _load("examples/train_cifar10.py")
    assert 0.0 <= example.main(["--smoke", "--recipe", "cifar10-resnet18"])["test/acc"] <= 1.0
    with pytest.raises(SystemExit, match="--data-root DIR"):
        example.main([])
    with pytest.raises(SystemExit, match="not CIFAR-10"):
        example.main(["--recipe", "digits-small", "--smoke"])


def test_train_imagefolder_smoke(capsys, traced_only):
    """A torchvision backbone by name through the example. Its default (the recipe's ResNet-50) trains in
    test_recipes_run.py; compiling it here too cost a minute of CI for nothing the recipe test misses."""
    example = _load("examples/train_imagefolder.py")
    result = example.main(["--smoke", "--model", "squeezenet1_1", "--image-size", "64"])
    assert 0.0 <= result["test/acc"] <= 1.0
    assert "squeezenet1_1 on" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--root DIR"):
        example.main([])


def test_compare_compile_smoke(capsys):
    report = _load("examples/compare_compile.py").main(["--smoke"])
    assert set(report["ratios"]) == {"steady", "whole_run"} and all(r > 0 for r in report["ratios"].values())
    assert report["runs"]["compiled"][0]["steps"] == 2 and report["runs"]["eager"][0]["steps"] == 2
    assert "eager / compiled:" in capsys.readouterr().out


def test_cifar10_accuracy_benchmark_tiny(cifar_zip, tmp_path, monkeypatch):
    bench = _load("benchmarks/cifar10_accuracy.py")
    monkeypatch.setattr("benchmarks._common.RESULTS_DIR", str(tmp_path))
    payload = bench.main(
        [
            "--zip",
            cifar_zip,
            "--limit-per-class",
            "20",
            "--epochs",
            "1",
            "--batch-size",
            "50",
            "--widths",
            "8",
            "8",
            "8",
            "--tta",
            "flip",
            "--tag",
            "test",
            "--compile-backend",
            "aot_eager",  # the subject is the record; test_train_cifar10_smoke trains the recipe with Inductor
        ]
    )
    written = json.loads((tmp_path / "cifar10_accuracy-cpu-test.json").read_text())
    assert written["test_accuracy"] == payload["test_accuracy"] and 0.0 <= payload["test_accuracy"] <= 1.0
    assert written["train_images"] == 200 and written["test_images"] == 200 and written["steps"] == 4
    assert written["reduced"]["epochs"] == {"full": 10, "used": 1}
    assert written["reduced"]["tta"] == {"full": "flip_translate", "used": "flip"}
    assert written["compile_backend"] == "aot_eager" and written["strategy"] == "CompiledStrategy"


def test_cifar10_accuracy_benchmark_names_an_unknown_backend_before_loading_data(cifar_zip, monkeypatch):
    import lcv_vision.recipes

    bench = _load("benchmarks/cifar10_accuracy.py")

    def never(*args, **kwargs):
        raise AssertionError("the data was loaded before the backend was checked")

    monkeypatch.setattr(lcv_vision.recipes, "build", never)
    with pytest.raises(ValueError, match="'no_such_backend' is not a registered torch.compile backend"):
        bench.main(["--zip", cifar_zip, "--compile-backend", "no_such_backend", "--no-write"])
