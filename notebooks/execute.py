"""Runs each notebook here top to bottom and stores it with its outputs, which the documentation shows.

    .venv/bin/python notebooks/execute.py              # every notebooks/*.ipynb, in place
    .venv/bin/python notebooks/execute.py tour.ipynb   # one of them

The docs build (`make docs`) renders the outputs stored in the notebook and runs nothing;
tests/test_notebooks.py executes every notebook again (so a stored notebook cannot rot unnoticed) and
checks that the stored outputs come from a clean top-to-bottom run. Run this after changing a notebook
or the library's behaviour it shows.

Each notebook runs in a temporary directory, in a kernel of this script's Python (a kernelspec written to
a temporary directory: no installed kernel needed), with 8 emulated CPU devices (the notebook sets them).
The kernel's temporary file names in warnings (``/tmp/ipykernel_123/456.py:28``) are stored as
``<cell>:28``, so that no output points outside the repository.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
TIMEOUT_S = 180  # per cell
KERNEL_FILE = re.compile(r"/[^\s:'\"]*/ipykernel_\d+/\d+\.py")


def execute(path: pathlib.Path) -> None:
  import nbclient
  import nbformat

  with tempfile.TemporaryDirectory() as tmp:
    name = "tpustrat-notebooks-python"
    spec_dir = pathlib.Path(tmp, "jupyter", "kernels", name)
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3", "language": "python"}))
    os.environ.update(JUPYTER_PATH=str(pathlib.Path(tmp, "jupyter")), JUPYTER_PLATFORM_DIRS="1",
                      JUPYTER_RUNTIME_DIR=str(pathlib.Path(tmp, "runtime")),
                      MPLBACKEND="module://matplotlib_inline.backend_inline")
    os.environ.pop("XLA_FLAGS", None)  # the notebook sets its own
    workdir = pathlib.Path(tmp, "run")
    workdir.mkdir()
    nb = nbformat.read(path, as_version=4)
    kernelspec = nb.metadata.get("kernelspec")
    nbclient.NotebookClient(nb, kernel_name=name, timeout=TIMEOUT_S,
                            resources={"metadata": {"path": str(workdir)}}).execute()
    if kernelspec is not None:
      nb.metadata["kernelspec"] = kernelspec  # the notebook's own, not the temporary one
    for cell in nb.cells:
      for output in cell.get("outputs", []):
        if "text" in output:
          output["text"] = KERNEL_FILE.sub("<cell>", output["text"])
    nbformat.validate(nb)
    nbformat.write(nb, path)
  print(f"{path.relative_to(HERE.parent)}: executed, outputs stored")


def main(argv: list[str]) -> None:
  paths = [HERE / a for a in argv] if argv else sorted(HERE.glob("*.ipynb"))
  for path in paths:
    execute(path)


if __name__ == "__main__":
  main(sys.argv[1:])
