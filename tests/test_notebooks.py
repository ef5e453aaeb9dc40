"""The notebooks in ``notebooks/`` execute from top to bottom and are stored without outputs."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks() -> None:
    """The tutorials exist (so the tests below cannot pass by finding nothing)."""
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stripped(path: Path) -> None:
    """Notebooks are committed without outputs or execution counts."""
    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == []
            assert cell.execution_count is None


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path: Path, demo_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every cell runs without error in a fresh kernel."""
    monkeypatch.setenv("SPEEDKIT_CACHE_DIR", str(demo_cache))
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
