"""Tests of the ``speedkit`` command line."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_speedkit.cli import build_parser, main


def test_help_explains_each_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    """``speedkit --help`` lists doctor and demo with a sentence each."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines to the terminal width
    assert "doctor" in out
    assert "demo" in out
    assert "what speedkit would choose" in out


def test_a_subcommand_is_required() -> None:
    """Running ``speedkit`` without a subcommand is a usage error, not a silent success."""
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([])
    assert exit_info.value.code == 2


def test_module_entry_point_runs_doctor_json() -> None:
    """``python -m lightning_speedkit doctor --json`` prints JSON with a recommendation on this CPU machine."""
    result = subprocess.run(
        [sys.executable, "-m", "lightning_speedkit", "doctor", "--json"], capture_output=True, text=True, check=True
    )
    report = json.loads(result.stdout)
    assert report["recommendation"]["precision"]["value"]


def test_console_script_is_installed() -> None:
    """The ``speedkit`` console script is installed beside the interpreter and answers ``--version``."""
    script = Path(sys.executable).parent / "speedkit"
    result = subprocess.run([str(script), "--version"], capture_output=True, text=True, check=True)
    assert result.stdout.startswith("speedkit ")


def test_doctor_text(capsys: pytest.CaptureFixture[str]) -> None:
    """``speedkit doctor`` prints the recommended settings as text."""
    assert main(["doctor"]) == 0
    assert "recommended" in capsys.readouterr().out


def _time_cell(seconds: float | None) -> str:
    """How the side-by-side table shows a time to target."""
    return f"{seconds:.1f} s" if seconds is not None else "not reached"


def _row_cells(printed: str, label: str) -> list[str]:
    """The cells after ``label`` of the one table row that starts with it (cells are separated by 2+ spaces)."""
    rows = [line for line in printed.splitlines() if line.startswith(label)]
    assert len(rows) == 1, (label, printed)
    return re.split(r"\s{2,}", rows[0][len(label) :].strip())


