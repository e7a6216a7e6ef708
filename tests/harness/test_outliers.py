"""Flagged repeats: the outlier rule on values, the `outlier` column the runner sets on a job's
rows, and `moebench table` / summary.csv on real written results naming a stalled or starved
repeat and leaving it out of the median -- a 90 s stalled prefill beside 0.08 s ones is named,
never shown as `45.70 ± 45.03`."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pandas as pd
import pytest

from harness import results as R
from harness.outliers import MIN_REPEATS, flag_outliers, outliers
from harness.table import sweep_table
from tests.cli_runner import run_cli

REPO = Path(__file__).resolve().parents[2]
FACTORS = {"engine": "moebench", "model": "tiny-mixtral", "cache_policy": "lru", "prefetch": "none",
           "workload": "chat", "context_tokens": 256, "gen_tokens": 8, "batch": 1, "dtype": "float32",
           "cache_capacity": None}
DEVICE = {"device_kind": "cpu", "device_name": "cpu (emulated device)", "emulated": True}
STALL = 90.7


def test_the_rule_flags_a_stall_not_jitter():
    assert outliers([0.081, 0.079, STALL, 0.080, 0.082]) == [False, False, True, False, False]
    assert outliers([0.08, 0.14, 0.081]) == [False, False, False]          # 1.75x: a busy machine's jitter
    assert outliers([0.08, 0.17, 0.081]) == [False, True, False]           # over 2x off the median
    assert outliers([3062.0, 2990.0, 22.6]) == [False, False, True]         # a rate: the same verdict
    assert outliers([0.5, 0.5, 0.5]) == [False, False, False]
    assert outliers([0.08, STALL]) is None and MIN_REPEATS == 3            # two cannot say which is off


def rows_of(job: str, placement: str, prefill_s: list[float], starved: list[bool] | None = None) -> list[dict]:
    """A job's measured rows as the runner emits them: client speeds and engine counters per repeat."""
    f = {**FACTORS, "placement": placement}
    rows = []
    for r, t in enumerate(prefill_s):
        extra = {"profiler": "none", **({"starved": starved[r]} if starved else {})}
        rows += R.make_rows(f, DEVICE, "s", job, r, "prefill_fresh",
                            {"time_s": t, "ttft_s": t, "tok_per_s": 256 / t}, "client", extra=extra)
        rows += R.make_rows(f, DEVICE, "s", job, r, "prefill_fresh", {"h2d_bytes": 1024.0}, "engine", extra=extra)
        rows += R.make_rows(f, DEVICE, "s", job, r, "decode", {"tok_per_s": 100.0 + r}, "client",
                            extra={"profiler": "none"})
    return rows


def test_the_runner_flags_the_stalled_repeats_rows():
    rows = rows_of("0", "fetch", [0.081, 0.079, STALL, 0.080, 0.082])
    flag_outliers(rows)
    df = pd.DataFrame(rows)
    judged = df[df.outlier.notna()]
    assert set(judged.metric) == {"time_s", "ttft_s", "tok_per_s"}          # speeds; counters are not judged
    assert set(judged[judged.outlier.astype(bool)].repeat) == {2}
    assert set(judged[judged.outlier.astype(bool)].phase) == {"prefill_fresh"}
    assert df[df.metric == "h2d_bytes"].outlier.isna().all()
    few = rows_of("1", "fetch", [0.08, STALL])
    flag_outliers(few)
    assert "outlier" not in pd.DataFrame(few)                                 # too few repeats: nothing set


def cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]


@pytest.mark.slow
def test_table_and_summary_name_flagged_repeats_and_leave_them_out(tmp_path):
    sweep = tmp_path / "s"
    outlier_rows = rows_of("0", "fetch", [0.081, 0.079, STALL, 0.080, 0.082])
    flag_outliers(outlier_rows)                                               # as the runner stores them
    R.write_job(sweep / "0", outlier_rows, {"t": 1})
    R.write_job(sweep / "1", rows_of("1", "cpu", [0.08, STALL], starved=[False, True]), {"t": 1})
    R.write_job(sweep / "2", rows_of("2", "resident", [0.08, 0.081]), {"t": 1})
    R.write_job(sweep / "3", rows_of("3", "hybrid", [0.081, 0.079, STALL]), {"t": 1})   # from before the column
    R.write_sweep(sweep)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = run_cli(["table", str(sweep), "--format", "md"], Path.cwd(), env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    table = {r[0]: dict(zip(cells(lines[0]), r)) for r in map(cells, lines[2:])}
    assert table["fetch"]["flagged repeats"] == "1 of 5 (outlier 1: prefill_fresh), excluded"
    assert table["fetch"]["TTFT s"] == "0.0805 ± 0.0015"                     # the four unflagged repeats
    assert table["cpu"]["flagged repeats"] == ("1 of 2 (starved 1: prefill_fresh), excluded; "
                                               "too few repeats to judge outliers")
    assert table["cpu"]["TTFT s"] == "0.0800"                                # not 45.39 ± 45.31
    assert table["resident"]["flagged repeats"] == "too few repeats to judge (2 < 3)"
    assert table["resident"]["TTFT s"] == "0.0805 ± 0.0005"
    assert table["hybrid"]["flagged repeats"] == "1 of 3 (outlier 1: prefill_fresh), excluded"
    assert "flagged repeats are excluded from the medians and spreads: outlier = at least 2x off" in proc.stdout
    assert table["fetch"]["tg tok/s"] == "102.0 ± 2.0"                       # decode was not flagged: all five
    t = sweep_table(R.load(sweep))
    assert list(t["flagged n"]) == [1, 1, 0, 1]

    summary = pd.read_csv(sweep / R.SUMMARY_FILE)
    ttft = summary[(summary.metric == "ttft_s")].set_index("placement")
    assert list(ttft.loc[["fetch", "cpu", "resident", "hybrid"], "n"]) == [4, 1, 2, 2]
    assert list(ttft.loc[["fetch", "cpu", "resident", "hybrid"], "n_flagged"]) == [1, 1, 0, 1]
    assert ttft.loc["fetch", "flagged"] == "outlier" and ttft.loc["cpu", "flagged"] == "starved"
    assert ttft.loc["cpu", "median"] == 0.08 and pd.isna(ttft.loc["resident", "flagged"])
