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


@pytest.mark.parametrize("name", ["lightning_speedkit", *MODULES])
def test_all_is_sorted_and_resolves(name: str) -> None:
    """Every module declares a sorted ``__all__`` whose names all exist."""
    module = importlib.import_module(name)
    exported = list(module.__all__)
    assert exported == sorted(exported)
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
    }
    assert callbacks <= set(lightning_speedkit.__all__)
