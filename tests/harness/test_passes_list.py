"""A job is an explicit list of passes (`run.passes`): a lean run, a skipped pass's reason recorded
once, a list refused in one line, a third-party pass through the CLI (the worked example in
docs/extending_passes.md, run as written), the default list in `moebench --help` -- and the run
path holds no module-level mutable state and imports no private name of another module."""
from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import harness.cli  # noqa: F401 -- registers the ConfigStore
from engine.config import preset
from engine.planner import plan_memory
from harness import results
from harness.cli import CONF_DIR
from harness.config import ConfigError, validate
from harness.contract import MEASURED_PHASES, OFFLOAD_PHASE, QUALITY_METRICS
from harness.engines import session_tokens_of
from harness.passes import DEFAULT_PASSES, PASSES
from harness.report import Reporter
from harness.runner import JobContext, run_job
from tests.cli_runner import run_cli

REPO = Path(__file__).resolve().parents[2]
SMALL = ["workload=chat", "workload.context_tokens=256", "workload.gen_tokens=4", "run.repeats=1", "run.quiet=true"]


def cli(args: list[str], cwd: Path, pythonpath: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), pythonpath) if p),
           "OMP_NUM_THREADS": "1"}
    return run_cli(args, cwd, env, timeout=600)


def only_run(cwd: Path) -> Path:
    (job_dir,) = (cwd / "results" / "runs").iterdir()
    return job_dir


def manifest_passes(job_dir: Path) -> list[dict]:
    return json.loads((job_dir / results.MANIFEST_FILE).read_text())["passes"]


def cfg_with(*overrides: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name="config", overrides=list(overrides))


# ----------------------------------------------------------------------------- through the CLI

@pytest.mark.slow
def test_a_lean_run_has_only_the_load_and_speed_rows(tmp_path):
    proc = cli(["run.passes=[speed]", *SMALL], tmp_path)
    assert proc.returncode == 0, proc.stderr
    job_dir = only_run(tmp_path)
    df = results.load(job_dir)
    assert (df.status == "ok").all() and set(df.profiler) == {"none"} and set(df.source) == {"client", "engine"}
    assert set(df.phase) == {"load", *MEASURED_PHASES, OFFLOAD_PHASE}
    assert set(df[df.phase != "load"].repeat) == {0}                   # the one measured repeat, nothing else
    assert not df.metric.str.startswith(("exposed_copy_ablation", "roofline", "kl_div")).any()
    assert df[df.metric == "token_agreement"].value.eq(1.0).all()      # still checked against the reference
    manifest = json.loads((job_dir / results.MANIFEST_FILE).read_text())
    assert manifest["passes"] == [{"name": "speed", "status": "ran", "reason": None}]
    assert manifest["default_passes"] == list(DEFAULT_PASSES)


@pytest.mark.slow
def test_a_skipped_pass_records_its_reason_once(tmp_path):
    """Default list, flags off: each pass appears once in the manifest, the skipped ones with the
    flag that skipped them; only the quality pass (whose absence would read as missing metrics)
    leaves rows too: null, with the same reason."""
    proc = cli(["run.timeline=false", "run.ablation=false", "run.check_reference=false", *SMALL], tmp_path)
    assert proc.returncode == 0, proc.stderr
    job_dir = only_run(tmp_path)
    passes = manifest_passes(job_dir)
    assert [p["name"] for p in passes] == list(DEFAULT_PASSES)
    why = {p["name"]: p["reason"] for p in passes if p["status"] == "skipped"}
    assert {p["name"]: p["status"] for p in passes if p["name"] not in why} == {"speed": "ran", "roofline": "ran",
                                                                                     "prediction": "ran"}
    assert why == {"serve": "load=none", "quality": "no exact reference (run.check_reference=false)",
                   "timeline": "run.timeline=false",
                   "trace": "run.record_trace=false", "torch_profile": "run.profiler=none",
                   "nsys": "run.profiler=none", "ablation": "run.ablation=false"}
    df = results.load(job_dir)
    assert set(df.profiler) == {"none", "quality", "prediction"}
    quality = df[df.profiler == "quality"]
    assert set(quality.metric) == set(QUALITY_METRICS) and quality.value.isna().all()
    assert set(quality.quality_reason) == {why["quality"]}
    for reason in (why["timeline"], why["ablation"]):                  # in the manifest alone
        assert not df.astype(str).isin([reason]).any().any()


