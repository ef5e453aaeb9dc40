"""Bad input to every public constructor and function: a ValueError naming the argument and the value received."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lightning_speedkit as speedkit
from lightning_speedkit.data import CachedDataset, callable_fingerprint, dataset_fingerprint
from lightning_speedkit.demo import DemoClassifier, DemoConfig, DemoDataModule

MODEL, DATA = nn.Linear(2, 2), [torch.zeros(2, 2)]

# (callable, keyword arguments, the argument that must be named, the value as the message must show it)
CASES: list[tuple[Callable[..., Any], dict[str, Any], str, str]] = [
    (speedkit.WeightAverage, {"decay": 1.0}, "decay", "1.0"),
    (speedkit.WeightAverage, {"share": "half"}, "share", "'half'"),
    (speedkit.WarmupScheduler, {"warmup": -3}, "warmup", "-3"),
    (speedkit.WarmupScheduler, {"warmup": 1.5}, "warmup", "1.5"),
    (speedkit.WarmupScheduler, {"decay": "step"}, "decay", "'step'"),
    (speedkit.WarmupScheduler, {"total_steps": 0}, "total_steps", "0"),
    (speedkit.WarmupScheduler, {"min_lr_ratio": 2.0}, "min_lr_ratio", "2.0"),
    (speedkit.WarmupScheduler, {"min_lr_ratio": "0.1"}, "min_lr_ratio", "'0.1'"),
    (speedkit.WarmupScheduler, {"start_factor": None}, "start_factor", "None"),
    (speedkit.WarmupScheduler, {"min_lr_ratio": True}, "min_lr_ratio", "True"),
    (speedkit.BatchSizeFinder, {"mode": "linear"}, "mode", "'linear'"),
    (speedkit.BatchSizeFinder, {"init_val": 0}, "init_val", "0"),
    (speedkit.BatchSizeFinder, {"max_val": 2.5}, "max_val", "2.5"),
    (speedkit.BatchSizeFinder, {"margin": 1.5}, "margin", "1.5"),
    (speedkit.BatchSizeFinder, {"steps_per_trial": 0}, "steps_per_trial", "0"),
    (speedkit.BatchSizeFinder, {"max_trials": 0}, "max_trials", "0"),
    (speedkit.BatchSizeFinder, {"lr_scaling": "cubic"}, "lr_scaling", "'cubic'"),
    (speedkit.BatchSizeFinder, {"reference_batch_size": -1}, "reference_batch_size", "-1"),
    (speedkit.BatchSizeFinder, {"objective": "speed"}, "objective", "'speed'"),
    (speedkit.BatchSizeFinder, {"throughput_tolerance": "x"}, "throughput_tolerance", "'x'"),
    (speedkit.BatchSizeFinder, {"batch_arg_name": ""}, "batch_arg_name", "''"),
    (speedkit.BatchSizeFinder, {"keep_global_batch": "yes"}, "keep_global_batch", "'yes'"),
    (speedkit.BatchSizeFinder, {"init_val": 64, "max_val": 8}, "init_val", "64"),
    (speedkit.UtilizationMonitor, {"window": "4"}, "window", "'4'"),
    (speedkit.UtilizationMonitor, {"warn_util_below": 0.0}, "warn_util_below", "0.0"),
    (speedkit.UtilizationMonitor, {"warn_data_wait_above": 1.0}, "warn_data_wait_above", "1.0"),
    (speedkit.UtilizationMonitor, {"peak_flops": -1.0}, "peak_flops", "-1.0"),
    (speedkit.UtilizationMonitor, {"flops_per_batch": 0}, "flops_per_batch", "0"),
    (speedkit.UtilizationMonitor, {"sample_interval": 0}, "sample_interval", "0"),
    (speedkit.UtilizationMonitor, {"sample_interval": float("inf")}, "sample_interval", "inf"),
    (speedkit.UtilizationMonitor, {"warn_util_below": "x"}, "warn_util_below", "'x'"),
    (speedkit.UtilizationMonitor, {"warn_data_wait_above": None}, "warn_data_wait_above", "None"),
    (speedkit.UtilizationMonitor, {"peak_flops": True}, "peak_flops", "True"),
    (speedkit.UtilizationMonitor, {"summary": "yes"}, "summary", "'yes'"),
    (speedkit.UtilizationMonitor, {"sampler": "nvml"}, "sampler", "'nvml'"),
    (speedkit.UtilizationMonitor, {"sampler": 5}, "sampler", "5"),
    (speedkit.UtilizationMonitor, {"sampler": lambda: None}, "sampler", "which takes other arguments"),
    (speedkit.ChannelsLast, {"enabled": "yes"}, "enabled", "'yes'"),
    (speedkit.FusedOptimizer, {"margin": 1.0}, "margin", "1.0"),
    (speedkit.FusedOptimizer, {"probe_steps": 0}, "probe_steps", "0"),
    (speedkit.FusedOptimizer, {"remember": "yes"}, "remember", "'yes'"),
    (speedkit.ChannelsLast, {"verify": None}, "verify", "None"),
    (speedkit.ChannelsLast, {"measure": "yes"}, "measure", "'yes'"),
    (speedkit.ChannelsLast, {"margin": 1.0}, "margin", "1.0"),
    (speedkit.ChannelsLast, {"probe_steps": 0}, "probe_steps", "0"),
    (speedkit.PrecisionTuner, {"candidates": []}, "candidates", "[]"),
    (speedkit.PrecisionTuner, {"candidates": 3}, "candidates", "3"),
    (speedkit.PrecisionTuner, {"candidates": ["16-true"]}, "candidates", "['16-true']"),
    (speedkit.PrecisionTuner, {"margin": -0.5}, "margin", "-0.5"),
    (speedkit.PrecisionTuner, {"probe_steps": 1}, "probe_steps", "1"),
    (speedkit.PrecisionTuner, {"loss_tolerance": -1}, "loss_tolerance", "-1"),
    (speedkit.LRFinder, {"start_factor": 0}, "start_factor", "0"),
    (speedkit.LRFinder, {"end_factor": -2.0}, "end_factor", "-2.0"),
    (speedkit.LRFinder, {"min_scale": 0.0}, "min_scale", "0.0"),
    (speedkit.LRFinder, {"max_scale": "big"}, "max_scale", "'big'"),
    (speedkit.LRFinder, {"steps": 2}, "steps", "2"),
    (speedkit.LRFinder, {"steps": 10**9}, "steps", "1000000000"),
    (speedkit.LRFinder, {"divergence": 1.0}, "divergence", "1.0"),
    (speedkit.LRFinder, {"min_signal": -1.0}, "min_signal", "-1.0"),
    (speedkit.TrainingGuard, {"backoff": 1.0}, "backoff", "1.0"),
    (speedkit.TrainingGuard, {"backoff": 0}, "backoff", "0"),
    (speedkit.TrainingGuard, {"max_rollbacks": -1}, "max_rollbacks", "-1"),
    (speedkit.TrainingGuard, {"window": 1}, "window", "1"),
    (speedkit.TrainingGuard, {"every_n_steps": 0}, "every_n_steps", "0"),
    (speedkit.TrainingGuard, {"spike_z": -1.0}, "spike_z", "-1.0"),
    (speedkit.TrainingGuard, {"stall_steps": 1.5}, "stall_steps", "1.5"),
    (speedkit.Compile, {"mode": "fastest"}, "mode", "'fastest'"),
    (speedkit.Compile, {"backend": "no-such-backend"}, "backend", "'no-such-backend'"),
    (speedkit.Compile, {"margin": 1.0}, "margin", "1.0"),
    (speedkit.Compile, {"margin": -0.1}, "margin", "-0.1"),
    (speedkit.Compile, {"options": {"bogus_option": 1}}, "options", "{'bogus_option': 1}"),
    (speedkit.DataLoaderTuner, {"probe_steps": 0}, "probe_steps", "0"),
    (speedkit.DataLoaderTuner, {"max_workers": -1}, "max_workers", "-1"),
    (speedkit.DataLoaderTuner, {"margin": "x"}, "margin", "'x'"),
    (speedkit.DataLoaderTuner, {"margin": 1.0}, "margin", "1.0"),
    (speedkit.DataLoaderTuner, {"candidates": []}, "candidates", "[]"),
    (speedkit.DataLoaderTuner, {"candidates": 3}, "candidates", "3"),
    (speedkit.DataLoaderTuner, {"candidates": [{"num_workers": "two"}]}, "candidates", "{'num_workers': 'two'}"),
    (speedkit.DataLoaderTuner, {"candidates": [{"workers": 2}]}, "candidates", "{'workers': 2}"),
    (speedkit.StructuredPruning, {}, "amount", "amount=None"),
    (speedkit.StructuredPruning, {"amount": 1.5}, "amount", "1.5"),
    (speedkit.StructuredPruning, {"target_speedup": 0.5}, "target_speedup", "0.5"),
    (speedkit.StructuredPruning, {"amount": 0.5, "start_epoch": -1}, "start_epoch", "-1"),
    (speedkit.StructuredPruning, {"amount": 0.5, "iterative_steps": 0}, "iterative_steps", "0"),
    (speedkit.StructuredPruning, {"amount": 0.5, "finetune_epochs": -1}, "finetune_epochs", "-1"),
    (speedkit.StructuredPruning, {"amount": 0.5, "importance": "random"}, "importance", "'random'"),
    (speedkit.StructuredPruning, {"amount": 0.5, "round_to": 0}, "round_to", "0"),
    (speedkit.StructuredPruning, {"amount": 0.5, "rewarm": -1}, "rewarm", "-1"),
    (speedkit.StructuredPruning, {"amount": 0.5, "monitor": 3}, "monitor", "3"),
    (speedkit.StructuredPruning, {"amount": 0.5, "latency_batch_sizes": (0,)}, "latency_batch_sizes", "(0,)"),
    (speedkit.StructuredPruning, {"amount": 0.5, "ignored_layers": [3]}, "ignored_layers", "[3]"),
    (speedkit.StructuredPruning, {"target_latency": 1.0}, "target_latency", "1.0"),
    (speedkit.StructuredPruning, {"target_latency": 0.5}, "target_latency", "0.5"),
    (speedkit.StructuredPruning, {"target_latency": 2.0, "latency_device": "gpu"}, "latency_device", "'gpu'"),
    (speedkit.StructuredPruning, {"amount": 0.5, "ignored_layers": "net.0"}, "ignored_layers", "'net.0'"),
    (speedkit.StructuredPruning, {"amount": 0.5, "ignored_layers": [""]}, "ignored_layers", "['']"),
    (speedkit.StructuredPruning, {"amount": 0.5, "example_input": "x"}, "example_input", "'x'"),
    (
        speedkit.StructuredPruning,
        {"amount": 0.5, "example_input": torch.tensor(1.0)},
        "example_input",
        "a tensor of shape ()",
    ),
    (speedkit.StructuredPruning, {"amount": 0.5, "latency_batch_sizes": 1}, "latency_batch_sizes", "1"),
    (speedkit.StructuredPruning, {"amount": 0.5, "monitor": ""}, "monitor", "''"),
    (speedkit.Int8Export, {"dirpath": 3}, "dirpath", "3"),
    (speedkit.Int8Export, {"calibration_batches": 0}, "calibration_batches", "0"),
    (speedkit.Int8Export, {"max_metric_drop": -0.1}, "max_metric_drop", "-0.1"),
    (speedkit.Int8Export, {"activation_type": "int4"}, "activation_type", "'int4'"),
    (speedkit.Int8Export, {"filename": "model.pt"}, "filename", "'model.pt'"),
    (speedkit.Int8Export, {"on_metric_drop": "ignore"}, "on_metric_drop", "'ignore'"),
    (speedkit.Int8Export, {"verify_batches": 0}, "verify_batches", "0"),
    (speedkit.Int8Export, {"latency_batch_size": 0}, "latency_batch_size", "0"),
    (speedkit.Int8Export, {"latency_repeats": -1}, "latency_repeats", "-1"),
    (speedkit.Int8Export, {"min_agreement": 1.5}, "min_agreement", "1.5"),
    (speedkit.Int8Export, {"max_fp32_layers": -1}, "max_fp32_layers", "-1"),
    (speedkit.Int8Export, {"inputs_from_batch": 3}, "inputs_from_batch", "3"),
    (speedkit.Int8Export, {"symmetric": "yes"}, "symmetric", "'yes'"),
    (speedkit.export_int8, {"model": "x", "calibration_data": DATA, "path": "x.onnx"}, "model", "'x'"),
    (speedkit.export_int8, {"model": MODEL, "calibration_data": None, "path": "x.onnx"}, "calibration_data", "None"),
    (speedkit.export_int8, {"model": MODEL, "calibration_data": 3, "path": "x.onnx"}, "calibration_data", "3"),
    (
        speedkit.export_int8,
        {"model": MODEL, "calibration_data": DATA, "path": "x.onnx", "validation_data": 3},
        "validation_data",
        "3",
    ),
    (
        speedkit.export_int8,
        {"model": MODEL, "calibration_data": DATA, "path": "x.onnx", "symmetric": 1},
        "symmetric",
        "1",
    ),
    (speedkit.export_int8, {"model": MODEL, "calibration_data": DATA, "path": "x.pt"}, "path", "'x.pt'"),
    (speedkit.export_int8, {"model": MODEL, "calibration_data": [], "path": "x.onnx"}, "calibration_data", "none"),
    (
        speedkit.export_int8,
        {"model": MODEL, "calibration_data": DATA, "path": "x.onnx", "num_threads": -1},
        "num_threads",
        "-1",
    ),
    (
        speedkit.export_int8,
        {"model": MODEL, "calibration_data": DATA, "path": "x.onnx", "example_input": {"x": torch.zeros(2, 2)}},
        "example_input",
        "a dict with keys (x)",
    ),
    (
        speedkit.export_int8,
        {"model": MODEL, "calibration_data": DATA, "path": "x.onnx", "inputs_from_batch": lambda b: (b, b)},
        "inputs_from_batch",
        "a tuple of 2",
    ),
    (
        speedkit.export_int8,
        {"model": MODEL, "calibration_data": DATA, "path": "x.onnx", "inputs_from_batch": lambda b: [b.numpy()]},
        "inputs_from_batch",
        "a list of 1: (ndarray)",
    ),
    (
        speedkit.load_pruned_checkpoint,
        {"model": MODEL, "checkpoint_path": __file__},
        "checkpoint_path",
        "test_bad_input.py",
    ),
    (speedkit.load_pruned_checkpoint, {"model": None, "checkpoint_path": __file__}, "model", "None"),
    (speedkit.load_pruned_checkpoint, {"model": "m", "checkpoint_path": __file__}, "model", "'m'"),
    (speedkit.load_pruned_checkpoint, {"model": 5, "checkpoint_path": __file__}, "model", "5"),
    (speedkit.load_pruned_checkpoint, {"model": nn.Linear, "checkpoint_path": __file__}, "model", "the class Linear"),
    (speedkit.load_pruned_checkpoint, {"model": MODEL, "checkpoint_path": ""}, "checkpoint_path", "''"),
    (speedkit.load_pruned_checkpoint, {"model": MODEL, "checkpoint_path": 5}, "checkpoint_path", "5"),
    (
        speedkit.load_pruned_checkpoint,
        {"model": MODEL, "checkpoint_path": __file__, "strict": "yes"},
        "strict",
        "'yes'",
    ),
    (speedkit.load_pruned_checkpoint, {"model": MODEL, "checkpoint_path": __file__, "strict": None}, "strict", "None"),
    (speedkit.load_pruned_checkpoint, {"model": MODEL, "checkpoint_path": __file__, "strict": 1}, "strict", "1"),
    (
        speedkit.load_pruned_checkpoint,
        {"model": MODEL, "checkpoint_path": __file__, "example_input": "x"},
        "example_input",
        "'x'",
    ),
    (
        speedkit.load_pruned_checkpoint,
        {"model": MODEL, "checkpoint_path": __file__, "example_input": torch.zeros(1, 3)},
        "example_input",
        "a tensor of shape (1, 3)",
    ),
    (speedkit.default_callbacks, {"batch_size": "max"}, "batch_size", "'max'"),
    (speedkit.default_callbacks, {"prune": 2.0}, "prune", "2.0"),
    (speedkit.default_callbacks, {"export": 3}, "export", "3"),
    (speedkit.default_callbacks, {"warmup": "yes"}, "warmup", "'yes'"),
    (speedkit.default_callbacks, {"monitor": 1}, "monitor", "1"),
    (speedkit.default_callbacks, {"tune_data": None}, "tune_data", "None"),
    (speedkit.default_callbacks, {"callbacks": [3]}, "callbacks", "[3]"),
    (speedkit.default_callbacks, {"callbacks": 3}, "callbacks", "3"),
    (speedkit.default_callbacks, {"channels_last": "no"}, "channels_last", "'no'"),
    (speedkit.default_callbacks, {"tune_precision": "bf16"}, "tune_precision", "'bf16'"),
    (speedkit.default_callbacks, {"lr": 1}, "lr", "1"),
    (speedkit.default_callbacks, {"lr": "Auto"}, "lr", "'Auto'"),
    (speedkit.preset, {"tune_data": None}, "tune_data", "None"),
    (speedkit.preset, {"precision": "32-true", "tune_precision": {"margin": 0.1}}, "tune_precision", "{'margin': 0.1}"),
    (speedkit.default_callbacks, {"guard": "on"}, "guard", "'on'"),
    (speedkit.preset, {"devices": 0}, "devices", "0"),
    (speedkit.preset, {"num_nodes": 0}, "num_nodes", "0"),
    (speedkit.preset, {"precision": "8-true"}, "precision", "'8-true'"),
    (speedkit.preset, {"logger": "tensorboard"}, "logger", "'tensorboard'"),
    (speedkit.preset, {"channels_last": 1}, "channels_last", "1"),
    (speedkit.preset, {"lr": 0.01}, "lr", "0.01"),
    (speedkit.preset, {"compile": "yes"}, "compile", "'yes'"),
    (speedkit.default_callbacks, {"compile": "yes"}, "compile", "'yes'"),
    (speedkit.preset, {"guard": "on"}, "guard", "'on'"),
    (speedkit.preset, {"logger": 1}, "logger", "1"),
    (speedkit.preset, {"logger": 0}, "logger", "0"),
    (speedkit.preset, {"verbose": "no"}, "verbose", "'no'"),
    (speedkit.preset, {"verbose": 2}, "verbose", "2"),
    (speedkit.preset, {"verbose": None}, "verbose", "None"),
    (speedkit.preset, {"export": ""}, "export", "''"),
    (speedkit.default_callbacks, {"export": ""}, "export", "''"),
    (CachedDataset, {"source": [], "path": "unused"}, "source", "an empty dataset"),
    (CachedDataset, {"source": [1], "path": "unused", "max_disk_bytes": 0}, "max_disk_bytes", "0"),
    (CachedDataset, {"source": [1], "path": "unused", "max_memory_bytes": -5}, "max_memory_bytes", "-5"),
    (CachedDataset, {"source": [1], "path": "unused", "max_disk_bytes": "x"}, "max_disk_bytes", "'x'"),
    (CachedDataset, {"source": [1], "path": "unused", "max_disk_bytes": 1.5}, "max_disk_bytes", "1.5"),
    (CachedDataset, {"source": 3, "path": "unused"}, "source", "3"),
    (CachedDataset, {"source": [1], "path": "unused", "transform": "flip"}, "transform", "'flip'"),
    (CachedDataset, {"source": [1], "path": None}, "path", "None"),
    (CachedDataset, {"source": [1], "path": 123}, "path", "123"),
    (CachedDataset, {"source": [1], "path": ""}, "path", "''"),
    (CachedDataset, {"source": "not a dataset", "path": "unused"}, "source", "'not a dataset'"),
    (CachedDataset, {"source": [1], "path": "unused", "fingerprint": 5}, "fingerprint", "5"),
    (CachedDataset, {"source": [1], "path": "unused", "fingerprint": ""}, "fingerprint", "''"),
    (CachedDataset, {"source": [1], "path": "unused", "fingerprint": ["a"]}, "fingerprint", "['a']"),
    (callable_fingerprint, {"fn": "x"}, "fn", "'x'"),
    (dataset_fingerprint, {"dataset": "abc"}, "dataset", "'abc'"),
    (DemoConfig, {"max_epochs": 0}, "max_epochs", "0"),
    (DemoConfig, {"lr": -1.0}, "lr", "-1.0"),
    (DemoConfig, {"target_acc": 1.5}, "target_acc", "1.5"),
    (DemoConfig, {"target_acc": "x"}, "target_acc", "'x'"),
    (DemoConfig, {"num_workers": -1}, "num_workers", "-1"),
    (DemoConfig, {"seed": -5}, "seed", "-5"),
    (DemoConfig, {"seed": 2**32}, "seed", "4294967296"),
    (DemoConfig, {"cache_dir": ""}, "cache_dir", "''"),
    (DemoClassifier, {"width": 0}, "width", "0"),
    (DemoClassifier, {"lr": -1.0}, "lr", "-1.0"),
    (DemoClassifier, {"lr": "x"}, "lr", "'x'"),
    (DemoClassifier, {"architecture": "vit"}, "architecture", "'vit'"),
    (DemoDataModule, {"batch_size": 0}, "batch_size", "0"),
    (DemoDataModule, {"batch_size": 2.5}, "batch_size", "2.5"),
    (DemoDataModule, {"num_workers": -1}, "num_workers", "-1"),
    (DemoDataModule, {"crop_size": "big"}, "crop_size", "'big'"),
    (speedkit.TrainingGuard, {"stall_steps": 1.0}, "stall_steps", "1.0"),  # it showed the int it made of it: "got 1."
    (speedkit.default_callbacks, {"prune": True}, "prune", "True"),  # StructuredPruning has no defaults
    (speedkit.default_callbacks, {"prune": {}}, "prune", "{}"),
]


def _id(case: tuple[Callable[..., Any], dict[str, Any], str, str]) -> str:
    return f"{case[0].__name__}-{case[2]}={case[3]}"


@pytest.mark.parametrize(("function", "kwargs", "argument", "shown"), CASES, ids=[_id(c) for c in CASES])
def test_bad_argument_is_refused_naming_it_and_its_value(
    function: Callable[..., Any], kwargs: dict[str, Any], argument: str, shown: str
) -> None:
    """The call raises ValueError (not TypeError) whose message names `argument` (backticked) and the value received.

    Every case fails in argument checking, before anything is read or written (the paths are never created).
    """
    with pytest.raises(ValueError, match=f"`{re.escape(argument)}`") as caught:
        function(**kwargs)
    message = str(caught.value)
    assert f"`{argument}`" in message
    assert re.search(r"got .*" + re.escape(shown), message), message


def test_every_public_callable_is_in_the_table() -> None:
    """Each public class and function of ``speedkit.__all__`` (and CachedDataset) has at least one bad-input case."""
    public = {
        name
        for name in speedkit.__all__
        if callable(getattr(speedkit, name)) and name not in {"RunSummary"}  # RunSummary takes no arguments
    }
    covered = {case[0].__name__ for case in CASES}
    assert public | {"CachedDataset", "DemoConfig", "DemoClassifier", "DemoDataModule"} <= covered


def test_load_pruned_checkpoint_of_a_missing_file_names_it(tmp_path: Path) -> None:
    """A missing checkpoint is a FileNotFoundError that names the path (the one bad input that is not a ValueError)."""
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "missing.ckpt"))):
        speedkit.load_pruned_checkpoint(MODEL, tmp_path / "missing.ckpt")
