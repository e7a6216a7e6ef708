"""An engine is one plugin: deleting llama.cpp's -- its package harness/llamacpp/, its tests and its one
registry line -- leaves the rest of moebench working. In a copy of the tree without them, every other
module imports, `moebench --help` and a real run work, `engine=llamacpp` and its sub-commands are
refused as unknown, and the import rules and the config tests pass: nothing outside the package named
it (tests/test_architecture.py checks the names; this checks the consequence)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.plugins import needs_engine

REPO = Path(__file__).resolve().parents[1]
REMOVED = ("harness/llamacpp/", "tests/llamacpp/")
REGISTRY = "harness/engines/registry.py"
LINE = "harness.llamacpp.adapter:LlamaCppAdapter"
# the copy's own moebench, never the checkout's: the editable install's import hook maps the `harness`
# and `engine` packages back to the checkout, where the deleted package still is
ISOLATE = '''import sys
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
sys.path[:] = [p for p in sys.path if "__editable__" not in p]
'''
IMPORT_ALL = '''import importlib, json, sys
from pathlib import Path
failed = {}
for pkg in ("engine", "harness", "workloads"):
    for path in sorted(Path(pkg).rglob("*.py")):
        parts = path.with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 -- every failure is reported, by module
            failed[name] = f"{type(exc).__name__}: {exc}"
from harness.engines.registry import ENGINES, commands, knob_columns
print(json.dumps({"failed": failed, "llamacpp": sorted(m for m in sys.modules if "llamacpp" in m),
                  "engines": ENGINES.names(), "commands": sorted(commands()), "knobs": knob_columns(),
                  "harness": sorted({str(Path(p).resolve()) for p in __import__("harness").__path__})}))
'''

pytestmark = [pytest.mark.slow, needs_engine("llamacpp")]     # in a tree without it, nothing to remove


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """The working tree (tracked and untracked, not ignored) without llama.cpp's plugin."""
    root = tmp_path_factory.mktemp("without-llamacpp")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for rel in filter(None, listed):
        src = REPO / rel
        if rel.startswith(REMOVED) or not src.is_file():
            continue
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, root / rel)
    registry = root / REGISTRY
    lines = registry.read_text().splitlines(keepends=True)
    kept = [line for line in lines if LINE not in line]
    assert len(kept) == len(lines) - 1, f"{REGISTRY} should name {LINE} on exactly one line"
    registry.write_text("".join(kept))
    (root / "sitecustomize.py").write_text(ISOLATE)
    return root


def run(tree: Path, argv: list[str], cwd: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    env.pop("MOEBENCH_REQUIRE_LLAMACPP", None)          # the plugin is gone on purpose
    return subprocess.run([sys.executable, *argv], cwd=cwd or tree, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_every_other_module_imports_and_nothing_knows_llamacpp(tree):
    proc = run(tree, ["-c", IMPORT_ALL])
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["harness"] == [str(tree.resolve() / "harness")]          # the copy's, not the checkout's
    assert got["failed"] == {}
    assert got["llamacpp"] == []
    assert got["engines"] == ["hf", "moebench"]
    assert got["commands"] == [] and "gguf_type" not in got["knobs"]


def test_moebench_help_and_a_run_without_it(tree, tmp_path):
    cli = ["-m", "harness.cli"]
    help_ = run(tree, [*cli, "--help"], cwd=tmp_path)
    assert help_.returncode == 0, help_.stderr
    out = tmp_path / "results"
    proc = run(tree, [*cli, "workload=chat", "workload.context_tokens=256", "workload.gen_tokens=4", "run.repeats=1",
                      "run.warmup=0", "run.quiet=true", f"run.out={out}", "run.sweep_id=s"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    show = ("import json, sys; from harness.results import load; df = load(sys.argv[1]); "
            "print(json.dumps({'status': sorted(df.status.unique()), 'engine': sorted(df.engine.unique()), "
            "'phases': sorted(df.phase.unique())}))")
    loaded = run(tree, ["-c", show, str(out)])
    assert loaded.returncode == 0, loaded.stderr
    table = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert table["status"] == ["ok"] and table["engine"] == ["moebench"]
    assert {"load", "prefill_fresh", "decode"} <= set(table["phases"])
    # the engine and its sub-command are unknown now: refused, naming what there is
    gone = run(tree, [*cli, "engine=llamacpp", f"run.out={out}"], cwd=tmp_path)
    assert gone.returncode == 1 and gone.stderr.strip() == ("moebench: engine=llamacpp: no such option; allowed: hf, "
                                                            "moebench"), gone.stderr
    setup = run(tree, [*cli, "setup", "llamacpp"], cwd=tmp_path)
    assert setup.returncode == 2 and "setup" in setup.stderr, setup.stderr


def test_the_import_rules_and_the_config_tests_pass_without_it(tree):
    proc = run(tree, ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/test_architecture.py",
                      "tests/harness/test_config.py"], timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
