"""The GPU check's device: what it is, what NVML says about it, its Trainer, its peak memory and /dev/shm."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from _harness import quiet_trainer

from lightning_speedkit.hardware import nvml_status
from lightning_speedkit.monitor import tf32_allowed
from lightning_speedkit.sampling import DeviceSampler, open_sampler

__all__ = ["describe", "device_trainer", "nvml_record", "open_quiet_sampler", "peak_gib", "shm_free"]


def device_trainer(device: torch.device, root: Path, **kwargs: Any) -> L.Trainer:
    """A quiet Trainer on one ``device`` writing under ``root``, without the sanity check; ``kwargs`` override."""
    return quiet_trainer(device, **{"devices": 1, "default_root_dir": root, "num_sanity_val_steps": 0, **kwargs})


def nvml_record(sampler: DeviceSampler | None = None) -> dict[str, Any]:
    """NVML's status now and, for a row that read the device, the sampler it got and why not NVML's."""
    ok, detail = nvml_status()
    record: dict[str, Any] = {"ok": ok, "detail": detail}
    if sampler is not None:
        record.update(sampler=type(sampler).__name__, fallback_reason=getattr(sampler, "fallback_reason", None))
    return record


def open_quiet_sampler(device: torch.device) -> DeviceSampler:
    """`open_sampler`; the fallback's warning goes to the JSON (the sampler carries the reason), once per row."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return open_sampler(device)


def peak_gib(device: torch.device) -> float | None:
    """The CUDA allocator's peak since its last reset, in GiB; None on a CPU."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def shm_free() -> int | None:
    """Free bytes in /dev/shm (where loader workers pass their batches), None without one."""
    try:
        return int(shutil.disk_usage("/dev/shm").free)
    except OSError:
        return None


def describe(device: torch.device) -> dict[str, Any]:
    """The versions, the device and its memory, the cores, /dev/shm and whether TF32 is allowed."""
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "lightning": L.__version__,
        "type": device.type,
        "cpu_count": os.cpu_count(),
        "shm_free_gib": (shm_free() or 0) / 2**30,
        "tf32_allowed": tf32_allowed(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            name=props.name,
            memory_gib=props.total_memory / 2**30,
            capability=f"{props.major}.{props.minor}",
            cuda=torch.version.cuda,
            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        )
    return info
