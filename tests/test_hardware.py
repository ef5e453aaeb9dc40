"""Tests of ``lightning_speedkit.hardware``: the CPU and GPU facts and whether NVML answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_speedkit.hardware import (
    CPU_FLAGS,
    ISA_ENV,
    GpuInfo,
    cpu_info,
    forced_isa,
    gpu_infos,
    has_tensor_cores,
    nvml_status,
    parse_cpu_flags,
    supports_bf16,
)

SAPPHIRE_RAPIDS = """\
processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
"""

EPYC = """\
processor\t: 0
model name\t: AMD EPYC
flags\t\t: fpu sse2 fma avx2 avx512f avx512_bf16 avx512_vnni
"""

ARM = """\
processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics bf16 sve
"""

MIXED = """\
processor\t: 0
flags\t\t: fpu avx2 avx512f
processor\t: 1
flags\t\t: fpu avx2
"""


@pytest.mark.parametrize(
    ("text", "present", "absent"),
    [
        (SAPPHIRE_RAPIDS, {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, set()),
        (EPYC, {"avx2", "avx512f", "avx512_bf16"}, {"amx_bf16", "amx_tile"}),
        (ARM, {"asimd", "bf16", "sve"}, {"avx2"}),
        (MIXED, {"fpu", "avx2"}, {"avx512f"}),
        ("", set(), {"avx2"}),
        ("model name\t: no flags line here\n", set(), {"model"}),
    ],
)
def test_parse_cpu_flags(text: str, present: set[str], absent: set[str]) -> None:
    """Flags come from the `flags`/`Features` lines, only those every processor has."""
    flags = parse_cpu_flags(text)
    assert present <= flags
    assert not absent & flags


@pytest.mark.parametrize(
    ("capability", "bf16", "tensor_cores"),
    [
        ((6, 1), False, False),
        ((7, 0), False, True),
        ((7, 5), False, True),
        ((8, 0), True, True),
        ((8, 9), True, True),
        ((9, 0), True, True),
        ((10, 0), True, True),
    ],
)
def test_gpu_capability_rules(capability: tuple[int, int], bf16: bool, tensor_cores: bool) -> None:
    """bf16 needs compute capability >= 8.0 and tensor cores >= 7.0, and `GpuInfo` derives both from its capability."""
    assert supports_bf16(capability) is bf16
    assert has_tensor_cores(capability) is tensor_cores
    info = GpuInfo(0, "fake", capability, 2**30)
    assert (info.bf16, info.tensor_cores) == (bf16, tensor_cores)


@pytest.mark.parametrize(
    ("text", "flags", "has_amx"),
    [
        (SAPPHIRE_RAPIDS, ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"), True),
        (EPYC, ("avx2", "avx512f", "avx512_vnni", "avx512_bf16"), False),
    ],
)
def test_cpu_info_reads_given_cpuinfo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, flags: tuple[str, ...], has_amx: bool
) -> None:
    """`cpu_info` keeps only the flags that matter, in CPU_FLAGS order, and reads the model name."""
    for name in ISA_ENV:
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    info = cpu_info(path)
    assert info.flags == flags
    assert info.has_amx_bf16 is has_amx
    assert info.model == text.split("model name\t: ")[1].splitlines()[0]


def test_cpu_info_falls_back_to_torch_without_proc_cpuinfo(tmp_path: Path) -> None:
    """Without /proc/cpuinfo the flags are the lower bound torch's CPU capability implies, never bf16 or AMX."""
    info = cpu_info(tmp_path / "missing")
    expected = {"AVX2": ("avx2",), "AVX512": ("avx2", "avx512f")}.get(torch.backends.cpu.get_cpu_capability(), ())
    assert info.flags == expected
    assert not info.has_amx_bf16


def test_cpu_info_on_this_machine() -> None:
    """On the real machine the core counts agree with the OS and the capability with torch."""
    info = cpu_info()
    assert info.logical_cores == os.cpu_count()
    assert 1 <= info.available_cores <= info.logical_cores
    assert info.torch_capability == torch.backends.cpu.get_cpu_capability()
    assert set(info.flags) <= set(CPU_FLAGS)


