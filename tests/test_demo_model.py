"""Tests of the demo model and the demo job."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import short_job_reason, tiny_trainer
from torch.utils.data import DataLoader, TensorDataset

import lightning_speedkit as speedkit
from lightning_speedkit.demo import DemoClassifier, DemoConfig, DemoResNet, format_report, run_demo
from lightning_speedkit.demo.run import ABLATION, _choices, format_seeds, parse_seeds, run_seeds
from lightning_speedkit.hardware import cpu_info
from lightning_speedkit.monitor import LABELS


@pytest.mark.parametrize(("width", "blocks"), [(8, 1), (16, 1), (8, 2)])
def test_resnet_shapes_and_size_knobs(width: int, blocks: int) -> None:
    """The model maps any crop size to 10 logits, and width/depth grow the parameter count."""
    model = DemoResNet(width=width, blocks_per_stage=blocks)
    assert model(torch.zeros(2, 3, 40, 40)).shape == (2, 10)
    smaller = DemoResNet(width=width // 2, blocks_per_stage=blocks)
    assert sum(p.numel() for p in model.parameters()) > sum(p.numel() for p in smaller.parameters())


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [({"width": 0}, "`width`"), ({"blocks_per_stage": 0}, "`blocks_per_stage`"), ({"width": 2.5}, "`width`")],
)
def test_resnet_rejects_bad_sizes(kwargs: dict[str, int], argument: str) -> None:
    """A width or depth that is not a positive int is refused with the argument's name."""
    with pytest.raises(ValueError, match=argument):
        DemoResNet(**kwargs)


def test_classifier_has_example_input_and_rejects_bad_lr() -> None:
    """The LightningModule exposes ``example_input_array`` of the crop size, and a bad LR is refused."""
    model = DemoClassifier(crop_size=48)
    assert model.example_input_array.shape == (1, 3, 48, 48)
    with pytest.raises(ValueError, match="`lr`"):
        DemoClassifier(lr=0.0)
    with pytest.raises(ValueError, match="`lr` must be a positive number, got 'x'"):
        DemoClassifier(lr="x")  # type: ignore[arg-type]


def test_run_demo_compares_both_variants_and_writes_json_and_png(tmp_path: Path, demo_cache: Path) -> None:
    """A one-epoch demo trains baseline and speedkit, and writes the table's data to demo.json and a PNG."""
    config = DemoConfig.quick(num_images=100, max_epochs=1, cache_dir=str(demo_cache))
    report = run_demo(config, out_dir=tmp_path, progress=False)
    assert set(report["runs"]) == {"baseline", "speedkit"}
    for run in report["runs"].values():
        assert run["epochs"] == 1
        assert 0.0 <= run["final_val_acc"] <= 1.0
        assert run["samples_per_s"] > 0
        assert run["diagnosis"] in LABELS
        assert min(run["step_data_wait_ms"], run["step_compute_ms"], run["step_between_ms"]) >= 0.0  # the bar's parts
    choices = report["runs"]["speedkit"]["choices"]
    assert choices["precision"] == "32-true"  # one short epoch: no probe can pay back, the reason says so
    assert choices["precision_reason"].startswith(short_job_reason("PrecisionTuner"))
    assert {"DataLoaderTuner", "LRFinder", "TrainingGuard"} <= set(choices["callbacks"])
    assert report["runs"]["baseline"]["choices"]["memory"] == {}  # no lever, no memory
    saved = json.loads((tmp_path / "demo.json").read_text())
    assert saved["runs"]["baseline"]["timeline"] == report["runs"]["baseline"]["timeline"]
    assert saved["machine"] == cpu_info().machine()  # as the seeds' file: the CPU and the load its figures come from
    assert [len(saved["load_average"][when]) for when in ("before", "after")] == [3, 3]
    assert (tmp_path / "demo.png").read_bytes()[:4] == b"\x89PNG"
    table = format_report(report)
    assert table.splitlines()[1].startswith(f"on {cpu_info().machine()['cpu'] or 'an unnamed CPU'}: ")
    assert "baseline" in table
    assert "speedkit" in table
    assert "final val_acc" in table
    assert "LR schedule" in table


