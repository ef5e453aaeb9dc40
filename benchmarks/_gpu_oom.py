"""Part 3 of the GPU check: both batch-size finders against a memory cap they must hit.

The cap (``set_per_process_memory_fraction``) is sized from one measured training step so that about a quarter of
the dataset fits: both searches must run out of memory. Each row says whether its search did, with the first message,
then trains and validates at the size found under the same cap. The loader workers are chosen after checking the free
space in ``/dev/shm``. In the CPU rehearsal `MemoryLimit` stands in for the cap.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from _gpu_device import device_trainer, nvml_record, peak_gib, shm_free
from _gpu_record import RunRecord, error_line, recorded_row, release
from _harness import train_step
from lightning.pytorch.callbacks import BatchSizeFinder as LightningFinder
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_speedkit.batch_size import BatchSizeFinder
from lightning_speedkit.demo import DemoClassifier, DemoDataModule
from lightning_speedkit.oom import MemoryLimit, is_oom_error

__all__ = ["choose_workers", "memory_cap", "oom_part"]


def choose_workers(
    cores: int, shm_free: int | None, batch_bytes: int, prefetch: int = 2, most: int = 8
) -> tuple[int, str]:
    """Loader workers: as many as the cores allow (at most ``most``), fewer where their batches would fill /dev/shm.

    Each worker keeps ``prefetch`` batches of ``batch_bytes`` in ``/dev/shm``, and together they may take half of its
    free space: a worker that runs out dies with a bus error, which no batch-size finder treats as an OOM.

    Example:
        >>> choose_workers(16, 64 * 2**30, 180 * 2**20)[1]
        'num_workers=8: 16 batches of 180 MiB in flight, 2.8 GiB of 64.0 GiB free in /dev/shm'
        >>> choose_workers(16, 64 * 2**20, 180 * 2**20)[0]  # a 64 MiB /dev/shm (Docker's default)
        0
    """
    wanted = max(0, min(most, cores))
    if shm_free is None:
        return 0, "num_workers=0: no /dev/shm to pass batches through"
    count = min(wanted, int(shm_free // 2 // max(1, prefetch * batch_bytes)))
    flight = count * prefetch * batch_bytes
    return count, (
        f"num_workers={count}: {count * prefetch} batches of {batch_bytes / 2**20:.0f} MiB in flight,"
        f" {flight / 2**30:.1f} GiB of {shm_free / 2**30:.1f} GiB free in /dev/shm"
    )


def memory_cap(reserved: float, fixed: float, per_sample: float, target: int) -> float:
    """Bytes the CUDA allocator may hold so that about ``target`` samples is the largest batch that fits.

    ``fixed`` and ``per_sample`` come from one training step measured at two batch sizes; ``reserved`` is what the
    allocator holds already. A batch four times ``target`` (the dataset) then needs far more than the cap.

    Example:
        >>> memory_cap(reserved=100e6, fixed=50e6, per_sample=1e6, target=400) / 1e6
        550.0
    """
    return reserved + fixed + per_sample * target


class OomWatched(DemoClassifier):
    """DemoClassifier that records each out-of-memory error of its training and validation steps.

    The finders swallow those in their search; this keeps the stage, the batch size and the message's first line.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ooms: list[dict[str, Any]] = []
        self.searching = True  # until the fit's first real training step (`Outcome` ends it)

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().optimizer_step(*args, **kwargs)  # forward, backward and the step: every training allocation
        except Exception as exc:
            self._note(exc, "training")
            raise

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        try:
            super().validation_step(batch, batch_idx)
        except Exception as exc:
            self._note(exc, "validation")
            raise

    def _note(self, exc: BaseException, stage: str) -> None:
        if is_oom_error(exc):
            size = getattr(self._trainer.datamodule, "batch_size", None) if self._trainer is not None else None
            self.ooms.append(
                {
                    "stage": stage,
                    "batch_size": size,
                    "in_search": self.searching,
                    "message": error_line(exc).split(": ", 1)[1],
                }
            )


class Outcome(Callback):
    """Records the batch size at the first real training step, and how long the search before it took."""

    def __init__(self) -> None:
        self.batch_size: int | None = None
        self.search_s = self._t0 = 0.0

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._t0 = time.perf_counter()

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.batch_size is None:  # both finders hide the callbacks from their trials
            self.search_s = time.perf_counter() - self._t0
            self.batch_size = int(trainer.datamodule.batch_size)  # type: ignore[attr-defined]
            pl_module.searching = False


def _step_memory(
    width: int, crop: int, device: torch.device, sizes: tuple[int, int] = (32, 256)
) -> tuple[float, float]:
    """Peak bytes of one ``16-mixed`` AdamW step of a fresh demo model at two batch sizes: (fixed, per sample).

    A first step, not measured, makes the one-time allocations (the cuBLAS and cuDNN workspaces, which the handles
    keep): measured in the first size's peak and already held in the second's, they made the difference negative
    (H200, torch 2.11: a per-sample figure of one byte, a cap of 0.16 GiB). A figure below the input's own bytes per
    sample is an error, not a cap.
    """

    def peak(n: int) -> float:
        release()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        model = DemoClassifier(width=width, crop_size=crop).to(device)
        x, y = torch.randn(n, 3, crop, crop, device=device), torch.randint(0, 10, (n,), device=device)
        step = train_step(model, x, y, autocast=torch.float16)  # forward, backward, AdamW; it synchronises
        step()
        used = torch.cuda.max_memory_allocated(device) - base
        del model, x, y, step
        return float(used)

    peak(sizes[0])  # the warm-up: one-time allocations
    peaks = [peak(n) for n in sizes]
    release()
    per_sample = (peaks[1] - peaks[0]) / (sizes[1] - sizes[0])
    if per_sample < 3 * crop * crop * 4:
        raise RuntimeError(
            f"per-sample memory measured at {per_sample:.0f} bytes (peaks {peaks[0] / 2**20:.1f} MiB at {sizes[0]},"
            f" {peaks[1] / 2**20:.1f} MiB at {sizes[1]}), below one sample's input: no cap can be sized from it"
        )
    return max(0.0, peaks[0] - per_sample * sizes[0]), per_sample


