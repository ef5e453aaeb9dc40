"""``speedkit doctor``: what this machine has, and the precision, strategy and ``num_workers`` speedkit would choose.

The report is a plain JSON-serialisable dict (:func:`collect`); :func:`format_text` prints it for people and
:func:`main` is what the ``speedkit doctor [--json]`` command runs.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Sequence
from dataclasses import asdict
from importlib import metadata
from typing import Any

import torch

from lightning_speedkit.__about__ import __version__
from lightning_speedkit.hardware import BF16_CPU_FLAGS, CpuInfo, GpuInfo, cpu_info, gpu_infos, nvml_status

__all__ = ["collect", "format_text", "main", "recommend"]

_PACKAGES = ("torch", "lightning", "torchmetrics", "torch-pruning")
_MAX_WORKERS_PER_GPU = 8
_LABEL_WIDTH = 21  # "lightning-speedkit" and two spaces


def recommend(cpu: CpuInfo, gpus: Sequence[GpuInfo]) -> dict[str, dict[str, Any]]:
    """The precision, strategy and ``num_workers`` speedkit would choose here, each with a one-line reason.

    Args:
        cpu: this machine's CPU facts.
        gpus: the CUDA devices to train on; empty for a CPU-only run.

    Returns:
        ``{"precision": {"value": ..., "reason": ...}, "strategy": {...}, "num_workers": {...}}``.

    Example:
        >>> cpu = CpuInfo(8, 8, "test CPU", ("avx2",), "AVX2")
        >>> {key: choice["value"] for key, choice in recommend(cpu, []).items()}
        {'precision': '32-true', 'strategy': 'auto', 'num_workers': 2}
        >>> recommend(cpu, [GpuInfo(0, "NVIDIA A100", (8, 0), 40 * 2**30)])["precision"]["value"]
        '16-mixed'
    """
    return {
        "precision": _precision(cpu, gpus),
        "strategy": _strategy(gpus),
        "num_workers": _num_workers(cpu, gpus),
    }


def collect() -> dict[str, Any]:
    """Gather versions, CPU, GPUs, NVML status and the recommendation into a JSON-serialisable dict.

    Example:
        >>> report = collect()
        >>> sorted(report)
        ['cpu', 'gpus', 'nvml', 'recommendation', 'versions']
    """
    cpu = cpu_info()
    gpus = gpu_infos()
    nvml_ok, nvml_reason = nvml_status()
    versions: dict[str, str | None] = {
        "python": platform.python_version(),
        "lightning_speedkit": __version__,
        **{name.replace("-", "_"): _package_version(name) for name in _PACKAGES},
        "torch_cuda": torch.version.cuda,
    }
    return {
        "versions": versions,
        "cpu": asdict(cpu),
        "gpus": [asdict(gpu) for gpu in gpus],
        "nvml": {"available": nvml_ok, "reason": nvml_reason},
        "recommendation": recommend(cpu, gpus),
    }


def format_text(report: dict[str, Any]) -> str:
    """Render a :func:`collect` report as aligned plain text, one fact per line.

    Args:
        report: the dict returned by :func:`collect` (or read back from its JSON).

    Returns:
        The text, without a trailing newline.
    """
    versions = report["versions"]
    cpu = report["cpu"]
    missing = [flag for flag in BF16_CPU_FLAGS if flag not in cpu["flags"]]
    lines = ["versions"]
    lines += _rows([(name.replace("_", "-"), _version_text(name, v)) for name, v in versions.items()])
    lines += ["", "cpu"]
    lines += _rows(
        [
            ("model", cpu["model"] or "unknown"),
            ("cores", f"{cpu['logical_cores']} logical, {cpu['available_cores']} available to this process"),
            ("torch ISA", cpu["torch_capability"]),
            ("bf16 flags", " ".join(cpu["flags"]) or "none"),
            ("missing", " ".join(missing) or "none"),
        ]
    )
    lines += ["", "gpus"]
    if report["gpus"]:
        for gpu in report["gpus"]:
            major, minor = gpu["capability"]
            lines += _rows(
                [
                    (
                        f"cuda:{gpu['index']}",
                        f"{gpu['name']}, compute {major}.{minor}, {gpu['total_memory_bytes'] / 2**30:.1f} GiB, "
                        f"bf16 {_yes_no(gpu['bf16'])}, tensor cores {_yes_no(gpu['tensor_cores'])}",
                    )
                ]
            )
    else:
        lines += _rows([("cuda", "no CUDA device visible to torch")])
    nvml = report["nvml"]
    lines += ["", "nvml"]
    lines += _rows([("available", f"{_yes_no(nvml['available'])} ({nvml['reason']})")])
    lines += ["", "recommended"]
    lines += _rows(
        [(key, f"{choice['value']!s:<10}  {choice['reason']}") for key, choice in report["recommendation"].items()]
    )
    return "\n".join(lines)


def main(json_output: bool = False) -> int:
    """Print the doctor report (as indented JSON when ``json_output``) and return the exit status 0."""
    report = collect()
    print(json.dumps(report, indent=2) if json_output else format_text(report))
    return 0


def _precision(cpu: CpuInfo, gpus: Sequence[GpuInfo]) -> dict[str, Any]:
    if gpus:
        old = [gpu for gpu in gpus if not gpu.tensor_cores]
        if old:
            return _choice("32-true", f"{_describe(old)} predates Volta (compute < 7.0): no tensor cores for fp16")
        no_bf16 = [gpu for gpu in gpus if not gpu.bf16]
        bf16_note = (
            "'bf16-mixed' is also available (every GPU has compute >= 8.0), needs no loss scaling, and preset's"
            " PrecisionTuner times it against '16-mixed' at fit start"
            if not no_bf16
            else f"'bf16-mixed' is not: {_describe(no_bf16)} has compute < 8.0"
        )
        return _choice("16-mixed", f"to start on CUDA, tensor cores on every GPU; {bf16_note}")
    bf16_flags = cpu.bf16_instructions
    if bf16_flags:
        return _choice(
            "32-true",
            f"to start; the CPU has {' and '.join(bf16_flags)}, so preset's PrecisionTuner times 'bf16-mixed'"
            " against it on real training steps at fit start and keeps the faster (measured on one such CPU:"
            " benchmarks/results/precision.json)",
        )
    return _choice(
        "32-true",
        "no bf16 instructions: bf16 autocast would be emulated (about 10x slower than fp32 measured on an AVX2 CPU),"
        " so it is not tried; Lightning turns '16-mixed' into 'bf16-mixed' on CPU (with a warning)",
    )


def _strategy(gpus: Sequence[GpuInfo]) -> dict[str, Any]:
    if len(gpus) > 1:
        return _choice("ddp", f"{len(gpus)} GPUs: one process per GPU, devices={len(gpus)}")
    if gpus:
        return _choice("auto", "one GPU: single device, no process group")
    return _choice("auto", "CPU only: single process")


def _num_workers(cpu: CpuInfo, gpus: Sequence[GpuInfo]) -> dict[str, Any]:
    cores = cpu.available_cores
    if gpus:
        workers = min(_MAX_WORKERS_PER_GPU, max(1, cores // len(gpus) - 1))
        return _choice(
            workers,
            f"{cores} cores / {len(gpus)} GPU process(es), one core kept for the training loop, "
            f"at least 1 and at most {_MAX_WORKERS_PER_GPU} per process",
        )
    return _choice(
        cores // 4,
        f"{cores} cores // 4: on CPU the loader workers compete with the model for the same cores; "
        "DataLoaderTuner measures it",
    )


def _choice(value: object, reason: str) -> dict[str, Any]:
    return {"value": value, "reason": reason}


def _describe(gpus: Sequence[GpuInfo]) -> str:
    """``"cuda:0 (Tesla P100, 6.0)"``, comma-separated for several GPUs."""
    return ", ".join(f"cuda:{g.index} ({g.name}, {g.capability[0]}.{g.capability[1]})" for g in gpus)


def _package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _rows(pairs: Sequence[tuple[str, object]]) -> list[str]:
    return [f"  {label:<{_LABEL_WIDTH}}{value}" for label, value in pairs]


def _version_text(name: str, version: str | None) -> str:
    if version is not None:
        return version
    return "none (torch built without CUDA)" if name == "torch_cuda" else "not installed"


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"
