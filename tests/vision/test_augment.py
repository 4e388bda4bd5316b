"""The recipe-level batch ops (alternating flip, TrivialAugmentWide) and the AugmentConfig -> Pipeline
mapping."""

from __future__ import annotations

import pytest
import torch
import torchvision.transforms.v2 as T

from lcv_vision.data.color import ColorJitter, Normalize
from lcv_vision.data.erasing import CoarseDropout, Erasing
from lcv_vision.data.geometry import HorizontalFlip, RandomCrop, RandomResizedCrop
from lcv_vision.data.mixing import MixupCutmix
from lcv_vision.data.trivial_augment import TRIVIAL_AUGMENT_OPS
from lcv_vision.recipes import (
    AlternatingFlipCrop,
    AugmentConfig,
    TrivialAugmentWide,
    build_train_pipeline,
    get_recipe,
)


def _store(n: int = 16) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randint(0, 256, (n, 3, 6, 6), dtype=torch.uint8)


def test_alternating_flip_flips_each_image_in_exactly_one_of_two_epochs():
    store = _store()
    epoch = {"e": 0}
    op = AlternatingFlipCrop(None, padding=0, epoch=lambda: epoch["e"], seed=3)
    index = torch.tensor([5, 0, 9, 3, 12])
    seen = {}
    for e in range(4):
        epoch["e"] = e
        params = op.sample(len(index), 6, 6, torch.Generator().manual_seed(e))
        out = op.apply(store, params, index=index)
        flipped = torch.tensor([torch.equal(out[j], store[i].flip(-1)) for j, i in enumerate(index.tolist())])
        same = torch.tensor([torch.equal(out[j], store[i]) for j, i in enumerate(index.tolist())])
        assert bool((flipped | same).all())
        seen[e] = flipped
    assert torch.equal(seen[0], ~seen[1]) and torch.equal(seen[0], seen[2]) and torch.equal(seen[1], seen[3])
    bits = op.image_bits(len(store))
    assert torch.equal(seen[0], bits[index])  # epoch 0 flips the images whose fixed bit is set
    assert 0 < int(bits.sum()) < len(store)


def test_alternating_flip_translates_like_random_crop_and_falls_back_with_a_warning():
    store = _store(8)
    op = AlternatingFlipCrop(None, padding=2, padding_mode="reflect", epoch=lambda: 1)
    crop = RandomCrop(None, padding=2, padding_mode="reflect")
    g = torch.Generator().manual_seed(0)
    params = op.sample(8, 6, 6, g)
    index = torch.arange(8)
    flips = op.image_bits(8) ^ True
    expected = crop.apply(store, {"top": params["top"], "left": params["left"], "flip": flips}, index=index)
    assert torch.equal(op.apply(store, params, index=index), expected)
    with pytest.warns(UserWarning, match="independent random flips"):
        out = op.apply(store, params)
    expected = crop.apply(
        store, {"top": params["top"], "left": params["left"], "flip": params["random_flip"]}
    )
    assert torch.equal(out, expected)


def _torchvision_draws(seed: int) -> tuple[int, int, bool]:
    """Replay the random draws of torchvision's TrivialAugmentWide.forward for one image."""
    torch.manual_seed(seed)
    op = int(torch.randint(len(TRIVIAL_AUGMENT_OPS), ()))
    name = list(TRIVIAL_AUGMENT_OPS)[op]
    magnitudes, signed = TRIVIAL_AUGMENT_OPS[name]
    b, negate = 0, False
    if magnitudes is not None:
        b = int(torch.randint(31, ()))
        negate = bool(signed and torch.rand(()) <= 0.5)
    return op, b, negate