@pytest.mark.usefixtures("one_thread")
def test_choices_keep_each_levers_memory_check(tmp_path: Path) -> None:
    """A run's choices say, per lever, what the memory did: a remembered decision's live check, with its ratio.

    (The second demo run's seed that probed again could not say why: its entries were gone, and the file kept no note.)
    """
    generator = torch.Generator().manual_seed(0)
    images = TensorDataset(torch.randn(256, 3, 16, 16, generator=generator), torch.randint(0, 10, (256,)))
    trainers = []
    for run in ("first", "second"):
        L.seed_everything(0, verbose=False)
        lever = speedkit.ChannelsLast(probe_steps=3)
        trainer = tiny_trainer(tmp_path / run, max_epochs=12, callbacks=[lever], limit_val_batches=0)
        trainer.fit(DemoClassifier(width=16, crop_size=16), DataLoader(images, batch_size=8))
        trainers.append(trainer)
    first, second = (_choices(trainer, DemoConfig.quick()) for trainer in trainers)
    assert first["sources"] == {"ChannelsLast": "measured"}
    assert "ChannelsLast" not in first["memory"] or "memory_check" not in first["memory"]["ChannelsLast"]
    assert second["sources"] == {"ChannelsLast": "remembered"}
    check = second["memory"]["ChannelsLast"]["memory_check"]
    assert check["ratio"] == pytest.approx(check["live_step_s"] / check["remembered_step_s"])
    assert set(second["memory"]["ChannelsLast"]) <= {"memory_note", "memory_check"}


def test_ablation_adds_one_lever_per_run(tmp_path: Path, demo_cache: Path) -> None:
    """Each ablation run differs from the one before by one lever: cache, then ChannelsLast, then preset(lr=True).

    Every run gets the same LR and the same epoch budget: only the library's own choices differ.
    """
    config = DemoConfig.quick(num_images=100, max_epochs=2, cache_dir=str(demo_cache))
    runs = run_demo(config, out_dir=tmp_path, progress=False, variants=ABLATION)["runs"]
    assert list(runs) == ["baseline", "cache", "channels_last", "speedkit"]
    assert [runs[n]["choices"]["callbacks"] for n in ("baseline", "cache", "channels_last")] == [
        [],
        [],
        ["ChannelsLast"],
    ]
    assert {"ChannelsLast", "LRFinder", "WarmupScheduler", "DataLoaderTuner"} <= set(
        runs["speedkit"]["choices"]["callbacks"]
    )
    assert [runs[n]["lr"] for n in ABLATION] == [config.lr] * 4  # too short a run for the LR finder to search
    assert [runs[n]["schedule"] for n in ABLATION[:3]] == ["constant"] * 3
    assert runs["speedkit"]["schedule"].startswith("warmup")
    assert [runs[n]["max_epochs"] for n in ABLATION] == [2, 2, 2, 2]


def test_seeds_alternate_the_order_and_a_miss_counts_as_zero(tmp_path: Path, demo_cache: Path) -> None:
    """run_seeds runs both sides per seed, baseline first on even positions; a target missed scores 0.00x."""
    config = DemoConfig.quick(num_images=100, max_epochs=1, target_acc=1.0, cache_dir=str(demo_cache))
    report = run_seeds(config, [0, 1], out_dir=tmp_path, progress=False)
    assert [row["order"] for row in report["seeds"]] == [["baseline", "speedkit"], ["speedkit", "baseline"]]
    assert [row["speedup"] for row in report["seeds"]] == [0.0, 0.0]
    assert report["summary"] == {"median": 0.0, "worst": 0.0, "reached": 0, "baseline_reached": 0, "total": 2}
    assert json.loads((tmp_path / "demo.json").read_text())["summary"] == report["summary"]
    assert format_seeds(report).endswith("speed-up over seeds: median 0.00x, worst 0.00x, reached 0/2")
    assert report["machine"] == cpu_info().machine()  # the file and the table name the CPU its figures come from
    assert f"on {cpu_info().model or 'an unnamed CPU'}: " in format_seeds(report)


