"""``lcv export``: a checkpoint -> one ``.pt2`` that a torch-only process runs with the eager logits."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import nn

from deploy_helpers import cifar_jpegs, run_fresh
from lcv_kernels.tolerances import reduction_tolerance
from lcv_vision.deploy import IncompatiblePackageError, UnexportableModelError, load_package
from lcv_vision.deploy.capture import capture
from lcv_vision.deploy.errors import UnsupportedPrecisionError
from lcv_vision.deploy.export import InferenceModel, check_precision, example_batch
from lcv_vision.deploy.images import decode_image
from lcv_vision.deploy.package import (
    METADATA_KEY,
    PackageInfo,
    amx_supported,
    check_compatible,
    cpu_capability,
)
from lcv_vision.module import ClassificationModule

pytestmark = pytest.mark.xdist_group("deploy")


def eager_logits(checkpoint: Path, images: torch.Tensor) -> torch.Tensor:
    """The trained module's own evaluation (``ClassificationModule.forward`` in eval mode: EMA weights)."""
    module = ClassificationModule.load_from_checkpoint(
        checkpoint, map_location="cpu", weights_only=False
    ).eval()
    mean = torch.tensor([0.5, 0.5, 0.5]).view(1, 3, 1, 1)  # digits-small's normalisation
    with torch.no_grad():
        return module((images.float() / 255.0 - mean) / mean).float()


def logits_tolerance(network: nn.Module) -> float:
    """fp32 tolerance of two compilations of ``network``: every layer's fan-in is one summed reduction, and the
    chain of them is one long sum as far as rounding goes (``reduction_tolerance`` of their total length)."""
    fan_ins = [m.weight[0].numel() for m in network.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    atol, _ = reduction_tolerance(torch.float32, sum(fan_ins))
    return atol


def test_package_runs_in_a_torch_only_process_with_the_eager_logits(
    digits_checkpoint, fp32_package, digits_test_set, tmp_path, request
):
    images = digits_test_set[0][:64]
    zip_path = os.path.abspath(
        os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "cifar10-jpeg.zip")
    )
    if os.path.exists(zip_path):  # real photos too, through the package's own host transform
        model = load_package(fp32_package)
        photos = [model.preprocess(decode_image(data)) for data in cifar_jpegs(zip_path, 32)]
        images = torch.cat([images, torch.stack(photos)])
    logits, report = run_fresh(fp32_package, images, tmp_path)
    assert report["imported"] == []
    info = json.loads(report["metadata"][METADATA_KEY])
    assert info["recipe"] == "digits-small" and info["class_names"] == [str(i) for i in range(10)]
    reference = eager_logits(digits_checkpoint, images)
    module = ClassificationModule.load_from_checkpoint(
        digits_checkpoint, map_location="cpu", weights_only=False
    )
    assert module.ema is not None  # the recipe evaluates its EMA weights; so must the package
    tolerance = logits_tolerance(module.ema.module) * (1.0 + reference.abs().max().item())
    assert logits.dtype == torch.float32 and logits.shape == reference.shape
    assert (logits - reference).abs().max().item() <= tolerance
    assert torch.equal(logits.argmax(1), reference.argmax(1))


def test_metadata_says_what_the_package_needs(fp32_package):
    info = load_package(fp32_package).info
    assert info.class_names == tuple(str(i) for i in range(10))
    assert (info.recipe, info.input_size, info.precision, info.quantization) == (
        "digits-small",
        (32, 32),
        "fp32",
        "none",
    )
    assert info.mean == (0.5, 0.5, 0.5) and info.std == (0.5, 0.5, 0.5)
    assert info.torch_version == torch.__version__ and info.cpu_capability == cpu_capability()


def test_preprocess_is_the_recipes_eval_transform(fp32_package, digits_test_set):
    model = load_package(fp32_package)
    stored = digits_test_set[0][:8]
    for image in stored:  # the recipe's own test images, as PIL images: unchanged
        assert torch.equal(model.preprocess(Image.fromarray(image.permute(1, 2, 0).numpy())), image)
    large = Image.fromarray(stored[0].permute(1, 2, 0).numpy()).resize((64, 48))
    assert model.preprocess(large).shape == (3, 32, 32) and model.preprocess(large).dtype == torch.uint8


