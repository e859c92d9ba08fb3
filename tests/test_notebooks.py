"""The research notebooks (notebooks/) run top to bottom on the CPU, on a Jupyter kernel from this interpreter, and are
committed without outputs. A notebook whose cell raises (an API that changed, say) fails here."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NAMES = sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))


def test_there_are_the_three_notebooks():
    assert {"quickstart", "research", "benchmarks"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_committed_without_outputs(name):
    import nbformat

    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"{name}.ipynb: cells {dirty} keep outputs (clear them before committing)"


@pytest.mark.parametrize("name", NAMES)
def test_runs_top_to_bottom(name, tmp_path):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    # the kernel: this interpreter (its ipykernel), with this session's caches, plots to files, not to a display
    env = {"JPHOTON_CACHE_DIR": os.environ.get("JPHOTON_CACHE_DIR", str(tmp_path)), "MPLBACKEND": "Agg"}
    client = NotebookClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}})
    os.environ.update(env)
    client.km = client.create_kernel_manager()
    client.km.kernel_cmd = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if a cell fails
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert outputs and not any(o.output_type == "error" for o in outputs)
