"""Every notebook under notebooks/ runs top to bottom (nbclient, a fresh python3 kernel, cwd =
notebooks/) without an error; the notebooks assert what they show (training_a_small_head: the training
loss falls, tau rises with training, and speculative output does not change with the head). They are
committed executed, so their tables and figures show where the repository is browsed: every code cell
whose fresh run displays a figure or a table has one committed too. Executing is skipped when
nbclient / nbformat / ipykernel are not installed; the committed-outputs checks need only json."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
MAX_BYTES = 2_000_000                   # a committed notebook with its figures stays small
DISPLAY_KINDS = ("image/png", "text/markdown")


def display_kinds(cell) -> set[str]:
  """The figure / table kinds a code cell's outputs show."""
  return {k for o in cell.get("outputs", []) if o.get("output_type") in ("display_data", "execute_result")
          for k in o.get("data", {}) if k in DISPLAY_KINDS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  pytest.importorskip("ipykernel")
  # the kernel inherits this environment: read the committed results and the committed tuner run
  for var in ("SPECJAX_RESULTS", "SPECJAX_TUNE_RUN"):
    monkeypatch.delenv(var, raising=False)
  monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")
  committed = nbformat.read(path, as_version=4)
  nb = copy.deepcopy(committed)
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": str(path.parent)}})
  try:
    client.execute()
  except nbclient.exceptions.CellExecutionError as e:   # the failing cell's source and traceback
    pytest.fail(f"{path.name}: {e}")
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if o.get("output_type") == "error"]
  assert not errors, errors
  # committed executed: what this run displays, the committed file displays too (re-execute and
  # commit the notebook after changing it)
  assert len(committed.cells) == len(nb.cells)
  missing = [(i, sorted(display_kinds(fresh) - display_kinds(old)))
             for i, (old, fresh) in enumerate(zip(committed.cells, nb.cells))
             if fresh.cell_type == "code" and display_kinds(fresh) - display_kinds(old)]
  assert not missing, f"{path.name}: cells committed without the outputs a run gives them (cell, kinds): {missing}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_executed(path):
  """Cheap, without a kernel: the committed file has figures, no error outputs, every code cell run
  in order, and stays under MAX_BYTES."""
  assert path.stat().st_size < MAX_BYTES, f"{path.name}: {path.stat().st_size} bytes"
  cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
  assert any("image/png" in display_kinds(c) for c in cells), f"{path.name}: no figure committed"
  assert not [o for c in cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
  counts = [c.get("execution_count") for c in cells]
  assert counts == list(range(1, len(cells) + 1)), f"{path.name}: not run top to bottom: {counts}"


def test_there_are_notebooks():
  names = {p.name for p in NOTEBOOKS}
  assert {"acceptance_by_position_and_category.ipynb", "reading_a_tuner_run.ipynb",
          "training_a_small_head.ipynb"} <= names, names
  assert os.path.isdir(NOTEBOOKS[0].parent)
