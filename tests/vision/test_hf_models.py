"""Hugging Face ``transformers`` classifiers as ``hf:`` models: the factory, the data's normalisation and labels,
and training under ``strategy="compiled"`` with 0 graph breaks and the same weights as eager.

Configs are the built-in ones shrunk through ``model_kwargs`` (one layer, 8-16 wide, 16 px images): every block
type of the architecture stays, and Dynamo traces each in about a second. The per-model runs use the
``aot_eager`` backend: graph breaks and recompiles are Dynamo's, and the weights check then tests the traced
graphs (forward and AOT backward) against eager. One ViT runs through Inductor itself (about 7-13 s here),
against float64 eager; speed is timed in ``benchmarks/strategy_overhead.py --workloads hf_vit_tiny,...``.
"""

from __future__ import annotations

import copy
import json
import logging
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from import_layers import imports
from lcv_kernels.tolerances import bound, network_length, tolerance, trajectory_tolerance
from lcv_vision.models import create_model
from lcv_vision.module import ClassificationModule
from lightning_plugin import CompiledStrategy
from photo_folder import CLASSES, image_files, reference_rgb, write_photo_folder

transformers = pytest.importorskip(
    "transformers", reason="Hugging Face transformers is in the hf and dev extras"
)

REPO = Path(__file__).resolve().parents[2]
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))

#: the smallest configs that keep every block type of each architecture (and 16 px inputs)
TINY: dict[str, dict] = {
    "vit-tiny": dict(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        image_size=16,
        patch_size=8,
    ),
    "convnext-tiny": dict(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], patch_size=4),
    "resnet-18": dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1]),
    # no stochastic depth: compiled code draws its random numbers differently, so weights would differ
    "swin-tiny": dict(
        image_size=16,
        patch_size=4,
        embed_dim=8,
        depths=[1, 1],
        num_heads=[1, 2],
        window_size=2,
        drop_path_rate=0.0,
    ),
    "dinov2-small": dict(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, mlp_ratio=2, image_size=16, patch_size=8
    ),
}


# ------------------------------------------------------------------------------------------------ the factory
def test_builtin_configs_build_classifiers_that_return_logits():
    for name, values in TINY.items():
        model = create_model(f"hf:{name}", num_classes=3, **values)
        logits = model(torch.randn(2, 3, 16, 16))
        assert type(logits) is torch.Tensor and logits.shape == (2, 3), name  # not a ModelOutput
        assert model.config.problem_type == "single_label_classification"  # set before the first step
        assert model.config.num_labels == 3
    # the built-in config is the hub checkpoint's size unless overridden
    assert list(create_model("hf:convnext-tiny", num_classes=2).config.hidden_sizes) == [96, 192, 384, 768]


def test_the_data_normalisation_is_mapped_to_the_processors():
    """Images normalised with the data's mean/std give the logits the bare model gives for the same images
    normalised with its processor's (ViT's 0.5), computed here independently."""
    model = create_model("hf:vit-tiny", num_classes=3, **TINY["vit-tiny"]).eval()
    raw = torch.rand(2, 3, 16, 16)
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in IMAGENET)
    model.adapt_to_data(*IMAGENET, class_names=["cat", "dog", "eel"])
    with torch.no_grad():
        expected = model.hf(pixel_values=(raw - 0.5) / 0.5).logits
        got = model((raw - mean) / std)
    atol, rtol = tolerance("norm", torch.float32)
    torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)
    assert model.config.id2label == {0: "cat", 1: "dog", 2: "eel"}
    with pytest.raises(ValueError, match="2 class names for a head of 3"):
        model.adapt_to_data(*IMAGENET, class_names=["a", "b"])


