"""Every figure checked and labelled, in-process on the tiny model: the numerical check per
measured repeat and phase (with injected faults), the reference off the device, the paired
ablation under a real device budget, expert-cache state, per-step latencies, failing passes."""
from __future__ import annotations

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir

import harness.cli  # noqa: F401 -- registers the ConfigStore
from engine.planner import plan_memory
from engine.config import preset
from engine.export import export_preset
from harness import results, scenario
from harness.cli import CONF_DIR
from harness.config import validate
from harness.engines import session_tokens_of
from harness.report import Reporter
from harness.runner import JobContext, run_job
from harness.scenario import run_repeat
from harness.session import RunSession
from tests.engine_loads import engine_loads
from tests.plugins import engine_params

pytestmark = pytest.mark.slow     # subprocess/CLI or multi-second runs: `make test` runs them, `-m "not slow"` skips
SMALL = ("workload=chat", "workload.context_tokens=256", "workload.gen_tokens=6", "run.timeline=false")


def cfg_with(*overrides: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def job(tmp_path, *overrides: str, session: RunSession | None = None):
    out = run_job(cfg_with(*overrides, f"run.out={tmp_path}"), JobContext(tmp_path / "job", "s", "j"),
                  Reporter(quiet=True), session)
    return out, (results.rows_to_table(out.rows).to_pandas() if out.rows else None)


def checks(df: pd.DataFrame) -> pd.DataFrame:
    m = df[(df.source == "engine") & df.metric.isin(["max_abs_logit_diff", "token_agreement"]) & (df.profiler == "none")]
    return m.pivot_table(index=["repeat", "phase"], columns="metric", values="value")


class Faulty:
    """The job's real adapter, with a fault injected into one measured repeat (the final norm's sign
    flipped, so every logit is negated and argmax becomes argmin) and into the restored KV of another."""

    def __init__(self, inner, corrupt_repeat: int, corrupt_kv_repeat: int) -> None:
        self.inner = inner
        self.repeat = -2                  # reset() runs once per repeat: the warm-up is -1, measured 0, 1, ...
        self.corrupt_repeat, self.corrupt_kv_repeat = corrupt_repeat, corrupt_kv_repeat

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def reset(self) -> None:
        norm = self.inner.engine.model.norm
        if self.repeat == self.corrupt_repeat:          # undo the fault of the repeat that just ended
            norm.mul_(-1)
        self.repeat += 1
        if self.repeat == self.corrupt_repeat:
            norm.mul_(-1)
        self.inner.reset()

    def restore(self, sess) -> None:
        self.inner.restore(sess)
        if self.repeat == self.corrupt_kv_repeat:
            g = torch.Generator().manual_seed(0)
            for t in (*sess.k, *sess.v):
                t.copy_(torch.randn(t.shape, generator=g) * 30)


def test_the_check_runs_on_every_measured_repeat_and_finds_injected_faults(tmp_path, monkeypatch):
    session = RunSession()
    real = session.engines.get

    def faulty(spec, **kw):
        eng, loaded = real(spec, **kw)
        return Faulty(eng, corrupt_repeat=1, corrupt_kv_repeat=2), loaded

    monkeypatch.setattr(session.engines, "get", faulty)
    out, df = job(tmp_path, "placement=fetch", "cache.capacity=2", "run.repeats=4", "run.ablation=false", *SMALL,
                  session=session)
    session.close()
    assert out.error is None, out.error
    c = checks(df)
    phases = {"prefill_fresh", "decode", "prefill_continuation", "prefill_restored"}
    assert set(c.index) == {(r, p) for r in range(4) for p in phases}           # every repeat, every phase
    bad = {(1, p) for p in phases} | {(2, "prefill_restored")}
    for key, row in c.iterrows():
        if key in bad:
            assert row["max_abs_logit_diff"] > 1e-3 and row["token_agreement"] < 1.0, key
        else:
            assert row["max_abs_logit_diff"] == 0.0 and row["token_agreement"] == 1.0, key


def test_reference_lives_off_the_device_and_the_ablation_fits_the_budget(tmp_path):
    """The real case: a budget smaller than resident needs, default check_reference and ablation."""
    spec = validate(cfg_with("placement=fetch", "cache.capacity=2", *SMALL))
    cfg = preset("tiny-mixtral")
    w = spec.workload
    resident = plan_memory(cfg, "resident", None, None, session_tokens_of(spec), w.batch, w.ubatch, 4, device_kind="cpu")
    fetch = plan_memory(cfg, "fetch", 2, None, session_tokens_of(spec), w.batch, w.ubatch, 4, device_kind="cpu")
    assert fetch.total < resident.total
    budget = (fetch.total + resident.total) // 2                               # fetch fits, resident does not
    out, df = job(tmp_path, "placement=fetch", "cache.capacity=2", f"hardware.device_memory={budget}", *SMALL)
    assert out.error is None, out.error
    assert (df.status == "ok").all()
    c = checks(df)
    assert len(c) == 3 * 4 and (c["max_abs_logit_diff"] == 0).all() and (c["token_agreement"] == 1).all()
    assert set(df.reference.dropna()) <= {"computed", "memory", "file"}
    peaks = df[(df.metric == "emulated_device_peak_bytes") & df.value.notna()]
    assert len(peaks) and (peaks.value <= budget).all()                        # never the reference's weights
    assert (peaks.value < resident.total).all()
    ab = df[df.metric == "exposed_copy_ablation_s"]
    assert len(ab) == 4 and ab.value.isna().all() and set(ab.ablation_mode) == {"skipped"}
    assert ab.ablation_reason.str.contains("resident plan does not fit").all()


def test_ablation_is_paired_interleaved_or_sequential_by_budget(tmp_path):
    spec = validate(cfg_with("placement=fetch", "cache.capacity=2", *SMALL))
    cfg, w = preset("tiny-mixtral"), spec.workload
    r = plan_memory(cfg, "resident", None, None, session_tokens_of(spec), w.batch, w.ubatch, 4, device_kind="cpu").total
    f = plan_memory(cfg, "fetch", 2, None, session_tokens_of(spec), w.batch, w.ubatch, 4, device_kind="cpu").total
    # each plan adds a 5% reserve of the budget: resident alone fits from r/0.95, both together from (r+f)/0.9
    between = int((r / 0.95 + (r + f) / 0.9) / 2)
    for budget, mode in ((None, "interleaved"), (between, "sequential")):
        extra = [] if budget is None else [f"hardware.device_memory={budget}"]
        out, df = job(tmp_path / mode, "placement=fetch", "cache.capacity=2", "run.repeats=3", *SMALL, *extra)
        assert out.error is None, out.error
        ab = df[df.metric.str.startswith("exposed_copy_ablation")]
        assert set(ab.ablation_mode) == {mode}
        med = ab[ab.metric == "exposed_copy_ablation_s"].set_index("phase")["value"]
        assert med.notna().all()
        # 3 pairs: no interval (6 needed) and no significance verdict (10 needed); sequential pairs: neither
        others = ab[ab.metric != "exposed_copy_ablation_s"]
        assert others.value.isna().all()
        why = "sequential pairs" if mode == "sequential" else "3 pair(s): too few pairs, inconclusive: no 95% interval (needs 6 pairs)"
        assert ab.ablation_note.str.contains(why, regex=False).all()
        raw = df[df.profiler == "ablation"]
        assert set(raw.ablation_side) == ({"resident", "placement"} if mode == "interleaved" else {"resident"})
        assert raw[raw.ablation_side == "resident"].repeat.nunique() == 3
        if mode == "interleaved":               # the side that goes first alternates, pair by pair
            first = raw.drop_duplicates("repeat").sort_values("repeat")["ablation_first"].tolist()
            assert first == ["placement", "resident", "placement"]
        # the statistic is the paired one: recompute it from the raw samples
        speed = df[(df.profiler == "none") & (df.metric == "time_s") & (df.source == "client")]
        side = raw[raw.ablation_side == "placement"] if mode == "interleaved" else speed
        a = side[side.phase == "decode"].sort_values("repeat")["value"].to_numpy()
        b = raw[(raw.ablation_side == "resident") & (raw.phase == "decode")].sort_values("repeat")["value"].to_numpy()
        assert med["decode"] == pytest.approx(float(pd.Series(a - b).median()))


def test_the_ablation_warms_its_resident_engine_as_the_measured_one_was(tmp_path, monkeypatch):
    """A pair is fair only when both sides start warm: the resident engine the ablation loads
    runs `run.warmup` unrecorded repeats before its measured ones, like the measured engine."""
    calls = []

    def spy(eng, *args, **kwargs):             # the real repeat, its placement noted
        calls.append(eng.engine.placement.name)
        return run_repeat(eng, *args, **kwargs)

    # every repeat of the measured and the resident engine: both passes import it from
    # harness.scenario when they run
    monkeypatch.setattr(scenario, "run_repeat", spy)
    for warmup in (0, 2):
        calls.clear()
        out, df = job(tmp_path / str(warmup), "placement=fetch", "cache.capacity=2", "run.repeats=2",
                      f"run.warmup={warmup}", *SMALL)
        assert out.error is None, out.error
        # the measured engine: warm-ups, repeats, then one more repeat per pair (interleaved)
        assert calls.count("fetch") == warmup + 2 + 2
        assert calls.count("resident") == warmup + 2
        assert calls[warmup + 2:warmup + 2 + warmup] == ["resident"] * warmup   # before its first measured one
        raw = df[(df.profiler == "ablation") & (df.ablation_side == "resident")]
        assert sorted(raw.repeat.unique()) == [0, 1]                   # the warm-ups are never rows


def test_warm_expert_cache_starts_prefill_with_fewer_misses(tmp_path):
    rows = {}
    for state in ("cold", "warm"):
        out, df = job(tmp_path / state, "placement=fetch", "cache.capacity=4", "run.repeats=1", "run.ablation=false",
                      f"run.expert_cache={state}", *SMALL)
        assert out.error is None
        fresh = df[(df.phase == "prefill_fresh") & (df.profiler == "none") & (df.source == "engine")]
        assert set(fresh.expert_cache) == {state}
        rows[state] = fresh.set_index("metric")["value"]
    assert rows["warm"]["expert_misses"] < rows["cold"]["expert_misses"]
    assert rows["warm"]["max_abs_logit_diff"] == 0.0                      # the cache state never changes outputs


def test_per_step_latencies_are_kept_and_give_the_percentiles(tmp_path):
    out, df = job(tmp_path, "placement=fetch", "cache.capacity=2", "run.repeats=2", "run.ablation=false", *SMALL)
    steps = pd.DataFrame(out.steps)
    assert len(steps) == 2 * 5 and set(steps.repeat) == {0, 1}
    results.write_job(tmp_path / "w", out.rows, {"t": 1}, steps=out.steps)
    back = results.load_steps(tmp_path / "w")
    for r, grp in back.groupby("repeat"):
        p50 = df[(df.metric == "tpot_s_p50") & (df.repeat == r) & (df.profiler == "none")]["value"].iloc[0]
        assert grp["tpot_s"].median() == pytest.approx(p50)


def test_a_failing_profiling_pass_keeps_the_measured_rows(tmp_path):
    (tmp_path / "job" / "trace.json").mkdir(parents=True)   # the trace cannot be written: a real OS error
    out, df = job(tmp_path, "placement=fetch", "cache.capacity=2", "run.repeats=1", "run.ablation=false",
                  "workload=chat", "workload.context_tokens=256", "workload.gen_tokens=4", "run.trace=true")
    assert out.error and "timeline" in out.error and "IsADirectoryError" in out.error
    failed = df[df.status == "failed"]
    assert list(failed.phase) == ["timeline"] and list(failed.profiler) == ["timeline"]
    measured = df[(df.status == "ok") & (df.profiler == "none")]
    assert {"prefill_fresh", "decode"} <= set(measured.phase)


def test_transformers_computes_only_the_last_position(tmp_path):
    spec = validate(cfg_with("engine=hf", "placement=resident", f"run.out={tmp_path}", *SMALL))
    from harness.engines.hf import HFAdapter
    hf = HFAdapter(spec)
    shapes = []
    hook = hf.model.lm_head.register_forward_hook(lambda m, i, o: shapes.append(tuple(o.shape)))
    sess = hf.new_session(1)
    logits = hf.prefill(sess, [list(range(10, 40))]).logits
    hook.remove()
    assert shapes == [(1, 1, spec.model_config.vocab_size)] and logits.shape == (1, spec.model_config.vocab_size)


def test_a_reference_that_does_not_fit_host_ram_is_refused_with_the_arithmetic(tmp_path):
    with engine_loads() as loads:
        out, df = job(tmp_path, "model=mixtral-8x7b", "placement=fetch", "cache.capacity=2", *SMALL)
    assert out.error and "numerical reference" in out.error and "run.check_reference=false" in out.error
    assert "of host RAM" in out.error and "available" in out.error          # the arithmetic, from the engine
    assert loads == []


@pytest.mark.parametrize("model", ["tiny-gpt-oss", "tiny-qwen3-next", "tiny-gemma4"])
def test_transformers_runs_the_second_wave_presets(tmp_path, model):
    """engine=hf on the exported preset (GPT-OSS's MXFP4 experts dequantised by transformers,
    Qwen3-Next's recurrent cache displaced and restored, windows shorter than the context): every
    phase agrees with our reference."""
    out, df = job(tmp_path, "engine=hf", f"model={model}", "placement=resident", "run.repeats=1",
                  "run.ablation=false", *SMALL)
    assert not out.error, out.error
    ok = df[(df.status == "ok") & (df.profiler == "none")]      # the per-phase checks (not the quality pass)
    agree = ok[ok.metric == "token_agreement"]
    assert set(agree.phase) == {"prefill_fresh", "decode", "prefill_continuation", "prefill_restored"}
    assert (agree["value"] == 1.0).all() and (ok[ok.metric == "max_abs_logit_diff"]["value"] <= 1e-4).all()


def test_load_rows_carry_the_settings_columns_every_other_row_has(tmp_path):
    """Tables and comparisons tell configs apart by these columns: a load row without them would
    pool `placement.n_cpu_layers=0` with `=2` (its placement_options null on both)."""
    out, df = job(tmp_path, "placement=hybrid", "placement.n_cpu_layers=1", "placement.cpu_layers=last_n",
                  "run.repeats=1", "run.ablation=false", *SMALL)
    assert out.error is None, out.error
    assert set(df.placement_map) == {"GGGC"}           # the last layer's experts on the CPU
    cols = ["placement_options", "placement_map", "ubatch", "token_source", "resolved_capacity", "expert_cache_mode", "threads"]
    load, decode = df[df.phase == "load"], df[(df.phase == "decode") & (df.profiler == "none")]
    assert len(load) and load[[c for c in cols if c != "resolved_capacity"]].notna().all().all()   # no cache: null
    assert load[cols].drop_duplicates().values.tolist() == decode[cols].drop_duplicates().values.tolist()


def test_transformers_prefills_in_micro_batches_of_ubatch_tokens(tmp_path):
    """The same work as ours and llama.cpp's -ub: a 100-token prefill at ubatch 32 is 4 forward
    passes, and its logits match one pass over the whole prompt."""
    spec = validate(cfg_with("engine=hf", "placement=resident", "workload.ubatch=32", f"run.out={tmp_path}", *SMALL))
    from harness.engines.hf import HFAdapter
    hf = HFAdapter(spec)
    passes = []
    hook = hf.model.lm_head.register_forward_hook(lambda m, i, o: passes.append(1))
    chunked = hf.prefill(hf.new_session(1), [list(range(10, 110))]).logits
    hook.remove()
    hf.ubatch = 512
    whole = hf.prefill(hf.new_session(1), [list(range(10, 110))]).logits
    assert len(passes) == 4 and torch.allclose(chunked, whole, atol=1e-4)


@pytest.mark.parametrize("engine", engine_params("hf", "llamacpp"))
def test_engines_that_run_a_checkpoint_as_saved_refuse_a_layer_count(tmp_path, engine):
    """model.num_layers with model.path would measure the whole checkpoint against our truncated one."""
    ckpt = export_preset("tiny-mixtral", 0, preset("tiny-mixtral"), tmp_path / "ckpt")
    out, df = job(tmp_path, f"engine={engine}", f"model.path={ckpt}", "model.num_layers=2", "run.repeats=1",
                  "run.ablation=false", *SMALL)
    assert out.error and "runs the checkpoint as saved: model.num_layers=2" in out.error


def test_an_engine_that_does_not_hold_the_budget_says_so(tmp_path, capsys):
    reporter = Reporter(quiet=False)
    run_job(cfg_with("engine=hf", "placement=resident", "hardware.device_memory=64KiB", "run.repeats=1",
                     "run.ablation=false", f"run.out={tmp_path}", *SMALL), JobContext(tmp_path / "job", "s", "j"), reporter)
    assert "hardware.device_memory=64KiB is not held by engine=hf: transformers runs on the CPU here" in \
        capsys.readouterr().err


def test_the_load_row_has_the_engine_s_own_load_beside_the_client_s(tmp_path):
    """The client's time_s holds one-time setup too (imports, a GGUF conversion); source=engine is
    the model load alone, never longer."""
    out, df = job(tmp_path, "engine=hf", "placement=resident", "run.repeats=1", "run.ablation=false", *SMALL)
    assert out.error is None, out.error
    load = df[(df.phase == "load") & (df.metric == "time_s")].set_index("source")["value"]
    assert 0 < load["engine"] <= load["client"]


def test_the_timeline_pass_starts_from_the_measured_repeats_expert_cache_state(tmp_path):
    """run.expert_cache=warm: the instrumented repeat is warm too, moving the bytes the speed rows moved."""
    out, df = job(tmp_path, "placement=fetch", "cache.capacity=2", "run.repeats=1", "run.ablation=false",
                  "run.expert_cache=warm", "run.timeline=true", *[a for a in SMALL if a != "run.timeline=false"])
    assert out.error is None, out.error
    h2d = df[(df.metric == "h2d_bytes") & (df.phase == "prefill_fresh")].set_index("profiler")["value"]
    assert h2d["timeline"] == h2d["none"]
    state = df[(df.phase == "prefill_fresh") & (df.metric == "h2d_bytes")].set_index("profiler")["expert_cache"]
    assert state["timeline"] == state["none"] == "warm"


def test_a_failing_close_after_a_failure_does_not_mask_the_failure(caplog):
    """A repeat that fails closes its session on the way out; when that close fails too (a dead
    llama.cpp server's slot erase), the repeat's own error is raised and the close's is logged.
    Without a failure in the block, the close's error is the one raised."""
    from harness.scenario import closing_session

    class DeadServer:                  # a close failing as a dead server's does (one not yet known dead)
        def alive(self):
            return True

        def close_session(self, sess):
            raise ConnectionError("POST /slots/0?action=erase: connection refused")

    with pytest.raises(RuntimeError, match="the stream broke"):
        with closing_session(DeadServer(), object()):
            raise RuntimeError("the stream broke")
    assert "closing the session after a failure failed too: ConnectionError" in caplog.text
    with pytest.raises(ConnectionError, match="connection refused"):
        with closing_session(DeadServer(), object()):
            pass
