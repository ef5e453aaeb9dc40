"""Fits on batches resident on the device, clocked between two synchronisations: what parts 1 and 5 measure.

Decoding and copying are out of the way, so the rows measure compute. The clock starts after the warm-up steps,
counts the samples the timed steps really had and reads the device meanwhile (NVML on a GPU).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from _gpu_device import device_trainer, nvml_record, open_quiet_sampler, peak_gib
from _harness import sync
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_speedkit.demo import DemoClassifier
from lightning_speedkit.monitor import measure_flops, training_peak_flops
from lightning_speedkit.sampling import DeviceSampler, SamplerThread

__all__ = ["Clock", "Resident", "accuracy", "full_batches", "on_device", "resident_fit"]

Batch = tuple[torch.Tensor, torch.Tensor]


def full_batches(batches: list[Batch], batch: int) -> list[Batch]:
    """The whole batches only: a partial last batch, cycled, would make samples/s count samples that never ran.

    Example:
        >>> two_and_a_bit = [(torch.zeros(4), torch.zeros(4))] * 2 + [(torch.zeros(1), torch.zeros(1))]
        >>> [len(y) for _, y in full_batches(two_and_a_bit, 4)]
        [4, 4]
    """
    return [(x, y) for x, y in batches if len(y) == batch]


def on_device(loader: DataLoader[Any], device: torch.device, limit: int = 64) -> list[Batch]:
    """The loader's first ``limit`` batches, copied to ``device``."""
    batches = []
    for x, y in loader:
        batches.append((x.to(device), y.to(device)))
        if len(batches) == limit:
            break
    return batches


class Resident(Dataset[Batch]):
    """``length`` batches cycling through a list of whole batches that already live on the device."""

    def __init__(self, batches: list[Batch], length: int) -> None:
        self.batches, self.length = batches, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Batch:
        return self.batches[index % len(self.batches)]


class Clock(Callback):
    """Times the ``steps`` steps after ``warmup`` between two synchronisations and stops the fit after them.

    It counts the samples those steps really had, and reads the device meanwhile (NVML on a GPU).
    """

    def __init__(self, warmup: int, steps: int, device: torch.device) -> None:
        self.warmup, self.steps, self.device = warmup, steps, device
        self.start = self.end = 0.0
        self.timed_steps = self.samples = 0
        self.sampler: DeviceSampler | None = None
        self.thread: SamplerThread | None = None
        self.readings: list[Any] = []

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if idx == self.warmup:
            self.sampler = open_quiet_sampler(self.device)
            self.thread = SamplerThread(self.sampler, interval_s=0.1)
            self.thread.start()
            sync(self.device)
            self.start = time.perf_counter()
        if idx >= self.warmup:
            self.samples += len(batch[1])

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, out: Any, batch: Any, idx: int
    ) -> None:
        self.timed_steps += idx >= self.warmup
        trainer.should_stop = trainer.should_stop or idx + 1 >= self.warmup + self.steps

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        sync(self.device)
        self.end = time.perf_counter()
        self._stop()

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        if self.thread is not None:
            self.thread.stop()
            self.readings += [r for r in self.thread.drain() if r.device != "cpu"]
            self.thread = None

    def figures(self) -> dict[str, Any]:
        """Samples/s and ms per step of the timed steps, the device's mean utilisation and power over them."""
        seconds = max(self.end - self.start, 1e-9)
        util = [r.utilization for r in self.readings if r.utilization is not None]
        power = [r.power_w for r in self.readings if r.power_w is not None]
        return {
            "samples_per_s": self.samples / seconds,
            "step_ms": 1000 * seconds / max(self.timed_steps, 1),
            "timed_steps": self.timed_steps,
            "timed_samples": self.samples,
            "gpu_utilization": sum(util) / len(util) if util else None,
            "gpu_power_w": sum(power) / len(power) if power else None,
            "nvml": nvml_record(self.sampler),
        }


def accuracy(model: L.LightningModule, batches: list[Batch]) -> float:
    """Top-1 accuracy of ``model`` on resident batches (eval mode, then back to training)."""
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in batches:
            correct += int((model(x).argmax(1) == y).sum())
            total += len(y)
    model.train()
    return correct / max(total, 1)


def resident_fit(
    s: dict[str, Any],
    device: torch.device,
    root: Path,
    crop: int,
    train: list[Any],
    precision: str,
    callbacks: list[Callback],
    unbounded: bool = False,
) -> tuple[dict[str, Any], DemoClassifier]:
    """One fit of ``warmup + steps`` steps on resident batches: its figures (MFU against the right peak), its model.

    ``unbounded``: the fit is planned without an end (the clock stops it), so a lever's probe can pay back.
    """
    L.seed_everything(0, verbose=False)
    model = DemoClassifier(width=s["width"], crop_size=crop)
    x = train[0][0]
    flops_per_sample = measure_flops(model, [x]) / len(x)  # before any callback compiles the model
    clock = Clock(s["warmup"], s["steps"], device)
    steps = s["warmup"] + s["steps"]
    loader = DataLoader(Resident(train, steps), batch_size=None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    limits = {"max_epochs": -1} if unbounded else {"max_steps": steps}
    trainer = device_trainer(device, root, precision=precision, callbacks=[*callbacks, clock], **limits)
    trainer.fit(model, train_dataloaders=loader)
    row = {"plugin": str(trainer.precision), **clock.figures(), "peak_memory_gib": peak_gib(device)}
    cuda = device.type == "cuda"  # a CPU has no peak in the table: no MFU in the rehearsal
    name = torch.cuda.get_device_name(device) if cuda else ""
    row["peak_flops"], row["peak_key"] = training_peak_flops(name, row["plugin"], model) if cuda else (None, None)
    row["flops_per_sample"] = flops_per_sample
    row["mfu"] = flops_per_sample * row["samples_per_s"] / row["peak_flops"] if row["peak_flops"] else None
    model.trainer = None  # type: ignore[assignment]  # the trainer holds the loader, the loader the GPU batches
    return row, model
