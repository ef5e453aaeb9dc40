"""GPU check: AMP vs fp32 with MFU, NVML readings, both batch-size finders against real CUDA OOM, INT8, compile.

One command; its parts run in order on one CUDA device with the embedded demo workload (DemoClassifier,
DemoDataModule):

0. data: the demo images, generated and packed (every part uses them).
1. precision: the same model trained for the same steps in ``32-true``, ``16-mixed``, ``16-mixed`` with
   `ChannelsLast`, ``bf16-mixed``, and `PrecisionTuner` choosing between ``16-mixed`` and ``bf16-mixed`` by timing
   them, on real demo batches kept on the GPU (whole batches only), so the rows measure compute, not decoding. Each
   row: samples/s between two ``torch.cuda.synchronize()`` after warm-up steps, peak memory, val_acc, MFU with the
   peak it divides by (TF32's for this conv net in ``32-true``: cuDNN runs its convolutions in TF32), and NVML's
   utilisation and power over the timed steps. The resident batches are released before part 2.
2. monitor: UtilizationMonitor with NVML readings on the naive pipeline (a JPEG decoded per sample, no workers), then
   on the decoded-image cache with `DataLoaderTuner`. A GPU whose NVML does not answer fails this part, saying why.
3. batch_size: speedkit's finder and Lightning's under a CUDA memory cap (``set_per_process_memory_fraction``) sized
   from one measured training step so that about a quarter of the dataset fits: both searches must run out of
   memory. Each row says whether its search did, with the first message, then trains and validates at the size found
   under the same cap. The loader workers are chosen after checking the free space in ``/dev/shm``.
4. int8: the ``16-mixed`` model of part 1 exported with `export_int8` (ONNX Runtime on the CPU).
5. compile: ``16-mixed`` eager, then compiled by `Compile` (inductor); last, as the slowest and least certain step.

Every part and row has a ``status`` (``ok``, ``partial``, ``failed``, ``timeout`` or ``skipped: <why>``) in the JSON,
which is written atomically when the run starts and after every row and part; an error is recorded with its
traceback and the next part runs. A watchdog ends the run within its time budget (8 minutes, 3 with ``--quick``),
marking the part it interrupted ``timeout``. Exit status: 0 when every part is ``ok`` or skipped, 1 when one is
not, 3 when the budget ran out.

    python benchmarks/gpu_check.py --out gpu_check.json              # one GPU: about 4-5 minutes, at most 8
    python benchmarks/gpu_check.py --quick --out gpu_check.json      # at most 3 minutes
    python3 benchmarks/gpu_check.py --out "$OUT/gpu_check.json"      # a lent machine brings back only $OUT
    python benchmarks/gpu_check.py --allow-cpu --quick --out /tmp/gpu_check.json   # rehearsal, no GPU needed

Without a CUDA device it prints ``skipped: no CUDA device``, writes that to the JSON and exits 0. ``--allow-cpu``
rehearses every part on the CPU instead, tiny and on one thread, with the CUDA-only steps marked skipped (the memory
cap becomes `MemoryLimit`, which raises a real ``torch.OutOfMemoryError``; compile uses ``aot_eager``).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # a lent machine has the checkout, not an installed package
    sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import argparse
import contextlib
import gc
import os
import shutil
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BatchSizeFinder as LightningFinder
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_speedkit.batch_size import BatchSizeFinder
from lightning_speedkit.channels_last import ChannelsLast
from lightning_speedkit.dataloader import DataLoaderTuner
from lightning_speedkit.demo import DemoClassifier, DemoDataModule
from lightning_speedkit.hardware import nvml_status
from lightning_speedkit.monitor import UtilizationMonitor, measure_flops, tf32_allowed, training_peak_flops
from lightning_speedkit.oom import MemoryLimit, is_oom_error
from lightning_speedkit.precision import PrecisionTuner
from lightning_speedkit.report import write_json_atomic
from lightning_speedkit.sampling import DeviceSampler, SamplerThread, open_sampler

DEFAULT_OUT = Path(__file__).parent / "results" / "gpu_check.json"
SKIP_LINE = "skipped: no CUDA device"
PARTS = ("data", "precision", "monitor", "batch_size", "int8", "compile")
BUDGET_S = {"full": 480.0, "quick": 180.0}
MIN_PART_S = 10.0  # a part (or row) that would start with less of the budget left is skipped, not cut short
MIN_COMPILE_S = 60.0  # inductor's first compile of the demo model's training step
EXIT_OK, EXIT_FAILED, EXIT_TIMEOUT = 0, 1, 3
CUDA_ONLY = [
    "bf16-mixed row",
    "peak memory",
    "NVML readings",
    "MFU (no peak for a CPU)",
    "memory cap (MemoryLimit stands in)",
    "per-sample memory measurement",
    "inductor (aot_eager stands in)",
]


def settings(quick: bool, cpu: bool = False) -> dict[str, Any]:
    """Sizes of each part; ``cpu`` is the rehearsal's (``--allow-cpu``): the same code, tiny."""
    if cpu:
        return {"num_images": 200, "image_size": 32, "width": 8, "batch": 16, "warmup": 2, "steps": 6,
                "monitor_steps": 12, "window": 4, "max_val": 128, "oom_epochs": 1, "calibration": 2,
                "max_workers": 1}  # fmt: skip
    if quick:
        return {"num_images": 2000, "image_size": 64, "width": 32, "batch": 128, "warmup": 10, "steps": 50,
                "monitor_steps": 30, "window": 10, "max_val": 16384, "oom_epochs": 1, "calibration": 8,
                "max_workers": 4}  # fmt: skip
    return {"num_images": 6000, "image_size": 64, "width": 64, "batch": 256, "warmup": 30, "steps": 180,
            "monitor_steps": 60, "window": 10, "max_val": 16384, "oom_epochs": 2, "calibration": 16,
            "max_workers": 8}  # fmt: skip


