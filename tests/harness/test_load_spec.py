"""The load spec: arrival processes with the statistics their formulas promise, seeded and
reproducible; length distributions within their bounds; trace files replayed in each accepted form;
length datasets sampled row by row, each row once before any repeats, beside any arrival process;
warm-up and the steady window on a hand-built case; every refusal as one line naming the key, what
is allowed and what was given; every conf/load option building a checked LoadConf."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from harness.serving.load import NAMES, LoadConf, RequestPlan, check_load, describe, schedule, steady_window

REPO = Path(__file__).resolve().parents[2]
N = 20_001                       # arrivals: 20 000 gaps


def arrivals(**kw) -> np.ndarray:
    return np.array([p.arrival_s for p in schedule(LoadConf(**kw))])


def lengths(side: str, **kw) -> np.ndarray:
    return np.array([getattr(p, f"{side}_len") for p in schedule(LoadConf(name="poisson", rate=4.0, **kw))])


# --- arrivals ----------------------------------------------------------------------------------
def gap_tolerances(shape: float, n: int) -> tuple[float, float]:
    """4 standard errors, relative, of the mean and of the coefficient of variation of n gamma(shape)
    gaps (exponential: shape 1): the mean's is cv/sqrt(n); the sample std's is
    sqrt((2 + excess kurtosis 6/shape) / n) / 2, and the CV adds the mean's."""
    cv = 1 / math.sqrt(shape)
    se_mean = cv / math.sqrt(n)
    return 4 * se_mean, 4 * (math.sqrt((2 + 6 / shape) / n) / 2 + se_mean)


def test_poisson_gaps_have_mean_one_over_rate_and_cv_one():
    gaps = np.diff(arrivals(name="poisson", rate=4.0, requests=N))
    tol_mean, tol_cv = gap_tolerances(1.0, len(gaps))          # 2.8% and 5.4%
    assert gaps.mean() == pytest.approx(0.25, rel=tol_mean)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=tol_cv)
    assert gaps.min() > 0


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_gaps_keep_the_mean_and_have_cv_one_over_sqrt_burstiness(burstiness):
    gaps = np.diff(arrivals(name="gamma", rate=4.0, burstiness=burstiness, requests=N))
    tol_mean, tol_cv = gap_tolerances(burstiness, len(gaps))
    assert gaps.mean() == pytest.approx(0.25, rel=tol_mean)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=tol_cv)


def test_constant_arrivals_are_exactly_evenly_spaced():
    t = arrivals(name="constant", rate=3.0, requests=1000)
    assert t.tolist() == [i / 3.0 for i in range(1000)]
    assert np.allclose(np.diff(t), 1 / 3.0, rtol=0, atol=1e-12)


def test_closed_loop_sends_everything_at_zero():
    plans = schedule(LoadConf(name="poisson", requests=8, max_concurrency=2))
    assert [p.arrival_s for p in plans] == [0.0] * 8 and [p.index for p in plans] == list(range(8))


def test_duration_keeps_the_arrivals_before_it_the_same_as_a_request_count():
    by_time = arrivals(name="poisson", rate=4.0, duration_s=30.0, seed=3)
    by_count = arrivals(name="poisson", rate=4.0, requests=len(by_time) + 1, seed=3)
    assert by_time.max() < 30.0 <= by_count[-1]
    assert by_time.tolist() == by_count[:-1].tolist()
    assert len(arrivals(name="constant", rate=4.0, duration_s=2.0)) == 8          # 0, 0.25, ..., 1.75


def test_a_seed_fixes_the_schedule_and_another_seed_changes_it():
    conf = LoadConf(name="gamma", rate=2.0, burstiness=0.5, requests=50, input_dist="uniform", input_ratio=0.5, seed=7)
    assert schedule(conf) == schedule(conf)
    other = schedule(dataclasses.replace(conf, seed=8))
    assert [p.arrival_s for p in other] != [p.arrival_s for p in schedule(conf)]
    assert [p.input_len for p in other] != [p.input_len for p in schedule(conf)]


