"""A run's routing statistics through the CLI: with run.record_trace the trace pass writes, per MoE
layer and over all, the entropy, adjacent-token overlap and distinct experts per step, each row
carrying the route digest -- equal for the same routing under another placement (the invariant:
placement never changes which experts a token routes to), different for another prompt."""
from __future__ import annotations

import pytest

from engine.config import preset
from harness import results
from harness.passes.trace import ROUTING_METRICS
from tests.harness.test_trust import SMALL, cli

pytestmark = pytest.mark.slow


def test_routing_rows_per_layer_and_a_digest_that_is_the_routing(tmp_path):
    proc = cli(["-m", "placement=resident,fetch", "cache.capacity=2", "workload.seed=0,1", "run.record_trace=true",
                "run.passes=[speed,trace]", "run.sweep_id=r", *SMALL], tmp_path)
    assert proc.returncode == 0, proc.stderr
    df = results.load(tmp_path / "results" / "sweeps" / "r")
    rows = df[df.phase == "routing"]
    cfg = preset("tiny-mixtral")                                          # the default model
    layers = [str(layer) for layer in cfg.moe_layers] + ["all"]
    for _, job in rows.groupby("job_id"):
        assert sorted(job["layer"].unique()) == sorted(layers)
        assert set(job["metric"]) == set(ROUTING_METRICS) and (job["profiler"] == "trace").all()
        got = job.set_index(["layer", "metric"])["value"]
        for layer in layers:
            assert got[layer, "distinct_decode"] == pytest.approx(cfg.top_k)      # batch 1: one token's k experts
            assert cfg.top_k < got[layer, "distinct_prefill"] <= cfg.n_experts
            assert 0 < got[layer, "entropy_ratio"] <= 1 and 0 <= got[layer, "jaccard"] <= 1
        assert job["route_digest"].nunique() == 1
    by_job = rows.groupby("job_id").agg(placement=("placement", "first"), digest=("route_digest", "first"))
    assert len(by_job) == 4 and by_job["digest"].nunique() == 2, by_job         # two prompts
    for _, same in by_job.groupby("digest"):                                   # each routed alike by both placements
        assert sorted(same["placement"]) == ["fetch", "resident"], by_job
