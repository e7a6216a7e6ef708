"""The import rules of docs/ARCHITECTURE.md, checked on the source (every import, including the
lazy ones inside functions): what each package owns and may import."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def imports(path: Path) -> set[str]:
    """Every module a file imports (absolute names; relative imports resolved to the package)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return out


def files(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for f in files(package):
        for mod in imports(f):
            if any(mod == p or mod.startswith(p + ".") for p in forbidden):
                bad.append(f"{f.relative_to(REPO)} imports {mod}")
    return bad


def test_engine_is_plain_pytorch():
    """engine/ never imports the harness, Hydra, OmegaConf, pandas or the workloads."""
    assert not offenders("engine", ("harness", "hydra", "omegaconf", "pandas", "workloads"))


def test_workloads_know_nothing_of_engine_or_harness():
    assert not offenders("workloads", ("engine", "harness", "hydra", "torch"))


def test_profiling_readers_have_no_back_edge_to_the_scenario():
    """harness.profiling reads timelines and traces; the passes that run scenarios live beside the runner."""
    assert not offenders("harness/profiling", ("harness.scenario", "harness.runner", "harness.passes",
                                               "harness.engines", "harness.cli"))


def test_the_contract_and_results_import_no_runtime():
    """The contract imports nothing of moebench; the results store only the contract."""
    assert not offenders("harness/results", ("torch", "engine", "hydra", "harness.runner", "harness.scenario"))
    contract = imports(REPO / "harness" / "contract.py")
    assert not {m for m in contract if m.split(".")[0] in ("torch", "engine", "hydra", "harness")}


@pytest.mark.parametrize("family", ["engine/placements", "engine/policies", "engine/prefetch", "harness/engines"])
def test_plugins_never_import_each_other(family):
    """A plugin module imports its family's base (and shared helpers), never another plugin:
    anything two plugins share moves into the base."""
    pkg = family.replace("/", ".")
    members = {f.stem for f in files(family)} - {"__init__", "base"}
    allowed_helpers = {"simulate"}                   # engine.policies.simulate: the replay driver, not a policy
    bad = []
    for f in files(family):
        if f.stem in ("__init__", "base") or f.stem in allowed_helpers:
            continue
        for mod in imports(f):
            for other in members - {f.stem} - allowed_helpers:
                if mod == f"{pkg}.{other}" or mod.startswith(f"{pkg}.{other}."):
                    bad.append(f"{f.relative_to(REPO)} imports {mod}")
    assert not bad
