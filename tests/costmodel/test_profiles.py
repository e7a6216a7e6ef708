"""Hardware profiles: every conf/hardware yaml loads, composes as a Hydra option and validates;
datasheet profiles say so and say which dtype each rate is for; `moebench calibrate --quick`
writes a loadable measured profile with rates per dtype."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir

import harness.cli  # noqa: F401 -- registers the ConfigStore schemas
from harness.cli import CONF_DIR
from harness.config import HardwareConf, validate
from harness.costmodel import ProfileError, list_profiles, load_profile
from harness.costmodel.calibrate import main as calibrate_main
from engine.dtypes import DTYPE_NAMES
from harness.costmodel.profiles import CONF_FIELDS, NUMERIC_FIELDS, PROFILE_DIR, RATE_FIGURES, profile_from_dict

PROFILES = list_profiles()
# the coverage the cost model's what-ifs rely on
REQUIRED = ("pcie3-x8", "pcie3-x16", "pcie4-x16", "pcie4-x8", "pcie5-x16", "a100", "h100", "h200")


def test_profile_dir_is_the_hydra_group():
    assert PROFILE_DIR == Path(CONF_DIR) / "hardware"
    assert PROFILES
    for token in REQUIRED:
        assert any(token in name for name in PROFILES), f"no profile covers {token!r}: {PROFILES}"


@pytest.mark.parametrize("name", PROFILES)
@pytest.mark.slow
def test_profile_loads_and_composes(name):
    hw = load_profile(name)
    assert hw.name == name
    raw = yaml.safe_load((PROFILE_DIR / f"{name}.yaml").read_text())
    assert set(raw) <= set(CONF_FIELDS)
    assert raw["device"] == "auto" and raw["device_memory"] is None   # describes hardware, does not move a run
    for key in NUMERIC_FIELDS:
        assert getattr(hw, key) is None or getattr(hw, key) > 0
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=[f"hardware={name}"])
    spec = validate(cfg)
    assert spec.hardware.name == name and spec.hardware.h2d_gbps == hw.h2d_gbps
    assert isinstance(spec.hardware, HardwareConf)


@pytest.mark.parametrize("name", PROFILES)
def test_shipped_profiles_are_datasheet_figures_with_sources(name):
    hw = load_profile(name)
    if hw.source == "measured":          # a user's `moebench calibrate` output
        pytest.skip("measured profile")
    assert hw.source == "datasheet"
    assert "datasheet" in hw.notes and "GB/s" in hw.notes and "achievable" in hw.notes
    assert not any(hw.overheads.as_dict().values())   # no software overheads for a datasheet figure
    if hw.emulated:                                   # CPU only: the "device" is the CPU and its RAM
        assert "CPU only" in hw.link and "CPU-only run" in hw.notes
        assert hw.device_mem_gbps == hw.cpu_mem_gbps == hw.h2d_gbps and hw.device_tflops * 1e3 == hw.cpu_gflops
        return
    assert hw.link and hw.link.startswith("PCIe")
    assert hw.h2d_gbps < {"3.0": 15.76, "4.0": 31.51, "5.0": 63.01}[hw.link.split()[1]] * int(hw.link.split("x")[-1]) / 16


@pytest.mark.parametrize("name", PROFILES)
def test_shipped_profiles_say_which_dtype_each_rate_is_for(name):
    hw = load_profile(name)
    if hw.source == "measured":
        pytest.skip("measured profile")
    assert hw.dtype in DTYPE_NAMES and "Dtypes:" in hw.notes
    assert hw.rate("device_tflops", hw.dtype) == hw.device_tflops
    fp32 = hw.rate("device_tflops", "float32")
    assert hw.rate("cpu_gflops", "float32") is not None            # the CPU estimates are FP32 ones
    if hw.emulated:                                               # CPU only: every dtype at the FP32 rate, said so
        assert fp32 == hw.device_tflops and "at the FP32 rate" in hw.notes
        return
    assert fp32 is not None and fp32 < hw.device_tflops           # FP32 without tensor cores: below the tensor peak
    for dt in DTYPE_NAMES:                                        # a CPU figure for a 16-bit dtype only where stated
        if dt != "float32" and hw.rate("cpu_gflops", dt) is not None:
            assert ("native bf16 matmul" in hw.notes and dt == "bfloat16") or "at the FP32 rate" in hw.notes


def test_unknown_profile_lists_the_available_ones():
    with pytest.raises(ProfileError, match="available profiles.*rtx4090-pcie4-x16"):
        load_profile("no-such-gpu")
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile("/nonexistent/dir/x.yaml")


@pytest.mark.parametrize("raw, match", [
    ({"name": "x", "source": "datasheet", "pcie_lanes": 16}, "unknown key.*pcie_lanes"),
    ({"source": "datasheet"}, "'name' is missing"),
    ({"name": "x", "source": "guess"}, "'source' must be one of"),
    ({"name": "x", "source": "datasheet", "h2d_gbps": -3}, "'h2d_gbps' must be a positive number"),
    ({"name": "x", "source": "datasheet", "h2d_gbps": "fast"}, "'h2d_gbps' must be a positive number"),
    ({"name": "x", "source": "datasheet", "dtype": "fp8"}, "'dtype' must be one of"),
    ({"name": "x", "source": "datasheet", "dtype_rates": {"int3": {"device_tflops": 1.0}}},
     "key 'int3' is neither a dtype nor a quantised weight type"),
    ({"name": "x", "source": "datasheet", "dtype_rates": {"float32": {"tflops": 1.0}}}, r"unknown figure\(s\) \['tflops'\]"),
    ({"name": "x", "source": "datasheet", "dtype_rates": {"float32": {"cpu_gflops": 0}}}, "must be a positive number"),
    ({"name": "x", "source": "datasheet", "dtype_rates": [1.0]}, "'dtype_rates' must be a mapping"),
    ({"name": "x", "source": "datasheet", "dtype": "bfloat16", "device_tflops": 2.0,
      "dtype_rates": {"bfloat16": {"device_tflops": 3.0}}}, "contradicts device_tflops = 2.0"),
])
def test_bad_profile_fields_are_named(raw, match):
    with pytest.raises(ProfileError, match=match):
        profile_from_dict(raw, source="bad.yaml")


def test_missing_figure_is_named_when_needed():
    hw = profile_from_dict({"name": "x", "source": "datasheet", "device_tflops": 1.0, "device_mem_gbps": 1.0})
    with pytest.raises(ProfileError, match="has no h2d_gbps"):
        hw.require("h2d_gbps", why="placement=fetch")


@pytest.mark.slow
def test_calibrate_quick_writes_a_loadable_measured_profile(tmp_path):
    out = tmp_path / "here.yaml"
    before = torch.get_num_threads()
    try:   # one thread: two stall for seconds on a busy 2-core box, and the test only checks the file
        assert calibrate_main(["--quick", "--threads", "1", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(before)
    hw = load_profile(out)
    assert hw.name == "here" and hw.source == "measured"
    raw = yaml.safe_load(out.read_text())
    assert set(raw) <= set(CONF_FIELDS)
    for key in ("h2d_gbps", "d2h_gbps", "device_tflops", "device_mem_gbps", "cpu_gflops", "cpu_mem_gbps"):
        assert getattr(hw, key) > 0, key
    assert hw.emulated and hw.device_memory_gib is None and "EMULATED" in hw.notes
    o = hw.overheads
    assert (out.parent / "here.overheads.json").is_file()
    assert all(v >= 0 for v in o.as_dict().values())
    assert o.layer_s > 0 and o.expert_s > 0               # a Python engine always pays these
    assert o.info["probes"] > 10 and o.info["torch_threads"] == 1 and o.info["dtype"] == "float32"
    # rates per dtype: the profile's own GEMM in the plain fields, bf16's in dtype_rates, GEMV for both
    assert hw.dtype == "float32" and set(raw["dtype_rates"]) == {"float32", "bfloat16"}
    assert set(raw["dtype_rates"]["bfloat16"]) == set(RATE_FIGURES)
    assert set(raw["dtype_rates"]["float32"]) == {"device_gemv_gbps", "cpu_gemv_gbps"}
    assert hw.rate("device_tflops", "bfloat16") > 0 and hw.rate("cpu_gemv_gbps", "float32") > 0
    assert hw.rate("cpu_gflops", "float16") is None       # not measured: predictions in float16 are refused


def test_a_dtype_too_slow_at_one_size_is_not_timed_at_larger_ones(monkeypatch):
    """Sizes run ascending; past a call of GEMM_MAX_CALL_S the dtype's larger sizes are skipped
    (8x the work each), its rate the sizes measured."""
    from harness.costmodel import calibrate
    times = iter([0.01, 2 * calibrate.GEMM_MAX_CALL_S])
    monkeypatch.setattr(calibrate, "best_time", lambda fn, repeats, kind="cpu": next(times))
    rates = calibrate.gemm_rates("cpu", ["float32"], (1024, 256, 512), repeats=1)
    assert list(rates) == ["float32@256", "float32@512"]
    assert rates["float32@512"] == pytest.approx(2 * 512 ** 3 / (2 * calibrate.GEMM_MAX_CALL_S) / 1e9)
