"""Tests of the package's shape: the floors of docs/ARCHITECTURE.md, file sizes, one copy of each shared helper."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_speedkit"
MAX_LINES = 400

# The floors of docs/ARCHITECTURE.md, lowest first. A module imports only its own floor's shared modules or lower
# floors; a concern never imports another concern (the foundation holds what two concerns share).
FOUNDATION = {
    "__about__", "batch", "budget", "checks", "cooldown", "data", "decisions", "hardware", "hooks", "layout", "lr",
    "lr_range", "lr_search", "lr_trial", "oom",
    "recommend",
    "report", "restore", "robust", "sampling", "schedule", "step_factor", "timing", "trials",
}  # fmt: skip
CONCERNS = {
    "average", "batch_size", "bench", "channels_last", "compile", "dataloader", "doctor", "fused", "guard", "int8",
    "lr_finder", "monitor", "precision", "pruning", "warmup",
}  # fmt: skip
ASSEMBLY = {"callback_table", "forked", "loggers", "preset"}
FACES = {"", "__main__", "cli", "demo"}  # "" is the package's __init__
FLOORS = {**dict.fromkeys(FOUNDATION, 0), **dict.fromkeys(CONCERNS, 1), **dict.fromkeys(ASSEMBLY, 2)}
FLOORS.update(dict.fromkeys(FACES, 3))
FLOOR_NAMES = ("foundation", "concern", "assembly", "face")


def room(module: str) -> str:
    """The top-level room of a dotted module name inside the package ("" for the package itself).

    Example:
        >>> room("lightning_speedkit.trials.session"), room("lightning_speedkit")
        ('trials', '')
    """
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imports_of(path: Path) -> set[str]:
    """The package modules a file imports (absolute, relative and ``from . import name`` forms), at any depth."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = parts if parts[-1] == "__init__" else parts[:-1]
    package = [p for p in package if p != "__init__"]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:  # `from lightning_speedkit import trials` imports the module `trials`
                found.add(f"{target}.{alias.name}" if _is_module(f"{target}.{alias.name}") else target)
    return {name for name in found if name == "lightning_speedkit" or name.startswith("lightning_speedkit.")}


SOURCES = sorted(PACKAGE.rglob("*.py"))


def _is_module(dotted: str) -> bool:
    path = PACKAGE.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _module(path: Path) -> str:
    name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return name.removesuffix(".__init__")


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_module_has_a_floor(path: Path) -> None:
    """Every module of the package sits on one of the four floors (a new room must be placed on purpose)."""
    assert room(_module(path)) in FLOORS, f"place {room(_module(path))!r} on a floor in docs/ARCHITECTURE.md and here"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path: Path) -> None:
    """No module imports one on a higher floor, and no concern imports another concern."""
    mine = room(_module(path))
    wrong = []
    for target in sorted(imports_of(path)):
        theirs = room(target)
        if theirs == mine or theirs not in FLOORS or mine not in FLOORS:
            continue
        if FLOORS[theirs] > FLOORS[mine]:
            wrong.append(f"{target} ({FLOOR_NAMES[FLOORS[theirs]]}) from a {FLOOR_NAMES[FLOORS[mine]]}")
        elif FLOORS[mine] == FLOORS[theirs] == 1:
            wrong.append(f"{target}: a concern importing another concern")
    assert not wrong, wrong


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_file_is_over_the_size_limit(path: Path) -> None:
    """Every file of the package is at most 400 lines: a longer one is split along its seams."""
    assert len(path.read_text().splitlines()) <= MAX_LINES


@pytest.mark.parametrize("helper", ["_is_int", "_is_number", "_warmups"])
def test_shared_helpers_are_written_once(helper: str) -> None:
    """The argument checks and the warmup lookup live once in the foundation, not as private copies per concern."""
    pattern = re.compile(rf"^\s*def {helper}\(", re.MULTILINE)
    copies = [str(p.relative_to(PACKAGE)) for p in SOURCES if pattern.search(p.read_text())]
    assert not copies, copies
