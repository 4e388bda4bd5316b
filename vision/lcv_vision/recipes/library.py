"""The built-in recipes. Each value carries its source; mean-loss equivalents are derived in comments.

airbench's published hyperparameters are for a *summed* loss at batch 1024 with Nesterov momentum
0.85, where lr 11.5 and weight decay 0.0153 are divided by ``1024 * (1 + 1 / (1 - 0.85))``.
airbench hands PyTorch ``weight_decay = wd / lr`` with ``wd = 0.0153 * 1024 / kilostep``, so every step
decays the weights by ``lr * weight_decay = 0.0153 / 7.667``. For our mean-reduced loss the gradient is
1024x smaller, so lr = 11.5 / 7.667 = 1.5, and the same per-step decay needs wd = 0.0153 / 11.5 = 1.33e-3.
"""

from __future__ import annotations

from lcv_vision.recipes._recipe import AugmentConfig, OptimConfig, Recipe
from lcv_vision.recipes._registry import register_recipe

_AIRBENCH_MOMENTUM = 0.85
_AIRBENCH_KILOSTEP = 1 + 1 / (1 - _AIRBENCH_MOMENTUM)


def _small_airbench_optim() -> OptimConfig:
    """The optimiser of the small CPU recipes (``digits-small``, tuned on CPU, and ``imagefolder-small``,
    which takes it over): one definition, so a retune of one carries to the other. A new object per recipe."""
    return OptimConfig(
        optimizer="sgd",
        lr=0.2,
        momentum=0.9,
        nesterov=True,
        weight_decay=5e-4,
        bias_lr_scale=4.0,
        schedule="triangle",
        warmup_fraction=0.2,
        warmup_start_factor=0.2,
        final_lr_factor=0.05,
    )


register_recipe(
    Recipe(
        name="cifar10-airbench",
        description="airbench94 network and schedule: aims at 94% CIFAR-10 test accuracy in 10 epochs",
        model="airbench94",
        dataset="cifar10",
        augment=AugmentConfig(crop_padding=2, padding_mode="reflect", flip="alternating"),
        optim=OptimConfig(
            optimizer="sgd",
            lr=11.5 / _AIRBENCH_KILOSTEP,
            momentum=_AIRBENCH_MOMENTUM,
            nesterov=True,
            weight_decay=0.0153 / 11.5,  # lr * wd = 0.0153 / kilostep, as airbench's SGD
            bias_lr_scale=64.0,
            schedule="triangle",
            warmup_fraction=0.23,
            warmup_start_factor=0.2,
            final_lr_factor=0.07,
        ),
        epochs=10,
        batch_size=1024,
        precision="bf16-mixed",
        label_smoothing=0.2,
        lookahead=True,
        ema_every_n_steps=5,
        tta="flip_translate",
        whitening_images=5000,
        whitening_bias_epochs=3,
        compile={"channels_last": True, "mode": "max-autotune-no-cudagraphs"},
        reference="airbench94 (arXiv 2404.00498; KellerJordan/cifar10-airbench legacy/airbench94.py)",
    )
)

register_recipe(
    Recipe(
        name="cifar10-resnet18",
        description=(
            "ResNet-18 (CIFAR stem), Nesterov SGD, triangular schedule, cutout, label smoothing, flip TTA"
        ),
        model="cifar_resnet18",
        dataset="cifar10",
        augment=AugmentConfig(crop_padding=4, padding_mode="reflect", flip="random", cutout=8),
        optim=OptimConfig(
            optimizer="sgd",
            lr=0.4,  # 0.1 per 128 images, scaled linearly to batch 512
            momentum=0.9,
            nesterov=True,
            weight_decay=5e-4,
            norm_weight_decay=0.0,
            schedule="triangle",
            warmup_fraction=0.2,
            warmup_start_factor=0.05,
            final_lr_factor=0.0,
        ),
        epochs=30,
        batch_size=512,
        precision="bf16-mixed",
        label_smoothing=0.1,
        tta="flip",
        compile={"channels_last": True},
        reference=(
            "FFCV CIFAR-10 example (triangular lr, label smoothing 0.1, flip TTA), widths of He et al. 2015"
        ),
    )
)

