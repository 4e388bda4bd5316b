"""Normalization modules with a fused activation (and optional residual add), drop-ins for norm → act.

``FusedBatchNormAct``, ``FusedGroupNormAct`` and ``FusedLayerNorm2dAct`` subclass ``nn.BatchNorm2d``,
``nn.GroupNorm`` and ``nn.LayerNorm``, so parameter names, buffers and state_dict keys are those of the
module they replace; ``from_module`` shares (does not copy) the original's parameters and buffers.
Each computes ``act(norm(x) + residual)`` with one ``lcv::`` op, forward and backward.

The ``*_module_forward`` functions do the same for a *plain* torch module (``nn.BatchNorm2d`` …) and
:func:`conv_bn_act` for a plain ``nn.Conv2d`` + ``nn.BatchNorm2d`` pair: the model rewriting in
``lightning_plugin.substitution`` calls them from patched block forwards, so the model keeps its modules
(and checkpoint keys) while running the fused ops.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kernels._common import ACTIVATIONS, apply_activation
from kernels.conv_ops import conv2d_fused
from kernels.norm_ops import batch_norm_act, dense_layout, group_norm_act, layer_norm2d_act

__all__ = [
    "FusedBatchNormAct",
    "FusedGroupNormAct",
    "FusedLayerNorm2dAct",
    "activation_name",
    "batch_norm_module_forward",
    "conv_bn_act",
    "conv_padding",
    "group_norm_module_forward",
    "layer_norm2d_module_forward",
    "why_conv_bn_not_fusable",
]

_ACT_MODULES: dict[type[nn.Module], str] = {
    nn.ReLU: "relu",
    nn.GELU: "gelu",
    nn.SiLU: "silu",
    nn.Identity: "none",
}


def activation_name(module: nn.Module | None) -> str | None:
    """Our activation name for an activation module (``None`` → ``"none"``), or None if it cannot be fused
    (an unknown module, or the tanh-approximate GELU)."""
    if module is None:
        return "none"
    if type(module) is nn.GELU and module.approximate != "none":
        return None
    return _ACT_MODULES.get(type(module))


def _checked_activation(act: nn.Module | None) -> str:
    name = activation_name(act)
    if name is None:
        supported = ", ".join(sorted(cls.__name__ for cls in _ACT_MODULES))
        raise ValueError(
            f"activation {type(act).__name__} cannot be fused; "
            f"supported: {supported} (GELU only exact) or None"
        )
    return name


def _dense(t: torch.Tensor) -> torch.Tensor:
    """Modules accept any strides, like their torch counterparts; the ops need NCHW or channels_last."""
    return t if dense_layout(t) is not None else t.contiguous()


def _residual_like(residual: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    if residual is None or dense_layout(residual) is not None:
        return residual
    return residual.contiguous(memory_format=dense_layout(x) or torch.contiguous_format)


def _fuse_residual(
    run: Callable[[str, torch.Tensor | None], torch.Tensor],
    out_dtype: torch.dtype,
    activation: str,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    """``run(activation, residual)`` when the residual has the output's dtype (the fused path); otherwise
    add it afterwards, so eager type promotion (e.g. a bf16 norm output + an fp32 residual) is kept."""
    if residual is None or residual.dtype == out_dtype:
        return run(activation, residual)
    return apply_activation(run("none", None) + residual, activation)


def _autocast_fp32(x: torch.Tensor) -> bool:
    """CUDA autocast computes group/layer norm in fp32 (the fused ops follow it)."""
    return x.is_cuda and torch.is_autocast_enabled("cuda")


def _share_state(src: nn.Module, cls: type[nn.Module], activation: str) -> nn.Module:
    """A ``cls`` instance that *is* ``src`` in state: same attributes, parameter and buffer dicts."""
    fused = cls.__new__(cls)
    nn.Module.__init__(fused)
    fused.__dict__.update(
        {k: v for k, v in src.__dict__.items() if k not in ("_parameters", "_buffers", "_modules")}
    )
    fused._parameters = src._parameters
    fused._buffers = src._buffers
    fused._modules = dict(src._modules)
    fused.activation = activation
    return fused


# ---------------------------------------------------------------------------------------------------------
# Functional forms over plain torch modules


def batch_norm_module_forward(
    bn: nn.BatchNorm2d,
    x: torch.Tensor,
    activation: str = "none",
    residual: torch.Tensor | None = None,
    sums: torch.Tensor | None = None,
    sumsq: torch.Tensor | None = None,
) -> torch.Tensor:
    """``act(bn(x) + residual)`` with ``lcv::batch_norm_act``, with ``nn.BatchNorm2d.forward``'s semantics:
    ``num_batches_tracked`` incremented, ``momentum=None`` meaning a cumulative average, running stats used
    in eval unless absent. ``sums``/``sumsq`` are the conv epilogue's statistics of ``x``, if any."""
    if x.dim() != 4:
        raise ValueError(f"expected 4D input (got {x.dim()}D input)")
    momentum: float | torch.Tensor = 0.0 if bn.momentum is None else bn.momentum
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        if bn.momentum is None:
            momentum = 1.0 / bn.num_batches_tracked  # a tensor: no host sync, no graph break
    use_batch = bn.training or (bn.running_mean is None and bn.running_var is None)
    track = not bn.training or bn.track_running_stats
    x = _dense(x)

    def run(act: str, res: torch.Tensor | None) -> torch.Tensor:
        return batch_norm_act(
            x,
            bn.running_mean if track else None,
            bn.running_var if track else None,
            bn.weight,
            bn.bias,
            use_batch,
            momentum,
            bn.eps,
            activation=act,
            residual=_residual_like(res, x),
            sums=sums,
            sumsq=sumsq,
        )

    return _fuse_residual(run, x.dtype, activation, residual)


