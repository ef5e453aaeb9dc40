"""The public surface: ``__all__`` sorted, complete and importable."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import lightning as L
import pytest

import lightning_speedkit

MODULES = [
    info.name
    for info in pkgutil.walk_packages(lightning_speedkit.__path__, "lightning_speedkit.")
    if info.name != "lightning_speedkit.__main__"
]


def _isort_key(name: str) -> tuple[int, str]:
    """Ruff's RUF022 order: SCREAMING_SNAKE_CASE constants, then CamelCase classes, then everything else."""
    if len(name) > 1 and name.isupper():
        return (0, name)
    if name[:1].isupper():
        return (1, name)
    return (2, name)


@pytest.mark.parametrize("name", ["lightning_speedkit", *MODULES])
def test_all_is_sorted_and_resolves(name: str) -> None:
    """Every module declares an ``__all__`` in ruff's isort-style order whose names all exist."""
    module = importlib.import_module(name)
    exported = list(module.__all__)
    assert exported == sorted(exported, key=_isort_key)
    for member in exported:
        assert hasattr(module, member), f"{name}.__all__ names missing {member!r}"


def test_every_callback_is_exported_at_the_top() -> None:
    """Each speedkit Callback class is reachable as ``speedkit.<Name>``."""
    callbacks = {
        obj.__name__
        for name in MODULES
        for obj in vars(importlib.import_module(name)).values()
        if inspect.isclass(obj)
        and issubclass(obj, L.Callback)
        and obj.__module__.startswith("lightning_speedkit")
        and not obj.__name__.startswith("_")
        and not obj.__module__.startswith("lightning_speedkit.demo")
        and obj is not lightning_speedkit.trials.Lever  # the contract levers subclass, not a callback to add
        and obj is not lightning_speedkit.hooks.LeanCallback  # the base every speedkit callback builds on
    }
    assert callbacks <= set(lightning_speedkit.__all__)
