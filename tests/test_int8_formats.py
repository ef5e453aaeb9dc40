"""The INT8 format follows the CPU the model is verified on: 7-bit weights on x86 without VNNI, as ORT advises."""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from torch import nn

from lightning_speedkit.hardware import CpuInfo, cpu_info
from lightning_speedkit.int8 import export_int8, int8_format

AVX2 = CpuInfo(2, 2, "AMD EPYC 7B13", ("avx2",), "AVX2")
AVX512 = CpuInfo(8, 8, "Intel Xeon Platinum 8124M", ("avx2", "avx512f"), "AVX512")
AVX512_VNNI = CpuInfo(8, 8, "Intel Xeon Platinum 8275CL", ("avx2", "avx512f", "avx512_vnni"), "AVX512")
AVX_VNNI = CpuInfo(16, 16, "12th Gen Intel Core i7-12700", ("avx2", "avx_vnni"), "AVX2")
AMX = CpuInfo(
    8,
    8,
    "Intel Xeon Platinum 8480+",
    ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16"),
    "AVX512",
)
FORCED = CpuInfo(8, 8, "AMD EPYC 9R14", ("avx2",), "AVX2", "ONEDNN_MAX_CPU_ISA=AVX2 (hides avx512f avx512_vnni)")


@pytest.mark.parametrize(
    ("cpu", "machine", "name", "reason"),
    [
        (AVX2, "x86_64", "U8S8+reduce_range", "x86 without VNNI or AMX-INT8 (flags: avx2)"),
        (AVX512, "x86_64", "U8S8+reduce_range", "without VNNI"),
        (AVX512_VNNI, "x86_64", "U8S8", "x86 with avx512_vnni"),
        (AVX_VNNI, "AMD64", "U8S8", "x86 with avx_vnni"),
        (AMX, "x86_64", "U8S8", "x86 with avx512_vnni/amx_int8"),
        (FORCED, "x86_64", "U8S8+reduce_range", "ISA forced: ONEDNN_MAX_CPU_ISA=AVX2"),
        (CpuInfo(4, 4, "Neoverse-N1", (), "DEFAULT"), "aarch64", "S8S8", "aarch64 CPU: S8S8"),
    ],
)
def test_the_format_is_chosen_from_the_cpu(cpu: CpuInfo, machine: str, name: str, reason: str) -> None:
    """VNNI or AMX-INT8: U8S8; x86 without them (or a forced AVX2 ISA): 7-bit weights; Arm: S8S8; the reason says so."""
    chosen = int8_format(cpu, machine=machine)
    assert chosen.name == name
    assert reason in chosen.reason
    assert chosen.weight_type == "int8"


@pytest.mark.parametrize(
    ("kwargs", "name", "said"),
    [
        ({"symmetric": True}, "S8S8+reduce_range", "symmetric=True asks for int8 activations"),
        ({"activation_type": "int8"}, "S8S8+reduce_range", "activation_type='int8' given"),
        ({"reduce_range": False}, "U8S8", "reduce_range=False given"),
        ({"activation_type": "uint8", "reduce_range": False}, "U8S8", "activation_type='uint8' given; reduce_range"),
    ],
)
def test_an_explicit_choice_is_kept_and_said(kwargs: dict[str, object], name: str, said: str) -> None:
    """What the user asked for wins over the CPU's rule, and the reason starts by saying it was asked for."""
    chosen = int8_format(AVX2, **kwargs)  # type: ignore[arg-type]
    assert chosen.name == name
    assert chosen.reason.startswith(said)


def test_vnni_keeps_the_full_range_even_for_symmetric_activations() -> None:
    """On a VNNI CPU nothing saturates: symmetric S8S8 keeps 8-bit weights."""
    assert int8_format(AVX512_VNNI, symmetric=True).name == "S8S8"


def _int8_weights(path: str) -> list[np.ndarray]:
    """The int8/uint8 weight initializers of a QDQ model (the inputs of weight DequantizeLinear nodes)."""
    model = onnx.load(path)
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    return [inits[n.input[0]] for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits]


def test_export_int8_quantizes_to_the_format_of_this_cpu(tmp_path: Path) -> None:
    """The report records the format chosen for this CPU and why; with reduce_range the weights use 7 bits."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    report = export_int8(net, [torch.randn(16, 8) for _ in range(2)], tmp_path / "m.onnx", latency_repeats=0)
    expected = int8_format(cpu_info(), machine=platform.machine())
    quantization = report["quantization"]
    assert quantization["int8_format"] == expected.name
    assert quantization["reduce_range"] is expected.reduce_range
    assert quantization["format_reason"] == expected.reason
    assert quantization["cpu"]["isa_limit"] == cpu_info().isa_limit
    weights = [w for w in _int8_weights(report["int8_path"]) if w.dtype == np.int8 and w.ndim == 2]
    assert len(weights) == 2
    widest = max(int(np.abs(w.astype(np.int16)).max()) for w in weights)
    assert widest == (64 if expected.reduce_range else 127)


def test_an_explicit_reduce_range_is_honoured(tmp_path: Path) -> None:
    """``reduce_range=False`` gives 8-bit weights on any CPU, and the report says it was asked for."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    report = export_int8(
        net, [torch.randn(16, 8)], tmp_path / "m.onnx", reduce_range=False, latency_repeats=0, verify=False
    )
    assert report["quantization"]["reduce_range"] is False
    assert "reduce_range=False given" in report["quantization"]["format_reason"]
    weights = [w for w in _int8_weights(report["int8_path"]) if w.dtype == np.int8 and w.ndim == 2]
    assert max(int(np.abs(w.astype(np.int16)).max()) for w in weights) == 127
