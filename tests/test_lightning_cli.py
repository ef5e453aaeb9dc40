"""Every speedkit callback is configurable from a LightningCLI YAML; ``configs/demo_cli.yaml`` trains the demo."""

from __future__ import annotations

import inspect
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lightning_speedkit as speedkit
from lightning_speedkit.demo import DemoClassifier, DemoDataModule

pytest.importorskip("jsonargparse", reason='LightningCLI needs jsonargparse: pip install "jsonargparse[signatures]"')

from lightning.pytorch.cli import LightningCLI

# jsonargparse >= 4.49 deprecates calls that lightning 2.6 still makes; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:(?s).*deprecated in v4", "ignore:(?s).*JsonargparseDeprecationWarning")

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo_cli.yaml"

EXPORTED_CALLBACKS = sorted(
    name for name in speedkit.__all__ if inspect.isclass(obj := getattr(speedkit, name)) and issubclass(obj, Callback)
)

# Non-default values for every constructor argument a YAML can express (ints, floats, unions, lists, None, dicts).
YAML_ARGS: dict[str, dict[str, Any]] = {
    "BatchSizeFinder": {
        "mode": "power",
        "init_val": 4,
        "max_val": 64,
        "margin": 0.2,
        "steps_per_trial": 2,
        "max_trials": 5,
        "lr_scaling": "sqrt",
        "reference_batch_size": 16,
        "keep_global_batch": True,
        "objective": "throughput",
        "throughput_tolerance": 0.1,
        "batch_arg_name": "bs",
        "remember": False,
    },
    "Compile": {
        "backend": "eager",
        "fullgraph": True,
        "dynamic": False,
        "options": {"trace.enabled": False},
        "measure": False,
        "margin": 0.2,
        "probe_steps": 3,
        "max_graph_breaks": 2,
        "min_compile_s": 1.0,
        "remember": False,
    },
    "ChannelsLast": {
        "enabled": False,
        "verify": False,
        "measure": False,
        "margin": 0.1,
        "probe_steps": 3,
        "remember": False,
    },
    "FusedOptimizer": {"margin": 0.1, "probe_steps": 8, "remember": False},
    "LRFinder": {
        "method": "range",
        "trial_steps": 8,
        "steps": 30,
        "start_factor": 0.001,
        "end_factor": 10.0,
        "min_scale": 0.1,
        "max_scale": 5.0,
        "divergence": 3.0,
        "smoothing": 0.8,
        "max_fraction": 0.5,
        "min_signal": 2.0,
        "remember": False,
    },
    "PrecisionTuner": {
        "candidates": ["32-true", "bf16-mixed"],
        "probe_steps": 3,
        "margin": 0.1,
        "loss_tolerance": 0.2,
        "remember": False,
    },
    "DataLoaderTuner": {
        "candidates": [{"num_workers": 0}, {"num_workers": 1, "persistent_workers": True, "prefetch_factor": 4}],
        "probe_steps": 5,
        "max_workers": 2,
        "margin": 0.1,
        "remember": False,
    },
    "Int8Export": {
        "dirpath": "exports",
        "calibration_batches": 4,
        "symmetric": True,
        "verify": False,
        "max_metric_drop": None,
        "activation_type": "int8",
        "reduce_range": True,
        "filename": "tiny.onnx",
        "metric": "val_acc",
        "on_metric_drop": "raise",
        "overwrite": True,
        "use_best_checkpoint": False,
        "verify_batches": 2,
        "latency_batch_size": 8,
        "latency_repeats": 0,
        "inputs_from_batch": None,
        "min_agreement": 0.9,
        "max_fp32_layers": 2,
    },
    "RunSummary": {},
    "StructuredPruning": {
        "target_speedup": 1.5,
        "start_epoch": 2,
        "iterative_steps": 2,
        "finetune_epochs": 3,
        "importance": "l1",
        "ignored_layers": ["model.classifier"],
        "round_to": None,
        "rewarm": 25,
        "monitor": "val_acc",
        "latency_batch_sizes": [1, 8],
        "latency_device": "cpu",
    },
    "TrainingGuard": {
        "every_n_steps": 10,
        "window": 20,
        "spike_z": 6.0,
        "stall_steps": 200,
        "stall_fraction": 0.8,
        "backoff": 0.25,
        "max_rollbacks": 2,
        "max_snapshot_bytes": 1000000,
        "check_every_n_steps": 4,
    },
    "UtilizationMonitor": {
        "window": 5,
        "warn_util_below": 0.5,
        "warn_data_wait_above": 0.3,
        "peak_flops": 1.0e12,
        "flops_per_batch": 2.0e6,
        "sample_interval": 0.25,
        "sampler": None,
        "summary": False,
    },
    "WarmupScheduler": {
        "warmup": 10,
        "decay": "linear",
        "total_steps": 100,
        "min_lr_ratio": 0.1,
        "start_factor": 0.2,
        "cooldown": 0.3,
        "cooldown_check": True,
    },
    "WeightAverage": {"decay": 0.9, "share": 0.5},
}