def test_a_saved_directory_comes_back_with_its_weights_and_processor(tmp_path):
    model = create_model("hf:resnet-18", num_classes=3, **TINY["resnet-18"]).eval()
    model.save_pretrained(tmp_path / "saved")
    # a processor of another family: its mean/std are read, not the built-in's
    processor = json.loads((tmp_path / "saved" / "preprocessor_config.json").read_text())
    (tmp_path / "saved" / "preprocessor_config.json").write_text(
        json.dumps({**processor, "image_mean": [0.5] * 3})
    )
    again = create_model(f"hf:{tmp_path / 'saved'}", num_classes=3).eval()
    assert again.image_mean == (0.5, 0.5, 0.5) and again.image_std == model.image_std
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(again(x), model(x))
    five = create_model(f"hf:{tmp_path / 'saved'}", num_classes=5)  # another data set: a new head
    assert all(m.training for m in five.modules())  # as built models are (from_pretrained's are not)
    five.eval()
    assert five.config.num_labels == 5 and five(x).shape == (2, 5)
    body = {k: v for k, v in model.state_dict().items() if "classifier" not in k}
    torch.testing.assert_close({k: five.state_dict()[k] for k in body}, body)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("hf:vit-tiyn", "Did you mean hf:vit-tiny"),
        ("hf:./no/such/dir", "neither a directory nor a built-in config"),
        ("hf:", "give hf:<local directory>"),
        ("hf:google/vit-base-patch16-224", "without network access, save it"),
    ],
)
def test_bad_names_get_one_clear_line(name, message, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # as without network, at once
    with pytest.raises(ValueError, match=message) as info:
        create_model(name, num_classes=3)
    assert "\n" not in str(info.value)


def test_unknown_config_fields_and_pretrained_are_refused():
    with pytest.raises(ValueError, match=r"\['num_hidden_layer'\] are not fields of vit's config"):
        create_model("hf:vit-tiny", num_classes=3, num_hidden_layer=1)
    with pytest.raises(ValueError, match="load their own weights"):
        ClassificationModule(model="hf:vit-tiny", num_classes=3, pretrained=True)


def test_nothing_imports_transformers_unless_an_hf_model_is_built(monkeypatch):
    found = [i for i in imports(REPO) if i.imported.split(".")[0] in ("transformers", "huggingface_hub")]
    assert [i for i in found if i.module_level] == []
    assert any(i.importer == "lcv_vision.models.hf" for i in found)  # the checker sees the lazy ones
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    with pytest.raises(ValueError, match=r"pip install 'lightning-compiled-vision\[hf\]'"):
        create_model("hf:vit-tiny", num_classes=3)


# ------------------------------------------------------------------------------------ training, compiled
class _Data(L.LightningDataModule):
    """16 random 16 px images of 3 classes, ImageNet-normalised as the DataModules say they are."""

    mean, std = IMAGENET
    class_names = ["a", "b", "c"]
    num_classes = 3

    def __init__(self, images: int = 16) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.images = torch.randn(images, 3, 16, 16, generator=g)
        self.targets = torch.randint(0, 3, (images,), generator=g)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.images, self.targets), batch_size=4)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.images[:4], self.targets[:4]), batch_size=4)


def _fit(
    module: ClassificationModule,
    strategy: object,
    precision: str = "32-true",
    images: int = 16,
    **kwargs: object,
) -> None:
    trainer = L.Trainer(
        **kwargs,
        strategy=strategy,
        precision=precision,
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=_Data(images))


@pytest.mark.parametrize("name", list(TINY))
def test_trains_compiled_with_no_graph_break_and_the_weights_of_eager(name):
    """4 training steps and a validation, compiled against eager from the same initial weights."""
    torch.manual_seed(0)
    eager = ClassificationModule(
        model=f"hf:{name}",
        num_classes=3,
        model_kwargs=TINY[name],
        lr=0.1,  # SGD: AdamW would scale the rounding noise of zero gradients (ViT's key bias) to full steps
        schedule="constant",
        weight_decay=0.0,
    )
    compiled = copy.deepcopy(eager)
    initial = {k: v.clone() for k, v in eager.state_dict().items()}
    _fit(eager, "auto")
    strategy = CompiledStrategy(backend="aot_eager", compile="always")
    _fit(compiled, strategy)

    stats = strategy.compile_stats
    assert stats.graphs >= 2 and stats.graph_breaks == 0, stats.break_reasons
    assert not stats.fell_back
    # one graph for training; validation's no_grad is the only recompile (none from steps 2-4 or the labels)
    assert all("grad_mode" in r for r in stats.recompile_reasons), stats.recompile_reasons
    assert stats.recompiles <= 1
    assert compiled.model.config.id2label == {0: "a", 1: "b", 2: "c"}  # from the datamodule

    # 4 steps (16 images in batches of 4) of a network whose sums run over its fan-ins and 4*16*16 positions
    length = network_length(eager.model, (4, 3, 16, 16))
    atol, rtol = trajectory_tolerance(torch.float32, length, steps=4)
    got, want = compiled.state_dict(), eager.state_dict()
    assert not any("_orig_mod" in k for k in got)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    moved = max((want[k].float() - initial[k].float()).abs().max().item() for k in want if "hf." in k)
    assert moved > 100 * atol  # the comparison is not vacuous: training changed the weights


