"""benchmarks/lr_decisions.py: each cell's LR decision without the fit after it, and two results compared."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from conftest import load_benchmark


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """The benchmark script, loaded by path."""
    return load_benchmark("lr_decisions")


def test_each_cell_records_the_lr_finder_decision_and_stops_before_the_first_step(
    bench: ModuleType, tmp_path: Path
) -> None:
    """The MLP at two user LRs: per cell the LR finder's scale, steps and reason, the fit stopped at step 0.

    The task's full budget (a second or two): the search's length depends on the steps left.
    """
    out = tmp_path / "decisions.json"
    bench.main(["--quick", "--threads", "1", "--out", str(out)])  # what `speedkit bench --quick` runs
    result: dict[str, Any] = json.loads(out.read_text())
    assert result["config"]["factors"] == [0.1, 1.0]
    assert result["config"]["seeds"] == [0]
    assert {"cpu", "isa"} <= set(result["machine"])
    cells = result["decisions"]
    assert [(c["task"], c["factor"], c["seed"]) for c in cells] == [("mlp", 0.1, 0), ("mlp", 1.0, 0)]
    for cell in cells:
        assert cell["stopped_at_step"] == 0  # nothing trained past the decisions
        assert cell["probed"] is True
        assert cell["steps"] > 0
        assert cell["scale"] in (0.01, 0.1, 1.0, 10.0, 100.0)
        assert cell["chosen_lr"] == pytest.approx(cell["lr"] * cell["scale"])
        assert cell["reason"]
        assert 0.0 in cell["trials"]["scales"]  # the reference trial, with its losses
        assert len(cell["trials"]["losses"]) == len(cell["trials"]["scales"])


def test_compare_counts_the_same_scales_and_lists_the_cells_that_differ(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--compare: the cells in both, those whose scale differs with both records, and those in either file only."""

    def cell(factor: float, seed: int, scale: float) -> dict[str, Any]:
        return {"task": "mlp", "factor": factor, "seed": seed, "scale": scale, "steps": 12, "probe_s": 0.1}

    config = {"schedule": "constant", "tasks": {"mlp": {"max_epochs": 6}}, "device": "cpu"}
    before = {"config": config, "decisions": [cell(0.1, 0, 10.0), cell(0.1, 1, 10.0), cell(1.0, 0, 1.0)]}
    after = {"config": config, "decisions": [cell(0.1, 0, 10.0), cell(0.1, 1, 1.0), cell(10.0, 0, 1.0)]}
    (tmp_path / "a.json").write_text(json.dumps(before))
    (tmp_path / "b.json").write_text(json.dumps(after))
    summary = bench.main(["--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert (summary["cells"], summary["same_scale"]) == (2, 1)
    assert [(d["before"]["seed"], d["before"]["scale"], d["after"]["scale"]) for d in summary["differ"]] == [
        (1, 10.0, 1.0)
    ]
    assert summary["before_only"] == [["mlp", 1.0, 0]]
    assert summary["after_only"] == [["mlp", 10.0, 0]]
    assert summary["config_differs"] == []
    out = capsys.readouterr().out
    assert "the same scale in 1 of 2 cells" in out
    assert "warning" not in out


def test_compare_warns_when_the_two_results_are_not_the_same_jobs(bench: ModuleType) -> None:
    """Another schedule or machine ISA: compare names it, since a different scale may come from that alone."""
    cells = [{"task": "mlp", "factor": 1.0, "seed": 0, "scale": 1.0}]
    before = {"config": {"schedule": "constant"}, "machine": {"isa": "AVX512"}, "decisions": cells}
    after = {"config": {"schedule": "cosine"}, "machine": {"isa": "AVX2"}, "decisions": cells}
    assert bench.compare(before, after)["config_differs"] == ["schedule", "machine isa"]


def test_a_fit_that_ends_before_its_first_step_is_an_error(bench: ModuleType, tmp_path: Path) -> None:
    """No training step, no decision to read: decide_one says which cell, rather than record nothing."""
    task = dataclasses.replace(bench.lr_tasks.TASKS["mlp"], max_epochs=0)
    with pytest.raises(RuntimeError, match="mlp x1 seed 0: the fit ended before its first training step"):
        bench.decide_one(task, 1.0, 0, tmp_path, "cpu")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tasks", "resnet"], "--tasks must name some of"),
        (["--factors", "0,1"], "--factors must be positive"),
        (["--factors", "1,x"], "got '1,x'"),
        (["--factors", "nan"], "--factors must be positive"),
        (["--seeds", "2-1"], "--seeds:"),
        (["--threads", "0"], "--threads must be at least 1, got 0"),
        (["--quick", "--seeds", "1"], "--quick sets tasks, seeds, factors itself; drop --seeds"),
    ],
)
def test_bad_arguments_are_refused_by_name(
    bench: ModuleType, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A task lr_tasks lacks, a factor that is not a positive number, bad seeds or threads: an error naming them."""
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err