@pytest.mark.parametrize(
    ("env", "flags", "limit"),
    [
        ({}, ("avx2", "avx512f", "avx512_vnni", "avx512_bf16"), ""),
        (
            {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
            ("avx2",),
            "ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2 (hides avx512f avx512_vnni avx512_bf16)",
        ),
        ({"ONEDNN_MAX_CPU_ISA": "avx2"}, ("avx2",), "ONEDNN_MAX_CPU_ISA=AVX2 (hides avx512f avx512_vnni avx512_bf16)"),
        (
            {"ATEN_CPU_CAPABILITY": "avx2"},
            ("avx2",),
            "ATEN_CPU_CAPABILITY=avx2 (hides avx512f avx512_vnni avx512_bf16)",
        ),
        (
            {"DNNL_MAX_CPU_ISA": "AVX512_CORE_VNNI"},
            ("avx2", "avx512f", "avx512_vnni"),
            "DNNL_MAX_CPU_ISA=AVX512_CORE_VNNI",
        ),
        ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, ("avx2", "avx512f", "avx512_vnni", "avx512_bf16"), ""),
        (
            {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "ALL"},
            ("avx2", "avx512f", "avx512_vnni", "avx512_bf16"),
            "",
        ),
    ],
)
def test_a_forced_isa_hides_the_flags_above_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], flags: tuple[str, ...], limit: str
) -> None:
    """ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA make an AVX-512 bf16 CPU's facts those of the CPU they force."""
    for name in ISA_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    path = tmp_path / "cpuinfo"
    path.write_text(EPYC)
    info = cpu_info(path)
    assert info.flags == flags
    assert info.isa_limit.startswith(limit) if limit else info.isa_limit == ""
    assert bool(info.bf16_instructions) is ("avx512_bf16" in flags)
    assert bool(info.int8_dot_instructions) is ("avx512_vnni" in flags)


def test_forced_isa_takes_the_lower_cap_and_ignores_unknown_values() -> None:
    """The lower of the two caps wins; an unknown value caps nothing."""
    assert forced_isa({"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX2"}) == (
        "AVX",
        "ATEN_CPU_CAPABILITY=default",
    )
    assert forced_isa({"ONEDNN_MAX_CPU_ISA": "AVX10_1_512_AMX"})[0] == "AVX512_CORE_AMX"
    assert forced_isa({"ONEDNN_MAX_CPU_ISA": "bogus", "ATEN_CPU_CAPABILITY": "zvector"}) == (None, "")


def test_the_forced_isa_reaches_precision_and_doctor_in_a_fresh_process() -> None:
    """Under the forced AVX2 ISA a fresh process reports no bf16 instructions, and doctor names the cap."""
    code = (
        "import json; from lightning_speedkit import doctor; from lightning_speedkit.hardware import cpu_info;"
        "r = doctor.collect(); print(json.dumps([cpu_info().bf16_instructions, r['cpu']['torch_capability'],"
        " r['recommendation']['precision']['reason']]))"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True).stdout
    bf16, capability, reason = json.loads(out.strip().splitlines()[-1])
    assert bf16 == []
    assert capability == "AVX2"
    assert reason.startswith("no bf16 instructions")


def test_nvml_status_never_raises() -> None:
    """`nvml_status` returns a bool and a non-empty reason on any machine."""
    ok, reason = nvml_status()
    assert isinstance(ok, bool)
    assert reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_cpu_only_machine_has_no_gpus() -> None:
    """Without CUDA there are no GPUs and NVML does not answer, with a reason saying why."""
    assert gpu_infos() == []
    ok, reason = nvml_status()
    assert ok is False
    assert reason


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_gpu_info_and_nvml() -> None:
    """Each CUDA device is reported with torch's name, capability and memory, and NVML answers."""
    infos = gpu_infos()
    assert [info.index for info in infos] == list(range(torch.cuda.device_count()))
    for info in infos:
        assert info.name == torch.cuda.get_device_name(info.index)
        assert info.capability == torch.cuda.get_device_capability(info.index)
        assert info.total_memory_bytes == torch.cuda.get_device_properties(info.index).total_memory > 0
        assert info.bf16 is supports_bf16(info.capability)
    ok, reason = nvml_status()
    assert ok, reason
    assert reason.startswith("driver ")
