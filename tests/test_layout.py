"""Channels-last layout facts and conversion: only strides change, never values, parameters or what a net computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_speedkit.demo import DemoResNet
from lightning_speedkit.hardware import CpuInfo, cpu_info
from lightning_speedkit.layout import (
    align_optimizer_state,
    has_convolutions,
    is_channels_last,
    nhwc_unsafe_convs,
    to_channels_last,
    to_default_layout,
)
from lightning_speedkit.pruning.surgery import apply_pruning_history, plan_pruning


def test_conversion_keeps_values_and_parameter_objects() -> None:
    """Only strides change: same values, same Parameter objects (an optimizer built earlier still works)."""
    net = DemoResNet(width=16)  # width 4 has a strided 1x1 conv oneDNN cannot train NHWC
    params = list(net.parameters())
    before = {k: v.clone() for k, v in net.state_dict().items()}
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    assert to_channels_last(net) > 0
    assert is_channels_last(net)
    assert all(a is b for a, b in zip(params, net.parameters(), strict=True))
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    net(torch.randn(2, 3, 16, 16)).sum().backward()
    optimizer.step()
    assert to_channels_last(net) == 0  # nothing left to convert


def test_channels_last_model_computes_what_the_default_layout_computes() -> None:
    """Forward outputs agree between layouts to float tolerance, and the output of the first conv is NHWC."""
    torch.manual_seed(0)
    net = DemoResNet(width=4).eval()
    x = torch.randn(4, 3, 16, 16)
    expected = net(x)
    to_channels_last(net)
    torch.testing.assert_close(net(x), expected, rtol=1e-4, atol=1e-5)
    assert net.stem(x).is_contiguous(memory_format=torch.channels_last)


def test_pruning_keeps_the_channels_last_layout() -> None:
    """torch-pruning builds new, smaller weights; a model that was NHWC before stays NHWC after.

    Wide enough that no pruned strided 1x1 convolution falls under oneDNN's channel block on any x86 CPU (16 on
    AVX-512): a narrower one goes back to the default layout there (`nhwc_unsafe_convs`, tested below).
    """
    torch.manual_seed(0)
    net = DemoResNet(width=64)
    to_channels_last(net)
    example = torch.randn(1, 3, 16, 16)
    plan = plan_pruning(net, example, 0.5, ignored_layers=["classifier"])
    apply_pruning_history(net, example, plan)
    assert net.stem[0].out_channels < 64
    assert is_channels_last(net)
    assert net(example).shape == (1, 10)


def test_one_by_one_convolutions_get_nhwc_strides() -> None:
    """A 1x1 conv weight passes ``is_contiguous`` for both layouts; it still gets the NHWC strides its gradient has."""
    conv = nn.Conv2d(8, 16, 1)
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert not is_channels_last(conv)
    assert to_channels_last(conv) == 1
    conv(torch.randn(2, 8, 4, 4, requires_grad=True).contiguous(memory_format=torch.channels_last)).sum().backward()
    assert conv.weight.grad is not None
    assert conv.weight.stride() == conv.weight.grad.stride()


@pytest.mark.parametrize("module", [nn.Conv3d(2, 4, 3), nn.ConvTranspose2d(2, 4, 3)])
def test_other_convolutions_are_converted(module: nn.Module) -> None:
    """3-D convolutions get the channels_last_3d layout; transposed convolutions are converted too."""
    assert has_convolutions(module)
    assert to_channels_last(module) == 1
    assert is_channels_last(module)


def test_optimizer_state_and_gradients_follow_the_parameters() -> None:
    """State an optimizer already holds, and existing gradients, get the parameters' new strides; steps still work."""
    torch.manual_seed(0)
    net = DemoResNet(width=16)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x = torch.randn(2, 3, 16, 16)
    net(x).sum().backward()
    optimizer.step()
    net(x).sum().backward()  # a gradient exists while the layout changes
    to_channels_last(net)
    convs = [m.weight for m in net.modules() if isinstance(m, nn.Conv2d)]
    assert all(w.grad is not None and w.grad.stride() == w.stride() for w in convs)
    assert align_optimizer_state(optimizer) == 2 * len(convs)  # exp_avg and exp_avg_sq of each conv weight
    assert all(optimizer.state[w][k].stride() == w.stride() for w in convs for k in ("exp_avg", "exp_avg_sq"))
    optimizer.step()
    assert align_optimizer_state(optimizer) == 0


