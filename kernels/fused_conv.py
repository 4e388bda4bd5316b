"""``FusedConvBNAct``: a drop-in for Conv2d → BatchNorm2d → activation (→ + residual → activation).

It *shares* the original ``nn.Conv2d`` and ``nn.BatchNorm2d`` (kept as ``.conv`` and ``.bn``), so parameters,
buffers and optimizer state are the same tensors as before the swap; only the state_dict prefix changes if
the caller re-parents them (``conv.weight`` stays ``<name>.conv.weight`` here).

* Eval mode (running stats in use): BatchNorm is folded into the conv epilogue as per-channel
  ``scale = γ / sqrt(running_var + eps)`` and ``shift = β - running_mean * scale``, with the residual and
  activation also in the epilogue: one kernel, one output write.
* Training mode: the conv's stats epilogue returns ``Σz`` and ``Σz²``; mean and biased variance follow,
  running stats are updated exactly as ``nn.BatchNorm2d`` does (momentum or cumulative average when
  ``momentum=None``, unbiased variance), then one elementwise pass applies ``z * a + b (+ residual)`` and
  the activation. That pass is plain PyTorch, which Inductor fuses into one kernel under ``torch.compile``.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels._common import ACTIVATIONS, apply_activation
from kernels.conv_ops import conv2d_fused
from kernels.conv_reference import batch_stats_from_sums, pair

__all__ = ["FusedConvBNAct", "activation_name"]


def activation_name(act: nn.Module | None) -> str:
    """Map an activation module to the epilogue's name; raise for anything the epilogue cannot do."""
    if act is None or isinstance(act, nn.Identity):
        return "none"
    if isinstance(act, nn.ReLU):
        return "relu"
    if isinstance(act, nn.SiLU):
        return "silu"
    if isinstance(act, nn.GELU):
        if act.approximate != "none":
            raise ValueError(
                f"GELU(approximate={act.approximate!r}) is not supported; only the exact erf form"
            )
        return "gelu"
    raise ValueError(
        f"unsupported activation module {type(act).__name__}; supported: ReLU, GELU, SiLU, Identity, None"
    )


class FusedConvBNAct(nn.Module):
    """Conv2d (+ BatchNorm2d) (+ residual add) (+ activation) on channels_last tensors, using ``lcv::conv2d_fused``.

    ``forward(x, residual=None)`` computes ``act(bn(conv(x)) + residual)``, the order of a ResNet block's tail.
    Inputs that are not channels_last are converted; the output is channels_last.
    """

    def __init__(self, conv: nn.Conv2d, bn: nn.BatchNorm2d | None = None, activation: str = "none") -> None:
        super().__init__()
        if not isinstance(conv, nn.Conv2d):
            raise TypeError(f"conv must be an nn.Conv2d, got {type(conv).__name__}")
        if conv.padding_mode != "zeros":
            raise ValueError(f"conv padding_mode={conv.padding_mode!r} is not supported; only 'zeros'")
        if isinstance(conv.padding, str) and conv.padding != "valid":
            raise ValueError(f"conv padding={conv.padding!r} is not supported; use explicit integer padding")
        if bn is not None:
            if not isinstance(bn, nn.BatchNorm2d):
                raise TypeError(f"bn must be an nn.BatchNorm2d or None, got {type(bn).__name__}")
            if bn.num_features != conv.out_channels:
                raise ValueError(
                    f"bn has {bn.num_features} features but conv has {conv.out_channels} output channels"
                )
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")
        self.conv = conv
        self.bn = bn
        self.activation = activation

    @classmethod
    def from_modules(
        cls, conv: nn.Conv2d, bn: nn.BatchNorm2d | None = None, act: nn.Module | None = None
    ) -> FusedConvBNAct:
        """Wrap existing modules, sharing (not copying) their parameters and buffers."""
        return cls(conv, bn, activation_name(act))

    @classmethod
    def why_not_fusable(
        cls, conv: nn.Module, bn: nn.Module | None = None, act: nn.Module | None = None
    ) -> str | None:
        """``None`` if ``from_modules(conv, bn, act)`` would succeed, else the reason it would raise.

        Lets a model-rewriting pass skip a chain (and log why) instead of catching exceptions itself.
        """
        try:
            cls.from_modules(conv, bn, act)  # type: ignore[arg-type]
        except (TypeError, ValueError) as err:
            return str(err)
        return None

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"

    def _conv_args(self) -> dict:
        conv = self.conv
        padding = 0 if conv.padding == "valid" else pair(tuple(conv.padding), "padding")
        return {
            "stride": tuple(conv.stride),
            "padding": padding,
            "dilation": tuple(conv.dilation),
            "groups": conv.groups,
        }

    def _uses_batch_stats(self) -> bool:
        bn = self.bn
        return bn is not None and (self.training or (bn.running_mean is None and bn.running_var is None))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        x = x.contiguous(memory_format=torch.channels_last)
        conv, bn = self.conv, self.bn
        if bn is None or not self._uses_batch_stats():
            scale = shift = None
            if bn is not None:  # eval: fold running stats into the epilogue
                scale = torch.rsqrt(bn.running_var + bn.eps)
                shift = -bn.running_mean * scale
                if bn.weight is not None:
                    scale = scale * bn.weight
                    shift = shift * bn.weight
                if bn.bias is not None:
                    shift = shift + bn.bias
            return conv2d_fused(
                x,
                conv.weight,
                conv.bias,
                scale=scale,
                shift=shift,
                residual=residual,
                activation=self.activation,
                **self._conv_args(),
            )
        return self._forward_batch_stats(x, residual)

    def _forward_batch_stats(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        conv, bn = self.conv, self.bn
        z, sums, sumsq = conv2d_fused(x, conv.weight, conv.bias, stats=True, **self._conv_args())
        count = z.shape[0] * z.shape[2] * z.shape[3]
        if count <= 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got input size {tuple(z.shape)}"
            )
        mean, var = batch_stats_from_sums(sums, sumsq, count)
        if self.training and bn.track_running_stats:
            self._update_running_stats(mean, var, count)
        a = torch.rsqrt(var + bn.eps)
        if bn.weight is not None:
            a = a * bn.weight.float()
        b = -mean * a
        if bn.bias is not None:
            b = b + bn.bias.float()
        u = z.float() * a.view(1, -1, 1, 1) + b.view(1, -1, 1, 1)
        if residual is not None:
            u = u + residual.float()
        return apply_activation(u, self.activation).to(z.dtype)  # z: autocast dtype if enabled

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, count: int) -> None:
        """The same update nn.BatchNorm2d makes: EMA with ``momentum`` or cumulative mean if it is None."""
        bn = self.bn
        if bn.num_batches_tracked is not None:
            bn.num_batches_tracked.add_(1)
        if bn.momentum is None:
            factor = 1.0 / bn.num_batches_tracked.to(torch.float32)
        else:
            factor = bn.momentum
        unbiased = var * (count / (count - 1))
        bn.running_mean.mul_(1 - factor).add_(mean.to(bn.running_mean.dtype) * factor)
        bn.running_var.mul_(1 - factor).add_(unbiased.to(bn.running_var.dtype) * factor)