@pytest.mark.slow
def test_a_refused_list_is_a_failed_job_in_one_line(tmp_path):
    proc = cli(["run.passes=[roofline]", *SMALL], tmp_path)
    assert proc.returncode == 1
    df = results.load(only_run(tmp_path))
    (error,) = df[df.status == "failed"].error
    assert error == ("ConfigError: run.passes: roofline needs speed listed before it (it reads what speed "
                     "measured); got run.passes=[roofline]")


def test_an_unknown_repeated_or_out_of_order_list_is_refused_in_one_line():
    cases = {
        ("run.passes=[speed,specd]",): r"run.passes: unknown pass 'specd'; allowed: ablation, nsys, prediction, quality, "
                                       r"roofline, serve, speed, timeline, torch_profile, trace \(third-party passes .*"
                                       r"'moebench.passes'\); got run.passes=\[speed,specd\]$",
        ("run.passes=[speed,speed]",): r"run.passes: speed is listed twice .*; got run.passes=\[speed,speed\]$",
        ("run.passes=[timeline,ablation]",): r"run.passes: ablation needs speed listed before it",
        ("run.passes=[speed,ablation,timeline]",): r"run.passes: ablation reads timeline's rows, so timeline "
                                                   r"comes before it; got run.passes=\[speed,ablation,timeline\]$",
        ("run.passes=[speed]", "run.profiler=torch"): r"run.passes: run.profiler=torch asks for the torch_profile "
                                                      r"pass, which the list leaves out; add torch_profile .*",
        ("run.passes=[speed]", "run.record_trace=true"): r"run.record_trace=true asks for the trace pass",
    }
    for overrides, message in cases.items():
        with pytest.raises(ConfigError, match=message) as err:
            validate(cfg_with(*overrides))
        assert "\n" not in str(err.value)


def test_the_help_lists_the_default_passes_in_order():
    proc = cli(["--help"], REPO)
    assert proc.returncode == 0, proc.stderr
    assert f"default: [{','.join(DEFAULT_PASSES)}]" in proc.stdout
    listed = [line.split()[0] for line in proc.stdout.splitlines() if line.startswith("  ") and line.split()
              and line.split()[0] in PASSES.names()]
    assert listed[:len(DEFAULT_PASSES)] == list(DEFAULT_PASSES)
    assert "== Configuration groups ==" in proc.stdout                  # Hydra's own help follows


# ----------------------------------------------------------------------------- the worked example

DOC = (REPO / "docs" / "extending_passes.md").read_text()


def doc_block(lang: str) -> str:
    (block,) = re.findall(rf"```{lang}\n(.*?)```", DOC, flags=re.S)
    return block


@pytest.mark.slow
def test_the_worked_example_runs_as_a_third_party_pass_through_the_cli(tmp_path):
    """docs/extending_passes.md as written: its module on the path, its entry point in a real
    distribution's metadata, its command; the pass's rows are the spread of the speed rows' TTFT."""
    plugin = tmp_path / "plugin"
    (plugin / "ttft_spread-1.0.dist-info").mkdir(parents=True)
    (plugin / "ttft_spread.py").write_text(doc_block("python"))
    group, name, target = re.search(r'\[project\.entry-points\."([\w.]+)"\]\n(\w+) = "([\w.:]+)"',
                                    doc_block("toml")).groups()
    (plugin / "ttft_spread-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: ttft-spread\n"
                                                                   "Version: 1.0\n")
    (plugin / "ttft_spread-1.0.dist-info" / "entry_points.txt").write_text(f"[{group}]\n{name} = {target}\n")
    command = shlex.split(doc_block("bash").strip())
    assert command[0] == "moebench"
    proc = cli([*command[1:], "run.quiet=true"], tmp_path, pythonpath=str(plugin))
    assert proc.returncode == 0, proc.stderr
    job_dir = only_run(tmp_path)
    df = results.load(job_dir)
    assert (df.status == "ok").all()
    spread = df[df.profiler == "ttft_spread"].set_index("phase")
    speed = df[(df.profiler == "none") & (df.metric == "ttft_s") & (df.source == "client")]
    assert set(spread.index) == {"prefill_fresh", "prefill_continuation", "prefill_restored"}
    for phase, ttft in speed.groupby("phase")["value"]:
        assert len(ttft) == 3 and spread.loc[phase, "value"] == pytest.approx(ttft.max() - ttft.min())
        assert spread.loc[phase, "unit"] == "s" and spread.loc[phase, "metric"] == "ttft_spread_s"
    assert {"name": "ttft_spread", "status": "ran", "reason": None} in manifest_passes(job_dir)


