"""Prefetch, the timeline, NVTX and the profiler passes, end to end on the tiny model."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

import harness.cli  # noqa: F401 -- registers the ConfigStore
from engine import Engine
from engine.nvtx_ranges import NvtxRanges
from engine.intervals import subtract
from engine.timeline import Timeline
from harness import results
from harness.cli import CONF_DIR
from harness.report import Reporter
from harness.runner import JobContext, run_job
from tests.engine_loads import engine_loads

REPO = Path(__file__).resolve().parents[2]


def cfg_with(*overrides: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def job(tmp_path: Path, *overrides: str):
    out = run_job(cfg_with(*overrides), JobContext(tmp_path, "s", "j"), Reporter(quiet=True))
    assert out.error is None, out.error
    results.write_job(tmp_path, out.rows, {"test": True})
    return results.load(tmp_path)


@pytest.mark.slow
def test_next_layer_gate_overlaps_copies_with_compute(tmp_path):
    """Reuse-heavy chat workload, emulated fetch with next_layer_gate: copies overlap compute,
    prefetched experts get used, and the tokens are exactly resident's."""
    df = job(tmp_path, "placement=fetch", "cache.capacity=4", "prefetch=next_layer_gate", "workload=chat",
             "workload.context_tokens=512", "workload.gen_tokens=24", "run.repeats=1", "run.trace=true")
    tl = df[(df.profiler == "timeline") & (df.phase == "decode")].set_index("metric")["value"]
    assert tl["overlap_frac"] > 0 and tl["overlap_s"] > 0
    assert tl["exposed_copy_s"] == pytest.approx(tl["copy_busy_s"] - tl["overlap_s"])
    assert np.isnan(tl["link_gbps"])                          # never from an emulated run
    speed = df[df.profiler == "none"]
    assert speed[(speed.metric == "prefetch_used")].value.sum() > 0
    assert (speed[speed.metric == "token_agreement"].value == 1.0).all()
    assert (speed[speed.metric == "max_abs_logit_diff"].value == 0.0).all()
    ablation = speed[speed.metric == "exposed_copy_ablation_s"]
    assert set(ablation.phase) == {"prefill_fresh", "decode", "prefill_continuation", "prefill_restored"}
    assert ablation.repeat.isna().all()