def group_norm_module_forward(
    gn: nn.GroupNorm, x: torch.Tensor, activation: str = "none", residual: torch.Tensor | None = None
) -> torch.Tensor:
    """``act(gn(x) + residual)`` with ``lcv::group_norm_act`` (4-D inputs)."""
    x = _dense(x)

    def run(act: str, res: torch.Tensor | None) -> torch.Tensor:
        return group_norm_act(
            x, gn.num_groups, gn.weight, gn.bias, gn.eps, activation=act, residual=_residual_like(res, x)
        )

    return _fuse_residual(run, torch.float32 if _autocast_fp32(x) else x.dtype, activation, residual)


def layer_norm2d_module_forward(
    ln: nn.LayerNorm, x: torch.Tensor, activation: str = "none", residual: torch.Tensor | None = None
) -> torch.Tensor:
    """``act(LayerNorm2d(x) + residual)`` (LayerNorm over the channels of NCHW ``x``) with
    ``lcv::layer_norm2d_act``."""
    if tuple(ln.normalized_shape) != (x.shape[1],):
        raise ValueError(
            f"LayerNorm2d normalizes the {x.shape[1]} channels of x, but the module's normalized_shape is "
            f"{tuple(ln.normalized_shape)}"
        )
    x = _dense(x)

    def run(act: str, res: torch.Tensor | None) -> torch.Tensor:
        return layer_norm2d_act(
            x, ln.weight, ln.bias, ln.eps, activation=act, residual=_residual_like(res, x)
        )

    return _fuse_residual(run, torch.float32 if _autocast_fp32(x) else x.dtype, activation, residual)