def test_only_convolution_weights_change_and_the_change_can_be_undone() -> None:
    """A 4-D parameter outside a convolution keeps its layout; `to_default_layout` restores the conv weights."""
    net = nn.Module()
    net.conv = nn.Conv2d(3, 8, 3)
    net.bias_map = nn.Parameter(torch.randn(1, 8, 4, 4))
    to_channels_last(net)
    assert net.bias_map.is_contiguous()
    assert not net.bias_map.is_contiguous(memory_format=torch.channels_last)
    assert to_default_layout(net) == 1
    assert net.conv.weight.is_contiguous()
    assert not is_channels_last(net)


AVX2 = CpuInfo(2, 2, "AMD EPYC (AVX2 only)", ("avx2",), "AVX2")
AVX512 = CpuInfo(2, 2, "AMD EPYC", ("avx2", "avx512f", "avx512_bf16"), "AVX512")
ARM = CpuInfo(2, 2, "Neoverse", (), "DEFAULT")


@pytest.mark.parametrize(
    ("conv", "cpu", "unsafe"),
    [
        (nn.Conv2d(4, 8, 1, stride=2), AVX2, True),
        (nn.Conv2d(7, 8, 1, stride=(1, 2)), AVX2, True),
        (nn.Conv2d(8, 16, 1, stride=2), AVX2, False),  # a whole channel block
        (nn.Conv2d(8, 16, 1, stride=2), AVX512, True),  # AVX-512's block is 16
        (nn.Conv2d(16, 32, 1, stride=2), AVX512, False),
        (nn.Conv2d(4, 8, 1, stride=1), AVX2, False),  # unit stride: no workspace copy
        (nn.Conv2d(4, 8, 3, stride=2), AVX2, False),  # not 1x1
        (nn.Conv2d(16, 16, 1, stride=2, groups=4), AVX2, True),  # 4 input channels per group
        (nn.Conv3d(4, 8, 1, stride=2), AVX2, True),
        (nn.Conv2d(4, 8, 1, stride=2), ARM, False),  # not oneDNN's x86 kernels
    ],
)
def test_nhwc_unsafe_convs_names_strided_1x1_convs_narrower_than_a_block(
    conv: nn.Module, cpu: CpuInfo, unsafe: bool
) -> None:
    """Only a strided 1x1 conv with fewer input channels per group than the CPU's oneDNN block is unsafe NHWC."""
    net = nn.Sequential(nn.Conv2d(3, 3, 3), conv)
    assert nhwc_unsafe_convs(net, cpu) == (["1"] if unsafe else [])


def test_pruning_to_a_narrow_strided_1x1_conv_leaves_the_default_layout(recwarn: pytest.WarningsRecorder) -> None:
    """A channels-last model that pruning leaves with a layer oneDNN cannot train NHWC goes back to NCHW, warned."""
    torch.manual_seed(0)
    net = DemoResNet(width=16)
    to_channels_last(net)
    example = torch.randn(1, 3, 16, 16)
    apply_pruning_history(net, example, plan_pruning(net, example, 0.75, ignored_layers=["classifier"]))
    narrow = nhwc_unsafe_convs(net, cpu_info())
    assert is_channels_last(net) == (not narrow)
    if narrow:
        assert any("back in the default layout" in str(w.message) for w in recwarn)
    net(example).sum().backward()  # trains in the layout it was left in
