"""The example notebook runs top to bottom on CPU: every cell, every assertion in it."""

import os
import sys

import pytest

NOTEBOOK = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "fine_tune_then_serve.ipynb")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_notebook_runs(tmp_path, monkeypatch):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # one thread in the kernel too, as in the workers (conftest)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        from ipykernel.kernelspec import install

        install(user=True, kernel_name="python3")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    env_dir = os.path.abspath(os.path.join(os.path.dirname(NOTEBOOK)))
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": env_dir}})
    client.execute()  # raises CellExecutionError on any error or failed assert
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code)  # every cell ran
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]


def test_committed_notebook_is_the_generators():
    """The committed notebook's cells are ``_make_notebook.py``'s, and it carries its outputs."""
    nbformat = pytest.importorskip("nbformat")
    sys.path.insert(0, os.path.dirname(NOTEBOOK))
    import _make_notebook

    committed = nbformat.read(NOTEBOOK, as_version=4)
    built = _make_notebook.build_notebook()
    assert [(c.cell_type, c.source) for c in committed.cells] == [(c.cell_type, c.source) for c in built.cells]
    code = [c for c in committed.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code)  # committed executed
    assert any(o.output_type == "display_data" for c in code for o in c.outputs)  # with its plots


def test_committed_notebook_holds_no_machine_paths():
    """Nothing of the machine that ran it: no absolute path in its outputs or metadata, no run
    timestamps (``_make_notebook.py --execute`` drops them)."""
    import json

    with open(NOTEBOOK) as f:
        text = f.read()
    for marker in ("/work/", "/tmp/", "/home/", "/root/", "/Users/", ":\\\\Users"):
        assert marker not in text, marker
    nb = json.loads(text)
    assert not [c["id"] for c in nb["cells"] if "execution" in c.get("metadata", {})]