def test_bf16_mixed_compiles_with_no_graph_break():
    """Autocast regions are traced too (training only, to keep it short; on the CPU, bf16 weights are not
    compared: eager and compiled round differently, and a tolerance wide enough for that would not see a wrong
    update)."""
    module = ClassificationModule(model="hf:resnet-18", num_classes=3, model_kwargs=TINY["resnet-18"], lr=0.1)
    strategy = CompiledStrategy(backend="aot_eager", compile="always")
    _fit(module, strategy, precision="bf16-mixed", limit_val_batches=0)
    stats = strategy.compile_stats
    assert stats.graphs == 1 and stats.graph_breaks == 0 and not stats.fell_back, stats.break_reasons
    assert stats.recompiles == 0, stats.recompile_reasons
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_vit_trains_under_inductor_with_no_graph_break_and_the_weights_of_float64_eager():
    """Inductor's own CPU code for a tiny ViT (attention, GELU, LayerNorm, forward and backward): 4 steps in
    fp32 against the same 4 steps in float64 eager, within what fp32's rounding allows. No validation: its
    no_grad graph would be a second Inductor compile for no new kind of code."""
    torch.manual_seed(0)
    settings = dict(lr=0.1, schedule="constant", weight_decay=0.0)
    compiled = ClassificationModule(
        model="hf:vit-tiny", num_classes=3, model_kwargs=TINY["vit-tiny"], **settings
    )
    reference = copy.deepcopy(compiled)
    initial = {k: v.clone() for k, v in compiled.state_dict().items()}
    _fit(reference, "auto", precision="64-true", limit_val_batches=0)
    strategy = CompiledStrategy(compile="always")  # inductor, the CPU tuning included
    _fit(compiled, strategy, limit_val_batches=0)

    stats = strategy.compile_stats
    assert stats.graphs == 1 and stats.graph_breaks == 0, stats.break_reasons
    assert not stats.fell_back and stats.recompiles == 0, stats.recompile_reasons
    length = network_length(reference.model, (4, 3, 16, 16))
    tol = trajectory_tolerance(torch.float32, length, steps=4)
    got, want = compiled.state_dict(), reference.state_dict()
    assert all(v.dtype == torch.float64 for v in want.values() if v.is_floating_point())
    for name, value in want.items():
        torch.testing.assert_close(got[name].double(), value, atol=bound(tol, value), rtol=0, msg=name)
    moved = max((want[k] - initial[k].double()).abs().max().item() for k in want if "hf." in k)
    assert moved > 100 * bound(tol, torch.tensor(moved))  # training moved the weights well past the bound


