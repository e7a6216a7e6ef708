"""Which rows a reader takes (harness.contract): the speed rows, one instrumented pass's rows and
the measured repeats -- the one rule the table, outliers, plots, notebooks, compare and the cost
model's validation all read."""
from __future__ import annotations

import pandas as pd

from harness import results
from harness.contract import profiled_rows, repeat_rows, speed_rows, speed_values
from harness.costmodel.validate import measured_rows

DEVICE = {"device_kind": "cpu", "device_name": "cpu (emulated device)", "emulated": True}
FACTORS = {"engine": "moebench", "model": "tiny-mixtral", "placement": "resident", "cache_capacity": None,
           "cache_policy": None, "prefetch": "none", "workload": "chat", "context_tokens": 64, "gen_tokens": 4,
           "batch": 1, "dtype": "float32"}


def table() -> pd.DataFrame:
    def rows(repeat, phase, profiler, value=1.0, source="client"):
        return results.make_rows(FACTORS, DEVICE, "s", "j", repeat, phase, {"time_s": value}, source,
                                 extra={"profiler": profiler})
    df = pd.DataFrame(rows(None, "load", "none") + rows(0, "decode", "none") + rows(1, "decode", None)
                      + rows(0, "decode", "timeline", 2.0) + rows(0, "quality", "quality", 3.0)
                      + rows(2, "decode", "none", None) + rows(0, "prefill_fresh", "none", 4.0, source="engine")
                      + [results.failed_row(FACTORS, DEVICE, "s", "j2", "boom", repeat=0, extra={"profiler": "none"})])
    return df


def test_speed_rows_are_ok_and_uninstrumented_a_missing_profiler_included():
    df = table()
    speed = speed_rows(df)
    assert set(speed["status"]) == {"ok"}
    assert set(speed["profiler"].fillna("<missing>")) == {"none", "<missing>"}
    assert len(speed) == 5                                   # load, two decode repeats, the null value, the engine's
    assert len(speed_values(df)) == 4                        # the null value left out
    assert sorted(repeat_rows(df)["repeat"].tolist()) == [0, 0, 1, 2]     # load has no repeat
    assert len(speed_rows(df.drop(columns="profiler"))) == 7  # no column: every ok row is un-instrumented


def test_one_pass_rows_by_name():
    df = table()
    assert profiled_rows(df, "timeline")["value"].tolist() == [2.0]
    assert profiled_rows(df, "quality")["value"].tolist() == [3.0]
    assert profiled_rows(df.drop(columns="profiler"), "timeline").empty


def test_the_cost_model_compares_with_the_contracts_speed_rows():
    df = table()
    got = measured_rows(df)
    speed = speed_rows(df)
    assert set(got.index) <= set(speed.index)                # never a row the contract calls instrumented
    # the predicted phases of the speed rows, from the client or the engine: load is not predicted
    assert set(got.index) == set(speed[speed["phase"] != "load"].index)
    assert measured_rows(df, "timeline")["value"].tolist() == [2.0]