# ----------------------------------------------------------------------------- a pass frees the engine

@pytest.mark.slow
def test_a_pass_after_a_sequential_ablation_is_skipped_saying_the_engine_was_freed(tmp_path):
    """Where only one engine fits the budget, the ablation frees the measured engine for its
    resident side; a pass listed after it that runs the engine is skipped, saying so."""
    spec = validate(cfg_with("placement=fetch", "cache.capacity=2", *SMALL))
    cfg, w = preset("tiny-mixtral"), spec.workload
    r = plan_memory(cfg, "resident", None, None, session_tokens_of(spec), w.batch, w.ubatch, 4, device_kind="cpu").total
    f = plan_memory(cfg, "fetch", 2, None, session_tokens_of(spec), w.batch, w.ubatch, 4, device_kind="cpu").total
    between = int((r / 0.95 + (r + f) / 0.9) / 2)          # resident fits alone, not beside fetch (test_checks)
    out = run_job(cfg_with("placement=fetch", "cache.capacity=2", f"hardware.device_memory={between}",
                           "run.passes=[speed,ablation,quality]", f"run.out={tmp_path}", *SMALL),
                  JobContext(tmp_path / "job", "s", "j"), Reporter(quiet=True))
    assert out.error is None, out.error
    status = {p["name"]: (p["status"], p["reason"]) for p in out.passes}
    assert status["speed"] == status["ablation"] == ("ran", None)
    assert status["quality"] == ("skipped", "the measured engine was freed for the ablation's resident side "
                                            "(both engines together exceed the device budget)")
    modes = {r.get("ablation_mode") for r in out.rows if r["metric"] == "exposed_copy_ablation_s"}
    assert modes == {"sequential"}
    quality = [r for r in out.rows if r.get("profiler") == "quality"]
    assert quality and all(r["value"] is None and r["quality_reason"] == status["quality"][1] for r in quality)


# ----------------------------------------------------------------------------- the run path's shape

RUN_PATH = ("harness", "engine", "workloads")
MUTATORS = {"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "setdefault", "add",
            "discard", "move_to_end", "appendleft", "extendleft", "sort", "reverse"}
CONTAINERS = {"dict", "list", "set", "OrderedDict", "defaultdict", "deque", "Counter"}
# module-level state a function changes, and why it belongs to the process rather than to a run
PROCESS_STATE = {
    "harness/sweep.py": {"_SIGNALS": "signal dispositions are the process's: whether SIGTERM/SIGINT raise now "
                                     "or wait for the next safe point"},
    "harness/llamacpp/process.py": {"_live": "the child servers a SIGTERM of this process or its exit must stop",
                                    "_prev_sigterm": "the SIGTERM handler installed before this module's"},
    "harness/model_id.py": {"_MEMO": "a memo of a pure function: a checkpoint's digest by its files' names, "
                                     "sizes and mtimes"},
    "harness/sim/synthetic.py": {"PRESETS": "filled once at import (_build_presets), read-only after"},
    "engine/config.py": {"_NUMBER_KEYS": "a memo of the registered families' config.json number keys"},
    "engine/devices.py": {"_allocator_caps": "a CUDA device's allocator cap is the process's: the caps of "
                                             "the devices still open, latest last"},
    "engine/blocks/mxfp4.py": {"_PAIRS": "a memo of a constant lookup table per torch device"},
    "engine/hostmem.py": {"_registered_bytes": "page-locked host memory is the process's, as the OS counts it"},
    "engine/kernels/cpu.py": {"_fast": "the compiled kernel library, loaded into the process once",
                              "_state": "the process's kernel switch (MOEBENCH_CPU_KERNELS), flipped only "
                                        "around an A/B comparison"},
    "engine/kernels/openmp.py": {"_state": "the process's OpenMP spin setting, decided once before torch loads "
                                           "(an environment variable libgomp reads at start)"},
}


