"""Tiny LightningModules and data for the strategy tests (user-defined modules, so dynamo traces them)."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

TRAINER_KWARGS = dict(
    accelerator="cpu",
    devices=1,
    max_epochs=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
)


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x))) + x


class TinyNet(nn.Module):
    def __init__(self, channels: int = 4, num_classes: int = 3, blocks: int = 2) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.Sequential(*[ConvBlock(channels) for _ in range(blocks)])
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.stem(x)))
        return self.head(x.mean(dim=(2, 3)))


class TinyModule(L.LightningModule):
    """Logs in every step, the way real modules do."""

    def __init__(self, lr: float = 0.1, channels: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = TinyNet(channels)
        self.train_losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss, prog_bar=True)
        self.train_losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.cross_entropy(self(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test/loss", F.cross_entropy(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def make_loader(n: int = 20, batch_size: int = 8, seed: int = 0, size: int = 8) -> DataLoader:
    """Fixed random data; n=20 with batch 8 leaves a smaller last batch (4) on purpose."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, size, size, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def params_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class LinearModule(L.LightningModule):
    """The smallest module worth compiling (for tests that fit under many strategies)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.layer(x)) * 2

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def make_vector_loader(n: int = 16, batch_size: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)),
        batch_size=batch_size,
    )
