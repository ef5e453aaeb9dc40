"""benchmarks/lr_starts.py: the cells lr_tasks found late, over many rounding-level starts of every variant."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from conftest import load_benchmark


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """The benchmark script, loaded by path."""
    return load_benchmark("lr_starts")


def _result(tmp_path: Path) -> Path:
    """An lr_tasks-shaped result: one MLP cell flagged for preset, one late once only, one on time."""

    def cell(factor: float, seed: int, **flags: bool) -> dict[str, Any]:
        return {"label": "right", "factor": factor, "seed": seed, "naive_s": 1.0, "preset_s": 1.5, **flags}

    flagged = cell(1.0, 0, preset_later_repeated=True, preset_later_than_every=True)
    once = cell(1.0, 1, preset_later_repeated=False, preset_later_than_every=True)
    result = {
        "config": {"device": "cpu", "tasks": {"mlp": {}}},
        "machine": {},
        "tasks": {"mlp": {"target": 0.8, "cells": [flagged, once, cell(10.0, 0)]}},
    }
    path = tmp_path / "lr_tasks.json"
    path.write_text(json.dumps(result))
    return path


def test_by_default_only_the_cells_late_beyond_the_noise_are_run(bench: ModuleType, tmp_path: Path) -> None:
    """A cell counts when a variant was late in every re-run and later than every naive fit; ``--cells`` picks any."""
    result = json.loads(_result(tmp_path).read_text())
    chosen = bench.select(result)
    assert [(c["task"], c["factor"], c["seed"], c["target"]) for c in chosen] == [("mlp", 1.0, 0, 0.8)]
    assert [(c["factor"], c["seed"]) for c in bench.select(result, [("mlp", 10.0, 0)])] == [(10.0, 0)]
    with pytest.raises(ValueError, match=r"--cells: mlp:3:0 is not a cell"):
        bench.select(result, [("mlp", 3.0, 0)])


def test_a_variant_is_later_only_when_its_median_over_the_starts_is(bench: ModuleType) -> None:
    """One slow draw (a miss) does not make a variant later; a cost paid on every start does.

    Start by start, a miss is the latest epoch, and the price is read where the variant reached it at naive's epoch.
    """
    times = {"naive": [1.0, 1.2, 1.1, 1.0], "preset": [None, 1.0, 1.1, 1.05], "preset_auto": [1.3, 1.4, 1.3, 1.35]}
    epochs = {"naive": [1, 2, 1, 1], "preset": [None, 1, 1, 1], "preset_auto": [1, 2, 1, 1]}
    verdict = bench.judge(times, epochs)
    assert (verdict["preset"]["later_epochs"], verdict["preset"]["earlier_epochs"]) == (1, 1)
    assert verdict["preset"]["same_epoch_over_naive"] == pytest.approx(1.025)  # starts 2 and 3: 1.0x and 1.05x
    assert verdict["preset_auto"]["same_epoch_over_naive"] == pytest.approx((1.3 / 1.1 + 1.3) / 2)  # the middle two
    assert bench._json_safe(bench.judge({"naive": [1.0], "preset": [None]}))["preset"]["median_s"] == "inf"
    assert verdict["naive"]["median_s"] == pytest.approx(1.05)
    assert verdict["preset"]["reached"] == 3
    assert not verdict["preset"]["later_as_a_distribution"]
    assert verdict["preset_auto"]["later_as_a_distribution"]
    assert verdict["preset_auto"]["over_naive"] == pytest.approx(1.325 / 1.05)
    missing = bench.judge({"naive": [None, None], "preset": [1.0, 1.0]})
    assert math.isinf(missing["naive"]["median_s"])
    assert missing["preset"]["over_naive"] is None
    assert not missing["preset"]["later_as_a_distribution"]  # naive never reached: nothing is later than it


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--cells", "mlp:1"], "--cells takes task:factor:seed"),
        (["--cells", "mlp:x:0"], "--cells takes task:factor:seed"),
        (["--starts", "0"], "--starts must be at least 1, got 0"),
        (["--quick", "--threads", "0"], "--threads must be at least 1, got 0"),
        ([], "--from is required"),
        (["--quick", "--without", "lr"], "--without takes preset() levers"),
        (["--quick", "--cells", "mlp:1:0"], "--quick runs lr_tasks --quick itself"),
    ],
)
def test_bad_arguments_name_the_option(
    bench: ModuleType, argv: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A malformed cell, no starts, no source: an argparse error naming the option and what was given."""
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert match in capsys.readouterr().err


def test_an_unknown_cell_of_the_source_is_refused_before_any_fit(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--cells`` naming a cell the ``--from`` result does not hold: an error naming it, no fit, no file."""
    out = tmp_path / "starts.json"
    with pytest.raises(SystemExit):
        bench.main(["--from", str(_result(tmp_path)), "--cells", "mlp:3:0", "--out", str(out)])
    assert "mlp:3:0 is not a cell" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.slow
def test_quick_fits_every_variant_from_every_start(bench: ModuleType, tmp_path: Path) -> None:
    """``--quick``: lr_tasks' quick MLP, then its right-LR cell from two starts; each variant fitted from both.

    ``--without fused_optimizer`` adds ``preset(fused_optimizer=False)``: its fits decide no fused update.
    Start 0 is the benchmark's own (no nudge); start 1 every initial weight one ulp up, for every variant alike.
    """
    out = tmp_path / "starts.json"
    result = bench.main(["--quick", "--without", "fused_optimizer", "--out", str(out)])
    assert json.loads(out.read_text())["summary"] == result["summary"]
    assert result["config"]["starts"] == 2
    (cell,) = result["cells"]
    assert (cell["task"], cell["factor"], cell["seed"]) == ("mlp", 1.0, 0)
    variants = ("naive", "preset", "preset_auto", "preset_without_fused_optimizer")
    assert list(cell["verdict"]) == list(variants)
    assert {len(times) for times in cell["times_s"].values()} == {2}
    starts = sorted((run["variant"], run["start_ulps"]) for run in result["runs"])
    assert starts == sorted((v, u) for v in variants for u in (0, 1))
    for run in result["runs"]:  # the lever switched off is not among the decisions of its variant's fits
        levers = run.get("decisions", {}).get("levers", {})
        assert ("FusedOptimizer" in levers) == (run["variant"] in ("preset", "preset_auto")), levers
    for run in result["runs"]:
        assert run["time_to_target_s"] == bench.lr_tasks.time_to_target(run["timeline"], cell["target"])
