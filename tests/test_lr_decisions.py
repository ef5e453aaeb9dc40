"""benchmarks/lr_decisions.py: each cell's LR decision without the fit after it, and two results compared."""

from __future__ import annotations

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
    bench.main(["--tasks", "mlp", "--seeds", "0", "--factors", "0.1,1", "--threads", "1", "--out", str(out)])
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
    """--compare: the cells in both, those whose scale differs with both records, and those in one file only."""

    def cell(factor: float, seed: int, scale: float) -> dict[str, Any]:
        return {"task": "mlp", "factor": factor, "seed": seed, "scale": scale, "steps": 12, "probe_s": 0.1}

    before = {"decisions": [cell(0.1, 0, 10.0), cell(0.1, 1, 10.0), cell(1.0, 0, 1.0)]}
    after = {"decisions": [cell(0.1, 0, 10.0), cell(0.1, 1, 1.0), cell(10.0, 0, 1.0)]}
    (tmp_path / "a.json").write_text(json.dumps(before))
    (tmp_path / "b.json").write_text(json.dumps(after))
    summary = bench.main(["--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert (summary["cells"], summary["same_scale"]) == (2, 1)
    assert [(d["before"]["seed"], d["before"]["scale"], d["after"]["scale"]) for d in summary["differ"]] == [
        (1, 10.0, 1.0)
    ]
    assert summary["in_one_only"] == [["mlp", 1.0, 0], ["mlp", 10.0, 0]]
    assert "the same scale in 1 of 2 cells" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--tasks", "resnet"], "--tasks must name some of"), (["--factors", "0,1"], "--factors must be positive")],
)
def test_bad_arguments_are_refused_by_name(
    bench: ModuleType, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--tasks naming no task of lr_tasks, a factor that is not positive: an error naming the option and the value."""
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err