def test_the_streams_are_the_children_of_default_rng_seed_in_order():
    """The reference: arrivals from the first child, input lengths the second, output the third."""
    conf = LoadConf(name="poisson", rate=4.0, requests=100, input_dist="uniform", input_ratio=0.5,
                    output_dist="uniform", output_ratio=0.5, seed=11)
    arrival_rng, input_rng, output_rng = np.random.default_rng(11).spawn(3)
    plans = schedule(conf)
    assert [p.arrival_s for p in plans] == [0.0, *np.cumsum(arrival_rng.exponential(0.25, 99)).tolist()]
    assert [p.input_len for p in plans] == input_rng.integers(128, 384, 100, endpoint=True).tolist()
    assert [p.output_len for p in plans] == output_rng.integers(32, 96, 100, endpoint=True).tolist()


def test_a_length_distribution_moves_neither_the_arrivals_nor_the_other_lengths():
    base = LoadConf(name="poisson", rate=4.0, requests=200, output_dist="normal", output_std=8.0, seed=1)
    changed = dataclasses.replace(base, input_dist="uniform", input_ratio=0.5)
    a, b = schedule(base), schedule(changed)
    assert [p.arrival_s for p in a] == [p.arrival_s for p in b]
    assert [p.output_len for p in a] == [p.output_len for p in b]
    assert [p.input_len for p in a] != [p.input_len for p in b]


# --- lengths -----------------------------------------------------------------------------------
def test_uniform_lengths_stay_within_and_span_mean_plus_minus_ratio():
    got = lengths("input", requests=N, input_len=100, input_dist="uniform", input_ratio=0.5)
    assert got.min() == 50 and got.max() == 150                 # within [100*(1-0.5), 100*(1+0.5)], both ends drawn
    assert len(np.unique(got)) == 101
    assert got.mean() == pytest.approx(100, rel=0.01)
    out = lengths("output", requests=N, output_len=100, output_dist="uniform", output_ratio=0.1)
    assert out.min() == 90 and out.max() == 110                 # 100*(1+0.1) is 110.00000000000001: still 110
    wide = lengths("output", requests=N, output_len=10, output_dist="uniform", output_ratio=0.25)
    assert wide.min() == 7 and wide.max() == 13                 # [7.5, 12.5] widened to whole tokens, as vLLM's


def test_normal_lengths_have_the_asked_mean_and_std_and_are_clipped_at_one():
    got = lengths("output", requests=N, output_len=1000, output_dist="normal", output_std=100.0)
    assert got.mean() == pytest.approx(1000, rel=0.01)          # 4 SE of the mean: 0.3%
    assert got.std() == pytest.approx(100, rel=0.03)            # 4 SE of the std: 2%
    clipped = lengths("input", requests=N, input_len=20, input_dist="normal", input_std=15.0)
    assert clipped.min() == 1 and (clipped == 1).sum() > 0.05 * N   # P(x < 1.5) = 11%: clipped, not dropped


def test_fixed_lengths_are_the_mean():
    plans = schedule(LoadConf(name="constant", rate=1.0, requests=5, input_len=300, output_len=7))
    assert {(p.input_len, p.output_len) for p in plans} == {(300, 7)}


# --- traces ------------------------------------------------------------------------------------
def trace(tmp_path: Path, name: str, text: str, **kw) -> list[RequestPlan]:
    path = tmp_path / name
    path.write_text(text)
    return schedule(LoadConf(name="trace", trace_file=str(path), **kw))


