"""Host RAM is a budget too: `moebench plan` lists what stays on the host against
hardware.host_memory_gib, and `moebench predict` bounds decode by hardware.disk_read_gbps when the
host cannot hold it (the experts RAM cannot hold page in from disk as they are touched)."""
from __future__ import annotations

import pytest

from engine.config import preset
from harness.plan import host_plan, spec_of
from tests.harness.test_predict import rows_of
from tests.harness.test_trust import cli

QWEN_CPU = ["model=qwen3-30b-a3b", "model.dtype=bfloat16", "hardware=rtx4090-pcie4-x16", "placement=cpu",
            "workload.context_tokens=4096", "run.check_reference=false"]


def test_the_host_plan_counts_what_each_placement_leaves_on_the_host():
    cfg = preset("qwen3-30b-a3b")
    layer = cfg.n_experts * cfg.expert_bytes(2)
    for placement, options, layers in (("cpu", [], 48), ("fetch", ["cache.capacity=16"], 48),
                                       ("hybrid", ["placement.n_cpu_layers=10"], 10), ("resident", [], 0)):
        spec = spec_of(["model=qwen3-30b-a3b", "model.dtype=bfloat16", f"placement={placement}", *options,
                        "run.check_reference=false", "hardware.host_memory_gib=64"])
        hp = host_plan(spec)
        assert hp.terms[0][1] == hp.expert_bytes == layers * layer, placement
        assert hp.budget == 64 << 30
    with_ref = host_plan(spec_of(["model=qwen3-30b-a3b", "model.dtype=bfloat16", "placement=resident"]))
    assert with_ref.terms[-1][0] == "reference model (run.check_reference)" and with_ref.fits is None


def test_plan_prints_the_host_verdict(tmp_path):
    small = cli(["plan", *QWEN_CPU, "hardware.host_memory_gib=32"], tmp_path)
    assert small.returncode == 0, small.stderr
    assert "host memory plan:" in small.stdout and "does not fit the host RAM: 22.39 GiB over" in small.stdout
    unknown = cli(["plan", *QWEN_CPU], tmp_path)
    assert "(hardware.host_memory_gib: no host verdict)" in unknown.stdout


def test_predict_bounds_decode_by_the_disk_when_the_host_cannot_hold_the_experts():
    fits, = rows_of([*QWEN_CPU, "hardware.host_memory_gib=128", "hardware.disk_read_gbps=7"])
    assert fits["host_fits"] is True and fits["bound"]["decode"] == "host RAM bandwidth"
    paged, = rows_of([*QWEN_CPU, "hardware.host_memory_gib=32", "hardware.disk_read_gbps=7"])
    assert paged["host_fits"] is False and paged["bound"]["decode"] == "disk"
    cfg = preset("qwen3-30b-a3b")
    experts = 48 * cfg.n_experts * cfg.expert_bytes(2)
    fraction = (paged["host_bytes"] - (32 << 30)) / experts
    per_token = fraction * cfg.top_k * 48 * cfg.expert_bytes(2)           # every layer's top-k on the CPU
    assert paged["decode_tok_s"] == pytest.approx(7e9 / per_token, rel=1e-3)     # + a token's activations' copies
    assert paged["decode_tok_s"] < fits["decode_tok_s"]
    assert paged["inputs"]["hardware.disk_read_gbps"] == {"value": 7.0, "unit": "GB/s", "source": "overridden"}
    unknown, = rows_of([*QWEN_CPU, "hardware.host_memory_gib=32"], code=1)      # no placement predicted
    assert unknown["decode_tok_s"] is None and "set hardware.disk_read_gbps" in unknown["reason"]
    assert unknown["prefill_tok_s"] == paged["prefill_tok_s"]

