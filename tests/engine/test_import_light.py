"""Planning a model never imports torch: model shapes, families, blocks' declarations, KV formats,
the registries and the memory planner load without it (engine.lazy), so `moebench plan` and
`--help` start in a fraction of torch's import time; the engine itself still loads it on use."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from engine.config import PRESETS
from engine.lazy import lazy_module
from engine.registry import PLACEMENTS

ROOT = Path(__file__).resolve().parents[2]

# every preset x every placement, each planned unlimited and in a budget that `auto` sizes, its KV
# in the model's dtype and in q8 (refused, in words, where a model keeps a state q8 cannot store)
PLAN_ALL = '''
def plans():
    from engine.config import PRESETS
    from engine.planner import plan_memory
    from engine.registry import PLACEMENTS
    out = {}
    for name, cfg in sorted(PRESETS.items()):
        for placement in PLACEMENTS.names():
            cap = "auto" if PLACEMENTS.get(placement).uses_cache({}) else None
            for budget in (None, 64 << 30):
                for kv in ("model", "q8"):
                    key = f"{name} {placement} {budget} {kv}"
                    try:
                        plan = plan_memory(cfg, placement, cap, budget, context=4096, batch=1, ubatch=512,
                                           dtype_bytes=2, kv_dtype=kv)
                        out[key] = [str(plan), plan.capacity, plan.total]
                    except ValueError as exc:
                        out[key] = [type(exc).__name__, str(exc)]
    return out
'''

LIGHT = PLAN_ALL + '''
import importlib, json, pkgutil, sys
import engine, engine.architecture, engine.blocks, engine.config, engine.families, engine.kv, engine.kvquant
import engine.planner, engine.registry
from engine.devices import fmt_bytes, parse_bytes
from engine.dtypes import DTYPE_NAMES, dtype_bytes
from engine.kv import StateTerm
from engine.kvquant import FORMATS
from engine.registry import FAMILIES, PLACEMENTS, POLICIES
for pkg in (engine.blocks, engine.families):
    for mod in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{pkg.__name__}.{mod.name}")
for reg in (FAMILIES, PLACEMENTS, POLICIES):
    for name in reg.names():
        reg.get(name)
assert parse_bytes("2GiB") == 2 << 30 and fmt_bytes(2 << 30) and dtype_bytes("bfloat16") == 2
assert StateTerm("KV cache", per_token=8).bytes(16, 2) == 256
assert [FORMATS[n].row_bytes(128, 2) for n in ("model", "f16", "q8", "q4")] == [256, 256, 136, 72]
result = plans()
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print(json.dumps({"torch": loaded, "plans": result}))
'''


def test_the_planning_path_imports_without_torch_and_plans_every_preset_and_placement():
    proc = subprocess.run([sys.executable, "-c", LIGHT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["torch"] == [], f"the planning path imported {out['torch']}"
    assert len(out["plans"]) == 4 * len(PRESETS) * len(PLACEMENTS.names())
    namespace: dict = {}
    exec(PLAN_ALL, namespace)                              # the same plans here, where torch is loaded
    assert "torch" in sys.modules
    assert out["plans"] == json.loads(json.dumps(namespace["plans"]()))


def test_the_engine_still_loads_from_the_package():
    proc = subprocess.run([sys.executable, "-c", "import sys, engine; assert 'torch' not in sys.modules; "
                           "from engine import Engine, GenerateResult, NonFiniteError; "
                           "assert 'torch' in sys.modules and Engine.__module__ == 'engine.engine'; "
                           "print(engine.Engine is Engine)"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True"


def test_a_lazy_module_is_imported_at_its_first_read_and_then_read_directly(tmp_path, monkeypatch):
    (tmp_path / "lazy_probe.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(tmp_path)
    monkeypatch.delitem(sys.modules, "lazy_probe", raising=False)
    namespace: dict = {}
    namespace["probe"] = lazy_module("lazy_probe", namespace)
    assert "lazy_probe" not in sys.modules
    assert namespace["probe"].VALUE == 42                  # the first read imports it ...
    assert namespace["probe"] is sys.modules["lazy_probe"]  # ... and puts the module itself in the name's place


def test_a_module_on_the_planning_path_reads_torch_itself_once_it_computed():
    import torch

    import engine.kvquant as kvquant
    kvquant.kv_format("q8").quantise(torch.ones(2, 32))
    assert kvquant.torch is torch                          # a monkeypatch of torch reaches it
