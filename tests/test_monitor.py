from __future__ import annotations

import csv
import json
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from conftest import TinyClassifier, load_benchmark, tiny_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset
from typing_extensions import override

import lightning_speedkit.monitor as monitor_module
from lightning_speedkit.dataloader import rebuild_dataloader
from lightning_speedkit.hardware import cpu_info
from lightning_speedkit.monitor import (
    DENSE_PEAK_FLOPS,
    LABELS,
    LoaderSettings,
    UtilizationMonitor,
    diagnose,
    measure_flops,
    mfu,
    peak_flops,
    precision_key,
)
from lightning_speedkit.sampling import DeviceSample, ProcessSampler

SAMPLER_THREAD = "speedkit-device-sampler"


class SlowDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """16 features and a label per item, each item taking ``delay`` seconds to "load"."""

    def __init__(self, size: int = 64, delay: float = 0.01) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 16, generator=g)
        self.y = self.x[:, :4].argmax(dim=1)
        self.delay = delay

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay)
        return self.x[index], self.y[index]


class SlowData(TinyClassifier):
    """The tiny MLP fed by a dataset that sleeps per item: data bound."""

    @override
    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
        return DataLoader(SlowDataset(), batch_size=8)


class HeavyModel(TinyClassifier):
    """A wide MLP on in-memory tensors: compute bound."""

    def __init__(self) -> None:
        super().__init__(batch_size=64, num_samples=512)
        self.net = nn.Sequential(nn.Linear(16, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 4))


class GpuLikeSampler:
    """Stands in for NVML at the sampler seam: GPU-like readings, and an optional failure once ``armed`` is set."""

    def __init__(self) -> None:
        self.armed = threading.Event()
        self.failed = threading.Event()
        self.closed = 0

    def sample(self) -> list[DeviceSample]:
        """A reading at 30% utilisation, or an NVML-like error once armed."""
        if self.armed.is_set():
            self.failed.set()
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return [DeviceSample("cuda:0", time.monotonic(), 0.3, 3 * 2**30, 16 * 2**30, 70.0, 55.0, 1500.0)]

    def close(self) -> None:
        """Count the closes."""
        self.closed += 1


class FailsMidRun(TinyClassifier):
    """Arms the fake sampler at batch 3 and waits until it has failed, so the failure is mid-run every time."""

    sampler: GpuLikeSampler  # set after construction (hyperparameters cannot hold an Event)

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if batch_idx == 3:
            self.sampler.armed.set()
            assert self.sampler.failed.wait(timeout=60)
        return super().training_step(batch, batch_idx)


class Crashes(TinyClassifier):
    """Raises in the fourth training step."""

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if batch_idx == 3:
            raise RuntimeError("boom")
        return super().training_step(batch, batch_idx)


def fit(tmp_path: Path, model: L.LightningModule, monitor: UtilizationMonitor, **kwargs: Any) -> UtilizationMonitor:
    """Fit ``model`` for 8 batches (unless overridden) with ``monitor`` and return the monitor."""
    kwargs.setdefault("max_steps", 8)
    L.seed_everything(0, verbose=False)
    tiny_trainer(tmp_path, callbacks=[monitor], **kwargs).fit(model)
    return monitor


def sampler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == SAMPLER_THREAD]


def test_all_is_sorted() -> None:
    """The module's `__all__` is sorted and every label is listed once."""
    assert monitor_module.__all__ == sorted(monitor_module.__all__)
    assert sorted(set(LABELS)) == list(LABELS)