def conv_padding(conv: nn.Conv2d) -> list[int] | None:
    """Explicit ``[pad_h, pad_w]`` of a conv, or None when it is asymmetric (``"same"`` with an even
    effective kernel pads one side more, which the fused conv cannot express)."""
    if isinstance(conv.padding, str):
        if conv.padding == "valid":
            return [0, 0]
        pads = []
        for dilation, kernel in zip(conv.dilation, conv.kernel_size, strict=True):
            total = dilation * (kernel - 1)
            if total % 2:
                return None
            pads.append(total // 2)
        return pads
    return [int(p) for p in conv.padding]


def why_conv_bn_not_fusable(conv: nn.Module, bn: nn.Module) -> str | None:
    """None if :func:`conv_bn_act` can run ``conv`` → ``bn`` as one fused conv + BN op, else the reason."""
    if type(conv) is not nn.Conv2d:
        return f"{type(conv).__name__} is not an nn.Conv2d"
    if type(bn) is not nn.BatchNorm2d:
        return f"{type(bn).__name__} is not an nn.BatchNorm2d"
    if conv.groups != 1:
        return f"grouped conv (groups={conv.groups}) has no fused Triton path"
    if conv.padding_mode != "zeros":
        return f"padding_mode={conv.padding_mode!r} (only 'zeros' is fused)"
    if conv_padding(conv) is None:
        return f"padding={conv.padding!r} is asymmetric for kernel {tuple(conv.kernel_size)}"
    if bn.num_features != conv.out_channels:
        return f"bn has {bn.num_features} features but conv has {conv.out_channels} output channels"
    return None


def conv_bn_act(
    x: torch.Tensor,
    conv: nn.Conv2d,
    bn: nn.BatchNorm2d,
    activation: str = "none",
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``act(bn(conv(x)) + residual)`` on the tensors of existing modules, output channels_last.

    Training (batch statistics): ``lcv::conv2d_fused`` writes ``z`` and its per-channel ``Σz``, ``Σz²``
    from the epilogue, then ``lcv::batch_norm_act`` finishes the statistics from those sums (no
    statistics pass over ``z``), updates the running stats and applies scale/shift, residual and
    activation in one pass. Eval: BatchNorm is folded into the conv epilogue (one kernel in all).
    """
    reason = why_conv_bn_not_fusable(conv, bn)
    if reason is not None:
        raise ValueError(f"conv_bn_act cannot fuse these modules: {reason}")
    x = x.contiguous(memory_format=torch.channels_last)
    conv_args = {
        "stride": tuple(conv.stride),
        "padding": conv_padding(conv),
        "dilation": tuple(conv.dilation),
    }
    if not (bn.training or (bn.running_mean is None and bn.running_var is None)):
        scale = torch.rsqrt(bn.running_var + bn.eps)
        shift = -bn.running_mean * scale
        if bn.weight is not None:
            scale = scale * bn.weight
            shift = shift * bn.weight
        if bn.bias is not None:
            shift = shift + bn.bias
        device = x.device.type
        out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype

        def run(act: str, res: torch.Tensor | None) -> torch.Tensor:
            return conv2d_fused(
                x, conv.weight, conv.bias, scale=scale, shift=shift, residual=res, activation=act, **conv_args
            )

        return _fuse_residual(run, out_dtype, activation, residual)
    z, sums, sumsq = conv2d_fused(x, conv.weight, conv.bias, stats=True, **conv_args)
    return batch_norm_module_forward(bn, z, activation, residual, sums.detach(), sumsq.detach())


# ---------------------------------------------------------------------------------------------------------
# Modules


class FusedBatchNormAct(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` followed by an activation, with an optional residual added before it:
    ``forward(x, residual=None) = act(bn(x) + residual)``, train and eval, via ``lcv::batch_norm_act``."""

    def __init__(self, num_features: int, activation: str = "relu", **kwargs: object) -> None:
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")
        super().__init__(num_features, **kwargs)  # type: ignore[arg-type]
        self.activation = activation

    @classmethod
    def from_module(cls, bn: nn.BatchNorm2d, act: nn.Module | None = None) -> FusedBatchNormAct:
        """Wrap an existing BatchNorm2d (and activation module), sharing its parameters and buffers."""
        if not isinstance(bn, nn.BatchNorm2d):
            raise TypeError(f"from_module expects nn.BatchNorm2d, got {type(bn).__name__}")
        return _share_state(bn, cls, _checked_activation(act))  # type: ignore[return-value]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        return batch_norm_module_forward(self, x, self.activation, residual)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", activation={self.activation}"


class FusedGroupNormAct(nn.GroupNorm):
    """``nn.GroupNorm`` + activation (+ residual before it) for 4-D inputs, via ``lcv::group_norm_act``."""

    def __init__(
        self, num_groups: int, num_channels: int, activation: str = "none", **kwargs: object
    ) -> None:
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")
        super().__init__(num_groups, num_channels, **kwargs)  # type: ignore[arg-type]
        self.activation = activation

    @classmethod
    def from_module(cls, gn: nn.GroupNorm, act: nn.Module | None = None) -> FusedGroupNormAct:
        """Wrap an existing GroupNorm (and activation module), sharing its parameters."""
        if not isinstance(gn, nn.GroupNorm):
            raise TypeError(f"from_module expects nn.GroupNorm, got {type(gn).__name__}")
        return _share_state(gn, cls, _checked_activation(act))  # type: ignore[return-value]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        if x.dim() != 4:
            raise ValueError(
                f"FusedGroupNormAct expects a 4-D (N, C, H, W) input, got shape {tuple(x.shape)}"
            )
        return group_norm_module_forward(self, x, self.activation, residual)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", activation={self.activation}"


class FusedLayerNorm2dAct(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW tensor (ConvNeXt ``LayerNorm2d``) + activation (+ residual),
    via ``lcv::layer_norm2d_act``; no permute copies, output in the input's memory format."""

    def __init__(self, num_channels: int, activation: str = "none", **kwargs: object) -> None:
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")
        super().__init__(num_channels, **kwargs)  # type: ignore[arg-type]
        self.activation = activation

    @classmethod
    def from_module(cls, ln: nn.LayerNorm, act: nn.Module | None = None) -> FusedLayerNorm2dAct:
        """Wrap a LayerNorm applied over channels (torchvision's ``LayerNorm2d``), sharing its parameters."""
        if not isinstance(ln, nn.LayerNorm):
            raise TypeError(
                f"from_module expects an nn.LayerNorm (such as LayerNorm2d), got {type(ln).__name__}"
            )
        if len(ln.normalized_shape) != 1:
            raise ValueError(
                "LayerNorm2d normalizes one (channel) dimension; "
                f"normalized_shape is {tuple(ln.normalized_shape)}"
            )
        return _share_state(ln, cls, _checked_activation(act))  # type: ignore[return-value]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        if x.dim() != 4:
            raise ValueError(
                f"FusedLayerNorm2dAct expects a 4-D (N, C, H, W) input, got shape {tuple(x.shape)}"
            )
        return layer_norm2d_module_forward(self, x, self.activation, residual)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", activation={self.activation}"
