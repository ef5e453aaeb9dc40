"""The peak MFU divides by: TF32's where cuDNN or cuBLAS may use it (a conv net in ``32-true``), from torch's flags."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from lightning_speedkit.monitor import DENSE_PEAK_FLOPS, mfu, tf32_allowed, training_peak_flops, uses_tf32

CONV_NET = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))
MLP = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
_SCOPES = ("backends", "backends.cuda.matmul", "backends.cudnn", "backends.cudnn.conv", "backends.cudnn.rnn")


def _scope(path: str) -> object:
    scope: object = torch
    for part in path.split("."):
        scope = getattr(scope, part)
    return scope


@pytest.fixture
def tf32_flags() -> Iterator[None]:
    """Put torch's TF32 settings (legacy flags and ``fp32_precision`` of every scope) back as they were."""
    saved = {path: _scope(path).fp32_precision for path in _SCOPES if hasattr(_scope(path), "fp32_precision")}
    yield
    for path, value in saved.items():  # broadest scope first, so the specific ones win
        _scope(path).fp32_precision = value


@pytest.mark.usefixtures("tf32_flags")
@pytest.mark.parametrize(
    ("cudnn", "matmul", "module", "precision", "key"),
    [
        (True, False, CONV_NET, "32-true", "tf32"),  # torch's defaults: the convs run in TF32
        (False, False, CONV_NET, "32-true", "fp32"),
        (True, False, MLP, "32-true", "fp32"),  # no convolution: cuDNN's flag does not apply
        (True, True, MLP, "32-true", "tf32"),  # set_float32_matmul_precision("high")
        (False, True, CONV_NET, "32-true", "tf32"),
        (True, False, None, "32-true", "tf32"),  # an unknown module may have convolutions: the lower MFU
        (True, False, CONV_NET, "16-mixed", "fp16"),  # autocast precisions have their own peak
        (False, False, MLP, "bf16-mixed", "bf16"),
    ],
)
def test_training_peak_follows_the_tf32_flags(
    cudnn: bool, matmul: bool, module: nn.Module | None, precision: str, key: str
) -> None:
    """On an H200, MFU of a conv net in 32-true divides by the TF32 peak when cuDNN may use TF32, else by fp32's."""
    torch.backends.cudnn.allow_tf32 = cudnn
    torch.backends.cuda.matmul.allow_tf32 = matmul
    assert tf32_allowed() == {"cudnn": cudnn, "matmul": matmul}
    assert training_peak_flops("NVIDIA H200", precision, module) == (DENSE_PEAK_FLOPS["H200"][key], key)


@pytest.mark.usefixtures("tf32_flags")
def test_the_fp32_peak_would_overstate_conv_mfu_sevenfold() -> None:
    """The defect this guards: with torch's default flags a conv net's MFU against the fp32 peak is 7.4x too high."""
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = True, False
    peak, _ = training_peak_flops("NVIDIA H200", "32-true", CONV_NET)
    assert peak is not None
    assert mfu(1e12, 0.01, DENSE_PEAK_FLOPS["H200"]["fp32"]) / mfu(1e12, 0.01, peak) == pytest.approx(495 / 67)


@pytest.mark.usefixtures("tf32_flags")
@pytest.mark.skipif(not hasattr(torch.backends.cudnn, "conv"), reason="torch without the fp32_precision API")
def test_flags_mixed_with_the_new_api_are_read_without_error() -> None:
    """Where torch refuses to read a legacy flag (APIs mixed), the new ``fp32_precision`` settings decide."""
    torch.backends.cudnn.conv.fp32_precision = "ieee"  # conv and RNN now disagree: the legacy getter raises
    torch.backends.cudnn.rnn.fp32_precision = "tf32"
    with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
        _ = torch.backends.cudnn.allow_tf32
    assert tf32_allowed()["cudnn"] is False
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    assert uses_tf32(CONV_NET) is False
    torch.backends.cudnn.conv.fp32_precision = "tf32"
    assert uses_tf32(CONV_NET) is True


@pytest.mark.usefixtures("tf32_flags")
@pytest.mark.parametrize(("name", "expected"), [("Tesla V100-SXM2-16GB", "fp32"), ("NVIDIA A100-SXM4-80GB", "tf32")])
def test_gpus_without_tf32_use_their_fp32_peak(name: str, expected: str) -> None:
    """Before Ampere there is no TF32: a conv net in 32-true divides by the fp32 peak there, not by nothing."""
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = True, False
    peak, key = training_peak_flops(name, "32-true", CONV_NET)
    assert key == expected
    assert peak is not None


def test_unknown_gpu_has_no_peak() -> None:
    """A GPU missing from the table gives no peak (pass `peak_flops` yourself), whatever the precision."""
    assert training_peak_flops("NVIDIA A10G", "bf16-mixed", MLP) == (None, "bf16")