def test_mooncake_jsonl_timestamps_are_milliseconds_and_lengths_come_from_the_file(tmp_path):
    rows = [{"timestamp": 1000, "input_length": 6755, "output_length": 500, "hash_ids": [0, 1]},
            {"timestamp": 1000, "input_length": 7319, "output_length": 490, "hash_ids": [0, 2]},
            {"timestamp": 4052, "input_length": 7234, "output_length": 794, "hash_ids": [3]},
            {"timestamp": 28482, "input_length": 2287, "output_length": 316, "hash_ids": [4]}]
    plans = trace(tmp_path, "t.jsonl", "\n".join(map(json.dumps, rows)) + "\n\n", max_concurrency=2)
    assert [p.arrival_s for p in plans] == pytest.approx([0.0, 0.0, 3.052, 27.482])
    assert [(p.input_len, p.output_len) for p in plans] == [(6755, 500), (7319, 490), (7234, 794), (2287, 316)]


def test_csv_timestamp_s_is_seconds_and_rows_are_sorted_stably(tmp_path):
    text = "timestamp_s,input_length,output_length\n12.5,10,1\n10.0,20,2\n12.5,30,3\n"
    plans = trace(tmp_path, "t.csv", text)
    assert [(p.arrival_s, p.input_len, p.output_len) for p in plans] == [(0.0, 20, 2), (2.5, 10, 1), (2.5, 30, 3)]


def test_equal_timestamps_keep_the_file_order(tmp_path):
    stamps = np.random.default_rng(0).integers(0, 5, 200)              # many ties, shuffled
    text = "".join(json.dumps({"timestamp": int(t), "input_length": i + 1}) + "\n" for i, t in enumerate(stamps))
    plans = trace(tmp_path, "t.jsonl", text)
    assert [p.input_len for p in plans] == (np.argsort(stamps, kind="stable") + 1).tolist()


def test_a_trace_without_lengths_draws_them_from_the_distributions(tmp_path):
    text = "timestamp\n0\n250\n500\n"                                     # milliseconds
    plans = trace(tmp_path, "t.csv", text, input_len=128, output_dist="uniform", output_ratio=0.5)
    assert [p.arrival_s for p in plans] == [0.0, 0.25, 0.5]
    assert {p.input_len for p in plans} == {128} and all(32 <= p.output_len <= 96 for p in plans)


def test_azure_csv_date_times_become_seconds_from_the_first(tmp_path):
    text = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
            "2023-11-16 18:15:46.6805900,4808,10\n"
            "2023-11-16 18:15:50.9951380,3180,8\n"
            "2023-11-16 18:16:46.6805900,110,27\n")
    plans = trace(tmp_path, "azure.csv", text)
    assert [p.arrival_s for p in plans] == pytest.approx([0.0, 4.314548, 60.0], abs=1e-9)
    assert [(p.input_len, p.output_len) for p in plans] == [(4808, 10), (3180, 8), (110, 27)]


def test_a_trace_cut_by_requests_or_duration(tmp_path):
    text = "\n".join(json.dumps({"timestamp": 1000 * i}) for i in range(10))
    assert len(trace(tmp_path, "t.jsonl", text, requests=4)) == 4
    assert [p.arrival_s for p in trace(tmp_path, "t.jsonl", text, duration_s=3.0)] == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("name,text,kw,message", [
    ("t.jsonl", '{"timestamp": 0}\n{"timestamp": "soon"}\n', {},
     "load.trace_file: t.jsonl line 2: allowed a number of milliseconds in column 'timestamp', got 'soon'"),
    ("t.jsonl", '{"timestamp": 0}\nnot json\n', {},
     "load.trace_file: t.jsonl line 2: allowed a JSON object per line, got 'not json'"),
    ("t.csv", "timestamp_s,input_length\n0,5\n1,\n", {},
     "load.trace_file: t.csv line 3: allowed a value in column 'input_length' (the first row has one), got none"),
    ("t.csv", "timestamp,timestamp_s\n0,0\n", {},
     "load.trace_file: t.csv: allowed one time column of timestamp, timestamp_s, TIMESTAMP, got timestamp and timestamp_s"),
    ("t.csv", "time,input_length\n0,5\n", {},
     "load.trace_file: t.csv: allowed a time column timestamp (ms), timestamp_s (s) or TIMESTAMP (date-time), "
     "got columns time, input_length"),
    ("t.jsonl", '{"timestamp": 0, "output_length": 0}\n', {},
     "load.trace_file: t.jsonl line 1: allowed an integer >= 1 in column 'output_length', got 0"),
    ("t.csv", "timestamp\n0\n1\n", {"requests": 3},
     "load.requests: allowed at most 2 (the requests in t.csv) or null, got 3"),
    ("t.csv", "timestamp\n0\n1\n", {"warmup_requests": 2},
     "load.warmup_requests: allowed fewer than the 2 requests of the schedule, got 2"),
])
def test_a_bad_trace_is_refused_in_one_line(tmp_path, name, text, kw, message):
    with pytest.raises(ValueError) as e:
        trace(tmp_path, name, text, **kw)
    assert str(e.value) == message


