"""A small Vision Transformer whose attention runs through ``F.scaled_dot_product_attention``.

SDPA is PyTorch 2's fused attention (flash / memory-efficient kernels on GPU, a fused CPU
path otherwise), and Inductor keeps it as one op, so the model compiles without breaks.
Pre-norm blocks, a class token and learned position embeddings (Dosovitskiy et al. 2020).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lcv_vision.models._registry import register_model

__all__ = ["VisionTransformer", "vit_tiny_patch4_32", "vit_small_patch4_32", "vit_tiny_patch16_224"]


class Attention(nn.Module):
    """Multi-head self-attention: one fused qkv projection, SDPA, an output projection."""

    def __init__(self, dim: int, num_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv(x).view(n, t, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(out.transpose(1, 2).reshape(n, t, d))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, dropout: float = 0.0) -> None:
        super().__init__()
        hidden = int(dim * mlp_ratio)
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads, dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    """ViT classifier.

    Args:
        num_classes: head size.
        image_size: square input side; must be divisible by ``patch_size``.
        patch_size: side of each patch (a strided conv embeds them).
        dim, depth, num_heads, mlp_ratio: transformer shape.
        in_channels: image channels.
        dropout: attention dropout (training only).
    """

    def __init__(
        self,
        num_classes: int = 1000,
        image_size: int = 224,
        patch_size: int = 16,
        dim: int = 192,
        depth: int = 12,
        num_heads: int = 3,
        mlp_ratio: float = 4.0,
        in_channels: int = 3,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image_size {image_size} is not divisible by patch_size {patch_size}")
        self.image_size = image_size
        self.patch_embed = nn.Conv2d(in_channels, dim, kernel_size=patch_size, stride=patch_size)
        num_patches = (image_size // patch_size) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, num_patches + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, num_heads, mlp_ratio, dropout) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.image_size or x.shape[-2] != self.image_size:
            raise ValueError(
                f"VisionTransformer built for {self.image_size} px input, got {tuple(x.shape[-2:])}"
            )
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1) + self.pos_embed
        return self.norm(self.blocks(x))[:, 0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(x))


@register_model
def vit_tiny_patch4_32(num_classes: int = 10, **kwargs: Any) -> VisionTransformer:
    """Tiny ViT for 32 px images: 64 patches of 4x4, dim 192, depth 6, 3 heads."""
    return VisionTransformer(
        num_classes, **{"image_size": 32, "patch_size": 4, "dim": 192, "depth": 6, "num_heads": 3, **kwargs}
    )


@register_model
def vit_small_patch4_32(num_classes: int = 10, **kwargs: Any) -> VisionTransformer:
    """Small ViT for 32 px images: dim 384, depth 7, 6 heads."""
    return VisionTransformer(
        num_classes, **{"image_size": 32, "patch_size": 4, "dim": 384, "depth": 7, "num_heads": 6, **kwargs}
    )


@register_model
def vit_tiny_patch16_224(num_classes: int = 1000, **kwargs: Any) -> VisionTransformer:
    """ViT-Ti/16 at 224 px (dim 192, depth 12, 3 heads)."""
    return VisionTransformer(
        num_classes,
        **{"image_size": 224, "patch_size": 16, "dim": 192, "depth": 12, "num_heads": 3, **kwargs},
    )