def test_predict_gives_top_k_labels(fp32_package, digits_test_set):
    model = load_package(fp32_package)
    images, labels = digits_test_set
    pils = [Image.fromarray(image.permute(1, 2, 0).numpy()) for image in images[:16]]
    predictions = model.predict(pils, top_k=3)
    assert [len(p.labels) for p in predictions] == [3] * 16
    logits = model(torch.stack([model.preprocess(p) for p in pils]))
    for prediction, row in zip(predictions, logits.softmax(1)):
        assert list(prediction.probabilities) == sorted(prediction.probabilities, reverse=True)
        assert prediction.indices[0] == int(row.argmax()) and prediction.labels[0] == str(
            prediction.indices[0]
        )
        assert math.isclose(prediction.probabilities[0], float(row.max()), rel_tol=1e-6)
    correct = sum(p.labels[0] == str(int(label)) for p, label in zip(predictions, labels[:16]))
    assert correct >= 12  # a trained model, not chance (1.6 of 16)
    assert len(model.predict(pils[:1], top_k=99)[0].labels) == 10  # at most every class


def test_another_torch_or_a_smaller_instruction_set_is_one_line(fp32_package, monkeypatch):
    info = load_package(fp32_package).info
    with pytest.raises(IncompatiblePackageError, match=r"built with torch .* this is torch 2\.13\.0"):
        check_compatible(info, "package 'x'", torch_version="2.13.0")
    need = info.cpu_capability
    if need == "DEFAULT":
        pytest.skip("the package was built for the baseline instruction set; nothing is smaller")
    with pytest.raises(
        IncompatiblePackageError, match=f"compiled for CPUs with {need}, but this CPU has DEFAULT"
    ):
        check_compatible(info, "package 'x'", capability="DEFAULT")
    import lcv_vision.deploy.package as package

    monkeypatch.setattr(package, "cpu_capability", lambda: "DEFAULT")
    with pytest.raises(IncompatiblePackageError) as raised:
        load_package(fp32_package)
    assert "\n" not in str(raised.value)


def test_bf16_package_needs_amx_or_cuda(monkeypatch):
    import lcv_vision.deploy.export as export

    monkeypatch.setattr(export, "amx_supported", lambda: False)
    with pytest.raises(UnsupportedPrecisionError, match="no AMX") as raised:
        check_precision("bf16", "cpu")
    assert "\n" not in str(raised.value)
    assert check_precision("bf16", "cuda") == torch.bfloat16


class _Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.mean() > 0:  # a Python branch on a tensor's value: not one graph
            return x * 2
        return x


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.gate = _Gate()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate(self.conv(x)).mean((2, 3)))


@pytest.mark.parametrize("strict", [False, True])
def test_an_unexportable_model_names_the_operation_and_the_module(strict):
    model = InferenceModel(_Net(), (0.5,) * 3, (0.5,) * 3).eval()
    with pytest.raises(UnexportableModelError) as raised:
        capture(model, example_batch((8, 8)), strict=strict)
    message = str(raised.value)
    assert "\n" not in message
    assert "_Gate 'network.gate'" in message and "if x.mean() > 0" in message


def test_package_info_round_trips(fp32_package):
    info = load_package(fp32_package).info
    assert PackageInfo.from_metadata(info.to_metadata()) == info


def test_classify_prints_top_k_labels(fp32_package, digits_test_set, tmp_path, capsys):
    from lcv_vision.cli import main

    image, label = digits_test_set[0][0], int(digits_test_set[1][0])
    path = tmp_path / "digit.png"
    Image.fromarray(image.permute(1, 2, 0).numpy()).save(path)
    main(["classify", str(fp32_package), str(path), "--top-k", "2", "--json"])
    answer = json.loads(capsys.readouterr().out.strip())
    assert answer["image"] == str(path) and len(answer["predictions"]) == 2
    assert answer["predictions"][0]["label"] == str(label)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["export", "missing.ckpt", "--out", "m.pt2"], "checkpoint 'missing.ckpt' does not exist"),
        (["classify", "missing.pt2", "x.png"], "package 'missing.pt2' does not exist"),
    ],
)
def test_deploy_commands_fail_in_one_line(argv, message, tmp_path, monkeypatch, capsys):
    from lcv_vision.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exited.value.code == 1 and err == f"lcv: error: {message}"