# --- length datasets ---------------------------------------------------------------------------
PAIRS = [(512, 128), (1024, 64), (48, 300), (7, 7), (2000, 1)]


def dataset(tmp_path: Path, name: str = "lengths.jsonl", rows=PAIRS, text: str | None = None) -> str:
    path = tmp_path / name
    path.write_text(text if text is not None else
                    "".join(json.dumps({"input_length": i, "output_length": o}) + "\n" for i, o in rows))
    return str(path)


def pairs(plans: list[RequestPlan]) -> list[tuple[int, int]]:
    return [(p.input_len, p.output_len) for p in plans]


def test_a_dataset_gives_each_request_one_rows_two_lengths_each_row_once_per_pass(tmp_path):
    """The reference: request i takes row order[i], where order is the rows' permutations drawn in
    turn from the fifth child of SeedSequence(seed) -- each row once per pass over the file."""
    f = dataset(tmp_path)
    plans = schedule(LoadConf(name="poisson", rate=4.0, requests=13, input_dist="dataset", output_dist="dataset",
                              dataset_file=f, seed=5))
    rng = np.random.default_rng(np.random.SeedSequence(5).spawn(5)[4])
    order = np.concatenate([rng.permutation(5) for _ in range(3)])[:13]
    assert pairs(plans) == [PAIRS[i] for i in order]
    for start in (0, 5):                                        # a pass: every row exactly once
        assert sorted(pairs(plans)[start:start + 5]) == sorted(PAIRS)
    many = pairs(schedule(LoadConf(name="constant", rate=1.0, requests=1003, input_dist="dataset",
                                   output_dist="dataset", dataset_file=f)))
    assert {many.count(pair) for pair in PAIRS} == {200, 201}   # 200 whole passes and 3 rows of the next


def test_a_dataset_moves_neither_the_arrivals_nor_a_drawn_side(tmp_path):
    f = dataset(tmp_path)
    for arrivals in ({"name": "poisson", "rate": 4.0}, {"name": "gamma", "rate": 2.0, "burstiness": 0.25},
                     {"name": "constant", "rate": 3.0}, {"name": "poisson", "rate": None, "max_concurrency": 2}):
        base = LoadConf(**arrivals, requests=40, output_dist="uniform", output_ratio=0.5, seed=2)
        mixed = dataclasses.replace(base, input_dist="dataset", dataset_file=f)
        a, b = schedule(base), schedule(mixed)
        assert [p.arrival_s for p in a] == [p.arrival_s for p in b], arrivals
        assert [p.output_len for p in a] == [p.output_len for p in b]              # drawn, as without the file
        assert {p.input_len for p in b} == {i for i, _ in PAIRS}
    closed = schedule(LoadConf(name="constant", rate=None, max_concurrency=2, requests=6, input_dist="dataset",
                               output_dist="dataset", dataset_file=f))
    assert [p.arrival_s for p in closed] == [0.0] * 6 and set(pairs(closed)) <= set(PAIRS)