@pytest.mark.parametrize(
    ("wait", "h2d", "util", "retries", "label"),
    [
        (0.05, 0.0, None, 0, "compute_bound"),
        (0.05, 0.0, 0.95, 0, "compute_bound"),
        (0.62, 0.0, 0.3, 0, "data_bound"),
        (0.62, 0.05, None, 0, "data_bound"),
        (0.40, 0.30, 0.5, 0, "h2d_bound"),
        (0.05, 0.0, 0.3, 0, "underutilized"),
        (0.62, 0.5, 0.1, 3, "memory_thrash"),
        (0.20, 0.0, None, 0, "compute_bound"),  # at the threshold is not above it
    ],
)
def test_diagnose_labels(wait: float, h2d: float, util: float | None, retries: int, label: str) -> None:
    """Allocator retries beat a copy-dominated wait, which beats any data wait, which beats low utilisation."""
    diagnosis = diagnose(wait, h2d, util, retries)
    assert diagnosis.label == label
    assert diagnosis.advice.startswith(f"{label}: ")


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (LoaderSettings(0, cores=16, accelerator="cuda"), "num_workers=0 on a 16-core machine; try num_workers=8, pin"),
        (LoaderSettings(0, cores=2), "num_workers=0 on a 2-core machine; try num_workers=2, persistent_workers=True"),
        (LoaderSettings(2, True, False, 2, cores=16, ranks_per_node=4), "num_workers=2 per rank, 4 ranks on a 16-core"),
        (LoaderSettings(8, True, True, 2, 64, cores=16), "num_workers=8 on a 16-core machine already uses the cores"),
        (LoaderSettings(8, True, True, 2, 64, cores=16), "prefetch_factor=4 (now 2)"),
        (LoaderSettings(8, True, True, 2, 64, cores=16), "(batch_size=64)"),
        (None, "try more DataLoader workers"),
    ],
)
def test_data_bound_advice_names_the_real_settings(settings: LoaderSettings | None, expected: str) -> None:
    """The data_bound advice quotes the loader's num_workers and the machine's cores and suggests concrete values."""
    advice = diagnose(0.62, loader=settings).advice
    assert advice.startswith("data_bound: 62% of each step waits for data; ")
    assert expected in advice


def test_pin_memory_advice_only_on_cuda() -> None:
    """pin_memory is suggested for a CUDA run that lacks it, and never on CPU, where it does nothing."""
    assert "pin_memory=True" in diagnose(0.5, 0.4, loader=LoaderSettings(accelerator="cuda")).advice
    assert "pin_memory" not in diagnose(0.5, loader=LoaderSettings(cores=4)).advice


@pytest.mark.parametrize(
    ("name", "precision", "expected"),
    [
        ("NVIDIA H200", "bf16", 989e12),
        ("NVIDIA H200 NVL", "bf16", 835e12),
        ("NVIDIA H100 80GB HBM3", "bf16", 989e12),
        ("NVIDIA H100 PCIe", "fp16", 756e12),
        ("NVIDIA H100 NVL", "fp8", 1671e12),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
        ("NVIDIA A100 80GB PCIe", "tf32", 156e12),
        ("NVIDIA A10", "bf16", 125e12),
        ("NVIDIA L4", "fp16", 121e12),
        ("NVIDIA L40S", "bf16", 362e12),
        ("Tesla T4", "fp16", 65e12),
        ("Tesla V100-SXM2-16GB", "fp32", 15.7e12),
        ("Tesla V100-SXM2-16GB", "bf16", None),  # no bf16 on Volta
        ("NVIDIA A10G", "bf16", None),  # not "A10"
        ("NVIDIA B300", "bf16", None),  # unknown: never another GPU's figure
    ],
)
def test_peak_flops_table(name: str, precision: str, expected: float | None) -> None:
    """GPU names map to their own dense peak, variants before families, and unknown GPUs give None."""
    assert peak_flops(name, precision) == (pytest.approx(expected) if expected else None)


def test_peak_table_is_dense() -> None:
    """Half precision is never listed above 1 PFLOP/s per GPU (sparse figures are twice the dense ones)."""
    assert all(row.get("bf16", 0) < 1e15 and row.get("fp16", 0) < 1e15 for row in DENSE_PEAK_FLOPS.values())


@pytest.mark.parametrize(
    ("precision", "tf32", "key"),
    [("bf16-mixed", False, "bf16"), ("16-mixed", False, "fp16"), ("32-true", False, "fp32"), ("32-true", True, "tf32"),
     ("transformer-engine", False, "fp8"), ("64-true", False, None)],
)  # fmt: skip
def test_precision_key(precision: str, tf32: bool, key: str | None) -> None:
    """Lightning precision strings map to the table's columns."""
    assert precision_key(precision, tf32) == key


