"""Which dtypes this machine runs fast: a probe of the same work in float32 and the
run's dtype, its speedups on every row, and a warning naming the phase a slow dtype slows."""
from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

import harness.cli  # noqa: F401 -- registers the ConfigStore
import harness.dtype_speed as ds
from harness import results
from harness.cli import CONF_DIR
from harness.runner import JobContext, run_job


def test_float32_is_the_baseline_without_a_probe(monkeypatch):
    monkeypatch.setattr("harness.costmodel.calibrate.gemm_rates", lambda *a, **k: pytest.fail("probed"))
    s = ds.dtype_speed.__wrapped__("float32", "cpu")
    assert (s.gemm_speedup, s.gemv_speedup, s.warning()) == (1.0, 1.0, None)


def test_the_probe_measures_both_shapes_and_is_cached():
    s = ds.dtype_speed("bfloat16", "cpu")
    assert s.gemm_speedup > 0 and s.gemv_speedup > 0 and not s.unsupported
    assert ds.dtype_speed("bfloat16", "cpu") is s
    assert set(s.cpu_flags) <= set(ds.FLAGS)


def test_the_warning_names_the_phases_a_slow_dtype_slows():
    fast = ds.DtypeSpeed("bfloat16", "cpu", 3.0, 1.2, ("avx512_bf16",))
    assert fast.warning() is None and fast.slow() == []
    decode = ds.DtypeSpeed("bfloat16", "cpu", 3.0, 0.5, ("amx_bf16",))
    assert decode.slow() == [("decode", 0.5)]
    assert "decode (matrix-vector work at 0.50x" in decode.warning() and "amx_bf16" in decode.warning()
    emulated = ds.DtypeSpeed("float16", "cpu", 0.1, 0.3, ("avx2",))
    assert [p for p, _ in emulated.slow()] == ["prefill", "decode"] and "emulated" in emulated.warning()


@pytest.mark.slow
def test_a_run_records_the_speedups_and_warns_on_a_slow_dtype(tmp_path, monkeypatch):
    monkeypatch.setattr(ds, "SLOW", 1e9)            # every dtype other than float32 counts as slow
    warnings = []

    class Rep:
        def __getattr__(self, name):
            return getattr(inner, name)

        def warn(self, msg):
            warnings.append(msg)

    from harness.report import Reporter
    inner = Reporter(quiet=True)
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=[
            "placement=resident", "workload=chat", "workload.context_tokens=256", "workload.gen_tokens=2",
            "run.repeats=1", "run.warmup=0", "run.timeline=false", "run.ablation=false", "model.dtype=bfloat16",
            f"run.out={tmp_path}"])
    out = run_job(cfg, JobContext(tmp_path / "j", "s", "j"), Rep())
    assert out.error is None, out.error
    df = results.rows_to_table(out.rows).to_pandas()
    speed = ds.dtype_speed("bfloat16", "cpu")
    assert set(df.dtype_gemm_speedup) == {speed.gemm_speedup} and set(df.dtype_gemv_speedup) == {speed.gemv_speedup}
    assert any("model.dtype=bfloat16 is slower than float32" in w for w in warnings)