# ---------------------------------------------------------------------------------------------- pure helpers


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


def full_batches(
    batches: list[tuple[torch.Tensor, torch.Tensor]], batch: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The whole batches only: a partial last batch, cycled, would make samples/s count samples that never ran.

    Example:
        >>> two_and_a_bit = [(torch.zeros(4), torch.zeros(4))] * 2 + [(torch.zeros(1), torch.zeros(1))]
        >>> [len(y) for _, y in full_batches(two_and_a_bit, 4)]
        [4, 4]
    """
    return [(x, y) for x, y in batches if len(y) == batch]


# ---------------------------------------------------------------------------------------------- the run record


class _Run:
    """The result, written atomically after every row and part, and a watchdog that ends the run on its budget.

    When the budget runs out the watchdog marks the part it interrupted ``timeout`` and the parts still to come
    ``skipped``, writes the JSON and ends the process (`EXIT_TIMEOUT`): a hung CUDA call or loader cannot hold it.
    """

    def __init__(
        self, result: dict[str, Any], out: Path, budget_s: float, exit_fn: Callable[[int], Any] = os._exit
    ) -> None:
        self.result, self.out, self.budget_s, self.exit_fn = result, out, budget_s, exit_fn
        self.started = time.monotonic()
        self.current: str | None = None
        self.lock = threading.RLock()
        self.timer = threading.Timer(budget_s, self.expire)
        self.timer.daemon = True

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def save(self) -> None:
        """Write the JSON now; never raises (a failed write is printed and the check goes on)."""
        with self.lock:
            self.result["seconds"] = round(time.monotonic() - self.started, 1)
            for _ in range(3):
                try:
                    write_json_atomic(self.result, self.out)
                    return
                except RuntimeError:  # a row changed while json walked the dict: again
                    continue
                except Exception as exc:
                    print(f"gpu_check: could not write {self.out} ({type(exc).__name__}: {exc})", flush=True)
                    return

    def part(
        self, name: str, body: Callable[[dict[str, Any]], None], inject: str | None = None, min_s: float = MIN_PART_S
    ) -> None:
        """Run one part; its status (and error) reach the JSON whatever happens, and the next part runs regardless."""
        entry = self.result["parts"][name]
        if self.left() < min_s:
            entry["status"] = f"skipped: {max(0.0, self.left()):.0f} s of the budget left, the part needs {min_s:.0f}"
            self.save()
            return
        self.current, entry["status"], start = name, "running", time.monotonic()
        print(f"{name} ...", flush=True)
        self.save()
        try:
            body(entry)
            if inject == name:
                raise RuntimeError(f"injected failure (--inject-failure {name})")
            if entry["status"] == "running":
                bad = [row for row in entry.get("rows", []) if not _passed(row["status"])]
                entry["status"] = "partial" if bad else "ok"
        except Exception as exc:
            entry.update(status="failed", error=_error(exc), traceback=traceback.format_exc()[-4000:])
            print(f"  {name} failed: {entry['error']}", flush=True)
        finally:
            entry["seconds"] = round(time.monotonic() - start, 1)
            self.current = None
            _release()
            self.save()

    def expire(self) -> None:
        """The budget ran out: record it, write, print what there is, end the process."""
        locked = self.lock.acquire(timeout=10)
        try:
            for name, entry in self.result["parts"].items():
                if name == self.current:
                    entry.update(status="timeout", error=f"the time budget of {self.budget_s:.0f} s ran out here")
                elif entry["status"] in ("pending", "running"):
                    entry["status"] = "skipped: the time budget ran out"
            self.result["status"] = "timeout"
            self.save()
            with contextlib.suppress(Exception):
                print(format_table(self.result), flush=True)
            print(
                f"gpu_check: the budget of {self.budget_s:.0f} s ran out in {self.current}; wrote {self.out}",
                flush=True,
            )
        finally:
            if locked:
                self.lock.release()
            self.exit_fn(EXIT_TIMEOUT)


@contextlib.contextmanager
def _row(record: _Run, rows: list[dict[str, Any]], /, **fields: Any) -> Iterator[dict[str, Any]]:
    """A row appended to ``rows``: an error inside is recorded in it (not raised), and the JSON is written after it."""
    row = {**fields, "status": "ok"}
    rows.append(row)
    try:
        yield row
    except Exception as exc:
        row.update(status=f"failed: {_error(exc)}", traceback=traceback.format_exc()[-2000:])
        print(f"  {' '.join(map(str, fields.values()))} failed: {_error(exc)}", flush=True)
    finally:
        record.save()


def _passed(status: str) -> bool:
    return status == "ok" or status.startswith("skipped")


def _error(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"


def _release() -> None:
    """Collect garbage, return the CUDA allocator's cached blocks; never raises (a failed part may break CUDA)."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def _nvml(sampler: DeviceSampler | None = None) -> dict[str, Any]:
    """NVML's status now and, for a row that read the device, the sampler it got and why not NVML's."""
    ok, detail = nvml_status()
    record: dict[str, Any] = {"ok": ok, "detail": detail}
    if sampler is not None:
        record.update(sampler=type(sampler).__name__, fallback_reason=getattr(sampler, "fallback_reason", None))
    return record


def _open_sampler(device: torch.device) -> DeviceSampler:
    """`open_sampler`; the fallback's warning goes to the JSON (the sampler carries the reason), once per row."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return open_sampler(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _trainer(device: torch.device, root: Path, **kwargs: Any) -> L.Trainer:
    defaults: dict[str, Any] = {
        "accelerator": "gpu" if device.type == "cuda" else "cpu",
        "devices": 1,
        "default_root_dir": root,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    return L.Trainer(**{**defaults, **kwargs})


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _shm_free() -> int | None:
    try:
        return int(shutil.disk_usage("/dev/shm").free)
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------- part 1: precision


class _Resident(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``length`` batches cycling through a list of whole batches that already live on the device."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> None:
        self.batches, self.length = batches, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batches[index % len(self.batches)]


class _Clock(Callback):
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
            self.sampler = _open_sampler(self.device)
            self.thread = SamplerThread(self.sampler, interval_s=0.1)
            self.thread.start()
            _sync(self.device)
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
        _sync(self.device)
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
            "nvml": _nvml(self.sampler),
        }


def _on_device(
    loader: DataLoader[Any], device: torch.device, limit: int = 64
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    batches = []
    for x, y in loader:
        batches.append((x.to(device), y.to(device)))
        if len(batches) == limit:
            break
    return batches


def _accuracy(model: L.LightningModule, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in batches:
            correct += int((model(x).argmax(1) == y).sum())
            total += len(y)
    model.train()
    return correct / max(total, 1)


def timed_fit(
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
    clock = _Clock(s["warmup"], s["steps"], device)
    steps = s["warmup"] + s["steps"]
    loader = DataLoader(_Resident(train, steps), batch_size=None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    limits = {"max_epochs": -1} if unbounded else {"max_steps": steps}
    trainer = _trainer(device, root, precision=precision, callbacks=[*callbacks, clock], **limits)
    trainer.fit(model, train_dataloaders=loader)
    row = {"plugin": str(trainer.precision), **clock.figures(), "peak_memory_gib": _peak_gib(device)}
    cuda = device.type == "cuda"  # a CPU has no peak in the table: no MFU in the rehearsal
    name = torch.cuda.get_device_name(device) if cuda else ""
    row["peak_flops"], row["peak_key"] = training_peak_flops(name, row["plugin"], model) if cuda else (None, None)
    row["flops_per_sample"] = flops_per_sample
    row["mfu"] = flops_per_sample * row["samples_per_s"] / row["peak_flops"] if row["peak_flops"] else None
    model.trainer = None  # type: ignore[assignment]  # the trainer holds the loader, the loader the GPU batches
    return row, model


def precision_part(
    entry: dict[str, Any],
    run: _Run,
    s: dict[str, Any],
    device: torch.device,
    root: Path,
    data: DemoDataModule,
    keep: dict[str, Any],
) -> None:
    """Part 1: a row per precision, and PrecisionTuner's measured choice, on batches resident on the device."""
    cuda = device.type == "cuda"
    train = full_batches(_on_device(data.train_dataloader(), device), s["batch"])
    val = _on_device(data.val_dataloader(), device)
    tuned = ["16-mixed", "bf16-mixed"] if cuda else ["32-true", "bf16-mixed"]  # CPU: Lightning runs 16-mixed as bf16
    bf16 = None if cuda and torch.cuda.is_bf16_supported() else "skipped: needs a CUDA GPU with bf16"
    runs: list[tuple[str, str, Callable[[], list[Callback]], str | None]] = [
        ("32-true", "32-true", list, None),
        ("16-mixed", "16-mixed", list, None),
        ("16-mixed+NHWC", "16-mixed", lambda: [ChannelsLast(measure=False)], None),
        ("bf16-mixed", "bf16-mixed", list, bf16),
        (f"PrecisionTuner({'|'.join(tuned)})", tuned[0], lambda: [PrecisionTuner(candidates=tuned)], None),
    ]
    rows: list[dict[str, Any]] = entry.setdefault("rows", [])
    try:
        for label, precision, callbacks, skip in runs:
            with _row(run, rows, precision=label) as row:
                if skip is not None or run.left() < MIN_PART_S:
                    row["status"] = skip or "skipped: time budget"
                    continue
                extra = callbacks()
                figures, model = timed_fit(
                    s,
                    device,
                    root,
                    data.crop_size,
                    train,
                    precision,
                    extra,
                    unbounded=label.startswith("PrecisionTuner"),
                )
                row.update(figures, val_acc=_accuracy(model.to(device), val))
                if label.startswith("PrecisionTuner"):
                    row["decision"] = extra[0].report()  # type: ignore[attr-defined]
                if label == "16-mixed":
                    keep["int8_model"] = model
                model.cpu()
                print(f"  {label}: {row['samples_per_s']:,.0f} samples/s", flush=True)
        base = next((r for r in rows if r["precision"] == "32-true" and "samples_per_s" in r), None)
        for row in rows:
            if base is not None and "samples_per_s" in row:
                row["speedup_vs_fp32"] = row["samples_per_s"] / base["samples_per_s"]
    finally:  # free the resident batches, whoever still holds the lists, before part 2 and part 3's memory cap
        train.clear()
        val.clear()
        _release()
        with contextlib.suppress(Exception):
            entry["memory_allocated_after_gib"] = torch.cuda.memory_allocated(device) / 2**30 if cuda else None


# ---------------------------------------------------------------------------------------------- part 2: monitor


class _Recorder(Logger):
    """Keeps every logged metric in memory (the monitor's NVML readings arrive through the loggers)."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict[str, float]] = []

    @property
    @override
    def name(self) -> str:
        return "recorder"

    @property
    @override
    def version(self) -> int:
        return 0

    @override
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    @override
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append(dict(metrics))

    def mean(self, key: str) -> float | None:
        values = [m[f"speedkit/monitor/{key}"] for m in self.metrics if f"speedkit/monitor/{key}" in m]
        return sum(values) / len(values) if values else None

    def peak(self, key: str) -> float | None:
        values = [m[f"speedkit/monitor/{key}"] for m in self.metrics if f"speedkit/monitor/{key}" in m]
        return max(values) if values else None


def monitor_part(entry: dict[str, Any], run: _Run, s: dict[str, Any], device: torch.device, root: Path) -> None:
    """Part 2: UtilizationMonitor on the naive pipeline, then on the cached one tuned by DataLoaderTuner."""
    cuda = device.type == "cuda"
    runs: list[tuple[str, bool, Callable[[], list[Callback]]]] = [
        ("JPEG decode, 0 workers", False, list),
        ("cached + DataLoaderTuner", True, lambda: [DataLoaderTuner()]),
    ]
    rows: list[dict[str, Any]] = entry.setdefault("rows", [])
    for name, cache, extra in runs:
        with _row(run, rows, run=name) as row:
            L.seed_everything(0, verbose=False)
            data = DemoDataModule(s["num_images"], s["image_size"], batch_size=s["batch"], cache=cache)
            model = DemoClassifier(width=s["width"], crop_size=data.crop_size)
            opened: list[DeviceSampler] = []

            def sampler(dev: torch.device, opened: list[DeviceSampler] = opened) -> DeviceSampler:
                opened.append(_open_sampler(dev))
                return opened[-1]

            monitor = UtilizationMonitor(window=s["window"], sample_interval=0.2, sampler=sampler, summary=False)
            recorder = _Recorder()
            trainer = _trainer(
                device,
                root,
                precision="16-mixed" if cuda else "32-true",
                max_steps=s["monitor_steps"],
                limit_val_batches=0,
                logger=recorder,
                callbacks=[*extra(), monitor],
            )
            trainer.fit(model, datamodule=data)
            report = monitor.report()
            row.update(
                num_workers=(report["loader"] or {}).get("num_workers", data.num_workers),
                diagnosis=report["diagnosis"],
                advice=report["advice"],
                data_wait_fraction=report["total"]["data_wait_fraction"],
                samples_per_s=report["total"]["samples_per_second"],
                gpu_utilization=recorder.mean("gpu_utilization"),
                gpu_memory_used_gb=recorder.peak("gpu_memory_used_gb"),
                gpu_power_w=recorder.mean("gpu_power_w"),
                gpu_temperature_c=recorder.peak("gpu_temperature_c"),
                gpu_sm_clock_mhz=recorder.mean("gpu_sm_clock_mhz"),
                mfu=report["mfu"],
                peak_flops=report["peak_flops"],
                peak_key=training_peak_flops(report["device"], str(trainer.precision), model)[1] if cuda else None,
                sampling_error=report["sampling_error"],
                nvml=_nvml(opened[0] if opened else None),
            )
            if cuda and row["nvml"].get("sampler") != "NvmlSampler":  # the GPU columns would be empty: say why
                row["status"] = f"failed: NVML unavailable: {row['nvml']['fallback_reason'] or row['nvml']['detail']}"
            model.trainer = None  # type: ignore[assignment]
            print(f"  monitor {name}: {report['diagnosis']}", flush=True)


# ---------------------------------------------------------------------------------------------- part 3: batch size


class _OomWatched(DemoClassifier):
    """DemoClassifier that records each out-of-memory error of its training and validation steps.

    The finders swallow those in their search; this keeps the stage, the batch size and the message's first line.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ooms: list[dict[str, Any]] = []
        self.searching = True  # until the fit's first real training step (`_Outcome` ends it)

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
                    "message": _error(exc).split(": ", 1)[1],
                }
            )


