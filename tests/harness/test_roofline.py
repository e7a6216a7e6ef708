"""A roofline beside every speed: the bound from bytes and FLOPs at measured rates (source=model),
and the measurement's fraction of it; null with the reason when the machine has no measured rates."""
from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir

import harness.cli  # noqa: F401 -- registers the ConfigStore
from harness import results
from harness.cli import CONF_DIR
from harness.config import validate
from harness.costmodel.profiles import PROFILE_DIR
from harness.report import Reporter
from harness.roofline import roofline
from harness.runner import JobContext, run_job

RATES = ["hardware.source=measured", "hardware.link=emulated", "hardware.h2d_gbps=5", "hardware.d2h_gbps=5",
         "hardware.device_tflops=0.1", "hardware.cpu_gflops=100", "hardware.dtype=float32"]
SMALL = ["placement=resident", "workload=chat", "workload.context_tokens=256", "workload.gen_tokens=8",
         "run.repeats=2", "run.timeline=false", "run.ablation=false"]


def cfg_with(*overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def rows(tmp_path, *overrides):
    out = run_job(cfg_with(*overrides, f"run.out={tmp_path}"), JobContext(tmp_path / "j", "s", "j"), Reporter(quiet=True))
    assert out.error is None, out.error
    return results.rows_to_table(out.rows).to_pandas()


@pytest.mark.slow
def test_roofline_rows_bound_the_measurement_and_scale_with_the_rates(tmp_path):
    df = rows(tmp_path, *SMALL, *RATES, "hardware.device_mem_gbps=10", "hardware.cpu_mem_gbps=10")
    bounds = df[(df.source == "model") & (df.profiler == "none")]      # the roofline's (the prediction pass's are its own)
    model = bounds.pivot_table(index="phase", columns="metric", values="value")
    measured = df[(df.source == "client") & (df.metric == "tok_per_s") & df.repeat.notna()].groupby("phase").value.median()
    for phase in ("prefill_fresh", "decode", "prefill_continuation", "prefill_restored"):
        bound = model.loc[phase, "roofline_tok_per_s"]
        assert bound > 0 and model.loc[phase, "frac_of_roofline"] == pytest.approx(measured[phase] / bound)
        assert measured[phase] <= bound          # nothing runs faster than its bytes and FLOPs allow
    assert set(bounds.roofline_profile) == {"local"}
    spec = validate(cfg_with(*SMALL, *RATES, "hardware.device_mem_gbps=20", "hardware.cpu_mem_gbps=20"))
    faster = roofline(spec, {}, None).phases["decode"]
    assert faster > 1.5 * model.loc["decode", "roofline_tok_per_s"]  # decode is bound by the bytes it reads


def test_without_measured_rates_the_rows_say_why():
    spec = validate(cfg_with(*SMALL))
    bound = roofline(spec, {}, None)
    if (PROFILE_DIR / "measured.yaml").is_file():        # this machine was calibrated: its figures are used
        assert bound.profile == "measured" and bound.phases["decode"] > 0
    else:
        assert bound.profile is None and not bound.phases and "moebench calibrate" in bound.reason


def test_the_basis_says_what_the_bound_takes_from_a_model_rather_than_the_run(tmp_path):
    """A batched decode where no lookups are counted (resident) takes its distinct experts from
    simulated routing; mixed expert formats are at their mean bytes; a counted fetch run at batch
    1 with exact experts assumes neither."""
    plain = roofline(validate(cfg_with(*SMALL, *RATES, "hardware.device_mem_gbps=10")), {}, None)
    assert plain.basis.startswith("bytes and FLOPs") and "simulated" not in plain.basis and "mean" not in plain.basis
    batched = roofline(validate(cfg_with(*SMALL, *RATES, "hardware.device_mem_gbps=10", "workload.batch=2")), {}, None)
    assert "distinct experts per batched step from simulated uniform routing" in batched.basis
    counted = roofline(validate(cfg_with(*SMALL, *RATES, "hardware.device_mem_gbps=10", "workload.batch=2",
                                         "placement=fetch", "cache.capacity=4")),
                       {"decode": {"expert_hits": 10, "expert_misses": 2}}, 4)
    assert "simulated" not in counted.basis
    table = tmp_path / "pop.json"                                     # tiny-mixtral: 4 MoE layers of 8 experts
    table.write_text(json.dumps([[float(e) for e in range(8)]] * 4))
    mixed = roofline(validate(cfg_with(*SMALL, *RATES, "hardware.device_mem_gbps=10", "experts.quant=mixed",
                                       f"experts.popularity={table}", "experts.mixed_count=2")), {}, None)
    assert "mixed expert formats at their mean bytes" in mixed.basis


# --- the machine's read bandwidth behind the bound ----------------------------------------------
MACHINE = dict(name="here", source="measured", link="emulated (memcpy)", h2d_gbps=5.0, d2h_gbps=5.0,
               device_tflops=0.1, device_mem_gbps=1.0, cpu_gflops=100.0, cpu_mem_gbps=1.0, dtype="float32",
               dtype_rates={"float32": {"cpu_gemv_gbps": 1.0, "device_gemv_gbps": 1.0}})


@pytest.fixture
def calibrated(tmp_path, monkeypatch):
    """This machine "calibrated" (a profile file where `moebench calibrate` writes one), with read
    figures far below any real machine's, so only a read measured now can lift the bound."""
    from harness import roofline as rl
    from harness.costmodel.profiles import HardwareProfile, save_profile

    path = save_profile(HardwareProfile(**MACHINE), tmp_path / "here.yaml")
    monkeypatch.setattr(rl, "MEASURED_PROFILE", str(path))
    return path


def test_the_read_bandwidth_is_a_stream_read_at_the_threads_and_at_all_cores():
    """Independent of any engine's kernel: the best of torch.sum and the BLAS GEMV over a buffer of
    at least 4x the last-level cache, at the asked threads and at every core, with the method and
    each reader's figure written out."""
    from harness.costmodel.calibrate import last_level_cache_bytes
    from harness.machine import available_cores
    from harness.read_bandwidth import read_bandwidth

    rb = read_bandwidth(threads=1, passes=2)
    assert rb.threads == 1 and rb.all_cores == available_cores()
    assert rb.gbps > 0 and rb.all_cores_gbps > 0
    assert rb.buffer_mib << 20 >= 4 * (last_level_cache_bytes() or 0) and rb.buffer_mib >= 256
    assert "torch.sum" in rb.method and f"{rb.buffer_mib} MiB" in rb.method and "1 thread(s)" in rb.method
    assert f"all {rb.all_cores} cores" in rb.method
    assert [name for name, _ in rb.readers] == ["torch.sum", "torch.mv"] and rb.gbps == max(v for _, v in rb.readers)
    assert rb.all_cores_gbps == max(v for _, v in rb.all_cores_readers)


def test_the_bound_reads_at_the_machines_read_bandwidth(calibrated, monkeypatch):
    """On this machine's calibration the bound's read figures are the read measured at the job's
    threads, not the profile's (a kernel's GEMV rate); recorded with its method."""
    from harness import roofline as rl
    from harness.read_bandwidth import ReadBandwidth

    spec = validate(cfg_with(*SMALL))
    profile_only = roofline(spec, {}, None)
    assert profile_only.read is None and profile_only.read_method == "profile 'here''s figures"

    def read_at(gbps):
        monkeypatch.setattr(rl, "machine_read", lambda threads: ReadBandwidth(gbps, threads, 2 * gbps, 2, 256))
        return roofline(spec, {}, None, threads=1)
    slow, fast = read_at(10.0), read_at(20.0)
    assert fast.phases["decode"] > 1.5 * slow.phases["decode"] > 1.5 * profile_only.phases["decode"]
    cols = fast.columns()
    assert cols["roofline_read_gbps"] == 20.0 and cols["roofline_read_gbps_all_cores"] == 40.0
    assert cols["roofline_read_method"].startswith("STREAM-class read: the best of torch.sum, torch.mv over 256 MiB")


def test_given_hardware_figures_are_the_bounds_as_given(monkeypatch):
    from harness import roofline as rl

    monkeypatch.setattr(rl, "machine_read", lambda threads: pytest.fail("measured a read for given figures"))
    bound = roofline(validate(cfg_with(*SMALL, *RATES, "hardware.device_mem_gbps=10")), {}, None, threads=1)
    assert bound.read is None and bound.read_method == rl.GIVEN and bound.phases["decode"] > 0


def test_a_rate_above_the_bound_says_the_roofline_is_wrong():
    from harness.roofline import ROOFLINE_SLACK, wrong

    assert wrong(100.0, 100.0) is None and wrong(100.0 * ROOFLINE_SLACK, 100.0) is None
    assert wrong(None, 100.0) is None and wrong(100.0, None) is None
    why = wrong(127.0, 100.0)
    assert why.startswith("roofline wrong: measured 127 tok/s is 1.27x the bound 100 tok/s")


@pytest.mark.slow
def test_rows_flag_a_wrong_roofline_and_record_the_machine_read(tmp_path, calibrated):
    """A real run on a "calibrated" machine: its rows carry the read measured now at the job's
    threads and its method; a bound the run beats by more than the slack (here: the device's GEMM
    rate set absurdly low, so the prefill bound is) is flagged, its fraction null, never a number."""
    from harness.costmodel.profiles import HardwareProfile, save_profile

    save_profile(HardwareProfile(**{**MACHINE, "device_tflops": 1e-9, "cpu_gflops": 1e-6}), calibrated)
    df = rows(tmp_path, *SMALL, "run.threads=1")
    model = df[(df.source == "model") & (df.profiler == "none")]
    assert len(model) and (model.roofline_read_gbps > 0).all() and (model.roofline_read_gbps_all_cores > 0).all()
    assert model.roofline_read_method.str.contains("torch.sum").all()
    assert model.roofline_read_method.str.contains("at 1 thread").all()
    frac_rows = model[model.metric == "frac_of_roofline"]
    flagged = frac_rows[frac_rows.roofline_wrong.astype(bool)]
    assert len(flagged) and flagged.value.isna().all()
    assert flagged.roofline_reason.str.startswith("roofline wrong: measured").all()