def test_a_seed_fixes_the_rows_and_a_duration_takes_the_same_rows_as_a_count(tmp_path):
    conf = LoadConf(name="poisson", rate=4.0, requests=30, input_dist="dataset", output_dist="dataset",
                    dataset_file=dataset(tmp_path), seed=9)
    assert schedule(conf) == schedule(conf)
    assert pairs(schedule(dataclasses.replace(conf, seed=10))) != pairs(schedule(conf))
    by_time = schedule(dataclasses.replace(conf, requests=None, duration_s=5.0))
    assert pairs(by_time) == pairs(schedule(conf))[:len(by_time)]


def test_trace_files_are_length_datasets_with_their_times_ignored(tmp_path):
    """The Mooncake and Azure column names, read by the trace reader's rules; times play no part."""
    mooncake = dataset(tmp_path, "m.jsonl", text=json.dumps({"timestamp": 9, "input_length": 6755, "output_length": 500,
                                                              "hash_ids": [0, 1]}) + "\n")
    azure = dataset(tmp_path, "a.csv", text="TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                            "2023-11-16 18:15:46.6805900,4808,10\n2023-11-16 18:15:50.9951380,3180,8\n")
    plain = dataset(tmp_path, "p.csv", text="input_length,output_length\n 30, 4\n")
    for f, want in ((mooncake, {(6755, 500)}), (azure, {(4808, 10), (3180, 8)}), (plain, {(30, 4)})):
        plans = schedule(LoadConf(name="constant", rate=2.0, requests=4, input_dist="dataset",
                                  output_dist="dataset", dataset_file=f))
        assert set(pairs(plans)) == want and [p.arrival_s for p in plans] == [0.0, 0.5, 1.0, 1.5]


def test_one_side_from_a_dataset_needs_only_its_column(tmp_path):
    f = dataset(tmp_path, "in.csv", text="ContextTokens\n100\n200\n")
    plans = schedule(LoadConf(name="poisson", rate=4.0, requests=8, input_dist="dataset", dataset_file=f,
                              output_len=9))
    assert {p.input_len for p in plans} == {100, 200} and {p.output_len for p in plans} == {9}
    with pytest.raises(ValueError) as e:
        schedule(LoadConf(name="poisson", rate=4.0, requests=8, output_dist="dataset", dataset_file=f))
    assert str(e.value) == ("load.dataset_file: in.csv: allowed a column output_length or GeneratedTokens for the "
                            "output lengths, got columns ContextTokens")


def test_a_trace_without_lengths_takes_them_from_a_dataset(tmp_path):
    f = dataset(tmp_path)
    plans = trace(tmp_path, "t.csv", "timestamp_s\n0\n1\n2\n", input_dist="dataset", output_dist="dataset",
                  dataset_file=f)
    assert [p.arrival_s for p in plans] == [0.0, 1.0, 2.0] and set(pairs(plans)) <= set(PAIRS)


@pytest.mark.parametrize("text,message", [
    ("", "load.dataset_file: allowed a file with at least one request, got '{path}' (no rows)"),
    ('{"input_length": 5, "output_length": 2}\n{"input_length": 0, "output_length": 2}\n',
     "load.dataset_file: d.jsonl line 2: allowed an integer >= 1 in column 'input_length', got 0"),
    ('{"input_length": 5, "output_length": -2}\n',
     "load.dataset_file: d.jsonl line 1: allowed an integer >= 1 in column 'output_length', got -2"),
    ('{"input_length": 5, "output_length": 2}\n{"input_length": 5}\n',
     "load.dataset_file: d.jsonl line 2: allowed a value in column 'output_length' (the first row has one), got none"),
    ('{"prompt": "hi", "completion": "there"}\n',
     "load.dataset_file: d.jsonl: allowed a column input_length or ContextTokens for the input lengths, "
     "got columns prompt, completion"),
    ('[5, 2]\n', "load.dataset_file: d.jsonl line 1: allowed a JSON object per line, got '[5, 2]'"),
])
def test_a_bad_dataset_is_refused_in_one_line(tmp_path, text, message):
    f = dataset(tmp_path, "d.jsonl", text=text)
    with pytest.raises(ValueError) as e:
        schedule(LoadConf(name="poisson", rate=4.0, requests=4, input_dist="dataset", output_dist="dataset",
                          dataset_file=f))
    assert str(e.value) == message.format(path=f)


# --- warm-up and the steady window ---------------------------------------------------------------
def test_warm_up_marks_the_first_requests_and_the_window_follows_ramp_and_drain():
    conf = LoadConf(name="constant", rate=2.0, requests=10, warmup_requests=2, ramp_s=1.0, drain_s=0.5)
    plans = schedule(conf)
    assert [p.warmup for p in plans] == [True, True] + [False] * 8
    assert [p.arrival_s for p in plans] == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5]
    start, end = steady_window(plans, conf)           # first measured 1.0 + 1.0; last 4.5 - 0.5
    assert (start, end) == (2.0, 4.0)
    assert [p.index for p in plans if not p.warmup and start <= p.arrival_s <= end] == [4, 5, 6, 7, 8]


