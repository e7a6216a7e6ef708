"""Tests for harness.results: schema (golden files), atomic job writes, load, sweeps.

Golden files live in tests/harness/golden/; after an intended schema change regenerate
them with MOEBENCH_UPDATE_GOLDEN=1 and review the diff.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from harness import results as R

GOLDEN = Path(__file__).parent / "golden"
UPDATE_GOLDEN = os.environ.get("MOEBENCH_UPDATE_GOLDEN") == "1"

FACTORS = {"engine": "moebench", "model": "tiny-mixtral", "placement": "fetch",
           "cache_capacity": 4, "cache_policy": "lru", "prefetch": "none",
           "workload": "coding_agent", "context_tokens": 256, "gen_tokens": 8, "batch": 1,
           "dtype": "float32", "expert_quant": "none", "kv_dtype": "model"}
DEVICE = {"device_kind": "cpu", "device_name": "emulated-cpu", "emulated": True}
MANIFEST = {"schema_version": 1, "config": {"placement": "fetch"}}


def _job_rows(job_id: str, factors: dict, repeats: int = 2, scale: float = 1.0,
              extra: dict | None = None) -> list[dict]:
    rows: list[dict] = []
    for rep in range(repeats):
        rows += R.make_rows(factors, DEVICE, "s1", job_id, rep, "prefill_fresh",
                            {"time_s": scale * (0.5 + rep * 0.25), "tokens": 256.0,
                             "h2d_bytes": 1024.0 * (rep + 1), "peak_device_bytes": None},
                            "engine", extra=extra)
        rows += R.make_rows(factors, DEVICE, "s1", job_id, rep, "decode",
                            {"time_s": scale * (0.125 + rep * 0.125), "tpot_s_p50": 0.015625},
                            "engine", extra=extra)
    return rows


def build_tree(root: Path) -> Path:
    """A small fixed tree: root/sweeps/s1/{0,1,2}; job 2 failed. Returns the sweep dir."""
    sweep = root / "sweeps" / "s1"
    R.write_job(sweep / "0", _job_rows("0", FACTORS, extra={"profiler": "none", "ubatch": 512}),
                MANIFEST)
    R.write_job(sweep / "1", _job_rows("1", {**FACTORS, "cache_capacity": "auto"}, scale=2.0),
                MANIFEST)
    R.write_job(sweep / "2", [R.failed_row({**FACTORS, "cache_capacity": 1}, DEVICE, "s1", "2",
                                           "DeviceMemoryError: plan needs 3.0 GiB, budget 2.0 GiB")],
                MANIFEST)
    return sweep


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    keys = ["sweep_id", "job_id", "repeat", "phase", "metric", "source"]
    return df.sort_values(keys, kind="stable", na_position="first").reset_index(drop=True)


def _check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE_GOLDEN:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"golden file {path} missing; run with MOEBENCH_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{name} differs from its golden file {path}"


# ----------------------------------------------------------------------------- golden

def test_rows_parquet_schema_matches_golden(tmp_path: Path) -> None:
    R.write_job(tmp_path / "job", _job_rows("0", FACTORS, extra={"profiler": "none"}), MANIFEST)
    schema = pq.read_schema(tmp_path / "job" / R.ROWS_FILE)
    fields = [[f.name, str(f.type)] for f in schema]
    columns = ",\n".join(f"  {json.dumps(f)}" for f in fields)
    text = f'{{"schema_version": {R.SCHEMA_VERSION},\n "columns": [\n{columns}\n ]}}\n'
    assert json.loads(text)["columns"] == fields
    _check_golden("rows_schema.json", text)
    assert schema.metadata[b"moebench.schema_version"] == b"1"
    assert [f[0] for f in fields][:len(R.REQUIRED_COLUMNS)] == R.REQUIRED_COLUMNS


def test_load_and_summary_of_fixed_tree_match_golden(tmp_path: Path) -> None:
    sweep = build_tree(tmp_path)
    _check_golden("load_small_tree.csv", R.load(tmp_path).to_csv(index=False))
    R.write_sweep(sweep)
    _check_golden("summary_small_tree.csv", (sweep / R.SUMMARY_FILE).read_text())


def test_load_dtypes(tmp_path: Path) -> None:
    df = R.load(build_tree(tmp_path))
    assert list(df.columns[:len(R.REQUIRED_COLUMNS)]) == R.REQUIRED_COLUMNS
    assert df["value"].dtype == "float64"
    for col in ("repeat", "context_tokens", "gen_tokens", "batch"):
        assert df[col].dtype == "Int64", col
    assert df["emulated"].dtype == "boolean"
    assert set(df["cache_capacity"]) == {"4", "auto", "1"}  # requested value, as text
    assert set(df["unit"].dropna()) <= set(R.METRIC_UNITS.values()) | {R.schema.ERROR_UNIT}


# ----------------------------------------------------------------------------- load

def test_job_sweep_and_tree_give_the_same_rows(tmp_path: Path) -> None:
    sweep = build_tree(tmp_path)
    tree, by_sweep = R.load(tmp_path), R.load(sweep)
    pd.testing.assert_frame_equal(_sorted(tree), _sorted(by_sweep))
    job0 = R.load(sweep / "0")
    expected = tree[tree["job_id"] == "0"].dropna(axis=1, how="all")
    pd.testing.assert_frame_equal(_sorted(job0), _sorted(expected), check_dtype=False)
    jobs = pd.concat([R.load(sweep / j) for j in ("0", "1", "2")], ignore_index=True)
    assert len(jobs) == len(tree) == 2 * 2 * 6 + 1
    assert R.load(sweep / "0" / R.ROWS_FILE).shape == job0.shape  # a single file works too


def test_corrupt_parquet_names_the_file(tmp_path: Path) -> None:
    sweep = build_tree(tmp_path)
    bad = sweep / "1" / R.ROWS_FILE
    bad.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(R.ResultsError) as err:
        R.load(tmp_path)
    assert str(bad) in str(err.value)
    assert "unreadable" in str(err.value)


def test_invalid_schema_names_file_and_column(tmp_path: Path) -> None:
    build_tree(tmp_path)
    bad = tmp_path / "other" / R.ROWS_FILE
    bad.parent.mkdir()
    table = R.rows_to_table(_job_rows("9", FACTORS, repeats=1)).drop_columns(["metric"])
    table = table.set_column(table.schema.get_field_index("value"), "value",
                             pa.array(["fast"] * table.num_rows))
    pq.write_table(table, bad)
    assert len(R.load(tmp_path)) == 25             # no DONE beside it: an incomplete job, not read
    with pytest.raises(R.ResultsError) as err:
        R.load(bad)                                  # named explicitly, it is read and refused
    msg = str(err.value)
    assert str(bad) in msg and "'metric'" in msg and "column 'value' has type string" in msg


def test_bad_status_is_rejected_naming_file(tmp_path: Path) -> None:
    bad = tmp_path / "j" / R.ROWS_FILE
    bad.parent.mkdir()
    df = pd.DataFrame(_job_rows("0", FACTORS, repeats=1))
    df["status"] = "maybe"
    pq.write_table(pa.Table.from_pandas(df, preserve_index=False), bad)
    (bad.parent / R.DONE_FILE).write_text(json.dumps({"status": "ok", "rows": len(df)}))
    with pytest.raises(R.ResultsError, match="maybe") as err:
        R.load(tmp_path)                             # a DONE beside it: a complete job, so it must be valid
    assert str(bad) in str(err.value)


def test_temp_and_partial_files_are_ignored(tmp_path: Path) -> None:
    sweep = build_tree(tmp_path)
    before = R.load(tmp_path)
    # a job killed mid-write: only a temp file, no rows.parquet, no DONE
    killed = sweep / "3"
    killed.mkdir()
    (killed / ".rows.parquet.abc123.tmp").write_bytes(b"half a parquet")
    (sweep / "0" / ".results.parquet.x.tmp").write_bytes(b"junk")
    pd.testing.assert_frame_equal(R.load(tmp_path), before)
    assert not R.job_complete(killed)
    with pytest.raises(R.ResultsError, match="not a results file"):
        R.load(killed / ".rows.parquet.abc123.tmp")


def test_empty_tree_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "empty" / "job").mkdir(parents=True)
    with pytest.raises(R.ResultsError, match="no results under"):
        R.load(tmp_path / "empty")
    with pytest.raises(FileNotFoundError):
        R.load(tmp_path / "nowhere")


# ----------------------------------------------------------------------------- jobs

def test_job_complete_and_status(tmp_path: Path) -> None:
    sweep = build_tree(tmp_path)
    assert R.job_complete(sweep / "0") and R.job_status(sweep / "0") == "ok"
    assert R.job_complete(sweep / "2") and R.job_status(sweep / "2") == "failed"
    assert not R.job_complete(tmp_path / "missing")
    # killed after rows.parquet but before the manifest / DONE: not complete
    (sweep / "1" / R.DONE_FILE).unlink()
    assert not R.job_complete(sweep / "1")
    (sweep / "0" / R.MANIFEST_FILE).unlink()
    assert not R.job_complete(sweep / "0")
    assert json.loads((sweep / "2" / R.DONE_FILE).read_text())["status"] == "failed"


def test_write_job_leaves_no_temp_files_and_cleans_old_ones(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    (job / ".rows.parquet.old.tmp").write_bytes(b"left by a killed run")
    R.write_job(job, _job_rows("0", FACTORS), MANIFEST)
    assert sorted(p.name for p in job.iterdir()) == [R.DONE_FILE, R.MANIFEST_FILE, R.ROWS_FILE]
    assert json.loads((job / R.MANIFEST_FILE).read_text()) == MANIFEST


def test_write_job_refuses_mixed_jobs_empty_rows_and_bad_manifest(tmp_path: Path) -> None:
    with pytest.raises(R.ResultsError, match="one \\(sweep_id, job_id\\)"):
        R.write_job(tmp_path / "j", _job_rows("0", FACTORS) + _job_rows("1", FACTORS), MANIFEST)
    with pytest.raises(R.ResultsError, match="no rows"):
        R.write_job(tmp_path / "j", [], MANIFEST)
    with pytest.raises(R.ResultsError, match="JSON"):
        R.write_job(tmp_path / "j", _job_rows("0", FACTORS), {"bad": object()})
    assert not (tmp_path / "j" / R.ROWS_FILE).exists()


def test_none_is_stored_as_null_not_zero(tmp_path: Path) -> None:
    R.write_job(tmp_path / "job", _job_rows("0", FACTORS, repeats=1), MANIFEST)
    table = pq.read_table(tmp_path / "job" / R.ROWS_FILE)
    metrics, values = table.column("metric").to_pylist(), table.column("value").to_pylist()
    assert [v for m, v in zip(metrics, values) if m == "peak_device_bytes"] == [None]
    assert table.column("value").null_count == 1
    df = R.load(tmp_path)
    peak = df.loc[df["metric"] == "peak_device_bytes", "value"]
    assert peak.isna().all() and not (peak == 0).any()


def test_failed_job_has_status_and_error_text(tmp_path: Path) -> None:
    df = R.load(build_tree(tmp_path))
    failed = df[df["status"] == "failed"]
    assert len(failed) == 1
    row = failed.iloc[0]
    assert row["job_id"] == "2" and row["phase"] == "job" and row["metric"] == "error"
    assert pd.isna(row["value"]) and pd.isna(row["repeat"])
    assert "DeviceMemoryError" in row["error"]
    assert df.loc[df["status"] == "ok", "error"].isna().all()


def test_extra_columns_are_kept(tmp_path: Path) -> None:
    df = R.load(build_tree(tmp_path))
    assert {"profiler", "ubatch", "error"} <= set(df.columns)
    assert set(df.loc[df["job_id"] == "0", "ubatch"]) == {512}
    assert df.loc[df["job_id"] == "1", "ubatch"].isna().all()


# ----------------------------------------------------------------------------- sweeps

@pytest.mark.slow
def test_write_sweep_twice_gives_no_duplicates(tmp_path: Path) -> None:
    sweep = build_tree(tmp_path)
    first = R.write_sweep(sweep)
    second = R.write_sweep(sweep)
    pd.testing.assert_frame_equal(first, second)
    stored = pq.read_table(sweep / R.SWEEP_TABLE)
    assert stored.num_rows == len(first) == 25
    key = ["sweep_id", "job_id", "repeat", "phase", "metric", "source"]
    for df in (R.load(sweep), R.load(tmp_path), R.load(sweep / R.SWEEP_TABLE)):
        assert len(df) == 25 and not df.duplicated(key).any()
    summary = pd.read_csv(sweep / R.SUMMARY_FILE)
    assert not summary.duplicated(["job_id", "phase", "source", "metric"]).any()


def test_a_retired_job_is_not_read_from_the_older_sweep_table(tmp_path: Path) -> None:
    sweep = build_tree(tmp_path)
    R.write_sweep(sweep)
    R.remove_job(sweep / "1")         # a twin stands in for it; the process dies before the table is rewritten
    R.invalidate_job(sweep / "0")     # being measured again when it died
    assert set(R.load(sweep).job_id) == {"2"}
    R.write_sweep(sweep)              # anyone's table: nothing deleted (a writer may be mid-job)
    assert (sweep / "1" / R.ROWS_FILE).is_file() and set(R.load(sweep).job_id) == {"2"}
    R.write_sweep(sweep, clear_leftovers=True)   # the sweep writer's: the retired job's leftovers go, the other's stay
    assert not (sweep / "1" / R.ROWS_FILE).exists() and (sweep / "0" / R.ROWS_FILE).is_file()
    for df in (R.load(sweep), R.load(sweep / R.SWEEP_TABLE)):
        assert set(df.job_id) == {"2"}


@pytest.mark.slow
def test_sweep_table_alone_still_loads(tmp_path: Path) -> None:
    sweep = build_tree(tmp_path)
    R.write_sweep(sweep)
    moved = tmp_path / "archive"
    moved.mkdir()
    shutil.copy(sweep / R.SWEEP_TABLE, moved / R.SWEEP_TABLE)
    pd.testing.assert_frame_equal(_sorted(R.load(moved)), _sorted(R.load(sweep)))
    # job-level file wins over the sweep table for the same job
    shutil.rmtree(sweep / "1")
    df = R.load(sweep)
    assert len(df) == 25 and (df["job_id"] == "1").sum() == 12


@pytest.mark.slow
def test_summary_medians_spread_and_failed_rows(tmp_path: Path) -> None:
    sweep = build_tree(tmp_path)
    R.write_sweep(sweep)
    summary = pd.read_csv(sweep / R.SUMMARY_FILE, dtype={"job_id": str})
    fresh = summary[(summary["job_id"] == "0") & (summary["phase"] == "prefill_fresh")].set_index("metric")
    t = fresh.loc["time_s"]                                  # repeats 0.5 and 0.75
    assert (t["median"], t["min"], t["max"], t["n"]) == (pytest.approx(0.625), 0.5, 0.75, 2)
    assert (t["p25"], t["p75"]) == (pytest.approx(0.5625), pytest.approx(0.6875))
    assert t["unit"] == "s" and t["status"] == "ok"
    dev = fresh.loc["peak_device_bytes"]
    assert dev["n"] == 0 and pd.isna(dev["median"])           # null stays null, never 0
    wide = R.summarize(R.load(sweep))
    assert wide[(wide.job_id == "0") & (wide.phase == "prefill_fresh")]["time_s"].iloc[0] == pytest.approx(0.625)
    failed = summary[summary["job_id"] == "2"]
    assert list(failed["status"]) == ["failed"] and "budget 2.0 GiB" in failed.iloc[0]["error"]


def test_write_sweep_without_jobs_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(R.ResultsError, match="no jobs under sweep dir"):
        R.write_sweep(tmp_path)


# ----------------------------------------------------------------------------- rows

def test_make_rows_units_and_validation() -> None:
    rows = R.make_rows(FACTORS, DEVICE, "s1", 0, 0, "decode",
                       {"time_s": 1, "gflops": 2.5, "hit_rate": float("nan")}, "client",
                       units={"gflops": "GFLOP/s"})
    assert [r["unit"] for r in rows] == ["s", "GFLOP/s", "ratio"]
    assert rows[0]["job_id"] == "0" and rows[0]["value"] == 1.0 and rows[2]["value"] is None
    assert rows[0]["cache_capacity"] == "4"
    assert list(rows[0])[:len(R.ROW_COLUMNS)] == R.ROW_COLUMNS
    with pytest.raises(R.ResultsError, match="'gflops'.*no unit"):
        R.make_rows(FACTORS, DEVICE, "s1", "0", 0, "decode", {"gflops": 1.0}, "engine")
    with pytest.raises(R.ResultsError, match="source must be one of .*'measured'"):
        R.make_rows(FACTORS, DEVICE, "s1", "0", 0, "decode", {"time_s": 1.0}, "measured")
    with pytest.raises(R.ResultsError, match="'time_s'.*'fast'"):
        R.make_rows(FACTORS, DEVICE, "s1", "0", 0, "decode", {"time_s": "fast"}, "engine")
    with pytest.raises(R.ResultsError, match="unit 's' by contract"):
        R.make_rows(FACTORS, DEVICE, "s1", "0", 0, "decode", {"time_s": 1.0}, "engine",
                    units={"time_s": "ms"})
    with pytest.raises(R.ResultsError, match="'context_tokens'.*'long'"):
        R.make_rows({**FACTORS, "context_tokens": "long"}, DEVICE, "s1", "0", 0, "decode",
                    {"time_s": 1.0}, "engine")
    with pytest.raises(R.ResultsError, match="reuse schema column names"):
        R.make_rows(FACTORS, DEVICE, "s1", "0", 0, "decode", {"time_s": 1.0}, "engine",
                    extra={"phase": "x"})
    with pytest.raises(R.ResultsError, match="error text"):
        R.failed_row(FACTORS, DEVICE, "s1", "0", "")


def test_mixed_type_extra_column_is_stored_as_text(tmp_path: Path) -> None:
    rows = (R.make_rows(FACTORS, DEVICE, "s1", "0", 0, "decode", {"time_s": 1.0}, "engine",
                        extra={"cache_state": "warm"})
            + R.make_rows(FACTORS, DEVICE, "s1", "0", 1, "decode", {"time_s": 1.0}, "engine",
                          extra={"cache_state": 3}))
    R.write_job(tmp_path / "j", rows, MANIFEST)
    assert list(R.load(tmp_path)["cache_state"]) == ["warm", "3"]
