"""A load on llama-server through the real CLI and the pinned build: one `-np` slot per request in
flight, every request streamed and stamped by the client, its cached prompt tokens the server's own
`timings.cache_n`, the same rows and summary as our engine's -- and the same requests: both engines
serve one schedule of prompts and lengths."""
from __future__ import annotations

import pandas as pd
import pytest

from harness import results
from tests.llamacpp.test_engine import cli, run_dir

pytestmark = pytest.mark.slow
LOAD = ["workload=chat", "workload.context_tokens=256", "workload.gen_tokens=4", "run.repeats=1", "run.warmup=0",
        "run.quiet=true", "run.passes=[speed,serve]", "load=poisson", "load.rate=40", "load.requests=10",
        "load.warmup_requests=2", "load.max_concurrency=3", "load.input_len=64", "load.output_len=6"]


@pytest.fixture(autouse=True)
def _built(bins):
    return bins


def serve_rows(job_dir) -> tuple[pd.DataFrame, pd.DataFrame]:
    df = results.load(job_dir)
    rows = df[(df.phase == "serve") & (df.profiler == "serve")]
    return df, rows


def test_llama_server_serves_the_load_our_engine_serves(tmp_path):
    ours_dir, theirs_dir = tmp_path / "ours", tmp_path / "theirs"
    ours_dir.mkdir(), theirs_dir.mkdir()
    cli(LOAD, ours_dir)
    cli(["engine=llamacpp", *LOAD], theirs_dir)
    _, ours = serve_rows(run_dir(ours_dir))
    df, theirs = serve_rows(run_dir(theirs_dir))
    assert set(df.n_parallel.dropna()) == {3}                          # a slot per request in flight
    per = theirs[theirs.request_id.notna()].pivot_table(index="request_id", columns="metric", values="value")
    mine = ours[ours.request_id.notna()].pivot_table(index="request_id", columns="metric", values="value")
    assert list(per.index) == list(mine.index) and len(per) == 10       # the same requests
    for m in ("prompt_tokens", "output_tokens_asked", "warmup"):
        assert per[m].tolist() == mine[m].tolist(), m
    assert (per["output_tokens"] == 6).all() and (per["output_mismatch"] == 0).all()
    assert (per["cached_prompt_tokens"] == 0).all()                     # the server's timings.cache_n, cache_prompt off
    assert (per["ttft_s"] > 0).all() and (per["e2el_s"] >= per["ttft_s"]).all()
    summary = theirs[theirs.request_id.isna()].set_index("metric")["value"]
    assert summary["requests"] == summary["completed"] == 8 and summary["cached_prompt_fraction"] == 0
    assert summary["harness_overhead_s_per_request"] > 0
    assert theirs[theirs.source == "engine"].empty                     # the server's steps are its own


def test_a_primed_shared_prefix_is_the_server_s_own_cache_count(tmp_path):
    """Every slot is given the 32-token prefix first; each request then lands on a slot holding it,
    and the server's timings.cache_n counts the tokens it did not compute: the window's fraction is
    their sum over the prompts' sum. Isolated, the server counts none."""
    primed, isolated = tmp_path / "primed", tmp_path / "isolated"
    primed.mkdir(), isolated.mkdir()
    cli(["engine=llamacpp", *LOAD, "load.shared_prefix=32", "load.prefix_cache=primed"], primed)
    cli(["engine=llamacpp", *LOAD, "load.shared_prefix=32", "load.prefix_cache=isolated"], isolated)
    df, rows = serve_rows(run_dir(primed))
    assert set(df.n_parallel.dropna()) == {4}                          # 3 in flight, one more for the prefix
    by = rows[rows.request_id.notna()].pivot_table(index="request_id", columns="metric", values="value")
    summary = rows[rows.request_id.isna()].set_index("metric")["value"]
    measured = by[by["warmup"] == 0]
    assert (by["cached_prompt_tokens"] >= 32).all() and (by["cached_prompt_tokens"] < by["prompt_tokens"]).all()
    assert summary["cached_prompt_fraction"] == pytest.approx(
        measured["cached_prompt_tokens"].sum() / measured["prompt_tokens"].sum())
    _, rows = serve_rows(run_dir(isolated))
    assert (rows[rows.metric == "cached_prompt_tokens"].value == 0).all()
