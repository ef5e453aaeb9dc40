"""Tests of the ``speedkit`` command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


def test_demo_quick_writes_report(tmp_path: Path, demo_cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``speedkit demo --quick`` trains both variants, prints the side-by-side table and writes demo.json."""
    out_dir = tmp_path / "out"
    argv = ["demo", "--quick", "--num-images", "100", "--max-epochs", "1", "--out", str(out_dir)]
    assert main([*argv, "--cache-dir", str(demo_cache)]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out_dir / "demo.json").read_text())
    runs = report["runs"]
    assert [run["epochs"] for run in runs.values()] == [1, 1]
    assert "time to val_acc 0.80" in printed
    if report["speedup"] is None:  # one epoch of 80 images: the target is usually out of reach, and says so
        assert "not reached" in printed
    else:
        assert f"speed-up (time to target, baseline / speedkit): {report['speedup']:.2f}x" in printed


def test_demo_seeds_prints_the_summary_line(
    tmp_path: Path, demo_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``speedkit demo --seeds 0-1`` prints a row per seed and the median/worst/reached line, and writes demo.json."""
    argv = ["demo", "--quick", "--num-images", "100", "--max-epochs", "1", "--target-acc", "1.0", "--seeds", "0-1"]
    assert main([*argv, "--out", str(tmp_path), "--cache-dir", str(demo_cache)]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((tmp_path / "demo.json").read_text())["summary"]
    assert summary["total"] == 2
    assert f"reached {summary['reached']}/2" in printed
    assert "speed-up over seeds: median 0.00x, worst 0.00x" in printed