class _Outcome(Callback):
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


def _step_memory(width: int, crop: int, device: torch.device, sizes: tuple[int, int] = (16, 64)) -> tuple[float, float]:
    """Peak bytes of one ``16-mixed`` AdamW step of a fresh demo model at two batch sizes: (fixed, per sample)."""
    peaks = []
    for n in sizes:
        _release()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        model = DemoClassifier(width=width, crop_size=crop).to(device)
        optimizer = torch.optim.AdamW(model.parameters())
        x, y = torch.randn(n, 3, crop, crop, device=device), torch.randint(0, 10, (n,), device=device)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        _sync(device)
        peaks.append(torch.cuda.max_memory_allocated(device) - base)
        del model, optimizer, x, y, loss
    _release()
    per_sample = max(1.0, (peaks[1] - peaks[0]) / (sizes[1] - sizes[0]))
    return max(0.0, peaks[0] - per_sample * sizes[0]), per_sample


def oom_part(entry: dict[str, Any], run: _Run, s: dict[str, Any], device: torch.device, root: Path) -> None:
    """Part 3: both finders under a memory cap they must hit, then training and validation at the size each found."""
    cuda = device.type == "cuda"
    crop = s["image_size"] * 7 // 8
    train_len = s["num_images"] - max(1, int(s["num_images"] * 0.2))  # DemoDataModule's 80/20 split
    target = max(4, train_len // 4)
    largest = min(s["max_val"], train_len) * (3 * crop * crop * 4 + 8)  # bytes of the largest batch a finder tries
    workers, why = choose_workers(os.cpu_count() or 1, _shm_free(), largest, most=s["max_workers"])
    entry["workers"] = {"num_workers": workers, "reason": why, "shm_free_gib": (_shm_free() or 0) / 2**30}
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
            with _row(run, rows, finder=name) as row:
                if cuda:
                    _release()
                    torch.cuda.set_per_process_memory_fraction(fraction, device)
                    torch.cuda.reset_peak_memory_stats(device)
                _search(row, s, device, root, workers, None if cuda else target)
    finally:
        _release()
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
    model = _OomWatched(width=s["width"], crop_size=data.crop_size)
    if limit is not None:
        MemoryLimit(limit).attach(model)  # the rehearsal's allocator: a real torch.OutOfMemoryError above it
    finders = {"speedkit": BatchSizeFinder, "lightning": LightningFinder}
    finder = finders[row["finder"]](mode="binsearch", init_val=32, max_val=s["max_val"])  # the same start for both
    outcome = _Outcome()
    trainer = _trainer(
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
        after = f"OOM in {'search' if outcome.batch_size is None else 'training/validation'}: {_error(exc)}"
    searched = [oom for oom in model.ooms if oom["in_search"]]
    trials = finder.report().get("trials", []) if isinstance(finder, BatchSizeFinder) else None
    row.update(
        found=outcome.batch_size,
        search_s=outcome.search_s,
        after_search=after,
        hit_oom=bool(searched),
        oom_count=len(searched),
        first_oom=searched[0] if searched else None,
        peak_memory_gib=_peak_gib(device),
        trials=None if trials is None else len(trials),
        nvml=_nvml(),
    )
    if not searched:
        row["status"] = f"failed: the search never ran out of memory (it stopped at {outcome.batch_size})"
    model.trainer = None  # type: ignore[assignment]
    print(
        f"  {row['finder']}: found {outcome.batch_size}, OOM in its search: {bool(searched)}, then {after}", flush=True
    )


# ---------------------------------------------------------------------------------------------- parts 4 and 5


def int8_part(entry: dict[str, Any], s: dict[str, Any], data: DemoDataModule, out: Path, keep: dict[str, Any]) -> None:
    """Part 4: the GPU-trained model to a verified INT8 ONNX model (ONNX Runtime on the CPU)."""
    from lightning_speedkit.int8 import export_int8

    model = keep.get("int8_model")
    entry["model"] = "the 16-mixed model of part 1" if model is not None else "untrained: part 1 left no model"
    if model is None:
        model = DemoClassifier(width=s["width"], crop_size=data.crop_size)
    model = model.to("cpu").float()
    data.num_workers, data.pin_memory = 0, False
    report = export_int8(
        model,
        data.train_dataloader(),
        out / "model.onnx",
        calibration_batches=s["calibration"],
        validation_data=data.val_dataloader(),
        latency_batch_size=32,
    )
    entry.update(report=dict(report), nvml=_nvml())


def compile_part(
    entry: dict[str, Any], run: _Run, s: dict[str, Any], device: torch.device, root: Path, data: DemoDataModule
) -> None:
    """Part 5: ``16-mixed`` eager, then compiled by `Compile` (``measure=False``: it compiles, the clock times)."""
    try:
        from lightning_speedkit.compile import Compile
    except Exception as exc:  # still being written, or broken: a skipped row, not a failed check
        entry["status"] = f"skipped: lightning_speedkit.compile unavailable ({_error(exc)})"
        return
    cuda = device.type == "cuda"
    entry["backend"] = "inductor" if cuda else "aot_eager (CPU rehearsal; inductor on CUDA)"
    train = full_batches(_on_device(data.train_dataloader(), device), s["batch"])
    rows: list[dict[str, Any]] = entry.setdefault("rows", [])
    try:
        for label in ("16-mixed", "16-mixed+compile"):
            with _row(run, rows, precision=label) as row:
                lever = (
                    [Compile(measure=False, backend="inductor" if cuda else "aot_eager")] if "compile" in label else []
                )
                figures, _ = timed_fit(s, device, root, data.crop_size, train, "16-mixed", lever)
                row.update(figures, decision=lever[0].report() if lever else None)
        if all("samples_per_s" in row for row in rows):
            entry["speedup"] = rows[1]["samples_per_s"] / rows[0]["samples_per_s"]
    finally:
        train.clear()
        with contextlib.suppress(Exception):
            torch._dynamo.reset()  # the compiled graphs and their caches go with the part


# ---------------------------------------------------------------------------------------------- the run


def run(
    quick: bool = False,
    out: str | Path = DEFAULT_OUT,
    allow_cpu: bool = False,
    budget_s: float | None = None,
    inject: str | None = None,
) -> dict[str, Any]:
    """Every part in order (or skip without CUDA), the JSON written as it goes; print the tables, return the result."""
    out, cuda = Path(out), torch.cuda.is_available()
    if not cuda and not allow_cpu:
        print(SKIP_LINE)
        write_json_atomic({"skipped": "no CUDA device", "torch": torch.__version__}, out)
        return {"skipped": "no CUDA device", "torch": torch.__version__}
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    s = settings(quick, cpu=not cuda)
    if not cuda:  # the rehearsal checks code paths, not speed: one thread cannot stall on busy shared cores
        torch.set_num_threads(1)
    budget = budget_s if budget_s is not None else BUDGET_S["quick" if quick else "full"]
    ok, detail = nvml_status()
    result: dict[str, Any] = {
        "status": "running",
        "quick": quick,
        "rehearsal": not cuda,
        "budget_s": budget,
        "device": _describe(device),
        "nvml": {"ok": ok, "detail": detail},
        "settings": s,
        "cuda_only_skipped": [] if cuda else CUDA_ONLY,
        "parts": {name: {"status": "pending"} for name in PARTS},
    }
    print(f"gpu_check on {result['device'].get('name', 'the CPU (rehearsal)')}: budget {budget:.0f} s, JSON {out}")
    print(f"NVML: {detail}" if ok else f"NVML UNAVAILABLE: {detail}", flush=True)
    record, keep = _Run(result, out, budget), {}
    record.save()
    record.timer.start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            data = DemoDataModule(s["num_images"], s["image_size"], batch_size=s["batch"], cache=True)
            parts: list[tuple[str, Callable[[dict[str, Any]], None], float]] = [
                ("data", lambda e: _data_part(e, data), MIN_PART_S),
                ("precision", lambda e: precision_part(e, record, s, device, root, data, keep), MIN_PART_S),
                ("monitor", lambda e: monitor_part(e, record, s, device, root), MIN_PART_S),
                ("batch_size", lambda e: oom_part(e, record, s, device, root), MIN_PART_S),
                ("int8", lambda e: int8_part(e, s, data, root / "int8", keep), MIN_PART_S),
                ("compile", lambda e: compile_part(e, record, s, device, root, data), MIN_COMPILE_S if cuda else 0),
            ]
            for name, body, min_s in parts:
                if name != "data" and result["parts"]["data"]["status"] != "ok":
                    result["parts"][name]["status"] = "skipped: no data"
                    continue
                record.part(name, body, inject, min_s)
    finally:
        record.timer.cancel()
    result["status"] = "ok" if all(_passed(p["status"]) for p in result["parts"].values()) else "failed"
    record.save()
    try:
        print(format_table(result))
    except Exception as exc:  # the JSON is written: a table that cannot be printed must not hide it
        print(f"(no table: {_error(exc)})")
    print(f"gpu_check: {result['status']}; wrote {out}", flush=True)
    return result


def _data_part(entry: dict[str, Any], data: DemoDataModule) -> None:
    """Part 0: the demo images generated (once per cache directory) and split; every later part needs them."""
    data.prepare_data()
    data.setup("fit")
    entry.update(num_images=data.num_images, image_size=data.image_size, crop_size=data.crop_size)


def _describe(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "lightning": L.__version__,
        "type": device.type,
        "cpu_count": os.cpu_count(),
        "shm_free_gib": (_shm_free() or 0) / 2**30,
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


# ---------------------------------------------------------------------------------------------- the tables


def _f(value: Any, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def _pct(key: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda row: None if row.get(key) is None else 100 * row[key]


def _nvml_cell(row: dict[str, Any]) -> str:
    nvml = row.get("nvml") or {}
    return "nvml" if nvml.get("sampler", "NvmlSampler") == "NvmlSampler" and nvml.get("ok") else "no-nvml"


_Column = tuple[str, int, "str | Callable[[dict[str, Any]], Any]", str]  # header, width, key or getter, format
_TIMED: list[_Column] = [("samples/s", 11, "samples_per_s", ",.0f"), ("step ms", 9, "step_ms", ".2f"),
                         ("vs fp32", 9, "speedup_vs_fp32", ".2f"), ("peak GiB", 10, "peak_memory_gib", ".2f"),
                         ("val_acc", 9, "val_acc", ".3f"), ("MFU", 6, "mfu", ".2f"), ("peak", 6, "peak_key", "s"),
                         ("util%", 7, _pct("gpu_utilization"), ".0f"), ("NVML", 9, _nvml_cell, "s")]  # fmt: skip
_MONITOR: list[_Column] = [("workers", 8, "num_workers", "d"), ("diagnosis", 15, "diagnosis", "s"),
                           ("wait%", 7, _pct("data_wait_fraction"), ".0f"), ("samples/s", 11, "samples_per_s", ",.0f"),
                           ("util%", 7, _pct("gpu_utilization"), ".0f"), ("mem GB", 8, "gpu_memory_used_gb", ".1f"),
                           ("power W", 9, "gpu_power_w", ".0f"), ("temp C", 8, "gpu_temperature_c", ".0f"),
                           ("SM MHz", 8, "gpu_sm_clock_mhz", ".0f"), ("MFU", 6, "mfu", ".2f"),
                           ("NVML", 9, _nvml_cell, "s")]  # fmt: skip
_FINDERS: list[_Column] = [("found", 7, "found", "d"), ("search s", 10, "search_s", ".1f"),
                           ("peak GiB", 10, "peak_memory_gib", ".2f"), ("OOMs", 6, "oom_count", "d"),
                           ("  first OOM in the search; after it", 0,
                            lambda r: f"  {(r['first_oom'] or {}).get('message', 'none')[:60]}; {r['after_search']}",
                            "s")]  # fmt: skip


def _table(title: str, part: dict[str, Any], label: str, width: int, columns: list[_Column]) -> list[str]:
    """A part's rows under its title and status; a row that did not finish shows its status instead of figures."""
    lines = ["", f"{title} [{part['status']}]", f"{label:<{width}}" + "".join(f"{c[0]:>{c[1]}}" for c in columns)]
    for row in part.get("rows", []):
        if "found" not in row and "samples_per_s" not in row:
            lines.append(f"{row[label]:<{width}}{row['status']}")
            continue
        cells = [_f(get(row) if callable(get) else row.get(get), spec, w) for _, w, get, spec in columns]
        lines.append(f"{row[label]:<{width}}" + "".join(cells))
        if row.get("decision"):
            lines.append(f"    decision: {row['decision'].get('decision')} ({row['decision'].get('reason')})")
    return lines


def format_table(r: dict[str, Any]) -> str:
    """Every part as a plain-text table under its status, in the order they ran, then the parts' errors."""
    d, s, parts = r["device"], r["settings"], r["parts"]
    name = f"{d.get('name', 'CPU rehearsal')} ({d.get('memory_gib', 0):.0f} GiB, cc {d.get('capability', '-')})"
    nvml = "ok" if r["nvml"]["ok"] else f"UNAVAILABLE ({r['nvml']['detail']})"
    lines = [f"gpu_check on {name}, torch {d['torch']}, lightning {d['lightning']}, {r.get('seconds', 0):.0f} s"]
    lines.append(f"NVML {nvml}; budget {r['budget_s']:.0f} s; data [{parts['data']['status']}]")
    title = f"1. precision: width {s['width']}, batch {s['batch']}, {s['steps']} timed steps on resident batches"
    lines += _table(title, parts["precision"], "precision", 34, _TIMED)
    lines += _table(f"2. UtilizationMonitor, batch {s['batch']}", parts["monitor"], "run", 26, _MONITOR)
    part, memory = parts["batch_size"], parts["batch_size"].get("memory", {})
    title = (
        f"3. batch-size finders, memory cap {_f(memory.get('cap_gib'), '.2f', 0)} GiB (about"
        f" {memory.get('target_batch', '-')} of {memory.get('train_samples', '-')} samples fit);"
        f" {part.get('workers', {}).get('reason', '')}"
    )
    lines += _table(title, part, "finder", 11, _FINDERS)
    part = parts["int8"]
    lines += ["", f"4. INT8 export of {part.get('model', 'the 16-mixed model')} [{part['status']}]"]
    if part.get("report"):
        q = part["report"]
        v, lat = q.get("verification") or {}, q.get("latency") or {}
        lines.append(f"size {q['fp32_bytes'] / 1e6:.2f} MB -> {q['int8_bytes'] / 1e6:.2f} MB ({q['size_ratio']:.2f}x)")
        lines += [
            f"latency {key}: {t['fp32_ms']:.2f} ms -> {t['int8_ms']:.2f} ms ({t['speedup']:.2f}x)"
            for key, t in lat.items()
            if key.startswith("batch_")
        ]
        agree, fp32, int8 = (v.get(k) for k in ("top1_agreement", "metric_fp32", "metric_int8"))
        lines.append(f"top-1 agreement {_f(agree, '.3f', 0)}, accuracy {_f(fp32, '.3f', 0)} -> {_f(int8, '.3f', 0)}")
    lines += _table(f"5. compile ({parts['compile'].get('backend', '-')})", parts["compile"], "precision", 34, _TIMED)
    errors = [f"error in {name}: {p['error']}" for name, p in parts.items() if p.get("error")]
    return "\n".join(lines + (["", *errors] if errors else []))


def exit_code(result: dict[str, Any]) -> int:
    """0 when every part passed or was skipped (or the whole check was), 1 when one did not, 3 on a timeout."""
    if result.get("status") == "timeout":
        return EXIT_TIMEOUT
    return EXIT_OK if result.get("skipped") or result.get("status") == "ok" else EXIT_FAILED


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller run (at most 3 minutes)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help='the JSON; on a lent machine "$OUT/gpu_check.json"')
    parser.add_argument("--allow-cpu", action="store_true", help="without CUDA, rehearse every part on the CPU")
    parser.add_argument("--budget", type=float, help="seconds before the run stops itself (default 480, quick 180)")
    parser.add_argument("--inject-failure", choices=PARTS, help=argparse.SUPPRESS)  # tests: make one part fail
    args = parser.parse_args(argv)
    return run(args.quick, args.out, args.allow_cpu, args.budget, args.inject_failure)


if __name__ == "__main__":
    sys.exit(exit_code(main(sys.argv[1:])))
