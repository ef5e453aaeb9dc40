"""Tests of the atomic file helpers and report flattening."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_speedkit.report import atomic_directory, atomic_file, flatten_reports, write_json_atomic


def test_atomic_file_keeps_the_old_file_when_writing_fails(tmp_path: Path) -> None:
    """An error inside the block leaves the previous file intact and no temporary file behind."""
    target = write_json_atomic({"v": 1}, tmp_path / "r.json")

    def fail_half_way() -> None:
        with atomic_file(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail_half_way()
    assert target.read_text() == '{\n  "v": 1\n}'
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_atomic_directory_removes_a_failed_build(tmp_path: Path) -> None:
    """A failing build leaves neither the target nor its temporary directory."""

    def fail_half_way() -> None:
        with atomic_directory(tmp_path / "set") as tmp:
            (tmp / "a").write_text("1")
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        fail_half_way()
    assert list(tmp_path.iterdir()) == []


def test_atomic_directory_keeps_the_winner_of_a_race(tmp_path: Path) -> None:
    """If another process put a complete directory in place first, it is kept and ours is discarded."""
    target = tmp_path / "set"
    with atomic_directory(target) as ours:
        (ours / "who").write_text("ours")
        target.mkdir()
        (target / "who").write_text("theirs")
    assert (target / "who").read_text() == "theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["set"]


def test_flatten_drops_secret_looking_keys() -> None:
    """Keys that look like secrets never reach a logger payload, whatever their value."""
    assert flatten_reports({"wandb_api_key": "x", "run": {"token": "y", "steps": 3}}) == {"speedkit/run/steps": 3}


def test_a_json_report_is_strict_json_even_with_an_infinite_value(tmp_path: Path) -> None:
    """``speedkit_summary.json`` and every JSON result go through `write_json_atomic`: no ``Infinity`` or ``NaN``.

    An unbounded compiled run's projected saving (``inf``) made the summary file one jq and JavaScript refuse.
    """
    import json

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    data = {"saving_s": float("inf"), "nested": [{"loss": float("nan")}, (1.5, float("-inf"))], "name": "x"}
    text = write_json_atomic(data, tmp_path / "summary.json").read_text()
    assert json.loads(text, parse_constant=refuse) == {
        "saving_s": None,
        "nested": [{"loss": None}, [1.5, None]],
        "name": "x",
    }
