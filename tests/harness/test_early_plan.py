"""A plan that cannot fit is refused before any weight is read: the job's memory plan (the one its
engine will make) comes right after the config is validated, before the exact reference loads
and runs the model. Through the real CLI, with a real checkpoint whose weights are cut short, so
that reading any of them would fail with another error than the plan's."""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from engine.planner import PlanError
from harness import results
from harness.engines.moebench import MoebenchAdapter
from harness.plan import job_plan, spec_of
from tests.harness.test_trust import SMALL, cli

pytestmark = pytest.mark.slow


def truncated_copy(src: Path, dst: Path) -> Path:
    """The checkpoint with every weight file cut to a quarter: its config reads, its weights do not."""
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        os.truncate(f, f.stat().st_size // 4)
    return dst


def test_a_budget_the_plan_cannot_fit_fails_before_any_weight_is_read(tmp_path, tiny_mixtral_dir):
    ckpt = truncated_copy(tiny_mixtral_dir, tmp_path / "ckpt")
    model = ["model=hf", f"model.path={ckpt}", "workload.tokens=random"]
    proc = cli([*model, "hardware.device_memory=1MiB", *SMALL], tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    df = results.load(next((tmp_path / "results" / "runs").iterdir()))
    assert set(df.status) == {"failed"} and df.phase.tolist() == [results.FAILED_PHASE]
    error = df.error.iloc[0]
    # the plan's refusal in one short line, not the safetensors error of the cut weights; its
    # arithmetic is in the job's log (the console)
    assert error.startswith("PlanError: placement 'fetch' does not fit the device budget") and "1.00 MiB" in error
    assert "\n" not in error and len(error) < 200 and re.search(r"breakdown, \d+ lines, is in the job's log", error)
    assert "non-expert weights" in proc.stdout and "= total" in proc.stdout
    assert "safetensors" not in error.lower() and "header" not in error.lower()
    # nothing ran the model: no reference was computed (nor cached), no engine loaded
    assert not list((tmp_path / "results").glob(".reference/*"))
    # the same checkpoint under a budget that fits reaches the weights, and fails on them there
    assert cli([*model, "hardware.device_memory=64MiB", *SMALL], tmp_path).returncode == 1
    runs = sorted((tmp_path / "results" / "runs").iterdir(), key=lambda d: d.stat().st_mtime_ns)
    assert len(runs) == 2
    later = results.load(runs[-1]).error.iloc[0]
    assert "model.safetensors" in later and "not a readable safetensors file" in later, later


@pytest.mark.parametrize("overrides", [
    ["placement=fetch", "cache.capacity=auto"],
    ["placement=fetch", "cache.capacity=2", "kv.dtype=q8"],
    ["placement=hybrid", "placement.n_cpu_layers=1"],
    ["placement=resident", "run.check_reference=false"],
])
def test_the_early_plan_is_the_one_the_engine_makes(overrides):
    """One rule: the plan the runner checks first equals the loaded engine's own."""
    spec = spec_of([*overrides, "hardware.device_memory=64MiB", "workload=chat", "workload.context_tokens=256"])
    early = job_plan(spec)
    adapter = MoebenchAdapter.build(spec, spec.engine_options)
    try:
        assert early == adapter.engine.plan
    finally:
        adapter.close()


def test_no_budget_or_another_engine_has_no_early_plan():
    assert job_plan(spec_of(["workload=chat"])) is None                        # no budget: nothing to refuse
    assert job_plan(spec_of(["engine=hf", "hardware.device_memory=1MiB"])) is None   # transformers plans its own way
    with pytest.raises(PlanError, match="does not fit the device budget"):
        job_plan(spec_of(["placement=resident", "hardware.device_memory=1MiB"]))
