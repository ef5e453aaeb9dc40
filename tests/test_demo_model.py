"""Tests of the demo model and the demo job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_speedkit.demo import DemoClassifier, DemoConfig, DemoResNet, format_report, run_demo
from lightning_speedkit.demo.run import ABLATION


@pytest.mark.parametrize(("width", "blocks"), [(8, 1), (16, 1), (8, 2)])
def test_resnet_shapes_and_size_knobs(width: int, blocks: int) -> None:
    """The model maps any crop size to 10 logits, and width/depth grow the parameter count."""
    model = DemoResNet(width=width, blocks_per_stage=blocks)
    assert model(torch.zeros(2, 3, 40, 40)).shape == (2, 10)
    smaller = DemoResNet(width=width // 2, blocks_per_stage=blocks)
    assert sum(p.numel() for p in model.parameters()) > sum(p.numel() for p in smaller.parameters())


@pytest.mark.parametrize(("kwargs", "argument"), [({"width": 0}, "width"), ({"blocks_per_stage": 0}, "blocks")])
def test_resnet_rejects_bad_sizes(kwargs: dict[str, int], argument: str) -> None:
    """A non-positive width or depth is refused with the argument's name."""
    with pytest.raises(ValueError, match=argument):
        DemoResNet(**kwargs)


def test_classifier_has_example_input_and_rejects_bad_lr() -> None:
    """The LightningModule exposes ``example_input_array`` of the crop size, and a bad LR is refused."""
    model = DemoClassifier(crop_size=48)
    assert model.example_input_array.shape == (1, 3, 48, 48)
    with pytest.raises(ValueError, match="`lr`"):
        DemoClassifier(lr=0.0)


def test_run_demo_compares_both_variants_and_writes_json_and_png(tmp_path: Path, demo_cache: Path) -> None:
    """A one-epoch demo trains baseline and speedkit, and writes the table's data to demo.json and a PNG."""
    config = DemoConfig.quick(num_images=100, max_epochs=1, cache_dir=str(demo_cache))
    report = run_demo(config, out_dir=tmp_path, progress=False)
    assert set(report["runs"]) == {"baseline", "speedkit"}
    for run in report["runs"].values():
        assert run["epochs"] == 1
        assert 0.0 <= run["final_val_acc"] <= 1.0
        assert run["samples_per_s"] > 0
        assert run["diagnosis"] in {"data_bound", "h2d_bound", "compute_bound", "underutilized", "memory_thrash"}
    assert report["runs"]["speedkit"]["choices"]["precision"] == "32-true"
    assert "DataLoaderTuner" in report["runs"]["speedkit"]["choices"]["callbacks"]
    saved = json.loads((tmp_path / "demo.json").read_text())
    assert saved["runs"]["baseline"]["timeline"] == report["runs"]["baseline"]["timeline"]
    assert (tmp_path / "demo.png").read_bytes()[:4] == b"\x89PNG"
    table = format_report(report)
    assert "baseline" in table
    assert "speedkit" in table
    assert "final val_acc" in table
    assert "LR schedule" in table


def test_ablation_adds_one_lever_per_run(tmp_path: Path, demo_cache: Path) -> None:
    """Each ablation run differs from the one before by one lever: cache, then ChannelsLast, then preset + schedule.

    Only speedkit's run changes the LR: its peak LR, a warmup + cosine schedule, and its epoch budget as max_epochs.
    """
    config = DemoConfig.quick(num_images=100, max_epochs=2, speedkit_epochs=1, cache_dir=str(demo_cache))
    runs = run_demo(config, out_dir=tmp_path, progress=False, variants=ABLATION)["runs"]
    assert list(runs) == ["baseline", "cache", "channels_last", "speedkit"]
    assert [runs[n]["choices"]["callbacks"] for n in ("baseline", "cache", "channels_last")] == [
        [],
        [],
        ["ChannelsLast"],
    ]
    assert {"ChannelsLast", "WarmupScheduler", "DataLoaderTuner"} <= set(runs["speedkit"]["choices"]["callbacks"])
    assert [runs[n]["lr"] for n in ABLATION] == [config.lr, config.lr, config.lr, config.speedkit_lr]
    assert [runs[n]["schedule"] for n in ABLATION[:3]] == ["constant"] * 3
    assert runs["speedkit"]["schedule"].startswith("warmup")
    assert [runs[n]["max_epochs"] for n in ABLATION] == [2, 2, 2, 1]
    assert runs["speedkit"]["epochs"] == 1


@pytest.mark.slow
def test_demo_model_learns(demo_cache: Path) -> None:
    """On a small generated set the demo model learns: validation accuracy far above chance (10%)."""
    report = run_demo(DemoConfig.quick(cache_dir=str(demo_cache)), progress=False, variants=("baseline",))
    run = report["runs"]["baseline"]
    assert run["final_val_acc"] >= 0.5
    accuracies = [point["val_acc"] for point in run["timeline"]]
    assert max(accuracies) > accuracies[0]
