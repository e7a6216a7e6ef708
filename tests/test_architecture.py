"""The import rules of docs/ARCHITECTURE.md, checked on the source (every import, including the
lazy ones inside functions and those only for type checking): each package lists what it MAY
import -- moebench packages and modules by dotted prefix, third-party distributions by their
top-level name; the standard library is always allowed -- and anything else fails. A package
without an entry fails too, so a new package states its place. Beside the allow-lists: no import
cycles among moebench's modules, and plugins of one family never import each other."""
from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("engine", "harness", "workloads", "benchmarks")       # the moebench code the rules cover
OURS = (*SOURCES, "tests")


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


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, Path] = {module_name(f): f for pkg in SOURCES for f in files(pkg)}


def imported_modules(module: str, path: Path, modules: Mapping[str, Path] = MODULES) -> set[str]:
    """What `module` (the file at `path`) imports, each import once: a moebench module by its name
    (`from pkg import mod` is `pkg.mod`; a class or function is its module; a benchmark script's
    `import sibling` is `benchmarks.sibling`), anything else by its top-level name."""
    scripts = module.startswith("benchmarks.") and module.count(".") == 1     # run as scripts from their dir
    pkg = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def resolve(name: str) -> str:
        top = name.split(".")[0]
        if scripts and f"benchmarks.{top}" in modules:
            name, top = f"benchmarks.{name}", "benchmarks"
        if top not in OURS:
            return top
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out |= {resolve(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            out |= {resolve(f"{base}.{a.name}") for a in node.names}
    return out


# --- the allow-lists ------------------------------------------------------------------------------
# Key: a package or module (the longest key that prefixes a file's module name is its rule).
# "ours": moebench prefixes it may import (its own package is always allowed); "third": top-level
# names of third-party distributions. Keep each entry's why beside it.
SCIENCE = ("numpy", "pandas")
RULES: dict[str, dict[str, tuple[str, ...]]] = {
    # the engine is plain PyTorch: usable from a notebook, no Hydra, OmegaConf, pandas, harness or workloads
    "engine": {"ours": ("engine",), "third": ("torch", "numpy", "safetensors", "psutil", "nvtx")},
    # workloads are text and token ids: nothing of the engine, the harness, torch or Hydra
    "workloads": {"ours": (), "third": ("numpy", "tokenizers")},
    # the contract is constants and tiny pure functions that everything imports; pandas for type hints only
    "harness.contract": {"ours": (), "third": ("pandas",)},
    # the row-level rules the results summary applies: per-phase reference verdicts, flagged repeats
    "harness.checks": {"ours": ("harness.contract", "engine.dtypes"), "third": ("pandas", "torch")},
    "harness.outliers": {"ours": ("harness.contract",), "third": ("pandas",)},
    "harness.order": {"ours": (), "third": ("pandas",)},
    # the results store: the contract and the row-level rules, never a runtime, an engine or Hydra; the
    # engine registry answers which knob columns the engines declare (asked, never named)
    "harness.results": {"ours": ("harness.contract", "harness.checks", "harness.outliers", "harness.engines.registry"),
                        "third": ("pandas", "pyarrow")},
    # figures read results; how they look is plotstyle's
    "harness.plots": {"ours": ("harness.contract", "harness.results", "harness.plotstyle", "harness.order"),
                      "third": ("matplotlib", *SCIENCE)},
    "harness.plotstyle": {"ours": ("harness.contract", "harness.order", "engine.registry"),
                          "third": ("matplotlib", *SCIENCE)},
    # the simulator replays traces through the engine's own policies
    "harness.sim": {"ours": ("engine",), "third": SCIENCE},
    # other engines' routing files in, the engine's trace file out; torch only to read torch.save dumps
    "harness.traces": {"ours": ("engine",), "third": ("numpy", "torch")},
    # timelines and traces are read, never measured: no back edge to the scenario, runner, passes or CLI
    "harness.profiling": {"ours": ("engine.intervals",), "third": ("pandas", "torch")},
    # the cost model asks the engine's blocks and plugins, reads results and the hardware profile schema;
    # the engine registry says which engine its predictions are for
    "harness.costmodel": {"ours": ("engine", "harness.contract", "harness.results", "harness.sim", "harness.config",
                                   "harness.manifest", "harness.measure", "harness.engines.registry"),
                          "third": (*SCIENCE, "torch", "yaml", "cupy")},
    # llama.cpp, one engine plugin package: its adapter (the interface, the checked job for type hints, the
    # harness helpers an adapter uses), build, convert, serve; its rows through the results schema
    "harness.llamacpp": {"ours": ("engine.config", "engine.export", "engine.checkpoint", "engine.finite",
                                  "harness.contract", "harness.results", "harness.manifest", "harness.remote_code",
                                  "harness.engines.base", "harness.config.schema", "harness.machine",
                                  "harness.measure",
                                  "engine.formats", "engine.dtypes", "engine.planner",   # its memory rule for the plan
                                  "engine.placements",        # the same per-layer map as placement=hybrid
                                  "engine.kernels.openmp",      # the server's environment as the user gave it
                                  "harness.serving.drive"),     # its serving client, on the same clock rules as ours
                         "third": ("gguf", "sentencepiece", "pynvml")},
    # engine adapters: ours, transformers; the checked job (RunSpec) for their type hints
    "harness.engines": {"ours": ("engine", "harness.contract", "harness.machine", "harness.remote_code",
                                 "harness.config.schema", "harness.serving.drive"),   # serving: the client loop
                        "third": ("torch", "transformers")},
    # what a job measures, one pass each
    "harness.passes": {"ours": ("engine", "workloads", "harness.contract", "harness.engines", "harness.profiling",
                                "harness.ablation", "harness.checks", "harness.config", "harness.job",
                                "harness.outliers", "harness.quality", "harness.reference", "harness.report",
                                "harness.roofline", "harness.scenario", "harness.session",
                                "harness.sim.stats",      # the trace pass's routing statistics
                                "harness.costmodel", "harness.predict_inputs",    # the prediction pass's
                                "harness.serving"),       # the serve pass's load, client loop and metrics
                       "third": ("torch",)},
    # serving under load: the load spec, the client-side loop, the metrics; the engine's batcher for type hints
    "harness.serving": {"ours": ("engine.batcher",), "third": ("numpy",)},
    # the application: configuration, runner, CLI, reports, analysis entry points
    "harness": {"ours": ("harness", "engine", "workloads"),
                "third": (*SCIENCE, "torch", "hydra", "omegaconf", "psutil", "pynvml", "rich", "scipy", "matplotlib",
                          "IPython")},
    # measurements and reports of their own; they may use anything moebench has
    "benchmarks": {"ours": ("engine", "harness", "workloads"),
                   "third": (*SCIENCE, "torch", "transformers", "hydra", "pytest", "pytest_benchmark", "yaml")},
}

# Known exceptions to the lists, each with why, kept until its import goes (none today).
EXCEPTIONS: dict[tuple[str, str], str] = {}


def rule_of(module: str) -> str | None:
    keys = [k for k in RULES if module == k or module.startswith(k + ".")]
    return max(keys, key=len) if keys else None


def allowed(module: str, target: str, rule: str) -> bool:
    spec = RULES[rule]
    if target.split(".")[0] not in OURS:
        return target in sys.stdlib_module_names or target == "__future__" or target in spec["third"]
    return any(target == p or target.startswith(p + ".") for p in (rule, *spec["ours"]))


def violations(modules: Mapping[str, Path]) -> list[str]:
    """Each import a file's rule does not allow (and each file no rule covers), one line each."""
    bad = []
    for module, path in sorted(modules.items()):
        rule = rule_of(module)
        if rule is None:
            bad.append(f"{module}: no allow-list covers it; add its package to RULES")
            continue
        for target in sorted(imported_modules(module, path, modules)):
            if not allowed(module, target, rule) and (module, target) not in EXCEPTIONS:
                bad.append(f"{module} imports {target}: not in the allow-list of {rule!r}")
    return bad


def test_every_import_is_allowed():
    assert not violations(MODULES)


def test_the_known_exception_is_still_there():
    """An exception whose import is gone is deleted from the list, so it cannot hide a new one."""
    for module, target in EXCEPTIONS:
        assert target in imported_modules(module, MODULES[module]), f"{module} no longer imports {target}: drop it"


def test_an_import_outside_the_list_fails(tmp_path):
    """The check itself: an engine module importing pandas or the harness, a results module importing
    the runner (inside a function), a module no rule covers -- each reported; the standard library,
    a module's own package and what its list allows pass."""
    sources = {"engine.probe": "import json\nimport pandas\nimport torch\nfrom engine.config import ModelConfig\n"
                               "from harness.contract import PHASES\n",
               "harness.results.probe": "from harness.contract import PHASES\ndef f():\n    from harness.runner import run\n",
               "elsewhere.probe": "import os\n"}
    probes = {}
    for name, source in sources.items():
        probes[name] = tmp_path / f"{name}.py"
        probes[name].write_text(source)
    assert violations({**MODULES, **probes}) == [
        "elsewhere.probe: no allow-list covers it; add its package to RULES",
        "engine.probe imports harness.contract: not in the allow-list of 'engine'",
        "engine.probe imports pandas: not in the allow-list of 'engine'",
        "harness.results.probe imports harness.runner: not in the allow-list of 'harness.results'"]


# --- no import cycles -----------------------------------------------------------------------------
# Cycles known today, each a set of modules its cycle stays within, with why it is not broken yet.
# A new cycle fails; so does a known one that has gone (delete its entry).
KNOWN_CYCLES: dict[frozenset[str], str] = {
    frozenset({"harness.cli", "harness.plan", "harness.rerun", "harness.runner"}):
        "plan and rerun parse their overrides with the CLI's helpers while the CLI dispatches to them, and the "
        "runner plans through harness.plan; it goes when the CLI's sub-commands and the runner's loop are split",
    frozenset({"engine.architecture", "engine.blocks.decoder", "engine.blocks.experts", "engine.blocks.mlp",
               "engine.blocks.quant_experts", "engine.cache", "engine.checkpoint", "engine.config",
               "engine.families.base", "engine.finite", "engine.model", "engine.prefetch.base", "engine.quant"}):
        "engine.config asks a model's family for its Architecture while families and blocks import ModelConfig; "
        "engine.checkpoint reads treatments through engine.quant (which imports ModelConfig) and checks "
        "finiteness through engine.finite (which imports the model); it goes when planning's config no longer "
        "builds blocks",
}


def import_graph(modules: Mapping[str, Path] = MODULES) -> dict[str, set[str]]:
    """module -> the moebench modules it imports (module-level and function-level alike)."""
    return {m: {t for t in imported_modules(m, p, modules) if t in modules and t != m} for m, p in modules.items()}


def cycles(graph: Mapping[str, Iterable[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = set()
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.add(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        found.append(frozenset(comp))
    return found


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    new = [sorted(c) for c in found if not any(c <= known for known in KNOWN_CYCLES)]
    assert not new, "import cycles: " + "; ".join(" <-> ".join(c) for c in new)
    gone = [sorted(k)[:3] for k in KNOWN_CYCLES if not any(c <= k for c in found)]
    assert not gone, f"known cycles no longer there (delete their KNOWN_CYCLES entries): {gone}"


def test_the_cycle_finder_finds_a_cycle_and_only_it():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [frozenset({"a", "b", "c"})]
    assert cycles({"a": {"b"}, "b": set()}) == []


# --- plugins ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["engine/placements", "engine/policies", "engine/prefetch", "harness/engines"])
def test_plugins_never_import_each_other(family):
    """A plugin module imports its family's base (and shared helpers), never another plugin:
    anything two plugins share moves into the base."""
    pkg = family.replace("/", ".")
    members = {f.stem for f in files(family)} - {"__init__", "base"}
    # engine.policies.simulate: the replay driver, not a policy; harness.engines.registry: the family's registry
    allowed_helpers = {"simulate", "registry"}
    bad = []
    for f in files(family):
        if f.stem in ("__init__", "base") or f.stem in allowed_helpers:
            continue
        for mod in imports(f):
            for other in members - {f.stem} - allowed_helpers:
                if mod == f"{pkg}.{other}" or mod.startswith(f"{pkg}.{other}."):
                    bad.append(f"{f.relative_to(REPO)} imports {mod}")
    assert not bad


# --- core modules ask plugins, never name them --------------------------------------------------------
# Core code (configuration, the results schema, the CLI, the cost model, the passes, the runner, the job,
# the scenario, the planner's front end) asks an engine adapter, a placement or a family what it can do
# (a capability, an adapter-owned hook); it never compares or spells a plugin's name, nor imports an
# engine plugin's own modules. Deleting a plugin's package leaves them working (tests/llamacpp/
# test_plugin_removal.py deletes llama.cpp's). Checked on every string literal outside docstrings.
CORE = ("harness.config", "harness.results.schema", "harness.cli", "harness.costmodel", "harness.passes",
        "harness.runner", "harness.job", "harness.scenario", "harness.plan")
# names that are not plugin names where core code uses them: `cpu` is a device kind everywhere in the
# harness; `resident` is the reference placement the design compares every other with (DESIGN §3: the
# invariant, the ablation's other side)
NOT_PLUGIN_NAMES = {"cpu", "resident"}
# a literal that is a plugin's name but means something else there, or an experiment on named plugins
NAMED: dict[tuple[str, str], str] = {
    ("harness.cli", "moebench"): "the program's own name in the sweep's recorded command line",
    ("harness.passes.nsys", "moebench"): "the NVTX domain the engine's ranges use (engine.nvtx_ranges)",
    ("harness.config.schema", "hf"): "model=hf, the model group's option for a checkpoint dir (not the engine)",
    ("harness.costmodel.fit", "fetch"): "the calibration probes: the link rate is fitted from fetch runs",
    ("harness.costmodel.fit", "stream"): "the calibration probes: streamed prefill is fitted from stream runs",
    ("harness.plan", "hybrid"): "`moebench fit --search n_cpu_layers` searches hybrid's CPU layer count",
}


def plugin_names() -> dict[str, str]:
    """name -> its family, for every registered engine adapter, model family and placement."""
    from engine.registry import FAMILIES, PLACEMENTS
    from harness.engines.registry import ENGINES
    out = {n: "placement" for n in PLACEMENTS.names() if n not in NOT_PLUGIN_NAMES}
    out.update({n: "model family" for n in FAMILIES.names()})
    out.update({n: "engine" for n in ENGINES.names()})
    return out


def engine_plugin_modules() -> set[str]:
    """The modules an engine plugin owns: an adapter module of harness.engines, or the whole package
    an adapter elsewhere lives in (harness.llamacpp for harness.llamacpp.adapter)."""
    from harness.engines.registry import ENGINES
    out = set()
    for name in ENGINES.names():
        module = ENGINES._targets[name].partition(":")[0]
        out.add(module if module.startswith("harness.engines.") else module.rpartition(".")[0])
    return out


def named_plugins(modules: Mapping[str, Path], names: Mapping[str, str], owned: Iterable[str]) -> list[tuple[str, str]]:
    """(module, what) for each plugin a core module names: a string literal equal to a plugin's name
    (docstrings aside), or an import of an engine plugin's own modules."""
    found = []
    for module, path in sorted(modules.items()):
        if not any(module == c or module.startswith(c + ".") for c in CORE):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs \
                    and node.value in names:
                found.append((module, node.value))
        for target in imported_modules(module, path, modules):
            if any(target == o or target.startswith(o + ".") for o in owned):
                found.append((module, f"import {target}"))
    return found


def test_core_modules_name_no_engine_family_or_placement():
    names = plugin_names()
    found = named_plugins(MODULES, names, engine_plugin_modules())
    bad = [f"{m}: {what!r}" + (f" (a {names[what]} name)" if what in names else "") for m, what in found
           if (m, what) not in NAMED]
    assert not bad, "core modules name plugins (ask a capability or an adapter hook instead): " + "; ".join(bad)
    gone = [key for key in NAMED if key not in found]
    assert not gone, f"NAMED entries no longer used (delete them): {gone}"


def test_the_name_scan_finds_a_name_and_an_import(tmp_path):
    """The scan itself: an engine compared by name, a family and a placement spelled, an engine
    plugin's module imported -- each found; a docstring naming them, a device kind `cpu` and a
    module outside the core pass."""
    sources = {"harness.passes.probe": '"""Runs on engine=hf, placement=fetch."""\n'
                                       'def f(spec):\n    return spec.engine == "hf" or spec.device == "cpu"\n'
                                       'FAMILY = "mixtral"\nPLACEMENT = "stream"\n'
                                       'def g():\n    from harness.engines.hf import HFAdapter\n',
               "harness.reference_probe": 'ENGINE = "moebench"\n'}
    probes = {}
    for name, source in sources.items():
        probes[name] = tmp_path / f"{name}.py"
        probes[name].write_text(source)
    found = [f for f in named_plugins({**MODULES, **probes}, plugin_names(), engine_plugin_modules()) if f[0] in probes]
    assert sorted(found) == [("harness.passes.probe", "hf"), ("harness.passes.probe", "import harness.engines.hf"),
                             ("harness.passes.probe", "mixtral"), ("harness.passes.probe", "stream")]