def test_the_window_is_over_measured_arrivals_of_a_hand_built_schedule():
    plans = [RequestPlan(0, 0.0, 8, 8, True), RequestPlan(1, 5.0, 8, 8, True), RequestPlan(2, 1.0, 8, 8, False),
             RequestPlan(3, 7.0, 8, 8, False), RequestPlan(4, 3.0, 8, 8, False)]
    conf = LoadConf(name="trace", ramp_s=0.5, drain_s=2.0)
    assert steady_window(plans, conf) == (1.5, 5.0)                      # a warm-up arrival (5.0) never counts
    with pytest.raises(ValueError) as e:
        steady_window(plans, dataclasses.replace(conf, ramp_s=4.5))
    assert str(e.value) == "load.ramp_s + load.drain_s: allowed at most the measured arrivals' span 6 s, got 4.5 + 2"


def test_a_closed_loop_window_holds_every_measured_request():
    conf = LoadConf(name="constant", requests=6, warmup_requests=1, max_concurrency=2)
    assert steady_window(schedule(conf), conf) == (0.0, 0.0)


# --- refusals ----------------------------------------------------------------------------------
BASE = {"name": "poisson", "rate": 4.0, "requests": 32}
REFUSALS = [
    ({"name": "zipf"}, "load.name: allowed none, constant, poisson, gamma, trace, got 'zipf'"),
    ({"rate": -1}, "load.rate: allowed a positive number or null, got -1"),
    ({"rate": 0.0}, "load.rate: allowed a positive number or null, got 0.0"),
    ({"duration_s": 60.0}, "load.requests, load.duration_s: allowed one of them, got both (32 and 60.0)"),
    ({"requests": None}, "load.requests, load.duration_s: allowed one of them with load=poisson "
                         "(only load=trace may leave both null: every row), got neither"),
    ({"requests": 0}, "load.requests: allowed an integer >= 1 or null, got 0"),
    ({"requests": None, "duration_s": -5.0}, "load.duration_s: allowed a positive number or null, got -5.0"),
    ({"rate": None}, "load.max_concurrency: allowed an integer >= 1 when load.rate is null (a closed loop), got null"),
    ({"max_concurrency": 0}, "load.max_concurrency: allowed an integer >= 1 or null, got 0"),
    ({"rate": None, "max_concurrency": 4, "requests": None, "duration_s": 60.0},
     "load.duration_s: allowed null when load.rate is null (a closed loop has no arrival times: give load.requests), "
     "got 60.0"),
    ({"rate": None, "max_concurrency": 4, "ramp_s": 2.0},
     "load.ramp_s: allowed 0 when load.rate is null (every arrival is at 0), got 2.0"),
    ({"drain_s": -1.0}, "load.drain_s: allowed a number >= 0, got -1.0"),
    ({"name": "gamma", "burstiness": 0.0},
     "load.burstiness: allowed a positive number with load=gamma (1 is poisson, < 1 burstier), got 0.0"),
    ({"name": "gamma", "burstiness": -2.0},
     "load.burstiness: allowed a positive number with load=gamma (1 is poisson, < 1 burstier), got -2.0"),
    ({"burstiness": 0.5}, "load.burstiness: allowed 1.0 unless load=gamma, got 0.5"),
    ({"warmup_requests": 32}, "load.warmup_requests: allowed 0 to 31 (fewer than load.requests=32), got 32"),
    ({"warmup_requests": -1}, "load.warmup_requests: allowed an integer >= 0, got -1"),
    ({"input_len": 0}, "load.input_len: allowed an integer >= 1, got 0"),
    ({"output_len": -3}, "load.output_len: allowed an integer >= 1, got -3"),
    ({"input_dist": "zipf"}, "load.input_dist: allowed fixed, uniform, normal, dataset, got 'zipf'"),
    ({"output_dist": "lognormal"}, "load.output_dist: allowed fixed, uniform, normal, dataset, got 'lognormal'"),
    ({"input_dist": "uniform"}, "load.input_ratio: allowed a number in (0, 1) with load.input_dist=uniform, got 0.0"),
    ({"input_dist": "uniform", "input_ratio": 1.5},
     "load.input_ratio: allowed a number in (0, 1) with load.input_dist=uniform, got 1.5"),
    ({"output_dist": "normal"}, "load.output_std: allowed a positive number with load.output_dist=normal, got 0.0"),
    ({"input_ratio": 0.2}, "load.input_ratio: allowed 0 with load.input_dist=fixed, got 0.2"),
    ({"output_dist": "uniform", "output_ratio": 0.2, "output_std": 3.0},
     "load.output_std: allowed 0 with load.output_dist=uniform, got 3.0"),
    ({"name": "trace", "rate": None, "requests": None},
     "load.trace_file: allowed a .jsonl or .csv file with load=trace, got null"),
    ({"name": "trace", "rate": None, "trace_file": "/nonexistent/t.jsonl"},
     "load.trace_file: allowed an existing .jsonl or .csv file, got '/nonexistent/t.jsonl' (no such file)"),
    ({"name": "trace", "rate": None, "trace_file": "arrivals.txt"},
     "load.trace_file: allowed a .jsonl or .csv file with load=trace, got 'arrivals.txt'"),
    ({"name": "trace", "trace_file": "t.jsonl"},
     "load.rate: allowed null with load=trace (the file's timestamps are the arrivals), got 4.0"),
    ({"trace_file": "t.jsonl"}, "load.trace_file: allowed null unless load=trace, got 't.jsonl'"),
    ({"input_dist": "dataset"}, "load.dataset_file: allowed a .jsonl or .csv file with load.input_dist=dataset, "
                                "got null"),
    ({"output_dist": "dataset", "dataset_file": "lengths.parquet"},
     "load.dataset_file: allowed a .jsonl or .csv file with load.output_dist=dataset, got 'lengths.parquet'"),
    ({"input_dist": "dataset", "output_dist": "dataset", "dataset_file": "/nonexistent/lengths.csv"},
     "load.dataset_file: allowed an existing .jsonl or .csv file, got '/nonexistent/lengths.csv' (no such file)"),
    ({"dataset_file": "lengths.csv"},
     "load.dataset_file: allowed null unless load.input_dist or load.output_dist is dataset, got 'lengths.csv'"),
    ({"input_dist": "dataset", "input_len": 512, "dataset_file": "lengths.csv"},
     "load.input_len: allowed the default 256 with load.input_dist=dataset (the lengths are load.dataset_file's), "
     "got 512"),
    ({"output_dist": "dataset", "output_ratio": 0.5, "dataset_file": "lengths.csv"},
     "load.output_ratio: allowed 0 with load.output_dist=dataset, got 0.5"),
    ({"seed": -1}, "load.seed: allowed an integer >= 0, got -1"),
    ({"ignore_eos": "yes"}, "load.ignore_eos: allowed true (output lengths are enforced: every request generates its planned length, and a shorter one counts as a mismatch), got 'yes'"),
    ({"ignore_eos": False}, "load.ignore_eos: allowed true (output lengths are enforced: every request generates its planned length, and a shorter one counts as a mismatch), got false"),
    ({"name": "none", "requests": None, "rate": 4.0},
     "load.rate: allowed null with load=none (the single-session phases; choose load=constant|poisson|gamma|trace "
     "for a load), got 4.0"),
]