def test_measure_flops_counts_forward_and_backward_without_side_effects() -> None:
    """An MLP costs 2*B*in*out per layer forward, the same for weight gradients, and again for inner input gradients."""
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = 8
    first, second = 2 * batch * 16 * 32, 2 * batch * 32 * 4
    assert measure_flops(model, [torch.randn(batch, 16)], backward=False) == first + second
    assert measure_flops(model, [torch.randn(batch, 16)]) == 2 * first + 3 * second
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # BatchNorm stats untouched
    assert all(p.grad is None for p in model.parameters())
    assert mfu(1e12, 0.5, 4e12) == 0.5


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("window", 0),
        ("window", 1.5),
        ("warn_util_below", 0.0),
        ("warn_util_below", 1.5),
        ("warn_data_wait_above", 1.0),
        ("warn_data_wait_above", -0.1),
        ("peak_flops", 0),
        ("flops_per_batch", float("inf")),
        ("sample_interval", 0),
    ],
)
def test_bad_arguments(argument: str, value: object) -> None:
    """Bad arguments are refused in `__init__`, naming the argument."""
    with pytest.raises(ValueError, match=f"`{argument}`"):
        UtilizationMonitor(**{argument: value})  # type: ignore[arg-type]


def test_report_before_fit() -> None:
    """Before any step the report says the diagnosis is unknown and nothing was timed."""
    report = UtilizationMonitor().report()
    assert (report["diagnosis"], report["batches"], report["steps"], report["data_wait_fraction"]) == (
        "unknown",
        0,
        0,
        0.0,
    )


def test_slow_dataset_is_data_bound_and_advice_names_workers(tmp_path: Path) -> None:
    """A dataset that sleeps per item is data_bound, and the advice gives the real num_workers=0 and core count."""
    with pytest.warns(UserWarning, match="UtilizationMonitor: data_bound"):
        report = fit(tmp_path, SlowData(), UtilizationMonitor(window=4)).report()
    cores = cpu_info().available_cores
    assert report["diagnosis"] == "data_bound"
    assert report["median_data_wait_fraction"] > 0.5
    assert 0 < report["data_wait_fraction"] <= 1
    assert f"num_workers=0 on a {cores}-core machine; try num_workers={min(8, cores)}" in report["advice"]
    assert report["loader"]["batch_size"] == 8
    assert (report["batches"], report["steps"], report["total"]["samples"]) == (8, 8, 64)
    assert report["label_counts"] == {"data_bound": 2}
    assert not sampler_threads()


class _SlowHook(L.Callback):
    """Host work after each step, in a callback placed after the monitor: 20 ms a batch."""

    @override
    def on_train_batch_end(self, *args: Any) -> None:
        time.sleep(0.02)


def test_a_slow_hook_after_the_step_is_the_loop_not_the_data(tmp_path: Path) -> None:
    """In-memory batches and a slow callback: ``loop_bound``, never advice to add loader workers.

    The time from the monitor's batch end to the next step's start was all data wait: ``data_bound: 92%`` and
    "try num_workers=2", which made an in-memory loader 2.7x slower.
    """
    monitor = UtilizationMonitor(window=4)
    with pytest.warns(UserWarning, match="UtilizationMonitor: loop_bound"):
        tiny_trainer(tmp_path, callbacks=[monitor, _SlowHook()], max_steps=8).fit(TinyClassifier())
    report = monitor.report()
    assert report["diagnosis"] == "loop_bound"
    assert report["total"]["between_fraction"] > report["total"]["data_wait_fraction"]
    assert report["total"]["between_s"] >= 7 * 0.02  # the hook's sleeps before the 7 steps after the first
    assert "num_workers" not in report["advice"]