@pytest.mark.slow
def test_perfetto_trace_has_expected_spans(tmp_path):
    job(tmp_path, "placement=fetch", "cache.capacity=2", "workload=chat", "workload.context_tokens=256",
        "workload.gen_tokens=4", "run.repeats=1", "run.trace=true", "run.ablation=false")
    trace = json.loads((tmp_path / "trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    cats = {e["cat"] for e in events}
    assert {"step", "layer", "attention", "router", "expert", "copy", "phase"} <= cats
    names = {e["name"] for e in events}
    assert {"prefill_fresh", "decode", "prefill_continuation", "prefill_restored"} <= names
    assert any(re.fullmatch(r"expert L\d+ e\d+", n) for n in names)
    assert all(e["dur"] >= 0 and "ts" in e for e in events)
    assert any(e["cat"] == "copy" and e["args"].get("bytes", 0) > 0 for e in events)


@pytest.mark.slow
def test_profiled_rows_never_reach_the_speed_summary(tmp_path):
    df = job(tmp_path, "placement=fetch", "cache.capacity=2", "workload=chat", "workload.context_tokens=256",
             "workload.gen_tokens=4", "run.repeats=2", "run.ablation=false", "run.profiler=torch")
    assert set(df.profiler) == {"none", "timeline", "torch", "quality", "prediction"}
    torch_rows = df[df.source == "torch"].set_index("metric")["value"]
    assert torch_rows["main_thread_copy_bytes"] > 0 and torch_rows["memcpy_events"] > 0
    assert "cpu_copy_bytes" not in torch_rows        # the profiler sees no op of the copy worker thread
    assert (tmp_path / "torch_trace.json").is_file()
    summary = results.summarize(df)
    decode = summary[summary.phase == "decode"].set_index("source")["n_repeats"]
    assert (decode.drop("model") == 2).all()      # the 2 speed repeats only
    assert decode.isna()["model"]                # the roofline is no repeat
    assert summary.get("copy_busy_s", summary.assign(copy_busy_s=np.nan)["copy_busy_s"]).isna().all()


def test_nsys_missing_gives_a_clear_message(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("NSYS", raising=False)
    with engine_loads() as loads:
        out = run_job(cfg_with("workload=chat", "workload.context_tokens=256", "workload.gen_tokens=2",
                               "run.repeats=1", "run.profiler=nsys", "run.ablation=false"),
                      JobContext(tmp_path, "s", "j"), Reporter(quiet=True))
    # refused at validation, before the job runs: no model was loaded
    assert out.error is not None and "run.profiler=nsys" in out.error and "Nsight Systems" in out.error
    assert loads == [] and len(out.rows) == 1


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "belady"])
@pytest.mark.parametrize("placement,opts", [("fetch", {"cache_capacity": 2}), ("fetch", {"cache_capacity": 5}),
                                            ("stream", {"cache_capacity": 3, "stream_threshold": 8})])
@pytest.mark.slow
def test_prefetch_never_changes_outputs(policy, placement, opts):
    prompts = np.random.default_rng(3).integers(0, 512, (2, 30)).tolist()
    ref = Engine.from_pretrained("tiny-mixtral", device="cpu").generate(prompts, 10)
    rec = Engine.from_pretrained("tiny-mixtral", device="cpu", placement=placement, record_lookups=True, **opts)
    rec.generate(prompts, 10)
    pol = {"future": rec.lookup_log} if policy == "belady" else {}
    for prefetch, popts in (("next_layer_gate", {}), ("trace_oracle", {"steps": rec.step_log})):
        eng = Engine.from_pretrained("tiny-mixtral", device="cpu", placement=placement, cache_policy=policy,
                                     policy_options=pol, prefetch=prefetch, prefetch_options=popts, **opts)
        got = eng.generate(prompts, 10)
        assert got.tokens == ref.tokens
        assert max((a - b).abs().max().item() for a, b in zip(got.logits, ref.logits)) <= 1e-5
        c = eng.counters
        assert c["prefetch_issued"] > 0 and c["prefetch_used"] <= c["prefetch_issued"]
        assert c["expert_hits"] + c["expert_misses"] == sum(len(s) for s in rec.lookup_log.values())
        if prefetch == "trace_oracle":
            assert c["prefetch_used"] > 0


def test_prefetch_needs_a_cache():
    with pytest.raises(ValueError, match="needs a placement with a device expert cache"):
        Engine.from_pretrained("tiny-mixtral", device="cpu", placement="cpu", prefetch="next_layer_gate")


def test_nvtx_ranges_run_on_cpu_and_build_attributes_once():
    eng = Engine.from_pretrained("tiny-mixtral", device="cpu", placement="fetch", cache_capacity=2)
    ranges = NvtxRanges()
    eng.set_instrument(ranges)
    eng.generate([[1, 2, 3, 4]], 3)
    n = len(ranges._attrs)
    eng.generate([[1, 2, 3, 4]], 3)
    assert 0 < len(ranges._attrs) <= n + 8        # names reused: attributes are cached, not rebuilt
    assert "expert L0 e0" in ranges._attrs or any(k.startswith("expert L") for k in ranges._attrs)
    assert NvtxRanges.range_name("phase", {"phase": "decode"}) == "moebench:decode"


def test_torch_cuda_nvtx_is_never_called():
    """torch.cuda.nvtx raises on CPU builds; the code uses the `nvtx` package only."""
    offenders = [p for d in ("engine", "harness") for p in (REPO / d).rglob("*.py")
                 if re.search(r"torch\.cuda\.nvtx\.\w+\s*\(|from torch\.cuda import nvtx", p.read_text())]
    assert offenders == []


def test_timeline_subtract_and_compute_on_emulated_device():
    assert subtract([(0, 10)], [(2, 3), (5, 7)]) == [(0, 2), (3, 5), (7, 10)]
    assert subtract([(0, 1), (2, 3)], []) == [(0, 1), (2, 3)]
    assert subtract([(0, 4)], [(0, 4)]) == []
    tl = Timeline("cpu")
    with tl.span("layer", layer=0):
        with tl.span("wait"):
            pass
    assert len(tl.compute_intervals()) >= 1