def _module_state(tree: ast.Module) -> set[str]:
    """Names bound at module level to a mutable container (a literal, a comprehension, a constructor)."""
    def mutable(v: ast.AST | None) -> bool:
        if isinstance(v, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
            return True
        f = v.func if isinstance(v, ast.Call) else None
        return (isinstance(f, ast.Name) and f.id in CONTAINERS) or (isinstance(f, ast.Attribute) and f.attr in CONTAINERS)
    names = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if targets and mutable(node.value):
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _changed_in_functions(tree: ast.Module, state: set[str]) -> set[str]:
    """Module-level names a function rebinds (`global`) or whose container it changes in place."""
    changed = set()
    for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        declared = {name for s in ast.walk(fn) if isinstance(s, ast.Global) for name in s.names}
        changed |= declared
        args = fn.args
        local = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)} - declared
        for s in ast.walk(fn):
            if isinstance(s, (ast.Assign, ast.AnnAssign)):
                local |= {t.id for t in (s.targets if isinstance(s, ast.Assign) else [s.target])
                          if isinstance(t, ast.Name)} - declared
        for s in ast.walk(fn):
            if isinstance(s, ast.Call) and isinstance(s.func, ast.Attribute) and s.func.attr in MUTATORS:
                target = s.func.value
            elif isinstance(s, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = s.targets if isinstance(s, (ast.Assign, ast.Delete)) else [s.target]
                target = next((t.value for t in targets if isinstance(t, ast.Subscript)), None)
            else:
                continue
            if isinstance(target, ast.Name) and target.id in state and target.id not in local:
                changed.add(target.id)
    return changed


def test_the_run_path_keeps_no_module_level_mutable_state():
    """A run's state is an object passed in (harness.session.RunSession): no module of harness/,
    engine/ or workloads/ keeps a container at module level that a function changes, or rebinds a
    global -- except the process's own state, each entry saying why."""
    found = {}
    for root in RUN_PATH:
        for path in sorted((REPO / root).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            rel = str(path.relative_to(REPO))
            for name in _changed_in_functions(tree, _module_state(tree)) - set(PROCESS_STATE.get(rel, {})):
                found.setdefault(rel, []).append(name)
    assert not found, f"module-level state changed by functions (pass it in, or say why it is the process's): {found}"


def test_a_known_mutation_is_found():
    """The check above finds each way of changing module state it looks for."""
    tree = ast.parse("A = {}\nB = []\nC = set()\nD = 0\nE = []\n"
                     "def f():\n    A['k'] = 1\n    B.append(1)\n"
                     "def g():\n    global D\n    D += 1\n    C.add(1)\n"
                     "def h(E):\n    E.append(1)\n")
    assert _changed_in_functions(tree, _module_state(tree)) == {"A", "B", "C", "D"}


# what another module of moebench imports under a private name, and why it may
PRIVATE_IMPORTS = {
    "harness/costmodel/validate.py": "the cost model's check against measured rows (`moebench calibrate`), off the "
                                     "run path: it parses a job's config as validation does",
}


def test_no_module_imports_a_private_name_of_another():
    bad = []
    for root in RUN_PATH:
        for path in sorted((REPO / root).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in RUN_PATH:
                    bad += [f"{rel}: from {node.module} import {a.name}" for a in node.names
                            if a.name.startswith("_") and not a.name.startswith("__") and rel not in PRIVATE_IMPORTS]
    assert not bad, bad
