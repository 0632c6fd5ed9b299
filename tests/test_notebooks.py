"""Every notebook runs top to bottom on CPU (SPECJAX_NOTEBOOK_SMALL=1 shrinks its work); a cell that raises, or
an assertion inside one (the quickstart's identical-output check), fails the test."""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from benchmarks.bench_eagle import GSM8K

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


@pytest.mark.parametrize("name", ["quickstart", "harness", "train_head"])
def test_notebook_runs_top_to_bottom(name, tmp_path, monkeypatch):
    if name != "quickstart" and not GSM8K.is_file():
        pytest.fail("the GSM8K questions (shared/data/gsm8k_train.jsonl) are missing")
    monkeypatch.setenv("SPECJAX_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("SPECJAX_GSM8K", str(GSM8K))
    notebook = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    assert not any(cell.get("outputs") for cell in notebook.cells), "commit notebooks without outputs"
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    figures = [output for cell in notebook.cells for output in cell.get("outputs", [])
               if "image/png" in output.get("data", {})]
    assert figures, "the notebook shows no plot"