@pytest.mark.parametrize(("text", "seeds"), [("0-4", [0, 1, 2, 3, 4]), ("2,5", [2, 5]), ("3", [3])])
def test_parse_seeds(text: str, seeds: list[int]) -> None:
    """Ranges, lists and single seeds are understood."""
    assert parse_seeds(text) == seeds


@pytest.mark.parametrize("text", ["", "a-b", "-1", "4-2", "0,4294967296", "0,0", "2-3,3", "1_0", "+3", "0-4294967296"])
def test_bad_seeds_are_refused(text: str) -> None:
    """A malformed or empty seed list, a seed numpy refuses or one given twice is a ValueError naming `seeds`.

    A seed over 2**32 - 1 trained the seeds before it, then died in a traceback; a repeated one counted twice in
    the median.
    """
    with pytest.raises(ValueError, match="`seeds`"):
        parse_seeds(text)


@pytest.mark.slow
def test_demo_model_learns(demo_cache: Path) -> None:
    """On a small generated set the demo model learns: validation accuracy far above chance (10%)."""
    report = run_demo(DemoConfig.quick(cache_dir=str(demo_cache)), progress=False, variants=("baseline",))
    run = report["runs"]["baseline"]
    assert run["final_val_acc"] >= 0.5
    accuracies = [point["val_acc"] for point in run["timeline"]]
    assert max(accuracies) > accuracies[0]


def test_demo_rules_benchmark_runs_every_way_and_restores_the_patched_rules(tmp_path: Path, demo_cache: Path) -> None:
    """benchmarks/demo_rules.py runs every way on a seed, writes the JSON, and puts the rules it switched off back."""
    from conftest import load_benchmark

    from lightning_speedkit.decisions import clearly_slower
    from lightning_speedkit.oom import release_memory
    from lightning_speedkit.trials import measure as measure_function
    from lightning_speedkit.trials import session as session_module

    bench = load_benchmark("demo_rules")
    config = DemoConfig.quick(num_images=100, max_epochs=1, target_acc=0.01, cache_dir=str(demo_cache))
    result = bench.run([0], config, out=tmp_path / "rules.json")
    assert [row["way"] for row in result["rows"]] == list(bench.WAYS)
    assert next(row["speedup"] for row in result["rows"] if row["way"] == "baseline") == 1.0
    no_probes = next(row for row in result["rows"] if row["way"] == "no_probes")
    assert (no_probes["probe_s"], no_probes["lr_reason"]) == (0.0, "as set")
    assert next(row["lr"] for row in result["rows"] if row["way"] == "lr_x2") == 2 * config.lr
    rows = {row["way"]: row for row in result["rows"]}
    assert (rows["no_fused"]["optimizer"], rows["no_layout"]["channels_last"]) == ("not used", "not used")
    assert (rows["no_fused_no_layout"]["optimizer"], rows["no_fused_no_layout"]["channels_last"]) == ("not used",) * 2
    remembered = next(row for row in result["rows"] if row["way"] == "remembered")
    assert remembered["probe_s"] == 0.0
    assert "probe_s" in remembered["first_run"]
    assert set(result["summary"]) == set(bench.WAYS)
    assert {"cpu", "isa", "bf16"} <= set(result["machine"])  # the CPU its figures were measured on
    assert json.loads((tmp_path / "rules.json").read_text())["summary"] == result["summary"]
    assert measure_function.__globals__["clearly_slower"] is clearly_slower
    assert session_module.release_memory is release_memory
