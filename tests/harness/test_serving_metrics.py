"""Serving metrics on hand-built request timelines whose answers are worked out here, by hand: the
per-request formulas, the steady-state window, failures, percentiles, goodput and the SLO verdict,
the token-weighted cached fraction, SLO parsing, validation, and None (never 0) for what was not
measured."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from harness.serving import metrics as M
from harness.serving.metrics import (METRICS, REQUEST_METRICS, SLO_PRESETS, RequestTimeline, measured,
                                     request_rows, slo_of, summarize, summary_rows)

UNITS = {"s", "tok/s", "req/s", "ratio", "count", "tok"}
WINDOW = (100.0, 110.0)          # a 10 s steady state


def req(rid: str, arrival: float, ttft: float | None = None, gaps: tuple[float, ...] = (), *, prompt: int = 10,
        asked: int | None = None, cached: int | None = None, error: str | None = None,
        warmup: bool = False) -> RequestTimeline:
    """A timeline from arrival, time to first token and the gaps after it."""
    times: list[float] = []
    if ttft is not None:
        times = [arrival + ttft]
        for g in gaps:
            times.append(times[-1] + g)
    return RequestTimeline(rid, arrival, tuple(times), prompt, len(times) if asked is None else asked,
                           cached, error, warmup)


# --- one request ---------------------------------------------------------------------------------------

def test_per_request_formulas():
    t = RequestTimeline("a", 10.0, (10.5, 10.75, 11.0, 11.5), prompt_tokens=7, output_tokens_asked=4)
    assert t.ttft_s == 0.5                          # 10.5 - 10.0
    assert t.e2el_s == 1.5                          # 11.5 - 10.0
    assert t.tpot_s == pytest.approx(1.0 / 3)       # (1.5 - 0.5) / (4 - 1)
    assert t.itl_s == (0.25, 0.25, 0.5)             # every gap, raw
    assert t.output_tok_per_s_per_user == 3.0       # (4 - 1) / (1.5 - 0.5)
    assert t.output_tokens == 4 and not t.output_mismatch
    assert RequestTimeline("b", 10.0, (10.5, 11.0), 7, output_tokens_asked=5).output_mismatch   # got 2, asked 5


def test_one_token_has_no_tpot_and_no_token_has_no_ttft():
    one = RequestTimeline("one", 0.0, (0.25,), 3, 1)
    assert one.ttft_s == one.e2el_s == 0.25
    assert one.tpot_s is None and one.itl_s == () and one.output_tok_per_s_per_user is None
    burst = RequestTimeline("burst", 0.0, (0.25, 0.25, 0.25), 3, 3)     # one chunk of three tokens
    assert burst.tpot_s == 0.0 and burst.itl_s == (0.0, 0.0)
    assert burst.output_tok_per_s_per_user is None                       # 2 tokens / 0 s: undefined
    none = RequestTimeline("none", 0.0, (), 3, 4)
    assert none.ttft_s is None and none.e2el_s is None and none.tpot_s is None


# --- the window, failures and percentiles ------------------------------------------------------------------

def test_window_keeps_steady_state_requests_only():
    ts = [req("warm", 101.0, 9.0, warmup=True),     # inside, but warm-up
          req("early", 99.0, 9.0),                  # before the window
          req("start", 100.0, 0.5),                 # at start_s: in
          req("mid", 105.0, 1.5, (0.5,)),           # in
          req("end", 110.0, 9.0)]                   # at end_s: out ([start, end))
    assert [t.request_id for t in measured(ts, WINDOW)] == ["start", "mid"]
    s = summarize(ts, WINDOW)
    assert (s.requests, s.completed, s.failed, s.duration_s) == (2, 2, 0, 10.0)
    assert s.ttft_s.mean == 1.0                     # (0.5 + 1.5) / 2: the 9 s requests left out
    assert s.request_throughput == 0.2              # 2 completed / 10 s
    assert s.output_tokens == 3 and s.output_throughput == 0.3
    assert s.prompt_tokens == 20 and s.total_token_throughput == 2.3     # (20 + 3) / 10


def test_failed_requests_count_as_failures_and_stay_out_of_latencies():
    ts = [req("ok", 101.0, 1.0, (0.5, 0.5)),
          req("broken", 102.0, 0.001, (0.001,), asked=50, error="connection reset")]    # fast, then failed
    s = summarize(ts, WINDOW)
    assert (s.requests, s.completed, s.failed) == (2, 1, 1)
    assert s.ttft_s.p50 == 1.0 and s.ttft_s.mean == 1.0 and s.itl_s.mean == 0.5
    assert s.output_tokens == 3 and s.output_throughput == 0.3    # the failure's two tokens not counted
    assert s.request_throughput == 0.1
    assert s.output_mismatch == 0                   # the failure's 2-of-50 is not a mismatch


def test_percentiles_are_numpy_linear_on_a_known_list():
    ttfts = [0.1 * k for k in range(10, 0, -1)]     # 1.0 .. 0.1, out of order
    s = summarize([req(f"r{k}", 101.0 + k / 2, ttft) for k, ttft in enumerate(ttfts)], WINDOW)
    # linear: rank p/100 * (n - 1) into the sorted list, interpolated between neighbours
    assert s.ttft_s.p50 == pytest.approx(0.55)      # rank 4.5: halfway from 0.5 to 0.6
    assert s.ttft_s.p90 == pytest.approx(0.91)      # rank 8.1: 0.9 + 0.1 * 0.1
    assert s.ttft_s.p99 == pytest.approx(0.991)     # rank 8.91: 0.9 + 0.91 * 0.1
    assert s.ttft_s.mean == pytest.approx(0.55)
    # the same as numpy's default on the list itself (ttft is recovered from absolute times: approx)
    assert [s.ttft_s.p50, s.ttft_s.p90, s.ttft_s.p99] == pytest.approx(np.percentile(ttfts, [50, 90, 99]))


def test_itl_pools_every_gap_and_tpot_is_per_request():
    s = summarize([req("steady", 101.0, 0.5, (0.125, 0.125, 0.125)), req("stall", 102.0, 0.5, (0.5,))], WINDOW)
    assert s.itl_s.mean == pytest.approx(0.21875)   # (3 * 0.125 + 0.5) / 4 gaps
    assert s.tpot_s.mean == pytest.approx(0.3125)   # (0.125 + 0.5) / 2 requests
    assert s.itl_s.p50 == 0.125 and s.tpot_s.p50 == pytest.approx(0.3125)


# --- goodput and the SLO ----------------------------------------------------------------------------------

def test_goodput_and_slo_met_with_violations():
    ts = [req("good", 101.0, 0.5, (0.05, 0.05)),
          req("at_bound", 101.5, 1.0, (0.1,)),       # on both bounds: good (<=)
          req("slow_first", 102.0, 1.5, (0.05,)),    # ttft over
          req("slow_decode", 103.0, 0.5, (0.2, 0.2)),  # tpot over
          req("one_token", 104.0, 0.5)]               # no tpot: meets that bound
    slo = slo_of("ttft=1.0,tpot=0.1,percentile=50")
    s = summarize(ts, WINDOW, slo)
    assert s.request_goodput == 0.3                 # good, at_bound, one_token / 10 s
    assert s.good_fraction == 0.6                   # 3 of 5
    assert s.slo_met is True                        # p50 ttft 0.5 <= 1.0; p50 tpot of (0.05, 0.1, 0.05, 0.2) 0.075 <= 0.1
    strict = summarize(ts, WINDOW, "ttft=1.0,tpot=0.1")     # p99 ttft: rank 3.96 of (.5,.5,.5,1,1.5) = 1.48 > 1.0
    assert strict.slo_met is False and strict.request_goodput == 0.3
    failing = summarize([*ts, req("failed", 105.0, 0.5, error="timeout")], WINDOW, slo)
    assert failing.slo_met is False                 # a failure fails the run's SLO
    assert failing.good_fraction == pytest.approx(0.5)    # 3 of 6: the failure is not good


def test_cached_fraction_is_token_weighted_not_a_mean_of_ratios():
    ts = [req("long", 101.0, 0.5, prompt=1000, cached=900),
          req("short", 102.0, 0.5, prompt=100, cached=0),
          req("silent", 103.0, 0.5, prompt=500)]        # engine did not say: left out
    s = summarize(ts, WINDOW)
    assert s.cached_prompt_fraction == pytest.approx(900 / 1100)      # 0.818...
    assert s.cached_prompt_fraction != pytest.approx((0.9 + 0.0) / 2)  # the mean of ratios, 0.45
    assert summarize([ts[2]], WINDOW).cached_prompt_fraction is None


def test_slo_presets_carry_mlperf_values_and_their_source():
    expected = {"mixtral-8x7b": (2.0, 0.2), "deepseek-r1": (2.0, 0.08), "deepseek-r1-interactive": (1.5, 0.015)}
    assert {n: (s.ttft_s, s.tpot_s) for n, s in SLO_PRESETS.items()} == expected
    for name, s in SLO_PRESETS.items():
        assert slo_of(name) is s and s.percentile == 99.0
        assert "github.com/mlcommons/inference" in s.source and "loadgen/mlperf.conf" in s.source


def test_custom_slo_parsing():
    s = slo_of("ttft=2.0,tpot=0.2")
    assert (s.ttft_s, s.tpot_s, s.percentile, s.source) == (2.0, 0.2, 99.0, "custom")
    assert slo_of(" tpot=0.05 , ttft=0.5 , percentile=90 ").percentile == 90.0
    assert slo_of(s) is s


@pytest.mark.parametrize("spec", ["mixtral", "", "ttft=2.0", "tpot=0.2", "ttft=2.0,tpot=fast", "ttft=2,tpot=0.2,e2el=5",
                                  "ttft=2,ttft=3,tpot=0.2", "ttft=0,tpot=0.2", "ttft=2,tpot=-1",
                                  "ttft=2,tpot=0.2,percentile=0", "ttft=2,tpot=0.2,percentile=101", "ttft=nan,tpot=1"])
def test_slo_refusals_list_the_presets(spec):
    with pytest.raises(ValueError) as err:
        slo_of(spec)
    message = str(err.value)
    assert "\n" not in message and repr(spec) in message
    assert all(name in message for name in SLO_PRESETS)


# --- validation and None ---------------------------------------------------------------------------------

@pytest.mark.parametrize("change, field", [
    ({"token_times_s": (0.5, 0.25)}, "token_times_s"),          # decreasing
    ({"token_times_s": (-0.5,)}, "token_times_s"),              # before arrival
    ({"token_times_s": (float("nan"),)}, "token_times_s"),
    ({"arrival_s": float("inf")}, "arrival_s"),
    ({"prompt_tokens": -1}, "prompt_tokens"),
    ({"output_tokens_asked": -3}, "output_tokens_asked"),
    ({"cached_prompt_tokens": -1}, "cached_prompt_tokens"),
    ({"cached_prompt_tokens": 11}, "cached_prompt_tokens"),     # more than the 10 prompt tokens
])
def test_validation_names_the_field(change, field):
    args = {"request_id": "x", "arrival_s": 0.0, "token_times_s": (0.5,), "prompt_tokens": 10,
            "output_tokens_asked": 1, **change}
    with pytest.raises(ValueError) as err:
        RequestTimeline(**args)
    assert f"RequestTimeline.{field}" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("window", [(5.0, 5.0), (5.0, 1.0), (0.0, float("inf"))])
def test_a_window_must_have_length(window):
    with pytest.raises(ValueError, match="window"):
        summarize([], window)


def test_nothing_measured_reads_none_never_zero():
    empty = summarize([req("outside", 50.0, 0.5)], WINDOW, "mixtral-8x7b")
    values = {r["metric"]: r["value"] for r in summary_rows(empty)}
    assert (values["requests"], values["completed"], values["failed"]) == (0.0, 0.0, 0.0)
    assert values["duration_s"] == 10.0
    unmeasured = set(METRICS) - {"requests", "completed", "failed", "duration_s"}
    assert {m for m in unmeasured if values[m] is not None} == set()

    one_token = summarize([req("a", 101.0, 0.5), req("b", 102.0, 0.25)], WINDOW)
    assert one_token.tpot_s.p99 is None and one_token.itl_s.mean is None       # no second token anywhere
    assert one_token.request_goodput is None and one_token.slo_met is None      # no SLO given
    assert one_token.ttft_s.p50 == 0.375

    all_failed = summarize([req("x", 101.0, error="refused")], WINDOW, "deepseek-r1")
    assert all_failed.request_throughput == 0.0 and all_failed.request_goodput == 0.0   # offered, none served
    assert all_failed.ttft_s.mean is None and all_failed.output_mismatch is None
    assert all_failed.slo_met is False


# --- rows and the data dictionary ------------------------------------------------------------------------

def test_summary_rows_cover_every_metric_with_its_unit():
    s = summarize([req("a", 101.0, 0.5, (0.125,), cached=5)], WINDOW, "mixtral-8x7b")
    rows = summary_rows(s)
    assert [r["metric"] for r in rows] == list(METRICS)
    assert {r["unit"] for r in rows} <= UNITS
    by = {r["metric"]: r for r in rows}
    assert by["tpot_s_p99"] == {"metric": "tpot_s_p99", "value": 0.125, "unit": "s"}
    assert by["cached_prompt_fraction"]["value"] == 0.5 and by["request_goodput"]["unit"] == "req/s"
    assert by["slo_met"]["value"] == 1.0            # 0.5 s <= 2 s, 0.125 s <= 0.2 s
    assert summary_rows(summarize([req("a", 101.0, 0.5, (0.25,))], WINDOW, "mixtral-8x7b"))[-1] == {
        "metric": "slo_met", "value": 0.0, "unit": "count"}     # 0.25 s per token > 0.2 s


def test_request_rows_one_per_request_and_metric():
    rows = request_rows([req("a", 1.0, 0.5, (0.25, 0.75), asked=4), req("b", 2.0, 0.5, error="reset")])
    assert len(rows) == 2 * len(REQUEST_METRICS)
    a = {r["metric"]: r["value"] for r in rows if r["request_id"] == "a"}
    assert (a["ttft_s"], a["e2el_s"], a["tpot_s"], a["itl_s_max"]) == (0.5, 1.5, 0.5, 0.75)
    assert (a["output_tokens"], a["output_tokens_asked"], a["output_mismatch"]) == (3.0, 4.0, 1.0)
    assert a["output_tok_per_s_per_user"] == 2.0 and a["cached_prompt_tokens"] is None
    b = {r["metric"]: r["value"] for r in rows if r["request_id"] == "b"}
    assert b["failed"] == 1.0 and b["tpot_s"] is None and b["itl_s_max"] is None
    assert {r["unit"] for r in rows} <= UNITS


def test_data_dictionary_names_the_aiperf_trap():
    """AIPerf's inter_token_latency is vLLM's TPOT; its inter_chunk_latency is vLLM's ITL."""
    assert METRICS["tpot_s_p99"][2][M.AIPERF] == "inter_token_latency.p99"
    assert METRICS["tpot_s_p99"][2][M.VLLM] == "p99_tpot_ms"
    assert METRICS["itl_s_p99"][2][M.AIPERF] == "inter_chunk_latency.p99"
    assert METRICS["itl_s_p50"][2][M.VLLM] == "median_itl_ms"
    assert REQUEST_METRICS["tpot_s"][2][M.AIPERF] == "inter_token_latency"
    for table in (METRICS, REQUEST_METRICS):
        for name, (unit, meaning, others) in table.items():
            assert unit in UNITS and meaning, name
            assert all(isinstance(k, str) and isinstance(v, str) and v for k, v in others.items()), name


def test_the_module_imports_no_torch():
    tree = ast.parse(Path(M.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "torch" not in imported and "numpy" in imported
