"""``cifar10-airbench`` trains exactly as airbench's published ``train`` loop (PyPI ``airbench`` 0.1.8).

Both sides start from the same network weights and see the same batches in the same order for 4 epochs of
3 steps (the last lookahead update, at step 10, falls in the epoch where the whitening bias is frozen; the
final reset drops steps 11-12 on both sides): that covers the lr/weight-decay conversion from airbench's
summed loss, the BN-bias lr scale, the triangular schedule, label smoothing, the whitening-bias freeze after 3
epochs and the lookahead (every 5 steps, and the final reset). Augmentation is left out (checked against
airbench's crops elsewhere); the network is airbench94 at small widths.
"""

from __future__ import annotations

import copy
import os

import lightning.pytorch as pl
import pytest
import torch

from lcv_kernels.tolerances import bound, network_length, trajectory_tolerance
from script_loader import load_script

pytest.importorskip("airbench", reason="airbench is in the dev extra: pip install -e '.[dev]'")

import airbench.utils as airbench_utils  # noqa: E402
from airbench.lib_airbench94 import make_net94  # noqa: E402

from lcv_vision.recipes import build_module  # noqa: E402

BATCH, STEPS_PER_EPOCH, EPOCHS = 64, 3, 4
WIDTHS = {"block1": 16, "block2": 32, "block3": 32}


def _airbench_on_cpu():
    return load_script("benchmarks/airbench_reference.py").airbench_on_cpu()


class _FixedBatches:
    """The part of airbench's ``CifarLoader`` its ``train`` loop uses, yielding the same batches every
    epoch."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.batches = batches
        self.batch_size = batches[0][0].shape[0]
        self.images = torch.cat([x for x, _ in batches])
        self.epoch = 0

    def normalize(self, images: torch.Tensor) -> torch.Tensor:  # the batches are already normalised
        return images

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        self.epoch += 1
        return iter(self.batches)


def test_recipe_trains_like_airbench_train_loop(tmp_path, monkeypatch):
    torch.manual_seed(0)
    batches = [
        (torch.randn(BATCH, 3, 32, 32), torch.randint(0, 10, (BATCH,))) for _ in range(STEPS_PER_EPOCH)
    ]
    monkeypatch.chdir(tmp_path)  # airbench's train() opens its test set at ./cifar10/test.pt
    os.makedirs("cifar10")
    torch.save(
        {
            "images": torch.zeros(4, 32, 32, 3, dtype=torch.uint8),
            "labels": torch.zeros(4, dtype=torch.long),
            "classes": [str(i) for i in range(10)],
        },
        "cifar10/test.pt",
    )

    with _airbench_on_cpu():
        net = make_net94(widths=WIDTHS)
        # train() sets the whitening filters again (same images, same values) after taking its lookahead copy;
        # set them first too, so that copy holds them as ours does (on real runs the difference fades in 5
        # steps)
        airbench_utils.init_whitening_conv(net[0], torch.cat([x for x, _ in batches]))
        start = copy.deepcopy(net)
        reference = airbench_utils.train(
            _FixedBatches(batches),
            epochs=EPOCHS,
            label_smoothing=0.2,
            learning_rate=11.5,
            bias_scaler=64.0,
            momentum=0.85,
            weight_decay=0.0153,
            whiten_bias_epochs=3,
            tta_level=0,
            make_net=lambda: net,
            run=0,
            verbose=False,
        )

    # Ours: the recipe's settings; its lr is "per 1024 examples" of a mean loss, so it scales with the batch.
    module = build_module(
        "cifar10-airbench",
        num_classes=10,
        whitening_images=0,
        channels_last=False,
        model_kwargs={"widths": list(WIDTHS.values())},
        lr=11.5 / (1 + 1 / 0.15) * BATCH / 1024,
    )
    ours_keys = list(module.model.state_dict())
    start_state = dict(zip(ours_keys, start.state_dict().values(), strict=True))
    module.model.load_state_dict(start_state)
    module.ema.module.load_state_dict(start_state)
    trainer = pl.Trainer(
        max_epochs=EPOCHS,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    assert trainer.global_step == EPOCHS * STEPS_PER_EPOCH

    want = dict(zip(ours_keys, reference.state_dict().values(), strict=True))
    got = module.model.state_dict()
    assert not torch.equal(want["whiten.bias"], start_state["whiten.bias"])  # both really trained
    # another implementation of the same steps: each sums the batch in another order (summed loss against
    # mean loss), and the 12 steps carry those errors
    steps = EPOCHS * STEPS_PER_EPOCH
    tol = trajectory_tolerance(torch.float32, network_length(reference, (BATCH, 3, 32, 32)), steps)
    for name, value in want.items():
        if value.is_floating_point():
            torch.testing.assert_close(got[name], value, atol=bound(tol, value), rtol=0, msg=name)