@pytest.mark.parametrize("override,message", REFUSALS, ids=[m.split(":")[0] + f"-{i}" for i, (_, m) in
                                                            enumerate(REFUSALS)])
def test_every_refusal_is_one_line_naming_the_key_the_allowed_and_the_given(override, message):
    with pytest.raises(ValueError) as e:
        check_load(LoadConf(**{**BASE, **override}))
    assert str(e.value) == message and "\n" not in message


def test_the_base_of_the_refusals_is_accepted_and_none_schedules_nothing():
    assert check_load(LoadConf(**BASE)) == LoadConf(**BASE)
    assert schedule(LoadConf()) == [] and describe(LoadConf()) == "no load (single-session phases)"


# --- labels and the shipped options -------------------------------------------------------------
def test_describe_says_the_process_the_count_the_concurrency_and_the_lengths():
    conf = LoadConf(name="poisson", rate=4.0, requests=32, warmup_requests=2, max_concurrency=4)
    assert describe(conf) == ("poisson 4 req/s, 32 requests (2 warm-up), max 4 concurrent, in 256 fixed, "
                              "out 64 fixed, seed 0")
    conf = LoadConf(name="gamma", rate=0.5, burstiness=0.25, duration_s=60.0, ramp_s=5.0, input_dist="uniform",
                    input_ratio=0.25, output_dist="normal", output_std=16.0, seed=3)
    assert describe(conf) == ("gamma 0.5 req/s burstiness 0.25, 60 s of arrivals, unlimited concurrency, "
                              "steady window +5 s / -0 s, in 256 uniform ±25%, out 64 normal sd 16, seed 3")
    assert describe(LoadConf(name="constant", requests=8, max_concurrency=2)).startswith("closed loop, 8 requests")
    conf = LoadConf(name="poisson", rate=2.0, requests=8, input_dist="dataset", output_dist="dataset",
                    dataset_file="data/lengths.csv")
    assert describe(conf) == ("poisson 2 req/s, 8 requests, unlimited concurrency, in dataset lengths.csv, "
                              "out dataset lengths.csv, seed 0")


OPTIONS = sorted((REPO / "conf" / "load").glob("*.yaml"))


def test_there_is_one_option_per_load_name():
    assert sorted(p.stem for p in OPTIONS) == sorted(NAMES)


@pytest.mark.parametrize("path", OPTIONS, ids=lambda p: p.stem)
def test_each_option_builds_a_checked_load_conf(path, tmp_path):
    assert path.read_text().startswith("# ")
    values = OmegaConf.to_container(OmegaConf.load(path))            # `???`: given on the command line
    if values.get("trace_file") == "???":
        values["trace_file"] = str(tmp_path / "t.jsonl")
        Path(values["trace_file"]).write_text("".join(json.dumps({"timestamp": 500 * i}) + "\n" for i in range(6)))
    conf = check_load(LoadConf(**values))
    assert conf.name == path.stem
    plans = schedule(conf)
    assert (len(plans) == 0) == (conf.name == "none")
    assert describe(conf)