def oom_part(entry: dict[str, Any], run: RunRecord, s: dict[str, Any], device: torch.device, root: Path) -> None:
    """Part 3: both finders under a memory cap they must hit, then training and validation at the size each found."""
    cuda = device.type == "cuda"
    crop = s["image_size"] * 7 // 8
    train_len = s["num_images"] - max(1, int(s["num_images"] * 0.2))  # DemoDataModule's 80/20 split
    target = max(4, train_len // 4)
    largest = min(s["max_val"], train_len) * (3 * crop * crop * 4 + 8)  # bytes of the largest batch a finder tries
    workers, why = choose_workers(os.cpu_count() or 1, shm_free(), largest, most=s["max_workers"])
    entry["workers"] = {"num_workers": workers, "reason": why, "shm_free_gib": (shm_free() or 0) / 2**30}
    entry["memory"] = {"target_batch": target, "train_samples": train_len}
    if cuda:
        fixed, per_sample = _step_memory(s["width"], crop, device)
        cap = memory_cap(torch.cuda.memory_reserved(device), fixed, per_sample, target)
        fraction = min(1.0, cap / torch.cuda.get_device_properties(device).total_memory)
        entry["memory"].update(
            cap="set_per_process_memory_fraction",
            cap_gib=cap / 2**30,
            fraction=fraction,
            per_sample_mib=per_sample / 2**20,
            fixed_mib=fixed / 2**20,
        )
    else:
        entry["memory"]["cap"] = f"MemoryLimit({target}) (CPU rehearsal: no allocator cap, no per-sample measurement)"
    print(f"  {why}; about {target} of {train_len} samples fit", flush=True)
    rows: list[dict[str, Any]] = entry.setdefault("rows", [])
    try:
        for name in ("speedkit", "lightning"):
            with recorded_row(run, rows, finder=name) as row:
                if cuda:
                    release()
                    torch.cuda.set_per_process_memory_fraction(fraction, device)
                    torch.cuda.reset_peak_memory_stats(device)
                _search(row, s, device, root, workers, None if cuda else target)
    finally:
        release()
        if cuda:
            with contextlib.suppress(Exception):
                torch.cuda.set_per_process_memory_fraction(1.0, device)


def _search(
    row: dict[str, Any], s: dict[str, Any], device: torch.device, root: Path, workers: int, limit: int | None
) -> None:
    """One finder's search, then training and validation at the size it found; whether and where it ran out."""
    cuda = device.type == "cuda"
    L.seed_everything(0, verbose=False)
    data = DemoDataModule(
        s["num_images"], s["image_size"], batch_size=32, cache=True, num_workers=workers, pin_memory=cuda
    )
    model = OomWatched(width=s["width"], crop_size=data.crop_size)
    if limit is not None:
        MemoryLimit(limit).attach(model)  # the rehearsal's allocator: a real torch.OutOfMemoryError above it
    finders = {"speedkit": BatchSizeFinder, "lightning": LightningFinder}
    finder = finders[row["finder"]](mode="binsearch", init_val=32, max_val=s["max_val"])  # the same start for both
    outcome = Outcome()
    trainer = device_trainer(
        device,
        root,
        precision="16-mixed" if cuda else "32-true",
        max_epochs=s["oom_epochs"],
        limit_val_batches=3,
        callbacks=[finder, outcome],
    )
    after = "trained + validated"  # at the size found, under the same cap
    try:
        trainer.fit(model, datamodule=data)
    except Exception as exc:
        if not is_oom_error(exc) and not is_oom_error(exc.__cause__ or exc):
            raise
        after = f"OOM in {'search' if outcome.batch_size is None else 'training/validation'}: {error_line(exc)}"
    searched = [oom for oom in model.ooms if oom["in_search"]]
    trials = finder.report().get("trials", []) if isinstance(finder, BatchSizeFinder) else None
    row.update(
        found=outcome.batch_size,
        search_s=outcome.search_s,
        after_search=after,
        hit_oom=bool(searched),
        oom_count=len(searched),
        first_oom=searched[0] if searched else None,
        peak_memory_gib=peak_gib(device),
        trials=None if trials is None else len(trials),
        nvml=nvml_record(),
    )
    if not searched:
        row["status"] = f"failed: the search never ran out of memory (it stopped at {outcome.batch_size})"
    elif after != "trained + validated":
        row["status"] = f"failed: the size found ({outcome.batch_size}) ran out of memory after the search"
    model.trainer = None  # type: ignore[assignment]
    print(
        f"  {row['finder']}: found {outcome.batch_size}, OOM in its search: {bool(searched)}, then {after}", flush=True
    )
