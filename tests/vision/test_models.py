"""Models against independent references: torchvision's ResNets, a hand-written attention, the whitening
math."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import torchvision

from lcv_kernels.tolerances import bound, network_length, reduction_tolerance
from lcv_vision.models import create_model, whitening_weights
from lcv_vision.models.vit import Attention


@pytest.mark.parametrize(("name", "size"), [("resnet18", 32), ("resnet34", 32), ("resnet50", 64)])
def test_resnet_state_dict_loads_into_torchvision_and_matches(name, size):
    ours = create_model(name, num_classes=10).eval()
    reference = torchvision.models.get_model(name, weights=None, num_classes=10).eval()
    # Perturb BN statistics so that eval mode really exercises them.
    with torch.no_grad():
        for m in ours.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.1, 0.1)
    missing, unexpected = reference.load_state_dict(ours.state_dict(), strict=True)
    assert not missing and not unexpected
    x = torch.randn(2, 3, size, size)
    want = reference(x)
    tol = reduction_tolerance(torch.float32, network_length(reference, x.shape))
    torch.testing.assert_close(ours(x), want, atol=bound(tol, want), rtol=0)
    # and torchvision's weights load back into ours
    ours.load_state_dict(reference.state_dict(), strict=True)


def test_resnet_channels_last_gives_the_same_output():
    model = create_model("resnet18", num_classes=4, width=8).eval()
    x = torch.randn(2, 3, 32, 32)
    expected = model(x)
    model = model.to(memory_format=torch.channels_last)
    atol = bound(reduction_tolerance(torch.float32, network_length(model, x.shape)), expected)
    torch.testing.assert_close(
        model(x.contiguous(memory_format=torch.channels_last)), expected, atol=atol, rtol=0
    )


def test_cifar_resnet_keeps_resolution_in_the_stem():
    model = create_model("cifar_resnet18", num_classes=10, width=8)
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, torch.nn.Identity)
    features = model.layer1(model.relu(model.bn1(model.conv1(torch.randn(1, 3, 32, 32)))))
    assert features.shape[-2:] == (32, 32)  # the ImageNet stem would be at 8x8 here
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_vit_attention_matches_a_hand_written_softmax_attention():
    torch.manual_seed(0)
    attn = Attention(dim=16, num_heads=4).eval()
    x = torch.randn(2, 5, 16)
    qkv = attn.qkv(x).view(2, 5, 3, 4, 4)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (N, heads, T, d)
    weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(4), dim=-1)
    expected = attn.proj((weights @ v).transpose(1, 2).reshape(2, 5, 16))
    # one output's sums: qkv (16), q.k (4), the softmax's 5, weights @ v (5), proj (16)
    tol = reduction_tolerance(torch.float32, 16 + 4 + 5 + 5 + 16)
    torch.testing.assert_close(attn(x), expected, atol=bound(tol, expected), rtol=0)


def test_vit_uses_scaled_dot_product_attention(monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    model = create_model("vit_tiny_patch4_32", num_classes=10, dim=32, depth=2, num_heads=2)
    assert model(torch.randn(3, 3, 32, 32)).shape == (3, 10)
    assert calls == [torch.Size([3, 2, 65, 16])] * 2  # 64 patches + class token, per block
    with pytest.raises(ValueError, match="built for 32 px input"):
        model(torch.randn(1, 3, 16, 16))


def test_whitening_decorrelates_patches():
    torch.manual_seed(0)
    mixing = torch.randn(12, 12)
    images = torch.randn(200, 3, 9, 9)
    # correlate the 2x2x3 patch entries a bit through a smooth blur plus channel mixing
    images = F.avg_pool2d(F.pad(images, (1, 1, 1, 1), mode="reflect"), 3, 1) + 0.3 * images
    images = torch.einsum("dc,nchw->ndhw", mixing[:3, :3], images)
    weight = whitening_weights(images, eps=0.0)
    assert weight.shape == (24, 3, 2, 2)
    torch.testing.assert_close(weight[12:], -weight[:12])
    out = F.conv2d(images, weight[:12])
    flat = out.permute(0, 2, 3, 1).reshape(-1, 12)
    covariance = flat.T @ flat / flat.shape[0]  # uncentred, like the patch covariance
    # Both covariances sum N*H*W patches in float32; the filters divide the first one's error (relative to
    # its largest eigenvalue) by the smallest eigenvalue: the condition number, from the data in float64.
    patches = images.double().unfold(2, 2, 1).unfold(3, 2, 1).permute(0, 2, 3, 1, 4, 5).reshape(-1, 12)
    eigenvalues = torch.linalg.eigvalsh(patches.T @ patches / patches.shape[0])
    condition = float(eigenvalues.max() / eigenvalues.min())
    atol = reduction_tolerance(torch.float32, flat.shape[0])[1] * (condition + 1)
    torch.testing.assert_close(covariance, torch.eye(12), atol=atol, rtol=0)


def test_whitening_replaces_directions_without_variance():
    grey = torch.rand(50, 1, 8, 8).expand(-1, 3, -1, -1)  # 3 identical channels: rank 4 of 12
    weight = whitening_weights(grey)
    out = F.conv2d(grey, weight)
    assert out.std(dim=(0, 2, 3)).min() > 0.1  # no dead channel for BN to blow up
    torch.testing.assert_close(weight[4:8], weight[:4])  # informative filters repeat
    with pytest.raises(ValueError, match="do not vary"):
        whitening_weights(torch.zeros(4, 3, 4, 4))


def test_airbench_net_structure():
    model = create_model("airbench94", num_classes=10)
    assert [g.conv1.out_channels for g in (model.layer1, model.layer2, model.layer3)] == [64, 256, 256]
    assert model.whiten.out_channels == 24 and not model.whiten.weight.requires_grad
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert all(not bn.weight.requires_grad and bn.eps == 1e-12 and bn.momentum == 0.4 for bn in norms)
    # dirac init: the first in_channels filters of each conv are identities
    w = model.layer2.conv1.weight
    assert torch.equal(w[:64, :, 1, 1], torch.eye(64)) and w[:64, :, [0, 2]].abs().sum() == 0
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert create_model("airbench95", num_classes=10).layer3.conv1.out_channels == 384
