"""Tests of the shared argument checks (`lightning_speedkit.checks`)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lightning_speedkit import checks
from lightning_speedkit.checks import (
    check_bool,
    check_choice,
    check_int,
    check_margin,
    check_number,
    check_probe_steps,
    is_int,
    is_number,
)

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_speedkit"


@pytest.mark.parametrize(
    ("value", "low", "expected"),
    [
        (3, None, True),
        (0, None, True),
        (-2, None, True),
        (True, None, False),
        (False, None, False),
        (2.0, None, False),
        ("3", None, False),
        (None, None, False),
        (0, 1, False),
        (1, 1, True),
        (2, 2, True),
        (1, 2, False),
        (True, 1, False),
    ],
)
def test_is_int_table(value: object, low: int | None, expected: bool) -> None:
    """An int that is not a bool, at least ``low`` when given."""
    assert is_int(value, low) is expected


@pytest.mark.parametrize(
    ("value", "bounds", "expected"),
    [
        (0.5, {}, True),
        (3, {}, True),
        (True, {}, False),
        ("0.5", {}, False),
        (None, {}, False),
        (math.nan, {}, False),
        (math.inf, {}, False),
        (0.0, {"low": 0, "high": 1}, True),
        (1.0, {"low": 0, "high": 1}, True),
        (0.0, {"low": 0, "high": 1, "open_low": True}, False),
        (1.0, {"low": 0, "high": 1, "open_high": True}, False),
        (-0.1, {"low": 0}, False),
        (1e9, {"low": 0}, True),
        (2, {"high": 1}, False),
    ],
)
def test_is_number_table(value: object, bounds: dict[str, Any], expected: bool) -> None:
    """A finite int or float that is not a bool, inside the bounds (closed unless open_low/open_high)."""
    assert is_number(value, **bounds) is expected


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: check_int("n", 0), "`n` must be a positive int, got 0."),
        (lambda: check_int("n", True), "`n` must be a positive int, got True."),
        (lambda: check_int("n", -1, low=0), "`n` must be an int >= 0, got -1."),
        (lambda: check_int("n", "x", optional=True), "`n` must be a positive int or None, got 'x'."),
        (lambda: check_int("n", 2.5, low=3, optional=True), "`n` must be an int >= 3 or None, got 2.5."),
        (lambda: check_number("x", "a"), "`x` must be a finite number, got 'a'."),
        (lambda: check_number("x", 0, 0, open_low=True), "`x` must be a positive number, got 0."),
        (lambda: check_number("x", -1, 0), "`x` must be a number >= 0, got -1."),
        (lambda: check_number("x", 1, 1, open_low=True), "`x` must be a number > 1, got 1."),
        (lambda: check_number("x", 2, high=1), "`x` must be a number <= 1, got 2."),
        (lambda: check_number("x", 1.0, 0, 1, open_high=True), "`x` must be a number in [0, 1), got 1.0."),
        (lambda: check_number("x", True, 0, 1), "`x` must be a number in [0, 1], got True."),
        (lambda: check_choice("mode", "z", ("a", "b")), "`mode` must be one of 'a', 'b', got 'z'."),
        (lambda: check_choice("mode", True, (1, 2)), "`mode` must be one of 1, 2, got True."),
        (lambda: check_choice("mode", [1], {"a"}), "`mode` must be one of 'a', got [1]."),
        (lambda: check_bool("flag", 1), "`flag` must be True or False, got 1."),
        (lambda: check_margin("margin", -0.1), "`margin` must be a number in [0, 1), got -0.1."),
        (lambda: check_probe_steps("steps", 1, low=2), "`steps` must be an int >= 2, got 1."),
    ],
)
def test_checks_raise_a_value_error_naming_the_argument_and_the_value(call: Callable[[], Any], message: str) -> None:
    """Each check raises ValueError (never TypeError) with the exact message "`name` must be ..., got <repr>."."""
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        call()


def test_checks_return_the_accepted_value() -> None:
    """A value that passes comes back (numbers as float), so a check can be used inline in an assignment."""
    assert check_int("n", 4) == 4
    assert check_int("n", None, optional=True) is None
    assert check_number("x", 1, 0) == 1.0
    assert isinstance(check_number("x", 1, 0), float)
    assert check_choice("mode", "a", ("a", "b")) == "a"
    assert check_bool("flag", False) is False
    assert check_margin("margin", 0) == 0.0
    assert check_probe_steps("steps", 3) == 3


def test_decisions_reexports_the_same_checks() -> None:
    """`lightning_speedkit.decisions` offers the very same `check_margin` and `check_probe_steps`, not copies."""
    from lightning_speedkit import decisions

    assert decisions.check_margin is checks.check_margin
    assert decisions.check_probe_steps is checks.check_probe_steps
