"""The notebooks run top to bottom (so they cannot rot), and are stored with the outputs of such a run.

Each notebook is executed in a temporary copy by a Jupyter kernel running this test's Python (a
kernelspec written to a temporary directory, so the test needs no installed kernel and no network). The
documentation renders the outputs stored in the notebook (`make docs` runs nothing);
`notebooks/execute.py` runs a notebook and stores its outputs.
"""

import json
import pathlib
import sys

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
TIMEOUT_S = 180  # per cell; the whole tour takes ~20-40 s on a 2-core machine


def test_there_are_notebooks():
  assert "tour.ipynb" in [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_with_the_outputs_of_a_clean_run(path):
  """What the docs show: every code cell run once, in order, from a fresh kernel, none failing, no output
  pointing outside the repository. Refresh with `.venv/bin/python notebooks/execute.py`."""
  nbformat = pytest.importorskip("nbformat")
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  code = [cell for cell in nb.cells if cell.cell_type == "code"]
  counts = [cell.execution_count for cell in code]
  assert counts == list(range(1, len(code) + 1)), (
      f"{path.name} is not stored as a clean top-to-bottom run (execution counts {counts}): "
      "run .venv/bin/python notebooks/execute.py")
  outputs = [o for cell in code for o in cell.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  text = "".join(o.get("text", "") for o in outputs)
  assert "/tmp/" not in text and "/home/" not in text, "an output names a path outside the repository"
  if path.name == "tour.ipynb":
    assert len([o for o in outputs if "image/png" in o.get("data", {})]) >= 3


@pytest.fixture
def kernel_name(tmp_path, monkeypatch):
  """A kernelspec for this interpreter in a temporary Jupyter data directory."""
  pytest.importorskip("ipykernel")
  name = "tpustrat-test-python"
  spec_dir = tmp_path / "jupyter" / "kernels" / name
  spec_dir.mkdir(parents=True)
  (spec_dir / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "tpustrat test kernel",
      "language": "python",
  }))
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
  monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")  # no migration warning from jupyter_core
  monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
  monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
  monkeypatch.delenv("XLA_FLAGS", raising=False)  # the notebook sets its own
  return name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
@pytest.mark.processes
def test_notebook_runs_top_to_bottom(path, tmp_path, kernel_name):
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  nb = nbformat.read(path, as_version=4)
  workdir = tmp_path / "run"
  workdir.mkdir()
  client = nbclient.NotebookClient(nb, kernel_name=kernel_name, timeout=TIMEOUT_S,
                                   resources={"metadata": {"path": str(workdir)}})
  client.execute()  # raises CellExecutionError, with the cell and its traceback, if a cell fails
  nbformat.write(nb, workdir / path.name)  # the executed copy, for a look after a failure

  outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
  text += "".join(o.get("data", {}).get("text/plain", "") for o in outputs if "data" in o)
  if path.name == "tour.ipynb":
    assert "8 devices" in text
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 3, "the group, all-to-all and loss-curve figures"
    assert "CPU 0,1,2,3,4,5,6,7" in text  # a Mirrored value drawn by visualize_array_sharding
    assert "training-set accuracy" in text
