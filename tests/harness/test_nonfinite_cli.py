"""A broken run is a failed row with the reason, through the real `moebench` CLI in subprocesses on
checkpoints written by transformers: NaN in one tensor is refused at load naming it (with or
without the reference, by our engine in the same words); finite weights that overflow at run time fail
the job naming the first bad layer (ours) or the phase (transformers' logits); and a quality metric
is null only with its `quality_reason`, asserted on the loaded tables. engine=llamacpp's refusals of
the same checkpoints: tests/llamacpp/test_nonfinite_cli.py."""
from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pytest
import torch

from engine import Engine, NonFiniteError
from harness import results
from harness.contract import QUALITY_METRICS, QUALITY_PHASE
from harness.quality import QualityRun, compare_explained, quality_run
from tests.engine.test_nonfinite import EXPERT_W1, FILE, poison, rewritten, scaled_experts
from tests.cli_runner import run_cli

pytestmark = pytest.mark.slow     # subprocess/CLI runs
REPO = Path(__file__).resolve().parents[2]
SMALL = ["model=hf", "workload=chat", "workload.tokens=random", "workload.context_tokens=256",
         "workload.gen_tokens=4", "run.repeats=1", "run.timeline=false", "run.ablation=false", "run.quiet=true"]


def sweep(args: list[str], cwd: Path, sweep_id: str, rc: int) -> pd.DataFrame:
    """The sweep's loaded table, after the CLI exited with `rc` and no traceback."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cwd.mkdir(parents=True, exist_ok=True)
    proc = run_cli(["-m", f"run.sweep_id={sweep_id}", *SMALL, *args], cwd, env, timeout=900)
    assert proc.returncode == rc, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return results.load(cwd / "results" / "sweeps" / sweep_id / results.SWEEP_TABLE)


def the_error(df: pd.DataFrame) -> str:
    """The one failed row of each job: its error, the same for every job; a job failed whole."""
    assert (df.status == "failed").all() and (df.phase == "job").all() and df.job_id.is_unique, df
    errors = set(df.error)
    assert len(errors) == 1, errors
    error = errors.pop()
    assert "\n" not in error
    return error


@pytest.fixture(scope="module")
def nan_ckpt(tiny_mixtral_dir, tmp_path_factory) -> Path:
    return rewritten(tiny_mixtral_dir, tmp_path_factory.mktemp("nan") / "ckpt", poison(EXPERT_W1))


@pytest.fixture(scope="module")
def overflow_ckpt(tiny_mixtral_dir, tmp_path_factory) -> Path:
    return rewritten(tiny_mixtral_dir, tmp_path_factory.mktemp("overflow") / "ckpt", scaled_experts(range(8)))


@pytest.fixture(scope="module")
def loader_error(nan_ckpt, tmp_path_factory) -> str:
    """Our engine's refusal, with and without the reference: one failed row per job, the same words."""
    df = sweep([f"model.path={nan_ckpt}", "run.check_reference=true,false"], tmp_path_factory.mktemp("ours"), "nan",
               rc=1)
    assert len(df) == 2
    return the_error(df)


def test_a_nan_checkpoint_is_a_failed_row_naming_the_tensor(loader_error, nan_ckpt):
    assert loader_error == (f"NonFiniteError: checkpoint {nan_ckpt} is refused: tensor {EXPERT_W1!r} in {FILE}: "
                            "5 of 6144 values are NaN or inf; 1 tensor in all holds NaN or inf (a model with NaN or "
                            "inf weights computes NaN; repair or re-export the checkpoint)")


