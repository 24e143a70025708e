"""Every notebook under notebooks/ runs top to bottom (nbclient, a fresh python3 kernel, cwd =
notebooks/) without an error; the notebooks assert what they show (training_a_small_head: the training
loss falls, tau rises with training, and speculative output does not change with the head). Skipped
when nbclient / nbformat / ipykernel are not installed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  pytest.importorskip("ipykernel")
  # the kernel inherits this environment: read the committed results and make a fresh tuner run
  for var in ("SPECJAX_RESULTS", "SPECJAX_TUNE_RUN"):
    monkeypatch.delenv(var, raising=False)
  monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": str(path.parent)}})
  try:
    client.execute()
  except nbclient.exceptions.CellExecutionError as e:   # the failing cell's source and traceback
    pytest.fail(f"{path.name}: {e}")
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if o.get("output_type") == "error"]
  assert not errors, errors


def test_there_are_notebooks():
  names = {p.name for p in NOTEBOOKS}
  assert {"acceptance_by_position_and_category.ipynb", "reading_a_tuner_run.ipynb",
          "training_a_small_head.ipynb"} <= names, names
  assert os.path.isdir(NOTEBOOKS[0].parent)