def test_importing_lcv_needs_no_deploy_extra():
    """torchao, litserve and onnx are imported by the commands that use them, never by ``import lcv_vision``."""
    code = (
        "import sys, lcv_vision.cli, lcv_vision.deploy\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torchao', 'litserve', 'onnx', 'onnxruntime', 'onnxscript', 'multipart')))"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(root / p) for p in ("", "kernels", "vision"))}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.skipif(not amx_supported(), reason="bf16 packages are built only for CPUs with AMX (none here)")
def test_bf16_package_on_an_amx_cpu_matches_fp32_within_bf16_rounding(
    digits_checkpoint, digits_test_set, tmp_path
):
    from lcv_vision.deploy.export import export_package, load_trained

    out = tmp_path / "digits-bf16.pt2"
    assert export_package(digits_checkpoint, out, precision="bf16").needs_amx
    images = digits_test_set[0]
    trained = load_trained(digits_checkpoint)
    with torch.no_grad():
        reference = InferenceModel(trained.network, trained.mean, trained.std).eval()(images)
    logits = load_package(out)(images)
    # Each conv/linear output is rounded to bf16 once (eps 2**-7), on both sides of a comparison at most twice.
    layers = sum(isinstance(m, (nn.Conv2d, nn.Linear)) for m in trained.network.modules())
    bound = layers * 2 * torch.finfo(torch.bfloat16).eps * (1.0 + reference.abs().max().item())
    assert (logits - reference).abs().max().item() <= bound
    assert (logits.argmax(1) == reference.argmax(1)).float().mean() >= 0.95


def test_a_bf16_inference_model_leaves_the_callers_fp32_network_alone():
    """Two inference models of one network (what ``benchmarks/inference.py`` builds on an AMX CPU): building
    the bf16 one must not turn the network, and so the fp32 one, into bf16."""
    torch.manual_seed(0)
    network = nn.Sequential(nn.Conv2d(3, 5, 3), nn.BatchNorm2d(5), nn.ReLU(), nn.Flatten(), nn.LazyLinear(3))
    images = torch.randint(0, 256, (2, 3, 7, 9), dtype=torch.uint8)
    fp32 = InferenceModel(network, (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)).eval()
    with torch.no_grad():
        before = fp32(images)
        bf16 = InferenceModel(network, (0.5, 0.4, 0.3), (0.2, 0.25, 0.3), torch.bfloat16).eval()
        after = fp32(images)
        low = bf16(images)
    assert fp32.network is network  # fp32 of an fp32 network: no copy
    assert all(
        t.dtype == torch.float32 for t in (*network.parameters(), *network.buffers()) if t.is_floating_point()
    )
    assert torch.equal(before, after)
    assert {p.dtype for p in bf16.network.parameters()} == {torch.bfloat16}
    assert low.dtype == torch.float32 and not torch.equal(low, before)  # it really ran in bf16


def test_a_bf16_package_is_refused_on_a_cpu_without_amx(fp32_package, monkeypatch):
    import dataclasses

    import lcv_vision.deploy.package as package

    bf16 = dataclasses.replace(load_package(fp32_package).info, precision="bf16", needs_amx=True)
    monkeypatch.setattr(package, "amx_supported", lambda: False)
    with pytest.raises(IncompatiblePackageError, match="bf16 for CPUs with AMX, and this CPU has none"):
        check_compatible(bf16, "package 'x'")


def test_conv_weights_are_prepacked_and_exact_at_any_batch(digits_checkpoint, fp32_package, digits_test_set):
    """The package holds every convolution's weight in oneDNN's layout (packed for batch 1 at export, see
    ``lcv_vision.deploy.prepack``), and gives the eager logits at batch sizes other than the packing hint."""
    from lcv_vision.deploy.prepack import PACKED_PREFIX

    model = load_package(fp32_package)
    module = ClassificationModule.load_from_checkpoint(
        digits_checkpoint, map_location="cpu", weights_only=False
    )
    assert module.ema is not None
    convs = sum(isinstance(m, nn.Conv2d) for m in module.ema.module.modules())
    packed = [name for name in model._runner.get_constant_fqns() if name.startswith(PACKED_PREFIX)]
    assert convs > 0 and len(packed) == convs
    images = digits_test_set[0][:7]
    reference = eager_logits(digits_checkpoint, images)
    tolerance = logits_tolerance(module.ema.module) * (1.0 + reference.abs().max().item())
    start = 0
    for batch in (1, 2, 4):
        logits = model(images[start : start + batch])
        assert (logits - reference[start : start + batch]).abs().max().item() <= tolerance
        start += batch
