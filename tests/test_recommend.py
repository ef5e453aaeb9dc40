"""Tests of ``lightning_speedkit.recommend``: the hardware decisions `preset` and ``speedkit doctor`` share."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_speedkit.hardware import CpuInfo, GpuInfo
from lightning_speedkit.preset import choose
from lightning_speedkit.recommend import (
    num_workers_choice,
    placement,
    recommend,
    strategy_choice,
    unified_precision,
)

CPU_2_CORES_AVX512_BF16 = CpuInfo(2, 2, "AMD EPYC", ("avx2", "avx512f", "avx512_bf16"), "AVX512")
CPU_2_CORES_AVX2 = CpuInfo(2, 2, "Intel Core", ("avx2",), "AVX2")
CPU_AMX = CpuInfo(112, 112, "Xeon 8480+", ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"), "AVX512")
CPU_32_CORES = CpuInfo(32, 32, "EPYC", ("avx2",), "AVX2")
H100 = GpuInfo(0, "NVIDIA H100", (9, 0), 80 * 2**30)
T4 = GpuInfo(0, "Tesla T4", (7, 5), 16 * 2**30)
P100 = GpuInfo(0, "Tesla P100", (6, 0), 16 * 2**30)
A100S = [GpuInfo(i, "NVIDIA A100", (8, 0), 40 * 2**30) for i in range(4)]


@pytest.mark.parametrize(
    ("cpu", "gpus", "precision", "strategy", "num_workers"),
    [
        (CPU_2_CORES_AVX512_BF16, [], "32-true", "auto", 0),
        (CPU_2_CORES_AVX2, [], "32-true", "auto", 0),
        (CPU_AMX, [], "32-true", "auto", 28),
        (CPU_32_CORES, [H100], "16-mixed", "auto", 8),
        (CPU_2_CORES_AVX2, [H100], "16-mixed", "auto", 1),
        (CPU_32_CORES, [T4], "16-mixed", "auto", 8),
        (CPU_32_CORES, A100S, "16-mixed", "ddp", 7),
        (CPU_32_CORES, [P100], "32-true", "auto", 8),
        (CPU_32_CORES, [H100, GpuInfo(1, "Tesla P100", (6, 0), 2**34)], "32-true", "ddp", 8),
    ],
)
def test_recommend_values(cpu: CpuInfo, gpus: list[GpuInfo], precision: str, strategy: str, num_workers: int) -> None:
    """`recommend` picks precision, strategy and num_workers from the CPU and GPUs, each with a one-line reason."""
    result = recommend(cpu, gpus)
    assert {key: choice["value"] for key, choice in result.items()} == {
        "precision": precision,
        "strategy": strategy,
        "num_workers": num_workers,
    }
    for choice in result.values():
        assert choice["reason"]
        assert "\n" not in choice["reason"]


@pytest.mark.parametrize(
    ("cpu", "gpus", "key", "fragments", "absent"),
    [
        (CPU_2_CORES_AVX2, [], "precision", ["no bf16 instructions", "'16-mixed'", "10x", "warning"], ["avx512_bf16"]),
        (CPU_2_CORES_AVX512_BF16, [], "precision", ["avx512_bf16", "PrecisionTuner", "precision.json"], ["silently"]),
        (CPU_AMX, [], "precision", ["avx512_bf16 and amx_bf16", "times 'bf16-mixed'"], []),
        (CPU_32_CORES, [H100], "precision", ["'bf16-mixed' is also available"], []),
        (CPU_32_CORES, [T4], "precision", ["'bf16-mixed' is not", "Tesla T4, 7.5"], []),
        (CPU_32_CORES, [P100], "precision", ["no tensor cores", "Tesla P100, 6.0"], []),
        (CPU_32_CORES, A100S, "strategy", ["devices=4", "nccl"], []),
        (CPU_32_CORES, [H100], "strategy", ["single device"], []),
        (CPU_2_CORES_AVX2, [], "strategy", ["single process"], []),
        (CPU_2_CORES_AVX2, [], "num_workers", ["compete with the model for the same cores", "DataLoaderTuner"], []),
    ],
)
def test_recommend_reasons(
    cpu: CpuInfo, gpus: list[GpuInfo], key: str, fragments: list[str], absent: list[str]
) -> None:
    """Each reason names the fact that decided it (bf16 instructions and the measurement, devices, cores)."""
    reason = recommend(cpu, gpus)[key]["reason"]
    for fragment in fragments:
        assert fragment in reason
    for fragment in absent:
        assert fragment not in reason


@pytest.mark.parametrize(
    ("processes", "num_nodes", "accelerator", "value", "fragments"),
    [
        (1, 1, "cpu", "auto", ["single process"]),
        (1, 1, "gpu", "auto", ["single device"]),
        (2, 1, "cpu", "ddp", ["2 processes", "devices=2", "CPU process", "gloo"]),
        (4, 1, "gpu", "ddp", ["4 processes", "devices=4", "nccl"]),
        (1, 2, "gpu", "ddp", ["2 processes", "devices=1 x num_nodes=2", "nccl"]),  # one GPU on each of two nodes
        (2, 3, "cpu", "ddp", ["6 processes", "devices=2 x num_nodes=3", "gloo"]),
        (1, 1, "cuda", "auto", ["single device"]),
    ],
)
def test_one_strategy_rule_counts_the_whole_world(
    processes: int, num_nodes: int, accelerator: str, value: str, fragments: list[str]
) -> None:
    """DDP exactly when processes per node x nodes > 1, on GPUs or CPU processes; the reason names the world size."""
    choice = strategy_choice(processes, num_nodes, accelerator)
    assert choice["value"] == value
    for fragment in fragments:
        assert fragment in choice["reason"]


@pytest.mark.parametrize(
    ("processes", "num_nodes", "match"),
    [
        (0, 1, "`processes` must be a positive int, got 0"),
        (1, 0, "`num_nodes` must be a positive int, got 0"),
        (True, 1, "`processes` must be a positive int, got True"),
        (1, "2", "`num_nodes` must be a positive int, got '2'"),
    ],
)
def test_strategy_rule_refuses_bad_counts(processes: Any, num_nodes: Any, match: str) -> None:
    """A non-positive (or boolean, or text) process or node count is refused with the argument's name."""
    with pytest.raises(ValueError, match=match):
        strategy_choice(processes, num_nodes)