def test_demo_quick_writes_report(tmp_path: Path, demo_cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``speedkit demo --quick`` prints a table whose times, epochs, probes and speed-up line are those of demo.json."""
    out_dir = tmp_path / "out"
    argv = ["demo", "--quick", "--num-images", "100", "--max-epochs", "1", "--out", str(out_dir)]
    assert main([*argv, "--cache-dir", str(demo_cache)]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out_dir / "demo.json").read_text())
    runs = report["runs"]
    assert list(runs) == ["baseline", "speedkit"]
    assert [run["epochs"] for run in runs.values()] == [1, 1]
    lines = printed.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("demo workload:"))
    assert lines[first + 1].startswith("on ")  # the CPU, as in demo.json's "machine"
    header = lines[first + 2]
    assert header.split() == ["baseline", "speedkit"]
    times = [run["time_to_target_s"] for run in runs.values()]
    assert _row_cells(printed, "time to val_acc 0.75") == [_time_cell(t) for t in times]
    assert _row_cells(printed, "epochs") == ["1", "1"]
    assert _row_cells(printed, "final val_acc") == [f"{run['final_val_acc'] or 0:.3f}" for run in runs.values()]
    assert _row_cells(printed, "probes")[0] == "none"  # the schedule, the LR search and their cost are in the table
    assert len(_row_cells(printed, "LR decided")) == 2
    assert runs["baseline"]["choices"]["probes"] == {}
    assert re.fullmatch(r"warmup \d+ steps, wsd \(cool-down 20%\)", runs["speedkit"]["schedule"])  # as resolved
    speedup_lines = [line for line in printed.splitlines() if line.startswith("speed-up (time to target")]
    if None in times:  # one epoch of 80 images: the target is usually out of reach, and then no speed-up is claimed
        assert report["speedup"] is None
        assert speedup_lines == []
    else:
        assert report["speedup"] == pytest.approx(times[0] / times[1])
        assert speedup_lines == [f"speed-up (time to target, baseline / speedkit): {report['speedup']:.2f}x"]


def _seed_cell(run: dict[str, Any]) -> str:
    """How the per-seed table shows one variant's run."""
    reached = run["time_to_target_s"]
    return f"{reached:.1f} s ({run['epochs']} ep)" if reached else f"not reached ({run['final_val_acc'] or 0:.3f})"


def test_demo_seeds_prints_the_summary_line(
    tmp_path: Path, demo_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``speedkit demo --seeds 0-1`` prints one row per seed and a summary line, each matching demo.json."""
    argv = ["demo", "--quick", "--num-images", "100", "--max-epochs", "1", "--target-acc", "1.0", "--seeds", "0-1"]
    assert main([*argv, "--out", str(tmp_path), "--cache-dir", str(demo_cache)]) == 0
    lines = capsys.readouterr().out.splitlines()
    report = json.loads((tmp_path / "demo.json").read_text())
    seeds, summary = report["seeds"], report["summary"]
    assert [row["seed"] for row in seeds] == [0, 1]
    header = next(i for i, line in enumerate(lines) if line.startswith("seed  "))
    rows = lines[header + 1 : header + 1 + len(seeds)]
    for line, row in zip(rows, seeds, strict=True):  # fixed columns: seed 6, baseline 22, speedkit 22, speed-up 9
        assert line[:6].strip() == str(row["seed"]), line
        assert line[6:28].strip() == _seed_cell(row["baseline"]), line
        assert line[28:50].strip() == _seed_cell(row["speedkit"]), line
        assert line[50:59].strip() == f"{row['speedup']:.2f}x", line
        assert line[61:].startswith(f"{row['speedkit']['choices']['precision']}, "), line
    match = re.fullmatch(
        r"speed-up over seeds: median (\d+\.\d\d)x, worst (\d+\.\d\d)x, reached (\d+)/(\d+)",
        lines[header + 1 + len(seeds)],
    )
    assert match, lines[header + 1 + len(seeds) :]
    speedups = [row["speedup"] for row in seeds]
    assert float(match[1]) == pytest.approx(statistics.median(speedups), abs=0.005)
    assert float(match[2]) == pytest.approx(min(speedups), abs=0.005)
    assert (int(match[3]), int(match[4])) == (sum(bool(r["speedkit"]["time_to_target_s"]) for r in seeds), 2)
    assert (summary["reached"], summary["total"]) == (int(match[3]), int(match[4]))
    assert speedups == [0.0, 0.0]  # target 1.0 is out of reach in one epoch: every seed is a miss, counted as 0.00x


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seed", "-5"], "--seed must be an int in [0, 4294967295]"),
        (["--seed", "abc"], "argument --seed: invalid int value: 'abc'"),
        (["--max-epochs", "0"], "--max-epochs must be a positive int, got 0"),
        (["--target-acc", "2"], "--target-acc must be a number in (0, 1], got 2.0"),
        (["--num-workers", "-1"], "--num-workers must be an int >= 0, got -1"),
        (["--num-images", "3"], "--num-images must be an int >= 10, got 3"),  # one per class: a traceback before
        (["--seeds", ""], "--seeds must be a range like 0-4 or a list like 0,2,5"),
        (["--quick", "--seeds", "0-999999"], "--seeds names 1000000 seeds, at most 64"),
        (["--seeds", "0-1", "--only", "baseline"], "--seeds runs baseline and speedkit on every seed"),
        (["--seeds", "0-1", "--seed", "7"], "it takes no --only, --ablation or --seed"),  # ignored, then recorded
        (["--seeds", "0-4294967295"], "--seeds names 4294967296 seeds, at most 64"),  # a MemoryError before
        (["--seeds", "1_0"], "--seeds must be a range like 0-4"),  # int() read it as 10
        (["--num-images", "99999999999"], "--num-images must be at most 1,000,000 for the demo workload"),
        (["--width", "100000000"], "--width must be at most 1,024 for the demo workload"),
        (["--batch-size", "100000000"], "--batch-size must be at most --num-images=5000"),
        (["--cache-dir", ""], "--cache-dir must be a directory or None, got ''"),
        (["--only", "fast"], "argument --only: invalid choice: 'fast'"),
    ],
)
def test_a_bad_demo_flag_is_one_line_and_status_2_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    """Every demo flag is checked before any work: exit status 2, one stderr line naming the flag, nothing written."""
    out = tmp_path / "out"
    try:
        status = main(["demo", *argv, "--out", str(out)])
    except SystemExit as exit_info:  # argparse's own checks (types, choices)
        status = exit_info.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("\n") == 1, err
    assert err.startswith("speedkit demo: error: ")
    assert message in err
    assert "Traceback" not in err
    assert not out.exists()


def test_an_out_directory_that_cannot_be_written_is_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--out`` under a file fails at once, status 2, naming the flag: not after training, with the results lost."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    assert main(["demo", "--quick", "--out", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("speedkit demo: error: --out must be a directory this user can write to")
    assert err.count("\n") == 1


def test_a_bad_demo_flag_exits_2_from_the_console_script(tmp_path: Path) -> None:
    """The installed command itself exits 2 with one line and no traceback for a value a config check refuses."""
    script = Path(sys.executable).parent / "speedkit"
    result = subprocess.run(
        [str(script), "demo", "--seed", "-5", "--out", str(tmp_path / "o")], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert result.stderr == "speedkit demo: error: --seed must be an int in [0, 4294967295] (a numpy seed), got -5\n"