def _same(a: Any, b: Any) -> bool:
    """Equal values of equal types (so a YAML ``10`` that became ``10.0`` counts as different)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # objects without a meaningful ==
        return True


def _cli(args: list[str], **kwargs: Any) -> LightningCLI:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["demo_cli"])  # LightningCLI warns when both sys.argv and args hold arguments
        return LightningCLI(DemoClassifier, DemoDataModule, args=args, save_config_kwargs={"overwrite": True}, **kwargs)


def test_every_exported_callback_has_yaml_arguments_here() -> None:
    """The table below covers each exported Callback (a new one must be added, not silently skipped)."""
    assert EXPORTED_CALLBACKS
    assert sorted(YAML_ARGS) == EXPORTED_CALLBACKS


def test_yaml_arguments_cover_every_constructor_parameter() -> None:
    """Each callback's YAML entry sets every constructor argument that YAML can express."""
    not_expressible = {
        ("StructuredPruning", "amount"),  # exclusive with target_speedup
        ("StructuredPruning", "target_latency"),  # exclusive with target_speedup
        ("StructuredPruning", "example_input"),  # a tensor
        ("Compile", "mode"),  # exclusive with options
    }  # exclusive / tensors
    for name in EXPORTED_CALLBACKS:
        params = set(inspect.signature(getattr(speedkit, name)).parameters)
        missing = {p for p in params - set(YAML_ARGS[name]) if (name, p) not in not_expressible}
        assert not missing, f"{name}: add {sorted(missing)} to YAML_ARGS"


@pytest.mark.parametrize("name", EXPORTED_CALLBACKS)
def test_callback_is_built_from_a_lightning_cli_yaml_snippet(name: str, tmp_path: Path) -> None:
    """``trainer.callbacks`` in LightningCLI YAML builds the callback exactly as the same keyword arguments do."""
    init_args = YAML_ARGS[name]
    snippet = yaml.safe_dump([{"class_path": f"lightning_speedkit.{name}", "init_args": init_args}])
    cli = _cli(
        [
            "--seed_everything=0",
            "--trainer.callbacks",
            snippet,
            "--trainer.logger=false",
            f"--trainer.default_root_dir={tmp_path}",
        ],
        run=False,
    )
    built = [c for c in cli.trainer.callbacks if type(c).__name__ == name]
    assert len(built) == 1
    expected = getattr(speedkit, name)(**init_args)
    public = {key for key in vars(expected) if not key.startswith("_")}
    assert public == {key for key in vars(built[0]) if not key.startswith("_")}
    mismatched = {key: (getattr(built[0], key), getattr(expected, key)) for key in public}
    assert not {key: pair for key, pair in mismatched.items() if not _same(*pair)}
    assert built[0].state_key == expected.state_key


def test_a_bad_value_in_yaml_is_refused_naming_the_argument(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A type error in the YAML fails at parse time with the argument's name, before any training."""
    snippet = yaml.safe_dump([{"class_path": "lightning_speedkit.WarmupScheduler", "init_args": {"warmup": "soon"}}])
    with pytest.raises(SystemExit):
        _cli(["--trainer.callbacks", snippet, f"--trainer.default_root_dir={tmp_path}"], run=False)
    assert "warmup" in capsys.readouterr().err


def test_the_example_config_builds_every_speedkit_callback(tmp_path: Path) -> None:
    """``configs/demo_cli.yaml`` parses, and its Trainer holds every speedkit callback in default_callbacks' order.

    That order is spelled out in ``tests/test_preset.py``; here the YAML must simply follow it.
    """
    cli = _cli(["--config", str(CONFIG), f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false"], run=False)
    names = [type(c).__name__ for c in cli.trainer.callbacks if type(c).__module__.startswith("lightning_speedkit")]
    everything = speedkit.default_callbacks(batch_size=True, prune=0.5, export=tmp_path)
    assert names == [type(c).__name__ for c in everything]
    finder = next(c for c in cli.trainer.callbacks if isinstance(c, speedkit.BatchSizeFinder))
    assert finder.max_val == 128
    assert cli.datamodule.cache is True
    assert isinstance(cli.model, DemoClassifier)


def _tiny_config(tmp_path: Path) -> Path:
    """The example config with the pruning schedule shrunk to two epochs (everything else overridden by flags)."""
    config = yaml.safe_load(CONFIG.read_text())
    for callback in config["trainer"]["callbacks"]:
        if callback["class_path"].endswith("StructuredPruning"):
            callback["init_args"].update(start_epoch=1, finetune_epochs=0, latency_batch_sizes=[1])
        if callback["class_path"].endswith("DataLoaderTuner"):
            callback["init_args"].update(probe_steps=2, candidates=[{"num_workers": 0}, {"num_workers": 1}])
        if callback["class_path"].endswith("BatchSizeFinder"):
            callback["init_args"].update(max_val=16, steps_per_trial=1)
        if callback["class_path"].endswith("Int8Export"):
            callback["init_args"].update(calibration_batches=2, latency_repeats=1, latency_batch_size=4)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow
def test_lightning_cli_fits_the_demo_with_every_speedkit_callback(
    tmp_path: Path, demo_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``LightningCLI fit --config`` trains the demo, prunes it and writes a verified INT8 model."""
    pytest.importorskip("onnxruntime", reason='Int8Export needs pip install "lightning-speedkit[export]"')
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "run"
    cli = _cli(
        [
            "fit",
            "--config",
            str(_tiny_config(tmp_path)),
            f"--trainer.default_root_dir={root}",
            "--trainer.logger=false",
            "--trainer.max_epochs=2",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            "--trainer.accelerator=cpu",
            "--model.width=4",
            "--model.crop_size=28",
            "--data.num_images=80",
            "--data.image_size=32",
            "--data.batch_size=8",
            f"--data.root={demo_cache}",
        ]
    )
    trainer = cli.trainer
    assert trainer.current_epoch == 2
    pruning = next(c for c in trainer.callbacks if isinstance(c, speedkit.StructuredPruning))
    report = pruning.report()
    assert report["params_after"] < report["params_before"]
    assert (root / "int8" / "model.onnx").is_file()
    export = json.loads((root / "int8" / "model.json").read_text())
    assert export["verification"]["top1_agreement"] > 0.0
    assert 1 <= cli.datamodule.batch_size <= 16  # BatchSizeFinder searched up to the tiny max_val
    assert any(isinstance(c, ModelCheckpoint) and c.best_model_path for c in trainer.callbacks)