class _SlowStream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """A plain IterableDataset that does not shard itself by worker: each worker would yield all of it."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        data = SlowDataset()
        return (data[i] for i in range(len(data)))


def test_an_iterable_dataset_is_not_advised_workers_that_would_repeat_it(tmp_path: Path) -> None:
    """A slow IterableDataset is data_bound, and the advice says workers need sharding first.

    It advised two workers, which, each yielding every sample, trained on the data twice an epoch.
    """

    class Streamed(TinyClassifier):
        @override
        def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
            return DataLoader(_SlowStream(), batch_size=8)

    with pytest.warns(UserWarning, match="UtilizationMonitor: data_bound"):
        report = fit(tmp_path, Streamed(), UtilizationMonitor(window=4)).report()
    assert report["diagnosis"] == "data_bound"
    assert "IterableDataset" in report["advice"]
    assert "get_worker_info" in report["advice"]
    assert "try num_workers" not in report["advice"]


def test_advice_does_not_suggest_workers_a_tuner_measured_slower(tmp_path: Path) -> None:
    """With a loader tuner that measured more workers slower on this run, the advice says so and offers no workers.

    The monitor finds the tuner by its ``workers_measured_slower`` method (`DataLoaderTuner`'s), not its class.
    """

    class Measured(L.Callback):
        def workers_measured_slower(self) -> str:
            return "num_workers=1 26% slower"

    monitor = UtilizationMonitor(window=4)
    with pytest.warns(UserWarning, match="UtilizationMonitor: data_bound"):
        tiny_trainer(tmp_path, callbacks=[Measured(), monitor], max_steps=8).fit(SlowData())
    report = monitor.report()
    assert report["diagnosis"] == "data_bound"
    assert "DataLoaderTuner measured num_workers=1 26% slower on real steps here" in report["advice"]
    assert "try num_workers" not in report["advice"]


def test_heavy_model_is_compute_bound_with_mfu_from_flop_counter(tmp_path: Path) -> None:
    """A wide MLP on in-memory data is compute_bound; MFU uses FLOPs counted once by torch.utils.flop_counter."""
    model = HeavyModel()
    report = fit(tmp_path, model, UtilizationMonitor(window=4, peak_flops=1e15)).report()
    assert report["diagnosis"] == "compute_bound"
    assert report["median_data_wait_fraction"] < 0.2
    assert report["flops_per_batch"] == measure_flops(model, [torch.zeros(64, 16)])
    expected = report["flops_per_batch"] / report["step_time_s"] / 1e15
    assert report["mfu"] == pytest.approx(expected)
    assert 0 < report["mfu"] < 1
    assert report["mfu_reason"] is None


def test_without_a_peak_the_report_says_why_there_is_no_mfu(tmp_path: Path) -> None:
    """On a CPU MFU needs ``peak_flops``, even with ``flops_per_batch`` given: the report names what to pass."""
    report = fit(tmp_path, TinyClassifier(), UtilizationMonitor(window=4, flops_per_batch=1e9)).report()
    assert (report["mfu"], report["peak_flops"]) == (None, None)
    assert "pass `peak_flops`" in report["mfu_reason"]


class _DictBatch(TinyClassifier):
    """A forward that takes the whole dict batch: the FLOP count, which calls it with the first tensor, fails."""

    @override
    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.net(batch["x"])  # type: ignore[no-any-return]

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.cross_entropy(self(batch), batch["y"])

    @override
    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader([{"x": x, "y": y} for x, y in self._data(0)], batch_size=self.batch_size)


def test_flops_that_cannot_be_counted_keep_the_peak_and_say_why(tmp_path: Path) -> None:
    """The FLOP count fails (a dict batch): the report keeps the user's ``peak_flops`` and names what is missing.

    It used to drop the peak and say "no peak FLOP/s known: pass `peak_flops`" to a user who had passed it.
    """
    with pytest.warns(UserWarning, match="could not count FLOPs"):
        report = fit(
            tmp_path, _DictBatch(), UtilizationMonitor(window=4, peak_flops=1e11), limit_val_batches=0
        ).report()
    assert (report["mfu"], report["peak_flops"], report["flops_per_batch"]) == (None, 1e11, None)
    assert report["mfu_reason"].startswith("could not count FLOPs (")
    assert report["mfu_reason"].endswith("): pass `flops_per_batch`")


def test_given_flops_per_batch_and_impossible_mfu_warns(tmp_path: Path) -> None:
    """`flops_per_batch` is used as given (no counting), and an MFU above 1 warns that the peak or FLOPs are wrong."""
    with pytest.warns(UserWarning, match=r"MFU .* > 1 is impossible"):
        report = fit(tmp_path, TinyClassifier(), UtilizationMonitor(window=4, peak_flops=1.0, flops_per_batch=5e9))
    assert report.report()["flops_per_batch"] == 5e9
    assert report.report()["mfu"] > 1


def test_metrics_reach_csv_logger_with_fake_gpu_readings(tmp_path: Path) -> None:
    """Each window logs `speedkit/monitor/...` keys at the global step, including the device readings."""
    sampler = GpuLikeSampler()
    monitor = UtilizationMonitor(window=4, sample_interval=0.001, sampler=lambda device: sampler)
    fit(tmp_path, TinyClassifier(), monitor, logger=CSVLogger(tmp_path, name="csv", version=0), log_every_n_steps=1)
    rows = list(csv.DictReader((tmp_path / "csv" / "version_0" / "metrics.csv").open()))
    logged = [row for row in rows if row.get("speedkit/monitor/data_wait_fraction")]
    assert [int(row["step"]) for row in logged] == [4, 8]
    for key in ("h2d_fraction", "step_time_s", "samples_per_second", "diagnosis", "gpu_utilization", "gpu_power_w"):
        assert logged[-1][f"speedkit/monitor/{key}"]
    assert float(logged[-1]["speedkit/monitor/gpu_utilization"]) == pytest.approx(0.3)
    assert LABELS[int(float(logged[-1]["speedkit/monitor/diagnosis"]))] == monitor.report()["diagnosis"]
    assert monitor.report()["utilization"] == pytest.approx(0.3)
    assert sampler.closed == 1


def test_sampler_failing_mid_run_does_not_stop_training(tmp_path: Path) -> None:
    """If the NVML stand-in raises mid-run, training finishes, a warning says so and the process reading takes over."""
    sampler = GpuLikeSampler()
    monitor = UtilizationMonitor(window=2, sample_interval=0.001, sampler=lambda device: sampler)
    model = FailsMidRun()
    model.sampler = sampler
    with pytest.warns(UserWarning, match="device sampling failed .*NVML_ERROR_GPU_IS_LOST"):
        fit(tmp_path, model, monitor)
    report = monitor.report()
    assert report["batches"] == 8
    assert report["sampling_error"] == "RuntimeError: NVML_ERROR_GPU_IS_LOST"
    assert sampler.closed == 1
    assert not sampler_threads()


def test_sampler_that_cannot_start_is_only_a_warning(tmp_path: Path) -> None:
    """A sampler that fails to open (no driver) leaves timing and diagnosis working."""

    def broken(device: torch.device) -> GpuLikeSampler:
        raise RuntimeError("NvmlSampler: nvmlInit failed: Driver Not Loaded")

    with pytest.warns(UserWarning, match="device sampling unavailable"):
        report = fit(tmp_path, TinyClassifier(), UtilizationMonitor(window=4, sampler=broken)).report()
    assert report["diagnosis"] in LABELS
    assert "Driver Not Loaded" in report["sampling_error"]


def test_nvml_fallback_is_reported_not_silent(tmp_path: Path) -> None:
    """When the sampler opened is the process reading standing in for a failed NVML, the report says why."""
    reason = "NVML unavailable for cuda:0: NvmlSampler: nvmlInit failed: NVML Shared Library Not Found"
    monitor = UtilizationMonitor(window=4, sampler=lambda device: ProcessSampler(fallback_reason=reason))
    report = fit(tmp_path, TinyClassifier(), monitor).report()
    assert report["sampling_error"] == reason
    assert report["diagnosis"] in LABELS


def test_exception_stops_thread_and_restores_strategy(tmp_path: Path) -> None:
    """An exception in training stops the sampling thread and unwraps the strategy's batch_to_device."""
    monitor = UtilizationMonitor(window=2, sample_interval=0.001)
    trainer = tiny_trainer(tmp_path, callbacks=[monitor], max_steps=8)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Crashes())
    assert not sampler_threads()
    assert "batch_to_device" not in vars(trainer.strategy)
    assert monitor.report()["batches"] == 3


