"""The kv_vs_residency figure: speed vs quality per treatment, and its frontier; drawn only where
a lossy run exists."""
from __future__ import annotations

import pandas as pd
import pytest
from matplotlib.colors import to_hex

from harness import plots, plotstyle
from harness import results as R
from harness.plots import pareto_front


def test_the_frontier_keeps_only_treatments_nothing_beats_on_both_axes():
    pts = pd.DataFrame({"kl": [0.0, 0.01, 0.02, 0.5, 0.03], "tok_s": [10.0, 15.0, 12.0, 30.0, 20.0]},
                       index=list("abcde"))
    assert list(pareto_front(pts).index) == ["a", "b", "e", "d"]       # c is slower than b at a larger KL


def _job(job_id: str, kv: str, quant: str, tok_s: float, kl: float, slots: int) -> list[dict]:
    f = {"engine": "moebench", "model": "tiny-mixtral", "placement": "fetch", "cache_capacity": "auto",
         "cache_policy": "lru", "prefetch": "none", "workload": "chat", "context_tokens": 2048, "gen_tokens": 8,
         "batch": 1, "dtype": "float32", "kv_dtype": kv, "expert_quant": quant}
    dev = {"device_kind": "cpu", "device_name": "cpu (emulated device)", "emulated": True}
    extra = {"resolved_capacity": slots}
    rows = []
    for r in range(2):
        rows += R.make_rows(f, dev, "s", job_id, r, "decode", {"tok_per_s": tok_s + r}, "client",
                            extra={**extra, "profiler": "none"})
    rows += R.make_rows(f, dev, "s", job_id, 0, "quality", {"kl_div_mean": kl, "top1_agreement": 1.0 - kl},
                        "engine", extra={**extra, "profiler": "quality"})
    return rows


def test_treatment_frontier_draws_every_treatment(tmp_path):
    for rows in (_job("0", "model", "none", 10.0, 0.0, 4), _job("1", "q8", "none", 12.0, 0.001, 6),
                 _job("2", "q4", "int4", 20.0, 0.05, 8)):
        R.write_job(tmp_path / "s" / rows[0]["job_id"], rows, {"t": 1})
    fig = plots.treatment_frontier(R.load(tmp_path / "s"))
    ax = fig.axes[0]
    labels = {t.get_text() for t in ax.texts}
    assert labels == {"4 slots", "6 slots", "8 slots"}
    assert ax.get_xscale() == "symlog"


def test_treatment_frontier_without_quality_rows_says_what_it_needs(tmp_path):
    rows = [r for r in _job("0", "model", "none", 10.0, 0.0, 4) if r["profiler"] != "quality"]
    R.write_job(tmp_path / "s" / "j", rows, {"t": 1})
    with pytest.raises(plots.MissingData, match="quality rows"):
        plots.treatment_frontier(R.load(tmp_path / "s"))


def test_treatment_frontier_of_exact_runs_only_says_there_is_no_trade(tmp_path):
    """Exact runs report quality too (KL 0): without a lossy one the figure has nothing to weigh."""
    for rows in (_job("0", "model", "none", 10.0, 0.0, 4), _job("1", "model", "none", 12.0, 0.0, 6)):
        R.write_job(tmp_path / "s" / rows[0]["job_id"], rows, {"t": 1})
    with pytest.raises(plots.MissingData, match="no lossy run here .* kv.dtype=q8 or experts.quant=int8"):
        plots.treatment_frontier(R.load(tmp_path / "s"))


def test_treatments_are_told_apart_by_marker_in_their_placements_colour(tmp_path):
    for rows in (_job("0", "model", "none", 10.0, 0.0, 4), _job("1", "q8", "none", 12.0, 0.001, 6),
                 _job("2", "q4", "int4", 20.0, 0.05, 8)):
        R.write_job(tmp_path / "s" / rows[0]["job_id"], rows, {"t": 1})
    ax = plots.treatment_frontier(R.load(tmp_path / "s")).axes[0]
    points = [c.lines[0] for c in ax.containers]
    assert len(points) == 3 and len({p.get_marker() for p in points}) == 3
    assert {to_hex(p.get_color()) for p in points} == {plotstyle.style("placement", "fetch").color}
