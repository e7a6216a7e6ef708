"""A plugin is one file plus its registration, end to end: a third-party placement and policy,
declared through real entry points of a temporary distribution, run from the CLI (their Options
as Hydra schemas), the simulator and the cost model, with no edit anywhere in moebench."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import results

pytestmark = pytest.mark.slow     # subprocess/CLI or multi-second runs: `make test` runs them, `-m "not slow"` skips
REPO = Path(__file__).resolve().parents[1]

PLUGIN = '''
"""A third-party placement (experts of layers of one parity on the CPU, the rest resident) and
eviction policy (most recently used first)."""
from dataclasses import dataclass

from engine.placements.base import Placement, PlacementTraits
from engine.policies.base import OrderedPolicy


@dataclass(frozen=True)
class ParityOptions:
    parity: int = 0          # layers with layer % 2 == parity run their experts on the CPU

    def __post_init__(self):
        if self.parity not in (0, 1):
            raise ValueError(f"parity must be 0 or 1, got {self.parity}")


class ParityCPU(Placement):
    name = "parity_cpu"
    Options = ParityOptions

    def expert_on_device(self, layer):
        return layer % 2 != self.options.parity

    @classmethod
    def device_expert_bytes(cls, cfg, expert_bytes, capacity, options):
        parity = cls.parse_options(options).parity
        return sum(1 for l in cfg.moe_layers if l % 2 != parity) * cfg.n_experts * expert_bytes

    @classmethod
    def traits(cls, cfg, options):
        parity = cls.parse_options(options).parity
        return PlacementTraits(cpu_layers=frozenset(l for l in cfg.moe_layers if l % 2 == parity))

    def run(self, layer, h, ids, weights):
        if self.expert_on_device(layer):
            return self.run_resident(layer, h, ids, weights)
        return self.run_on_cpu(layer, h, ids, weights)


class MRU(OrderedPolicy):
    name = "mru"

    def on_hit(self, expert, t):
        self._order.move_to_end(expert)

    def victim(self, t, protected=frozenset()):
        return self._first_unprotected(reversed(self._order), protected)
'''


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("plugin")
    (root / "mb_parity.py").write_text(PLUGIN)
    dist = root / "mb_parity-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mb-parity\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[moebench.placements]\nparity_cpu = mb_parity:ParityCPU\n\n"
                                           "[moebench.policies]\nmru = mb_parity:MRU\n")
    return root


def run(args: list[str], cwd: Path, plugin: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{plugin}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{args}\n{proc.stdout}\n{proc.stderr}"
    return proc


SMALL = ["workload=chat", "workload.context_tokens=256", "workload.gen_tokens=4", "run.repeats=1",
         "run.timeline=false", "run.quiet=true"]


def test_third_party_placement_and_policy_from_the_cli(tmp_path, plugin_path):
    run(["-m", "harness.cli", "-m", "placement=parity_cpu", "placement.parity=0,1", "run.sweep_id=p", *SMALL],
        tmp_path, plugin_path)
    run(["-m", "harness.cli", "-m", "placement=fetch", "cache.policy=mru,lru", "cache.capacity=2",
         "run.sweep_id=q", *SMALL], tmp_path, plugin_path)
    df = results.load(tmp_path / "results" / "sweeps")
    assert (df.status == "ok").all()
    speed = df[(df.profiler == "none") & (df.source == "engine")]
    assert (speed[speed.metric == "token_agreement"].value == 1.0).all()           # the invariant holds
    parity = speed[(speed.placement == "parity_cpu") & (speed.metric == "d2h_activation_bytes")]
    assert (parity.groupby("job_id").value.sum() > 0).all() and parity.job_id.nunique() == 2
    mru = speed[(speed.cache_policy == "mru") & (speed.phase == "decode") & (speed.metric == "expert_misses")]
    lru = speed[(speed.cache_policy == "lru") & (speed.phase == "decode") & (speed.metric == "expert_misses")]
    assert len(mru) == len(lru) == 1 and mru.value.iloc[0] != lru.value.iloc[0]     # a different policy ran
    bad = subprocess.run([sys.executable, "-m", "harness.cli", "placement=parity_cpu", "placement.parity=2", *SMALL],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{plugin_path}"})
    df = results.load(next((tmp_path / "results" / "runs").iterdir()))
    assert bad.returncode == 1 and "parity must be 0 or 1, got 2" in df[df.status == "failed"].error.iloc[0]


def test_third_party_plugins_in_the_simulator_and_the_cost_model(tmp_path, plugin_path):
    sim = run(["-m", "harness.sim.cli", "--synthetic", "mixtral-like", "--tokens", "300", "--policy", "mru,lru",
               "--capacity", "2", "--out", str(tmp_path / "sim.csv")], tmp_path, plugin_path)
    import pandas as pd
    rows = pd.read_csv(tmp_path / "sim.csv")
    assert {"mru", "lru"} <= set(rows.policy) and "mru" in sim.stdout
    script = ("import json\n"
              "from harness.costmodel import WorkloadShape, predict\n"
              "s = WorkloadShape(context_tokens=256, gen_tokens=8)\n"
              "p = predict('tiny-mixtral', 'parity_cpu', s, 'rtx4090-pcie4-x16', placement_options={'parity': 1})\n"
              "r = predict('tiny-mixtral', 'resident', s, 'rtx4090-pcie4-x16')\n"
              "f = predict('tiny-mixtral', 'fetch', s, 'rtx4090-pcie4-x16', capacity=2, policy='mru')\n"
              "print(json.dumps({'parity_d2h': p.phases['decode'].d2h_bytes, 'resident_d2h': r.phases['decode'].d2h_bytes,"
              " 'mru_misses': f.phases['decode'].expert_misses}))\n")
    out = json.loads(run(["-c", script], tmp_path, plugin_path).stdout.strip().splitlines()[-1])
    assert out["parity_d2h"] > 0 == out["resident_d2h"] and out["mru_misses"] > 0