def test_an_overflow_at_run_time_is_a_failed_row_naming_the_first_bad_layer(overflow_ckpt, tmp_path):
    placements = "placement=resident,fetch,cpu,hybrid,stream"
    df = sweep([f"model.path={overflow_ckpt}", "run.check_reference=false", placements, "cache.capacity=2"], tmp_path,
               "overflow", rc=1)
    assert set(df.placement) == {"resident", "fetch", "cpu", "hybrid", "stream"}
    assert the_error(df) == (
        "NonFiniteError: prefill of session positions 0-255 went non-finite; the first non-finite output is layer 1 "
        "of 3 (model.layers.1), from its routed experts (finite input, non-finite output): 16384 of 16384 values NaN "
        "or inf, in pass 1 of the 1 since the session began (the session's passes replayed with every layer's output "
        "checked); the session was emptied")


def test_transformers_nan_logits_are_a_failed_row(overflow_ckpt, nan_ckpt, tmp_path):
    df = sweep(["engine=hf", f"model.path={overflow_ckpt},{nan_ckpt}", "run.check_reference=false"], tmp_path, "hf",
               rc=1)
    assert len(df) == 2
    assert the_error(df) == ("NonFiniteError: engine=hf returned 128 of 128 logits NaN or inf in phase prefill_fresh "
                             "(the model computed no number there; no token it chose is a measurement)")


# ------------------------------------------------------------------ a null quality metric has its reason

def test_a_null_quality_metric_always_has_its_reason(tiny_mixtral_dir, tmp_path):
    df = sweep([f"model.path={tiny_mixtral_dir}", "engine=moebench,hf", "run.check_reference=true,false"], tmp_path,
               "q", rc=0)
    q = df[(df.phase == QUALITY_PHASE) & df.metric.isin(QUALITY_METRICS)]
    assert len(q) == 4 * len(QUALITY_METRICS) and (q.status == "ok").all()
    assert q[q.value.isna()].quality_reason.notna().all()           # null only with a reason
    assert q[q.value.notna()].quality_reason.isna().all()           # and a measured one has none
    reasons = q.groupby(["engine", "job_id"]).quality_reason.agg(lambda s: set(s.dropna()))
    ours = df[(df.engine == "moebench") & (df.phase == QUALITY_PHASE)]
    checked = ours[ours.job_id.str.contains("check_reference=True")]
    assert checked.value.notna().all() and checked.metric.nunique() == len(QUALITY_METRICS)   # all measured
    assert {frozenset(r) for r in reasons} == {
        frozenset(), frozenset({"no exact reference (run.check_reference=false)"}),
        frozenset({"engine=hf gives no full-vocabulary logits per position"})}


def passes(logits: torch.Tensor, nll_count: int, nll: float = 10.0) -> QualityRun:
    return QualityRun(logits, nll, nll_count, [[1, 2, 3]])


def test_compare_gives_each_null_metric_its_reason_and_refuses_nan():
    ref = passes(torch.randn(1, 5, 32), nll_count=4)
    metrics, reasons = compare_explained(passes(ref.logits.clone(), nll_count=3), ref, None)
    assert metrics["ppl_ratio"] is None
    assert "different prompt positions (3 vs the reference's 4)" in reasons["ppl_ratio"]
    assert metrics["token_agreement"] is None and reasons["token_agreement"]
    assert {m for m, v in metrics.items() if v is None} == set(reasons)
    bad = ref.logits.clone()
    bad[0, 2, 7] = float("nan")
    for got, want in ((passes(bad, 4), ref), (ref, passes(bad, 4))):     # either side: never NaN against NaN
        with pytest.raises(NonFiniteError, match=r"quality pass holds 1 of 160 logits NaN or inf"):
            compare_explained(got, want, [[1, 2, 3]])


def test_a_quality_pass_that_goes_non_finite_raises(overflow_ckpt):
    eng = Engine.from_pretrained(str(overflow_ckpt), device="cpu", max_context=256, all_logits=True, ubatch=16)
    with pytest.raises(NonFiniteError, match=r"^prefill of session positions 0-15 went non-finite.*layer 1 of 3"):
        quality_run(eng, [list(range(20, 60))], 3)
    eng.close()