register_recipe(
    Recipe(
        name="imagefolder-resnet50",
        description=(
            "torchvision's ResNet-50 reference recipe knobs (IMAGENET1K_V2, 80.858%) on any ImageFolder"
        ),
        model="resnet50",
        dataset="imagefolder",
        # FixRes: train crops of 176, evaluate the centre 224 of images stored at 232 (torchvision's val
        # resize)
        data_kwargs={"image_size": 176, "storage_size": 232, "eval_image_size": 224},
        augment=AugmentConfig(
            rrc_scale=(0.08, 1.0),
            flip="random",
            trivial_augment=True,
            random_erase=0.1,
            mixup_alpha=0.2,
            cutmix_alpha=1.0,
        ),
        optim=OptimConfig(
            optimizer="sgd",
            lr=0.5 * 128 / 1024,  # torchvision: 0.5 for 8 GPUs x 128; this is one device's 128 (8 GPUs: 0.5)
            momentum=0.9,
            nesterov=False,
            weight_decay=2e-5,
            norm_weight_decay=0.0,
            schedule="cosine",
            warmup_fraction=5 / 600,
            warmup_start_factor=0.01,
            final_lr_factor=0.0,
        ),
        epochs=600,
        batch_size=128,
        precision="bf16-mixed",
        label_smoothing=0.1,
        # torchvision: decay 0.99998 every 32 steps, its alpha scaled by (devices x batch x 32 / epochs); for
        # one device of 128 that is 1 - 2e-5 * 128 * 32 / 600 = 0.999863 (8 devices: 0.99891)
        ema_decay=1 - 2e-5 * 128 * 32 / 600,
        ema_every_n_steps=32,
        compile={"channels_last": True},
        reference="pytorch.org/blog/how-to-train-state-of-the-art-models-using-torchvision-latest-primitives",
    )
)

register_recipe(
    Recipe(
        name="digits-small",
        description=(
            "small airbench-style net on the bundled sklearn digits (offline): >= 97% test in ~1 min on CPU"
        ),
        model="airbench94",
        model_kwargs={"widths": [32, 64, 64]},
        dataset="digits",
        # Full batches only: the last, smaller one (41 images, shuffled anew each epoch) would cost the
        # compiled strategy a second compile of the training graph, longer than all of this recipe's training.
        data_kwargs={"drop_last": True},
        augment=AugmentConfig(crop_padding=2, padding_mode="constant", flip="none"),
        optim=_small_airbench_optim(),
        epochs=12,
        batch_size=64,
        precision="bf16-mixed",
        label_smoothing=0.1,
        ema_decay=0.9,
        ema_every_n_steps=1,
        whitening_images=1000,
        compile={"channels_last": True},
        reference="this project (tuned on CPU for `make run`)",
    )
)

register_recipe(
    Recipe(
        name="cifar10-vit",
        description=(
            "tiny ViT (patch 4, SDPA attention) on CIFAR-10 with AdamW, strong augmentation and mixup/cutmix"
        ),
        model="vit_tiny_patch4_32",
        dataset="cifar10",
        augment=AugmentConfig(
            crop_padding=4,
            flip="random",
            trivial_augment=True,
            mixup_alpha=0.8,
            cutmix_alpha=1.0,
            random_erase=0.25,
        ),
        optim=OptimConfig(
            optimizer="adamw",
            lr=1e-3,
            momentum=0.9,
            weight_decay=0.05,
            norm_weight_decay=0.0,
            schedule="cosine",
            warmup_fraction=0.05,
            warmup_start_factor=0.01,
            final_lr_factor=0.01,
        ),
        epochs=100,
        batch_size=512,
        precision="bf16-mixed",
        label_smoothing=0.1,
        ema_decay=0.999,
        tta="flip",
        compile={"channels_last": False},
        reference=(
            "DeiT training knobs (AdamW 1e-3 per 512, wd 0.05, mixup 0.8 / cutmix 1.0), scaled to 32 px"
        ),
    )
)

register_recipe(
    Recipe(
        name="imagefolder-small",
        description="small airbench-style net for ImageFolder sets of a few hundred photos: minutes on a CPU",
        model="airbench94",
        model_kwargs={"widths": [32, 64, 128]},
        dataset="imagefolder",
        # 64 px crops of 72 px squares: small enough for a CPU, large enough for photos of objects
        data_kwargs={"image_size": 64, "storage_size": 72},
        augment=AugmentConfig(rrc_scale=(0.35, 1.0), flip="random"),
        optim=_small_airbench_optim(),
        epochs=24,
        batch_size=32,
        precision="bf16-mixed",
        label_smoothing=0.1,
        ema_decay=0.98,
        ema_every_n_steps=1,
        whitening_images=256,
        compile={"channels_last": True},
        reference=(
            "this project (digits-small's settings at 64 px; measured on CIFAR-10 JPEG subsets, see README)"
        ),
    )
)
