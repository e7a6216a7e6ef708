"""Every analysis notebook executes top to bottom -- on the committed sample results, and on the
result sets a user ordinarily has: a sweep where every job finished, one where every job failed,
a mixed one, and results outside the checkout read from another working directory -- saying in a
visible output what it could not show and why, never raising. Committed with its outputs
stripped (notebooks only read results; DESIGN §1)."""
from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from harness import results
from tests.cli_runner import run_cli

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

pytestmark = pytest.mark.slow     # subprocess/CLI or multi-second runs: `make test` runs them, `-m "not slow"` skips
REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
# tiny sweeps of the tiny preset, two jobs each (a few seconds a sweep on 2 cores)
FAST = ["workload=chat", "workload.context_tokens=256", "workload.gen_tokens=4", "run.repeats=1",
        "run.ablation=false", "run.quiet=true", "placement=resident,fetch", "cache.capacity=2"]
RESULT_SETS = {   # name -> (overrides, the statuses its jobs must end with)
    # timeline and routing trace on: every figure of 01 and 02 has its data
    "all_ok": (["run.record_trace=true"], {"ok"}),
    # the plan does not fit: each job validates, then fails at run time with a PlanError
    "all_failed": (["hardware.device_memory=1MiB", "run.timeline=false"], {"failed"}),
    # fetch's 2 slots fit 5 MiB, resident's every expert does not
    "mixed": (["hardware.device_memory=5MiB", "run.timeline=false"], {"ok", "failed"}),
}
CASES = [*RESULT_SETS, "outside"]   # outside: all_ok's results tree, the notebook run from another directory
READS_NO_RESULTS = "03_what_if"     # cost-model predictions only: one run (from outside) stands for every set

# What each notebook must say (substrings of its visible outputs) and the least figures it draws.
FAILED_SAYS = ["0 finished, 2 failed", "PlanError", "no job finished"]
MIXED_SAYS = ["1 finished, 1 failed", "PlanError: placement 'resident' does not fit"]
EXPECT: dict[tuple[str, str], tuple[list[str], int]] = {
    ("01_placement_sweep", "all_ok"): (["2 finished, 0 failed"], 5),
    ("01_placement_sweep", "all_failed"): (FAILED_SAYS, 0),
    ("01_placement_sweep", "mixed"): ([*MIXED_SAYS, "Not shown:** overlap: no profiler=timeline rows"], 4),
    ("01_placement_sweep", "outside"): (["2 finished, 0 failed"], 5),
    ("02_cache_policies", "all_ok"): (["2 routing trace(s)", "max |engine − simulator|"], 2),
    ("02_cache_policies", "all_failed"): ([*FAILED_SAYS, "No routing trace"], 1),      # the synthetic curves
    ("02_cache_policies", "mixed"): ([*MIXED_SAYS, "No routing trace"], 1),
    ("02_cache_policies", "outside"): (["2 routing trace(s)", "max |engine − simulator|"], 2),
    ("04_kv_vs_residency", "all_ok"): (["Not shown:** treatment frontier: no lossy run"], 0),
    ("04_kv_vs_residency", "all_failed"): (FAILED_SAYS, 0),
    ("04_kv_vs_residency", "mixed"): ([*MIXED_SAYS, "Not shown:** treatment frontier: no lossy run"], 0),
    ("04_kv_vs_residency", "outside"): (["Not shown:** treatment frontier: no lossy run"], 0),
}
EXPECT[(READS_NO_RESULTS, "outside")] = (["hardware profiles"], 1)


def execute(path: Path, cwd: Path) -> tuple[str, int]:
    """Run the notebook with its kernel in `cwd`; (its visible text outputs, the figures it drew).
    Raises CellExecutionError naming the failing cell."""
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    outputs = [out for c in nb.cells if c.cell_type == "code" for out in c.outputs]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "\n".join(str(o.get("data", {}).get(kind, "")) + str(o.get("text", "")) for o in outputs
                     for kind in ("text/markdown", "text/plain"))
    return text, sum("image/png" in o.get("data", {}) for o in outputs)


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


@pytest.fixture
def kernel_env(monkeypatch) -> None:
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.delenv("MOEBENCH_LOSSY_RESULTS", raising=False)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_executes_on_the_samples(path: Path, monkeypatch, kernel_env) -> None:
    monkeypatch.setenv("MOEBENCH_RESULTS", str(REPO / "results" / "samples"))
    monkeypatch.setenv("MOEBENCH_LOSSY_RESULTS", str(REPO / "results" / "samples-lossy"))
    text, images = execute(path, path.parent)
    assert images >= 1, f"{path.name} drew no figure"
    assert "Not shown" not in text, text            # the samples hold what every cell needs


def _make(name: str, cwd: Path) -> Path:
    overrides, statuses = RESULT_SETS[name]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = run_cli(["-m", *FAST, *overrides, f"run.sweep_id={name}"], cwd, env, timeout=600)
    sweep = cwd / "results" / "sweeps" / name
    df = results.load(sweep)
    assert set(df.status) == statuses and df.job_id.nunique() == 2, (proc.returncode, proc.stderr[-2000:])
    assert proc.returncode == (0 if statuses == {"ok"} else 1), proc.stderr[-2000:]
    return sweep


@pytest.fixture(scope="session")
def result_set(tmp_path_factory) -> Callable[[str], Path]:
    """name -> its sweep dir, made by the real CLI once per test session: under pytest-xdist the
    workers share one dir (the session's base temp) and a lock, so each set is made once."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "notebook-result-sets"
    root.mkdir(exist_ok=True)

    def get(name: str) -> Path:
        with open(root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)          # released when the file closes
            made = root / f"{name}.made"
            if not made.exists():
                (root / name).mkdir(exist_ok=True)
                made.write_text(str(_make(name, root / name)))
            return Path(made.read_text())
    return get


def test_the_what_if_notebook_reads_no_results() -> None:
    """So its run on one result set stands for all four (it takes the longest of the four to run)."""
    nb = nbformat.read(REPO / "notebooks" / f"{READS_NO_RESULTS}.ipynb", as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert not [w for w in ("MOEBENCH_RESULTS", "results_dir", "load(", "RESULTS") if w in code]


@pytest.mark.parametrize("path,case", [(p, c) for p in NOTEBOOKS for c in CASES
                                       if p.stem != READS_NO_RESULTS or c == "outside"],
                         ids=lambda v: v.stem if isinstance(v, Path) else v)
def test_executes_on_ordinary_results(path: Path, case: str, result_set, kernel_env, monkeypatch, tmp_path) -> None:
    if case == "outside":      # a results tree outside the checkout, the kernel in a directory outside it too
        results_dir, cwd = result_set("all_ok").parents[1], tmp_path
    else:
        results_dir, cwd = result_set(case), path.parent
    monkeypatch.setenv("MOEBENCH_RESULTS", str(results_dir))
    text, images = execute(path, cwd)
    says, least = EXPECT[(path.stem, case)]
    missing = [s for s in says if s not in text]
    assert not missing, f"{path.name} on {case} does not say {missing}:\n{text[-3000:]}"
    assert images >= least, f"{path.name} on {case} drew {images} figures, expected >= {least}"
    if path.stem != READS_NO_RESULTS:
        assert str(results_dir) in text          # it read the results it was pointed at