@pytest.mark.parametrize(
    ("cpu", "gpus", "devices", "num_nodes", "accelerator"),
    [
        (CPU_32_CORES, [], "auto", 1, "auto"),
        (CPU_32_CORES, [], 4, 1, "auto"),
        (CPU_32_CORES, [], 1, 2, "auto"),
        (CPU_32_CORES, [H100], "auto", 1, "auto"),
        (CPU_32_CORES, [H100], "auto", 4, "auto"),
        (CPU_32_CORES, A100S, 2, 1, "auto"),
        (CPU_32_CORES, A100S, "auto", 1, "cpu"),
        (CPU_32_CORES, A100S, 3, 2, "cpu"),
    ],
)
def test_preset_and_doctor_use_the_same_strategy_rule(
    cpu: CpuInfo, gpus: list[GpuInfo], devices: Any, num_nodes: int, accelerator: str
) -> None:
    """`preset.choose` takes its strategy, reason included, from the rule doctor's `recommend` prints."""
    chosen = choose(cpu, gpus, devices=devices, num_nodes=num_nodes, accelerator=accelerator)
    on_gpu = chosen["accelerator"] == "gpu"
    processes = chosen["devices"]
    rule = strategy_choice(processes, num_nodes, chosen["accelerator"])
    assert (chosen["strategy"], chosen["reasons"]["strategy"]) == (rule["value"], rule["reason"])
    advice = recommend(cpu, gpus[:processes] if on_gpu else [], processes, num_nodes)
    assert advice["strategy"] == rule
    assert chosen["num_workers"] == advice["num_workers"]["value"]


def test_doctor_and_preset_agree_on_this_hardware_by_default() -> None:
    """With every GPU (or one CPU process) on one node, doctor's recommendation is what `choose` picks."""
    for cpu, gpus in ((CPU_32_CORES, []), (CPU_32_CORES, [H100]), (CPU_32_CORES, A100S), (CPU_AMX, [P100])):
        advice, chosen = recommend(cpu, gpus), choose(cpu, gpus)
        assert (chosen["precision"], chosen["strategy"], chosen["num_workers"]) == tuple(
            advice[key]["value"] for key in ("precision", "strategy", "num_workers")
        )