class _StepCosts:
    """A virtual step clock for ``compile="auto"``: a compiled forward costs ``compiled_s``, an eager one
    ``eager_s``, every clock read a millisecond. No real time enters the decision."""

    def __init__(self, eager_s: float, compiled_s: float) -> None:
        self.eager_s, self.compiled_s, self.now = eager_s, compiled_s, 0.0

    def clock(self) -> float:
        self.now += 1e-3
        return self.now

    def eager_forward(self, module: torch.nn.Module, args: object) -> None:
        if not torch.compiler.is_compiling():  # Dynamo drops this branch from the traced graph
            self.now += self.eager_s

    def backend(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        compiled = torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

        def run(*args: object) -> object:
            self.now += self.compiled_s
            return compiled(*args)

        return run


#: ms per training step, eager and compiled, of ``hf_vit_tiny`` and ``hf_convnext_tiny`` in one run of
#: ``benchmarks/strategy_overhead.py`` on a heavily shared 2-core CPU (``strategy_overhead-cpu-hf.json``): one
#: model measured slower compiled, one faster (at light load both were within 6% of eager)
MEASURED_MS = {"vit-tiny": (18676.4, 22485.0), "convnext-tiny": (12081.3, 8460.9)}


@pytest.mark.parametrize(
    ("name", "choice", "line"),
    [("vit-tiny", "eager", "0.83x"), ("convnext-tiny", "compiled", "1.43x")],
)
def test_compile_auto_decides_by_the_measured_step_times(name, choice, line, tmp_path, monkeypatch, caplog):
    """``compile="auto"`` with the benchmark's step times injected: ViT, slower compiled, trains eagerly
    after the measuring steps (and validates eagerly: one graph); ConvNeXt keeps compiling. One line says
    which and why."""
    from lightning_plugin.compile import decision as compile_decision
    from lightning_plugin.kernel_choice.cache import CACHE_DIR_ENV

    eager_ms, compiled_ms = MEASURED_MS[name]
    costs = _StepCosts(eager_ms / 1e3, compiled_ms / 1e3)
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "decisions"))  # no decision from an earlier run
    monkeypatch.setattr(compile_decision, "step_clock", costs.clock)
    caplog.set_level(logging.INFO)
    module = ClassificationModule(model=f"hf:{name}", num_classes=3, model_kwargs=TINY[name], lr=0.1)
    module.model.register_forward_pre_hook(costs.eager_forward)
    strategy = CompiledStrategy(backend=costs.backend)  # compile="auto", the default
    steps = compile_decision.WARMUP_STEPS + 1 + 2 * compile_decision.SAMPLES + 2  # decided, then 2 more
    _fit(module, strategy, images=4 * steps)

    decision = strategy.compile_decision
    assert decision is not None and decision.source == "measured" and decision.choice == choice
    assert decision.speedup == pytest.approx(eager_ms / compiled_ms, rel=1e-3)
    lines = [r.getMessage() for r in caplog.records if "compile='auto'" in r.getMessage()]
    assert len(lines) == 1 and line in lines[0], lines
    assert ("training eagerly" in lines[0]) == (choice == "eager"), lines[0]
    stats = strategy.compile_stats
    assert stats.graph_breaks == 0 and stats.decision == choice
    assert stats.graphs == (1 if choice == "eager" else 2)  # validation compiles only where compiling stays


# ------------------------------------------------------------------------------------------- fused blocks
def test_a_tiny_hf_resnet_has_every_batch_norm_fused_with_its_conv(monkeypatch):
    """Every BatchNorm of HF's ResNet sits in a ResNetConvLayer or ResNetShortCut: all fuse as conv_bn_act,
    and the rewritten model computes what it did (the ops' PyTorch references; the kernels are tested in
    tests/kernels)."""
    from lightning_plugin import KNOWN_KERNELS
    from lightning_plugin.kernel_choice.substitution import apply_substitutions, planned_norms

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = create_model("hf:resnet-18", num_classes=3, **TINY["resnet-18"]).eval()
    eager = copy.deepcopy(model)
    report = apply_substitutions(model, frozenset(KNOWN_KERNELS))
    paths = {r.path for r in report.replacements}
    kinds = sorted({type(m).__name__ for p, m in model.named_modules() if p in paths})
    modes = planned_norms(model)
    bns = [p for p, m in model.named_modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(bns) == 6 and all(modes.get(p) == "conv_bn_act" for p in bns), (modes, report.summary())
    assert kinds == ["ResNetConvLayer", "ResNetShortCut"], report.summary()
    x = torch.randn(2, 3, 16, 16)
    atol, rtol = tolerance("norm", torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), eager(x), atol=atol, rtol=rtol)


# ------------------------------------------------------------------------------------------------- lcv fit
def test_lcv_builds_a_saved_hf_model_for_a_recipe_of_another_architecture(tmp_path):
    """``lcv fit --recipe imagefolder-small --model.model hf:<dir>``: the recipe's airbench ``widths`` and
    whitening layer are left behind (not given on the command line); the head has the folder's classes."""
    pytest.importorskip("jsonargparse", reason="the lcv CLI needs jsonargparse")
    from lcv_vision.cli import LcvCLI
    from lcv_vision.recipes import get_recipe

    photos = write_photo_folder(tmp_path / "photos")
    create_model("hf:resnet-18", num_classes=5, **TINY["resnet-18"]).save_pretrained(tmp_path / "saved")
    recipe = get_recipe("imagefolder-small")
    args = ["--model.model", f"hf:{tmp_path / 'saved'}", "--data.root", str(photos)]
    cli = LcvCLI(recipe, gpu=False, run=False, args=[*args, "--model.lr", "0.02"])
    assert recipe.model_kwargs and recipe.whitening_images  # what must not reach the HF model
    hp = cli.model.hparams
    assert hp.model_kwargs is None and hp.whitening_images == 0 and hp.lr == 0.02
    assert cli.model.model.config.num_labels == len(CLASSES)