def test_trivial_augment_matches_torchvision_given_the_same_draws():
    torch.manual_seed(1)
    images = torch.randint(0, 256, (60, 3, 12, 12), dtype=torch.uint8)
    reference = T.TrivialAugmentWide()
    expected, draws = [], []
    for i in range(len(images)):
        torch.manual_seed(100 + i)
        expected.append(reference(images[i]))
        draws.append(_torchvision_draws(100 + i))
    params = {
        "op": torch.tensor([d[0] for d in draws]),
        "bin": torch.tensor([d[1] for d in draws]),
        "negate": torch.tensor([d[2] for d in draws]),
    }
    assert len(set(params["op"].tolist())) >= 10  # most ops are exercised
    out = TrivialAugmentWide().apply(images, params)
    assert torch.equal(out, torch.stack(expected))


def test_trivial_augment_draws_per_sample_and_accepts_float_input():
    op = TrivialAugmentWide()
    params = op.sample(4000, 8, 8, torch.Generator().manual_seed(0))
    counts = torch.bincount(params["op"], minlength=14).float()
    assert counts.min() > 0.7 * 4000 / 14 and counts.max() < 1.3 * 4000 / 14
    assert 0.45 < params["negate"].float().mean() < 0.55
    images = torch.rand(3, 3, 8, 8) * 255
    ident = {
        "op": torch.zeros(3, dtype=torch.long),
        "bin": torch.zeros(3, dtype=torch.long),
        "negate": torch.zeros(3, dtype=torch.bool),
    }
    assert torch.equal(op.apply(images, ident), images.round().to(torch.uint8))


def _types(pipeline) -> list[type]:
    return [type(op) for op in pipeline.ops]


def _pipeline(recipe: str, num_classes: int = 10):
    return build_train_pipeline(
        get_recipe(recipe).augment, mean=(0.5,) * 3, std=(0.25,) * 3, image_size=32, num_classes=num_classes
    )


def test_recipe_pipelines_have_the_recipe_ops_in_order():
    assert _types(_pipeline("cifar10-airbench")) == [AlternatingFlipCrop, Normalize]
    assert _types(_pipeline("cifar10-resnet18")) == [RandomCrop, HorizontalFlip, Normalize, CoarseDropout]
    assert _types(_pipeline("digits-small")) == [RandomCrop, Normalize]
    assert _types(_pipeline("imagefolder-resnet50", 5)) == [
        RandomResizedCrop,
        HorizontalFlip,
        TrivialAugmentWide,
        Normalize,
        Erasing,
        MixupCutmix,
    ]
    assert _types(_pipeline("cifar10-vit")) == [
        RandomCrop,
        HorizontalFlip,
        TrivialAugmentWide,
        Normalize,
        Erasing,
        MixupCutmix,
    ]
    jitter = build_train_pipeline(
        AugmentConfig(color_jitter=0.4, flip="none"),
        mean=(0.5,) * 3,
        std=(0.5,) * 3,
        image_size=32,
        num_classes=10,
    )
    assert _types(jitter) == [ColorJitter, Normalize]


def test_pipeline_outputs_and_settings():
    pipe = _pipeline("cifar10-resnet18")
    crop, _, norm, cutout = pipe.ops
    assert crop.padding == (4, 4, 4, 4) and crop.padding_mode == "reflect"
    assert cutout.hole_height_range == (8.0, 8.0) and cutout.p == 1.0
    images = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8)
    x, y = pipe(images, torch.arange(4), torch.Generator().manual_seed(0))
    assert x.shape == (4, 3, 32, 32) and x.dtype == torch.float32
    assert int((x == 0).all(dim=1).flatten(1).sum(1).min()) >= 64  # an 8x8 hole of zeros per image
    mix = _pipeline("cifar10-vit").ops[-1]
    assert (mix.mixup_alpha, mix.cutmix_alpha, mix.label_smoothing) == (
        0.8,
        1.0,
        0.0,
    )  # smoothing is in the loss
    with pytest.raises(ValueError, match="alternating"):
        build_train_pipeline(
            AugmentConfig(rrc_scale=(0.5, 1.0), flip="alternating"),
            mean=(0.5,),
            std=(0.5,),
            image_size=8,
            num_classes=2,
        )