def test_cpu_processes_share_the_cores_for_loader_workers() -> None:
    """On CPU, N training processes split the cores before the quarter for loader workers; on GPUs each keeps one."""
    assert num_workers_choice(CPU_32_CORES, [])["value"] == 8
    assert num_workers_choice(CPU_32_CORES, [], processes=4)["value"] == 2
    assert "32 cores / 4 processes" in num_workers_choice(CPU_32_CORES, [], processes=4)["reason"]
    assert num_workers_choice(CPU_32_CORES, A100S[:2])["value"] == 8
    assert num_workers_choice(CPU_32_CORES, A100S)["value"] == 7


@pytest.mark.parametrize(
    ("gpus", "accelerator", "devices", "expected"),
    [
        ([], "auto", "auto", ("cpu", 1, 0, 1)),
        ([], "cpu", 2, ("cpu", 2, 0, 2)),
        (A100S, "auto", "auto", ("gpu", 4, 4, 4)),
        (A100S, "gpu", -1, ("gpu", 4, 4, 4)),
        (A100S, "cuda", 2, ("cuda", 2, 2, 2)),
        (A100S, "auto", [1, 3], ("gpu", [1, 3], 2, 2)),
        (A100S, "cpu", "auto", ("cpu", 1, 0, 1)),  # GPUs present, CPU asked: no GPU is trained on
    ],
)
def test_placement(gpus: list[GpuInfo], accelerator: str, devices: Any, expected: tuple[Any, ...]) -> None:
    """The accelerator and devices for the Trainer, the GPUs they select and the processes per node."""
    where = placement(CPU_32_CORES, gpus, accelerator, devices)
    assert (where.accelerator, where.devices, len(where.gpus), where.processes) == expected
    if devices == [1, 3]:
        assert [gpu.index for gpu in where.gpus] == [1, 3]


@pytest.mark.parametrize(
    ("gpus", "kwargs", "match"),
    [
        ([], {"accelerator": "gpu"}, r"`accelerator`='gpu' asks for a CUDA GPU, but torch sees none"),
        ([], {"accelerator": "cuda"}, r"`accelerator`='cuda'"),
        (A100S, {"accelerator": "mps"}, r"`accelerator` must be one of 'auto', 'cpu', 'gpu', 'cuda'.*got 'mps'"),
        (A100S, {"accelerator": None}, r"`accelerator` must be .*got None"),
        ([], {"devices": [0, 1]}, r"`devices` must be 'auto' or a positive int, got \[0, 1\]"),
        ([], {"devices": -1}, r"`devices` must be 'auto' or a positive int, got -1"),
        ([], {"devices": True}, r"`devices` must be .*got True"),
        ([], {"devices": 33}, r"`devices`=33 asks for more than this machine has: 32 CPU core"),
        (A100S, {"devices": 5}, r"`devices`=5 asks for more than this machine has: 4 GPU"),
        (A100S, {"devices": [0, 0]}, r"`devices` must be .*list of GPU indices, got \[0, 0\]"),
        (A100S, {"devices": [2, 7]}, r"`devices`=\[2, 7\] names GPUs this machine lacks"),
        (A100S, {"devices": "0,1"}, r"`devices` must be .*got '0,1'"),
    ],
)
def test_placement_refuses_what_the_machine_cannot_do(gpus: list[GpuInfo], kwargs: dict[str, Any], match: str) -> None:
    """A GPU where torch sees none, an accelerator speedkit does not decide for, or malformed devices: a ValueError."""
    with pytest.raises(ValueError, match=match):
        placement(CPU_32_CORES, gpus, **kwargs)


@pytest.mark.parametrize(
    ("given", "expected"),
    [(16, "16-mixed"), ("16", "16-mixed"), ("bf16", "bf16-mixed"), (32, "32-true"), ("64", "64-true"),
     ("bf16-true", "bf16-true"), ("auto", "auto")],
)  # fmt: skip
def test_unified_precision_translates_lightnings_aliases(given: Any, expected: str) -> None:
    """Lightning's legacy precision aliases become its unified names; unified names stay as they are."""
    assert unified_precision(given) == expected


@pytest.mark.parametrize("given", ["fp8", 8, None, True])
def test_unified_precision_refuses_the_unknown(given: Any) -> None:
    """Anything else is refused with the argument's name and the value received."""
    with pytest.raises(ValueError, match=rf"`precision` must be one of .*, got {given!r}\."):
        unified_precision(given)
