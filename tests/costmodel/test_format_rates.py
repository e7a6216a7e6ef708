"""Rates per weight format: a profile may give the routed experts' GEMV and FLOP rates for a
quantised weight type (a CPU unpacking 4-bit blocks reads fewer bytes per second than it reads
8-bit ones), the time model uses them for experts held in that type and the run's dtype's figure
otherwise, and a prediction lists the figure it used."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from engine.config import PRESETS
from engine.formats import WeightFormat, weight_bytes
from harness.costmodel import WorkloadShape, predict
from harness.costmodel.profiles import ProfileError, load_profile, profile_from_dict
from tests.plugins import needs_engine
from tests.cli_runner import run_cli

REPO = Path(__file__).resolve().parents[2]
SHAPE = WorkloadShape(context_tokens=512, gen_tokens=64)


def held(fmt: str, preset: str = "qwen3-30b-a3b"):
    cfg = PRESETS[preset]
    return cfg.replace(weight_bytes=weight_bytes(cfg, WeightFormat(fmt)))


def profile(**format_rates):
    hw = load_profile("rtx2080-i9-10900x")
    return hw.replace(dtype_rates={**hw.dtype_rates, **format_rates})


def decode(cfg, hw, placement="cpu"):
    return predict(cfg, placement, SHAPE, hw, dtype="float16").phases["decode"]


def test_the_experts_weight_type_is_the_one_most_of_their_parameters_are_in():
    assert held("q4_k_m").weight_bytes.expert_type == "q4_k"       # q6_k down projections in some layers
    assert held("q8_0").weight_bytes.expert_type == "q8_0"
    cfg = PRESETS["gpt-oss-120b"]
    assert weight_bytes(cfg, WeightFormat("bf16", "mxfp4")).expert_type == "mxfp4"


def test_a_format_rate_slows_only_the_experts_held_in_that_type():
    q4, q8 = held("q4_k"), held("q8_0")
    plain, slow = profile(), profile(q4_k={"cpu_gemv_gbps": 25.5})          # a quarter of the 102 GB/s read
    base, slowed = decode(q4, plain), decode(q4, slow)
    assert slowed.bound == base.bound == "host RAM bandwidth"
    cpu_base, cpu_slow = base.spent_s["host RAM bandwidth"], slowed.spent_s["host RAM bandwidth"]
    assert cpu_slow == pytest.approx(4 * cpu_base, rel=1e-6)               # the experts' reads, at the type's rate
    assert decode(q8, slow).time_s == pytest.approx(decode(q8, plain).time_s)   # q8_0 experts: the dtype's figure
    resident = held("q4_k", "tiny-mixtral")
    assert decode(resident, slow, "resident").time_s == pytest.approx(decode(resident, plain, "resident").time_s)


def test_a_format_flop_rate_bounds_a_long_prefill_on_the_cpu():
    q4 = held("q4_k")
    fast = predict(q4, "cpu", SHAPE, profile(), dtype="float16").phases["prefill_fresh"]
    slow = predict(q4, "cpu", SHAPE, profile(q4_k={"cpu_gflops": 130.2}), dtype="float16").phases["prefill_fresh"]
    assert fast.bound == slow.bound == "CPU compute"
    assert slow.spent_s["CPU compute"] == pytest.approx(10 * fast.spent_s["CPU compute"], rel=1e-6)


def test_the_profile_takes_weight_types_and_refuses_other_keys():
    raw = {"name": "x", "source": "datasheet", "dtype": "float32", "cpu_gflops": 100.0,
           "dtype_rates": {"q4_k": {"cpu_gemv_gbps": 20.0}, "mxfp4": {"device_gemv_gbps": 900.0}}}
    hw = profile_from_dict(raw)
    assert hw.expert_rate("cpu_gemv_gbps", "q4_k", "float32") == 20.0
    assert hw.expert_rate("cpu_gflops", "q4_k", "float32") == 100.0        # not given for q4_k: the dtype's
    assert hw.expert_rate("cpu_gemv_gbps", None, "float32") is None
    with pytest.raises(ProfileError, match=r"'q4_k_m' is neither a dtype nor a quantised weight type; allowed: "):
        profile_from_dict({**raw, "dtype_rates": {"q4_k_m": {"cpu_gemv_gbps": 20.0}}})


@needs_engine("llamacpp")                  # the engine that holds q4_k_m experts
def test_predict_lists_the_format_figure_it_used(tmp_path):
    proc = run_cli(["predict", "model=qwen3-30b-a3b", "model.dtype=float16", "model.weight_format=q4_k_m",
                    "engine=llamacpp", "hardware=rtx2080-i9-10900x", "placement=hybrid", "placement.n_cpu_layers=36",
                    "+hardware.dtype_rates.q4_k={cpu_gemv_gbps: 40}", "--format", "json"], tmp_path,
                   {**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(proc.stdout)
    assert row["inputs"]["hardware.cpu_gemv_gbps[q4_k]"] == {
        "value": 40.0, "unit": "GB/s", "source": "overridden",
        "note": "the routed experts' (q4_k) rate, in place of the float16 one"}
