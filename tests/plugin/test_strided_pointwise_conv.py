"""Strided 1x1 convolutions with few input channels avoid oneDNN's AVX2 weight-gradient fault (oneDNN#6035).

Truth is float64 ``F.conv2d`` with the stride (PyTorch's own non-oneDNN convolution: oneDNN has no float64).
The fault itself is reproduced in a child process with oneDNN capped at AVX2 (``ONEDNN_MAX_CPU_ISA``): there
an AVX-512 CPU returns a wrong weight gradient and an AVX2-only CPU segfaults or spins, so the child is
what fails without the rewrite on either.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from boring import TRAINER_KWARGS
from lcv_kernels.tolerances import bound, reduction_tolerance
from lightning_plugin.cpu.strided_pointwise_conv import (
    SubsampledPointwiseConv2d,
    restore_convs,
    subsample_strided_pointwise_convs,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _close(actual: torch.Tensor, reference: torch.Tensor, length: int) -> None:
    limit = bound(reduction_tolerance(actual.dtype, length), reference)
    assert (actual.double() - reference).abs().max().item() <= limit


@pytest.mark.parametrize(
    ("batch", "channels", "groups", "size", "stride", "bias", "channels_last"),
    [
        (2, 4, 1, (32, 32), (2, 2), True, True),  # the faulting case on AVX2
        (1, 3, 1, (7, 9), (2, 3), False, True),  # N=1, odd H/W, uneven strides: a last row/column read
        (3, 6, 2, (5, 6), (3, 1), True, False),  # groups, a stride of 1 on one side, contiguous
        (2, 1, 1, (1, 1), (2, 2), True, True),  # 1x1 image: one output pixel
    ],
)
def test_the_rewrite_gives_the_strided_convolution_and_its_gradients(
    batch, channels, groups, size, stride, bias, channels_last
):
    conv = nn.Conv2d(channels, 5 * groups, 1, stride=stride, groups=groups, bias=bias)
    reference = nn.Conv2d(channels, 5 * groups, 1, stride=stride, groups=groups, bias=bias).double()
    reference.load_state_dict(conv.state_dict())
    assert subsample_strided_pointwise_convs(conv) == [conv] and type(conv) is SubsampledPointwiseConv2d
    assert conv.stride == stride and conv.state_dict().keys() == reference.state_dict().keys()
    x = torch.randn(batch, channels, *size) + 3.0  # a large mean: the gradient sums stay far from zero
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
        conv.to(memory_format=torch.channels_last)
    x64 = x.double().requires_grad_()
    x = x.requires_grad_()
    out, out64 = conv(x), reference(x64)
    assert out.shape == out64.shape
    _close(out, out64, channels // groups)
    upstream = torch.randn(out64.shape, dtype=torch.float64)
    out.backward(upstream.float())
    out64.backward(upstream)
    _close(x.grad, x64.grad, 5)
    pixels = batch * out64.shape[-2] * out64.shape[-1]
    _close(conv.weight.grad, reference.weight.grad, pixels)
    if bias:
        _close(conv.bias.grad, reference.bias.grad, pixels)
    restore_convs([conv])
    assert type(conv) is nn.Conv2d


def test_only_the_faulting_shape_is_rewritten():
    model = nn.Sequential(
        nn.Conv2d(4, 8, 1, stride=2),  # rewritten
        nn.Conv2d(8, 8, 1, stride=2),  # 8 input channels: oneDNN's block, no fault
        nn.Conv2d(16, 8, 1, stride=2, groups=4),  # 4 a group: rewritten
        nn.Conv2d(4, 4, 1),  # stride 1
        nn.Conv2d(4, 4, 3, stride=2),  # not 1x1
        nn.Conv2d(4, 4, 1, stride=2, padding=1),  # padded: reads zeros the subsampled view lacks
    )
    assert subsample_strided_pointwise_convs(model) == [model[0], model[2]]


_CHILD = textwrap.dedent(
    """
    import torch
    from torch import nn
    from lightning_plugin.cpu.strided_pointwise_conv import subsample_strided_pointwise_convs

    torch.manual_seed(0)
    torch.set_num_threads(1)
    conv = nn.Conv2d(4, 8, 1, stride=2).to(memory_format=torch.channels_last)
    reference = nn.Conv2d(4, 8, 1, stride=2).double()
    reference.load_state_dict(conv.state_dict())
    assert subsample_strided_pointwise_convs(conv) == [conv]
    x = (torch.randn(32, 4, 32, 32) + 3.0).contiguous(memory_format=torch.channels_last)
    conv(x).square().sum().backward()
    reference(x.double()).square().sum().backward()
    print(repr((conv.weight.grad.double() - reference.weight.grad).abs().max().item()))
    print(repr(reference.weight.grad.abs().max().item()))
    """
)


def test_the_weight_gradient_is_right_with_onednn_capped_at_avx2():
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_NUM_THREADS": "2"}
    child = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )
    assert child.returncode == 0, child.stderr[-2000:]
    error, scale = (float(line) for line in child.stdout.split())
    atol, rtol = reduction_tolerance(torch.float32, 32 * 16 * 16)
    assert error <= atol + rtol * scale


class _Downsampler(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.shortcut = nn.Conv2d(4, 8, 1, stride=2)
        self.seen: list[type] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(type(self.shortcut))
        return self.shortcut(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_compiled_strategy_rewrites_on_cpu_and_restores_after_fit(tmp_path):
    module = _Downsampler()
    data = torch.utils.data.TensorDataset(torch.randn(4, 4, 8, 8))
    trainer = L.Trainer(**TRAINER_KWARGS, strategy="compiled", max_steps=2, default_root_dir=tmp_path)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    assert module.seen == [SubsampledPointwiseConv2d] * 2
    assert type(module.shortcut) is nn.Conv2d
    x = torch.randn(1, 4, 5, 5)
    torch.testing.assert_close(
        module.shortcut(x), F.conv2d(x, module.shortcut.weight, module.shortcut.bias, 2)
    )