def test_resume_continues_counters(tmp_path: Path) -> None:
    """A resumed run ends with the same counters, windows and labels as an uninterrupted one."""
    full = UtilizationMonitor(window=3)
    checkpoint = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1, filename="{step}")
    trainer = tiny_trainer(tmp_path, callbacks=[full, checkpoint], max_steps=8, enable_checkpointing=True)
    L.seed_everything(0, verbose=False)
    trainer.fit(SlowData())
    resumed = UtilizationMonitor(window=3)
    L.seed_everything(0, verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tiny_trainer(tmp_path, callbacks=[resumed], max_steps=8).fit(
            SlowData(), ckpt_path=str(tmp_path / "ckpt" / "step=4.ckpt")
        )
    a, b = full.report(), resumed.report()
    keys = ("diagnosis", "steps", "batches", "windows", "label_counts")
    assert (
        {k: a[k] for k in keys}
        == {k: b[k] for k in keys}
        == {
            "diagnosis": "data_bound",
            "steps": 8,
            "batches": 8,
            "windows": 3,  # at batches 3 and 6, and the partial one at the end
            "label_counts": {"data_bound": 3},
        }
    )
    assert (a["total"]["steps"], a["total"]["samples"]) == (b["total"]["steps"], b["total"]["samples"]) == (8, 64)
    assert b["total"]["data_wait_s"] > 0.5 * a["total"]["data_wait_s"]  # the first half's time was carried over


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_gpu_run_reads_nvml(tmp_path: Path) -> None:
    """On a GPU the monitor times with CUDA events, reads NVML and diagnoses a data-bound run."""
    monitor = UtilizationMonitor(window=4, sample_interval=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(tmp_path, SlowData(), monitor, accelerator="gpu")
    report = monitor.report()
    assert report["diagnosis"] == "data_bound"
    assert report["device"] == torch.cuda.get_device_name(0)
    assert report["sampling_error"] is None
    assert report["utilization"] is not None
    assert 0.0 <= report["utilization"] <= 1.0
    assert report["total"]["steps"] == 8


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_spawn_logs_the_slowest_rank(tmp_path: Path) -> None:
    """Under 2-process DDP on CPU every window gathers both ranks and logs the slowest one and its step time."""
    monitor = UtilizationMonitor(window=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(
            tmp_path,
            SlowData(),
            monitor,
            max_steps=4,
            strategy="ddp_spawn",
            devices=2,
            logger=CSVLogger(tmp_path, name="csv", version=0),
            log_every_n_steps=1,
        )
    rows = list(csv.DictReader((tmp_path / "csv" / "version_0" / "metrics.csv").open()))
    logged = [row for row in rows if row.get("speedkit/monitor/slowest_rank")]
    assert [int(row["step"]) for row in logged] == [2, 4]
    for row in logged:
        assert float(row["speedkit/monitor/slowest_rank"]) in (0.0, 1.0)
        assert float(row["speedkit/monitor/step_time_max_s"]) >= float(row["speedkit/monitor/step_time_s"])
        assert float(row["speedkit/monitor/median_data_wait_fraction_max"]) > 0.2
        assert LABELS[int(float(row["speedkit/monitor/diagnosis"]))] == "data_bound"


@pytest.mark.slow
def test_benchmark_quick_mode(tmp_path: Path, demo_cache: Path) -> None:
    """The benchmark runs end to end in quick mode, writes its JSON and diagnoses both demo runs right."""
    bench = load_benchmark("monitor")
    result = bench.main(["--quick", "--out", str(tmp_path / "out.json"), "--root", str(demo_cache)])
    written = json.loads((tmp_path / "out.json").read_text())
    assert set(written["overhead"]) == {"none", "empty_callback", "speedkit", "device_stats", "throughput"}
    assert result["diagnosis"]["data_bound"]["correct"]
    assert result["diagnosis"]["compute_bound"]["correct"]
    assert "num_workers=0" in result["diagnosis"]["data_bound"]["advice"]


def test_a_sampler_that_returns_no_sampler_is_refused_at_fit_start(tmp_path: Path) -> None:
    """A `sampler` function returning something without `sample()`/`close()` fails naming `sampler`, not a warning."""
    monitor = UtilizationMonitor(window=4, sampler=lambda device: None)
    model = TinyClassifier()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"`sampler` must return a DeviceSampler .* got None"):
        tiny_trainer(tmp_path, callbacks=[monitor]).fit(model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_tensor_dataset_fetched_per_sample_is_told_to_fetch_batches_at_once() -> None:
    """Read off a loader over in-memory tensors, the advice is the batched fetch; not once the loader fetches so."""
    loader = DataLoader(TensorDataset(torch.zeros(8, 2), torch.zeros(8)), batch_size=4)
    per_sample = LoaderSettings.from_loader(loader, cores=2)
    assert per_sample.fetched_per_sample
    assert "batched_fetch=True" in diagnose(0.4, loader=per_sample).advice
    fetched = LoaderSettings.from_loader(rebuild_dataloader(loader, {"num_workers": 0, "batched_fetch": True}), cores=2)
    assert not fetched.fetched_per_sample
    assert "batched_fetch" not in diagnose(0.4, loader=fetched).advice


class _LongSlowData(TinyClassifier):
    """120 batches an epoch of items that take 2 ms each: a loader tuner switches workers inside the first epoch."""

    @override
    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
        return DataLoader(SlowDataset(size=960, delay=0.002), batch_size=8)


def test_the_advice_reads_the_loader_in_use_not_the_one_the_fit_started_with(tmp_path: Path) -> None:
    """After `DataLoaderTuner` rebuilt the loader with 2 workers, the monitor judges that loader, not the first one.

    The settings were read once at fit start, and the tuner's counted trials switch the loader inside the first
    epoch: the monitor kept advising "num_workers=0 ... try num_workers=2" for the rest of the fit, and its report
    said 0 workers.
    """
    from lightning_speedkit import DataLoaderTuner

    tuner, monitor = DataLoaderTuner(candidates=[{"num_workers": 2}], probe_steps=4), UtilizationMonitor(window=10)
    L.seed_everything(0, verbose=False)
    trainer = tiny_trainer(tmp_path, callbacks=[tuner, monitor], max_epochs=2, limit_val_batches=0)
    trainer.fit(_LongSlowData())
    assert tuner.report()["rebuilt"] is True, tuner.report()["reason"]
    assert trainer.train_dataloader.num_workers == 2
    assert monitor.report()["loader"]["num_workers"] == 2
    assert "num_workers=0" not in monitor.report()["advice"]


def test_the_compute_bound_advice_leaves_out_what_the_run_already_has() -> None:
    """A compiled model is not told to compile; on CUDA, bf16, compile and channels_last each only when not in use."""
    cpu = LoaderSettings(in_use=("torch.compile",))
    assert diagnose(0.05, loader=cpu).advice.endswith("speed the model up: a GPU.")
    assert diagnose(0.05, loader=LoaderSettings()).advice.endswith("speed the model up: torch.compile, or a GPU.")
    cuda = LoaderSettings(accelerator="cuda", in_use=("bf16-mixed precision", "channels_last"))
    assert diagnose(0.05, utilization=0.95, loader=cuda).advice.endswith("speed the model up: torch.compile.")


def test_a_compiled_model_is_not_advised_torch_compile(tmp_path: Path) -> None:
    """A compute-bound fit under `Compile` reads as compiled: the advice names only what it lacks (a GPU here)."""
    from lightning_speedkit import Compile
    from lightning_speedkit.monitor.loader import speedups_in_use

    monitor = UtilizationMonitor(window=4)
    trainer = tiny_trainer(tmp_path, callbacks=[Compile(backend="eager", measure=False), monitor], max_steps=8)
    trainer.fit(HeavyModel())
    assert speedups_in_use(trainer) == ("torch.compile",)
    assert tuple(monitor.report()["loader"]["in_use"]) == ("torch.compile",)
    assert "torch.compile" not in monitor.report()["advice"]  # compute bound (on a quiet machine): "a GPU" alone


def test_a_model_with_a_compiled_submodule_is_not_advised_torch_compile(tmp_path: Path) -> None:
    """``self.net = torch.compile(net)`` reads as compiled too (an ``OptimizedModule`` inside the module)."""
    from lightning_speedkit.monitor.loader import speedups_in_use

    monitor, model = UtilizationMonitor(window=4), HeavyModel()
    model.net = torch.compile(model.net, backend="eager")  # type: ignore[assignment]
    trainer = tiny_trainer(tmp_path, callbacks=[monitor], max_steps=8)
    trainer.fit(model)
    assert speedups_in_use(trainer) == ("torch.compile",)
    assert "torch.compile" not in monitor.report()["advice"]


def test_a_librarys_iterable_dataset_that_shards_itself_keeps_the_worker_advice() -> None:
    """An IterableDataset of litdata, Hugging Face datasets or WebDataset splits itself among workers: not flagged."""
    from lightning_speedkit.data.streaming import unsharded_iterable

    body = {"__module__": "litdata.streaming.dataset", "__iter__": lambda self: iter(())}
    shards = type("StreamingDataset", (IterableDataset,), body)
    plain = type("Stream", (IterableDataset,), {"__iter__": lambda self: iter(())})
    assert not unsharded_iterable(shards())
    assert unsharded_iterable(plain())
    loader = LoaderSettings.from_loader(DataLoader(shards(), batch_size=4), cores=2)
    assert not loader.iterable
    assert "try num_workers=2" in diagnose(0.6, loader=loader).advice