def _pretrain_on_photos(model: torch.nn.Module, photo_folder: str, size: int) -> None:
    """Stands in for a hub checkpoint's pretraining: 20 full-batch steps on the folder's training photos,
    resized to ``size`` (PIL-decoded, independently of the recipe's loader), labels 0 and 1 of 10; the
    fine-tune then replaces the head. Random weights would make the fine-tune's accuracy a coin toss."""
    files = image_files(photo_folder, "train")
    pixels = [reference_rgb(f)[None].float() / 255 for f in files]
    images = torch.cat([F.interpolate(p, size=(size, size), mode="bilinear", antialias=True) for p in pixels])
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in IMAGENET)
    targets = torch.tensor([CLASSES.index(f.relative_to(photo_folder).parts[1]) for f in files])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(20):
        loss = F.cross_entropy(model((images - mean) / std), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def test_a_saved_checkpoint_fine_tunes_on_the_photo_folder(photo_folder, tmp_path, monkeypatch):
    """``lcv fit --recipe imagefolder-small --model.model hf:<dir>``, one epoch (5 steps) on the photo folder:
    the run starts from the saved weights (a re-initialised body would be as far from them as they are from
    zero), fine-tuning moves them in training mode, the new head has the folder's 2 named classes, and the
    final weights beat the majority class (3 of the 6 validation photos). Trained eagerly with eager
    augmentation: compiling both is tested elsewhere and would add ~20 s here."""
    pytest.importorskip("jsonargparse", reason="the lcv CLI needs jsonargparse")
    from lcv_vision.cli import run
    from lcv_vision.data.pipeline import Pipeline

    compiled_init = Pipeline.__init__
    monkeypatch.setattr(
        Pipeline, "__init__", lambda self, *args, **kw: compiled_init(self, *args, **{**kw, "compile": False})
    )
    monkeypatch.setattr(sys, "argv", ["lcv"])  # run() is the command line in-process; not pytest's argv
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(1234)  # not the run's seed: its fresh initialisation would differ from these weights
    pretrained = create_model("hf:resnet-18", num_classes=10, **TINY["resnet-18"])
    _pretrain_on_photos(pretrained, photo_folder, size=24)
    pretrained.save_pretrained(tmp_path / "pretrained")
    sizes = ["--data.image_size", "24", "--data.storage_size", "27", "--data.batch_size", "4"]
    cli = run(
        [
            "fit",
            *("--recipe", "imagefolder-small", "--model.model", f"hf:{tmp_path / 'pretrained'}"),
            *("--data.root", photo_folder, *sizes, "--data.num_workers", "0", "--model.lr", "0.05"),
            *(
                "--trainer.max_epochs",
                "1",
                "--trainer.strategy",
                "auto",
                "--trainer.enable_progress_bar",
                "false",
            ),
        ]
    )
    assert cli is not None and cli.trainer.global_step == 5  # 20 photos in batches of 4
    tuned = cli.model.model
    assert tuned.config.num_labels == 2 and tuned.config.id2label == {0: "china", 1: "flower"}
    before, after = pretrained.state_dict(), tuned.state_dict()
    convs = [k for k in before if k.endswith("convolution.weight")]
    assert len(convs) == 6
    for key in convs:
        moved = float((after[key] - before[key]).norm())
        assert 0 < moved < 0.5 * float(before[key].norm()), key
    # trained in training mode (from_pretrained returns an eval-mode model): BatchNorm's statistics moved
    stats = [k for k in before if k.endswith("running_mean")]
    assert stats and all(not torch.equal(after[k], before[k]) for k in stats)
    assert cli.test_results["final"]["test/acc"] > 0.5
