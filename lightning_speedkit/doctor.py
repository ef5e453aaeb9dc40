"""``speedkit doctor``: what this machine has, and the precision, strategy and ``num_workers`` speedkit would choose.

The report is a plain JSON-serialisable dict (:func:`collect`); :func:`format_text` prints it for people and
:func:`main` is what the ``speedkit doctor [--json]`` command runs. The recommendation is
`lightning_speedkit.recommend.recommend` for every GPU torch sees (or one CPU process), the rules `preset` uses.
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
from lightning_speedkit.hardware import CPU_FLAGS, cpu_info, gpu_infos, nvml_status
from lightning_speedkit.recommend import recommend
from lightning_speedkit.trials.memory import DecisionMemory

__all__ = ["collect", "format_text", "main"]

_PACKAGES = ("torch", "lightning", "torchmetrics", "torch-pruning")
_LABEL_WIDTH = 21  # "lightning-speedkit" and two spaces


def collect() -> dict[str, Any]:
    """Gather versions, CPU, GPUs, NVML status and the recommendation into a JSON-serialisable dict.

    Example:
        >>> report = collect()
        >>> sorted(report)
        ['cpu', 'gpus', 'nvml', 'recommendation', 'remembered', 'versions']
    """
    cpu = cpu_info()
    gpus = gpu_infos()
    nvml_ok, nvml_reason = nvml_status()
    memory = DecisionMemory()
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
        "remembered": {"dir": str(memory.root), "entries": memory.entries()},
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
    missing = [flag for flag in CPU_FLAGS if flag not in cpu["flags"]]
    lines = ["versions"]
    lines += _rows([(name.replace("_", "-"), _version_text(name, v)) for name, v in versions.items()])
    lines += ["", "cpu"]
    lines += _rows(
        [
            ("model", cpu["model"] or "unknown"),
            ("cores", f"{cpu['logical_cores']} logical, {cpu['available_cores']} available to this process"),
            ("torch ISA", cpu["torch_capability"]),
            ("ISA flags", " ".join(cpu["flags"]) or "none"),
            ("missing", " ".join(missing) or "none"),
            ("forced ISA", cpu.get("isa_limit") or "none (ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA unset)"),
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
    remembered = report.get("remembered", {"dir": "", "entries": []})
    lines += ["", f"remembered decisions ({remembered['dir']}; `speedkit forget` clears them)"]
    entries = remembered["entries"] or [{"lever": "none", "decision": "", "made": "", "device": ""}]
    lines += _rows(
        [
            (e["lever"], f"{e['decision'] or ''}  {e.get('made') or ''}  {e.get('device') or ''}".strip())
            for e in entries
        ]
    )
    return "\n".join(lines)


def main(json_output: bool = False) -> int:
    """Print the doctor report (as indented JSON when ``json_output``) and return the exit status 0."""
    report = collect()
    print(json.dumps(report, indent=2) if json_output else format_text(report))
    return 0


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
