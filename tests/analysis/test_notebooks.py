"""Every analysis notebook executes top to bottom on the committed sample results, and is
committed with its outputs stripped (notebooks only read results; DESIGN §1)."""
from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

pytestmark = pytest.mark.slow     # subprocess/CLI or multi-second runs: `make test` runs them, `-m "not slow"` skips
REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def test_the_four_notebooks_exist() -> None:
    assert [p.name for p in NOTEBOOKS] == ["01_placement_sweep.ipynb", "02_cache_policies.ipynb",
                                           "03_what_if.ipynb", "04_kv_vs_residency.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: strip outputs before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_executes_on_the_samples(path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MOEBENCH_RESULTS", str(REPO / "results" / "samples"))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()                       # raises CellExecutionError naming the failing cell
    images = sum("image/png" in out.get("data", {}) for c in nb.cells if c.cell_type == "code" for out in c.outputs)
    assert images >= 1, f"{path.name} drew no figure"
