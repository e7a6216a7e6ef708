"""The nsys command line, finding nsys, and reading the checked-in export fixture.

The fixture's timeline is drawn in tests/profiling/build_nsys_fixture.py; every expected
value below is worked out by hand from it (times in microseconds after T0; the export
holds integer nanoseconds, the rows hold seconds)."""
from __future__ import annotations

import shutil
import sqlite3
import stat
from pathlib import Path

import pytest

from harness.profiling.nsys import (NSYS_COMMAND, ROW_UNITS, NsysExportError, NsysNotFound, find_nsys,
                                    nsys_command, nsys_rows, read_nsys_sqlite, trace_sqlite)
from tests.profiling import build_nsys_fixture as fixture_builder

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "nsys_small.sqlite"
US = 1e-6


def by_scope(rows: list[dict]) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for r in rows:
        assert r["source"] == "nsys" and r["unit"] == ROW_UNITS[r["metric"]]
        assert r["metric"] not in out.setdefault(r["scope"], {}), "one row per (scope, metric)"
        out[r["scope"]][r["metric"]] = r["value"]
    return out


@pytest.fixture()
def fixture_copy(tmp_path: Path) -> Path:
    dst = tmp_path / "trace.sqlite"
    shutil.copyfile(FIXTURE, dst)
    return dst


# ----------------------------------------------------------------------------- command line

def test_nsys_command_template_is_exact():
    assert NSYS_COMMAND == ("nsys profile --trace=cuda,nvtx,osrt --sample=none --cpuctxsw=none "
                            "--capture-range=cudaProfilerApi --capture-range-end=stop --export=sqlite "
                            "-f true -o <job dir>/trace")


def test_nsys_command_prepends_profile(tmp_path: Path):
    cmd = nsys_command(tmp_path / "job 1", ["python", "-m", "harness.app", "placement=fetch"])
    assert cmd == ["nsys", "profile", "--trace=cuda,nvtx,osrt", "--sample=none", "--cpuctxsw=none",
                   "--capture-range=cudaProfilerApi", "--capture-range-end=stop", "--export=sqlite",
                   "-f", "true", "-o", str(tmp_path / "job 1" / "trace"),
                   "python", "-m", "harness.app", "placement=fetch"]
    assert " ".join(cmd[:-6]) + " -o <job dir>/trace" == NSYS_COMMAND
    assert cmd[-5] == str(tmp_path / "job 1" / "trace")   # a job dir with a space stays one word
    assert nsys_command("j", ["x"], nsys="/opt/nsys/bin/nsys")[0] == "/opt/nsys/bin/nsys"
    assert trace_sqlite(tmp_path) == tmp_path / "trace.sqlite"
    with pytest.raises(ValueError, match="argv must be a non-empty list"):
        nsys_command(tmp_path, "python -m x")


# ----------------------------------------------------------------------------- find_nsys

def _fake_exe(path: Path) -> Path:
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_find_nsys_absent_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("NSYS", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))          # an empty directory: no nsys anywhere
    with pytest.raises(NsysNotFound) as err:
        find_nsys()
    msg = str(err.value)
    assert "not installed or not on PATH" in msg
    assert str(tmp_path) in msg                          # what was searched
    assert "Nsight Systems" in msg and "NSYS=/path/to/nsys" in msg   # how to get it


def test_find_nsys_bad_env_value(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("NSYS", str(tmp_path / "nope" / "nsys"))
    with pytest.raises(NsysNotFound, match=r"NSYS='.*nope/nsys' is not an executable nsys binary"):
        find_nsys()


def test_find_nsys_env_and_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    exe = _fake_exe(tmp_path / "nsys")
    monkeypatch.delenv("NSYS", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_nsys() == str(exe)
    other = tmp_path / "elsewhere"
    other.mkdir()
    monkeypatch.setenv("NSYS", str(_fake_exe(other / "nsys-2024.6")))
    assert find_nsys() == str(other / "nsys-2024.6")


# ----------------------------------------------------------------------------- the fixture

def test_builder_reproduces_checked_in_fixture(tmp_path: Path):
    rebuilt = fixture_builder.build(tmp_path / "rebuilt.sqlite")
    dump = lambda p: list(sqlite3.connect(p).iterdump())   # noqa: E731 -- schema + every row, in order
    assert dump(rebuilt) == dump(FIXTURE)
    assert FIXTURE.stat().st_size < 32 * 1024


def test_builder_runs_as_script(tmp_path: Path):
    assert fixture_builder.main([str(tmp_path / "x.sqlite")]) == 0
    assert read_nsys_sqlite(tmp_path / "x.sqlite")["memcpy"].shape[0] == 5


def test_fixture_enum_ids_are_not_nsys_numbering():
    # the trap that makes the by-name join matter: nsys's own ids mean other kinds here
    con = sqlite3.connect(FIXTURE)
    oper = dict(con.execute("SELECT name, id FROM ENUM_CUDA_MEMCPY_OPER"))
    kind = dict(con.execute("SELECT name, id FROM ENUM_CUDA_MEM_KIND"))
    assert oper["CUDA_MEMCPY_KIND_HTOD"] != 1 and oper["CUDA_MEMCPY_KIND_DTOH"] != 2
    assert kind["CUDA_MEMOPR_MEMORY_KIND_PINNED"] != 1 and kind["CUDA_MEMOPR_MEMORY_KIND_PAGEABLE"] != 0


def test_read_classifies_by_name():
    t = read_nsys_sqlite(FIXTURE)
    m = t["memcpy"].sort_values("start")
    # C1..C5 in start order
    assert m["direction"].tolist() == ["h2d", "h2d", "h2d", "d2h", "h2d"]
    assert m["host_memory"].tolist() == ["pinned", "pageable", "pinned", "pinned", "pinned"]
    assert m["copy_kind"].tolist()[:2] == ["CUDA_MEMCPY_KIND_HTOD"] * 2
    assert t["kernel"]["name"].tolist()[-1] == "reduce_kernel"      # shortName via StringIds
    nv = t["nvtx"].sort_values("start")
    # the domain-create event and the mark (no end) are not ranges; textId resolves to its string
    assert nv["name"].tolist() == ["warmup:setup", "moebench:prefill_fresh", "moebench:decode", "moebench:decode"]
    assert nv["range_kind"].tolist() == ["push_pop", "push_pop", "start_end", "push_pop"]
    assert dict(zip(t["meta"]["name"], t["meta"]["value"]))["EXPORT_SCHEMA_VERSION"] == "3.16.1"


def test_rows_whole_capture_by_hand():
    s = by_scope(nsys_rows(FIXTURE))["all"]
    # bytes: pinned H2D = C1 + C3 + C5 = 100000 + 50000 + 60000 = 210000
    #        pageable H2D = C2 = 40000; all H2D = 250000; D2H = C4 = 8000
    assert s["h2d_bytes_pinned"] == 210_000
    assert s["h2d_bytes_pageable"] == 40_000
    assert s["h2d_bytes"] == 250_000
    assert s["d2h_bytes"] == 8_000
    # pinned H2D busy: [2,6] + [13,15] + [20,22] = 4 + 2 + 2 = 8 us -> 210000 / 8e-6 / 1e9 = 26.25 GB/s
    assert s["h2d_time_s_pinned"] == pytest.approx(8 * US)
    assert s["h2d_gbps_pinned"] == pytest.approx(26.25)
    # pageable: [4,8] = 4 us -> 40000 / 4e-6 / 1e9 = 10 GB/s
    assert s["h2d_time_s_pageable"] == pytest.approx(4 * US)
    assert s["h2d_gbps_pageable"] == pytest.approx(10.0)
    # copy union: [2,6] u [4,8] = [2,8] (C1 and C2 overlap: 6, not 8), [13,15], [16,17], [20,22]
    #   = 6 + 2 + 1 + 2 = 11 us
    assert s["copy_busy_s"] == pytest.approx(11 * US)
    # kernel union: [1,3], [5,10], [12,14] u [14,16] = [12,16] (touching), [21,24] = 2 + 5 + 4 + 3 = 14 us
    assert s["kernel_busy_s"] == pytest.approx(14 * US)
    # overlap: [2,8] n ([1,3],[5,10]) = [2,3] + [5,8] = 1 + 3 = 4; [13,15] n [12,16] = 2;
    #   [16,17] n [12,16] = 0 (touching); [20,22] n [21,24] = 1 -> 4 + 2 + 0 + 1 = 7 us
    assert s["overlap_s"] == pytest.approx(7 * US)
    assert s["exposed_copy_s"] == pytest.approx(4 * US)          # 11 - 7
    assert s["overlap_frac"] == pytest.approx(7 / 11)
    assert s["link_gbps"] == pytest.approx(250_000 / 11e-6 / 1e9)   # 22.727... GB/s


def test_rows_per_nvtx_range_by_hand():
    scopes = by_scope(nsys_rows(FIXTURE))
    assert list(scopes) == ["all", "moebench:decode", "moebench:prefill_fresh", "warmup:setup"]

    p = scopes["moebench:prefill_fresh"]       # window [1,11]
    # copies inside: C1 [2,6] pinned 100000, C2 [4,8] pageable 40000 -> union [2,8] = 6 us
    # kernels inside: [1,3], [5,10] = 7 us; overlap [2,3] + [5,8] = 4 us
    assert (p["h2d_bytes"], p["h2d_bytes_pinned"], p["h2d_bytes_pageable"], p["d2h_bytes"]) == \
        (140_000, 100_000, 40_000, 0)
    assert p["h2d_gbps_pinned"] == pytest.approx(25.0)            # 100000 / 4e-6 / 1e9
    assert p["h2d_gbps_pageable"] == pytest.approx(10.0)          # 40000 / 4e-6 / 1e9
    assert p["copy_busy_s"] == pytest.approx(6 * US)
    assert p["kernel_busy_s"] == pytest.approx(7 * US)
    assert p["overlap_s"] == pytest.approx(4 * US)
    assert p["exposed_copy_s"] == pytest.approx(2 * US)
    assert p["overlap_frac"] == pytest.approx(4 / 6)
    assert p["link_gbps"] == pytest.approx(140_000 / 6e-6 / 1e9)   # 23.33 GB/s

    d = scopes["moebench:decode"]              # two ranges of one name: [12,20] u [21,25]
    # copies: C3 [13,15] 50000 B; C4 D2H [16,17] 8000 B; C5 [20,22] clipped to [21,22] =
    #   half of it -> 60000 * 1/2 = 30000 B. pinned H2D = 50000 + 30000 = 80000
    assert d["h2d_bytes_pinned"] == pytest.approx(80_000)
    assert d["h2d_bytes"] == pytest.approx(80_000)
    assert d["d2h_bytes"] == pytest.approx(8_000)
    # pinned H2D time: [13,15] + [21,22] = 3 us -> 80000 / 3e-6 / 1e9 = 26.67 GB/s
    assert d["h2d_time_s_pinned"] == pytest.approx(3 * US)
    assert d["h2d_gbps_pinned"] == pytest.approx(80_000 / 3e-6 / 1e9)
    # no pageable copy: 0 bytes, 0 s, and no rate (None, not 0)
    assert (d["h2d_bytes_pageable"], d["h2d_time_s_pageable"], d["h2d_gbps_pageable"]) == (0, 0, None)
    # copy union [13,15], [16,17], [21,22] = 2 + 1 + 1 = 4 us
    # kernels clipped: [12,16] (K3 u K4), [21,24] = 4 + 3 = 7 us
    # overlap: [13,15] = 2, [16,17] touches [12,16] = 0, [21,22] = 1 -> 3 us
    assert d["copy_busy_s"] == pytest.approx(4 * US)
    assert d["kernel_busy_s"] == pytest.approx(7 * US)
    assert d["overlap_s"] == pytest.approx(3 * US)
    assert d["exposed_copy_s"] == pytest.approx(1 * US)
    assert d["overlap_frac"] == pytest.approx(0.75)
    assert d["link_gbps"] == pytest.approx(20.0)                  # 80000 / 4e-6 / 1e9

    w = scopes["warmup:setup"]                 # [-1,-0.5]: nothing ran
    assert w["copy_busy_s"] == 0 and w["kernel_busy_s"] == 0 and w["h2d_bytes"] == 0
    assert w["overlap_frac"] is None and w["link_gbps"] is None


def test_prefix_filter():
    scopes = by_scope(nsys_rows(FIXTURE, prefix="moebench:"))
    assert list(scopes) == ["all", "moebench:decode", "moebench:prefill_fresh"]
    assert len(nsys_rows(FIXTURE, prefix="moebench:")) == 3 * len(ROW_UNITS)


# ----------------------------------------------------------------------------- robustness

def _renumber(path: Path, enum: str, mapping: dict[str, int], refs: list[tuple[str, str]]) -> None:
    """Give `enum`'s names the ids in `mapping`, rewriting every referencing column."""
    con = sqlite3.connect(path)
    old = dict(con.execute(f"SELECT name, id FROM {enum}"))
    shift = 1_000_000                       # move out of the way first: ids are a primary key
    con.execute(f"UPDATE {enum} SET id = id + {shift}")
    for table, col in refs:
        con.execute(f"UPDATE {table} SET {col} = {col} + {shift}")
    for name, new in mapping.items():
        con.execute(f"UPDATE {enum} SET id = ? WHERE id = ?", (new, old[name] + shift))
        for table, col in refs:
            con.execute(f"UPDATE {table} SET {col} = ? WHERE {col} = ?", (new, old[name] + shift))
    con.commit()
    con.close()


@pytest.mark.parametrize("numbering", ["nsys", "shifted"])
def test_renumbered_enum_ids_parse_the_same(fixture_copy: Path, numbering: str):
    b = fixture_builder
    if numbering == "nsys":   # nsys 2024.6's own ids
        oper = {n: i for i, n, _ in b._MEMCPY_OPER}
        kind = {n: i for i, n, _ in b._MEM_KIND}
        event = {n: i for i, n, _ in b._EVENT_TYPE}
    else:                     # arbitrary ids
        oper = {n: 100 + 3 * i for n, i in b.MEMCPY_IDS.items()}
        kind = {n: 200 + 7 * i for n, i in b.MEM_KIND_IDS.items()}
        event = {n: 300 + i for n, i in b.EVENT_TYPE_IDS.items()}
    _renumber(fixture_copy, "ENUM_CUDA_MEMCPY_OPER", oper, [("CUPTI_ACTIVITY_KIND_MEMCPY", "copyKind")])
    _renumber(fixture_copy, "ENUM_CUDA_MEM_KIND", kind,
              [("CUPTI_ACTIVITY_KIND_MEMCPY", "srcKind"), ("CUPTI_ACTIVITY_KIND_MEMCPY", "dstKind")])
    _renumber(fixture_copy, "ENUM_NSYS_EVENT_TYPE", event, [("NVTX_EVENTS", "eventType")])
    con = sqlite3.connect(fixture_copy)
    assert dict(con.execute("SELECT name, id FROM ENUM_CUDA_MEMCPY_OPER"))["CUDA_MEMCPY_KIND_HTOD"] == \
        oper["CUDA_MEMCPY_KIND_HTOD"] != b.MEMCPY_IDS["CUDA_MEMCPY_KIND_HTOD"]
    con.close()
    assert nsys_rows(fixture_copy) == nsys_rows(FIXTURE)


def test_missing_optional_tables(fixture_copy: Path):
    con = sqlite3.connect(fixture_copy)
    con.execute("DROP TABLE NVTX_EVENTS")
    con.execute("DROP TABLE CUPTI_ACTIVITY_KIND_KERNEL")
    con.commit()
    con.close()
    t = read_nsys_sqlite(fixture_copy)
    assert t["nvtx"].empty and t["kernel"].empty
    scopes = by_scope(nsys_rows(fixture_copy))
    assert list(scopes) == ["all"]                       # no NVTX: the whole capture only
    s = scopes["all"]
    # no kernels: nothing hides the 11 us of copies
    assert s["copy_busy_s"] == pytest.approx(11 * US)
    assert (s["kernel_busy_s"], s["overlap_s"], s["overlap_frac"]) == (0, 0, 0)
    assert s["exposed_copy_s"] == pytest.approx(11 * US)


def test_export_without_any_activity(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    path = tmp_path / "empty.sqlite"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE StringIds (id INTEGER NOT NULL PRIMARY KEY, value TEXT NOT NULL)")
    con.close()
    with caplog.at_level("WARNING", logger="harness.profiling.nsys"):
        s = by_scope(nsys_rows(path))["all"]
    assert "no CUDA copies or kernels" in caplog.text
    assert s["copy_busy_s"] == 0 and s["overlap_frac"] is None and s["link_gbps"] is None


def test_memcpy_without_enum_tables_is_a_clear_error(fixture_copy: Path):
    con = sqlite3.connect(fixture_copy)
    con.execute("DROP TABLE ENUM_CUDA_MEM_KIND")
    con.commit()
    con.close()
    with pytest.raises(NsysExportError, match="no ENUM_CUDA_MEM_KIND table.*by name, never by numeric id"):
        read_nsys_sqlite(fixture_copy)


def test_non_nsys_sqlite_is_a_clear_error(tmp_path: Path):
    path = tmp_path / "other.sqlite"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE results (metric TEXT, value REAL)")
    con.close()
    with pytest.raises(NsysExportError, match=r"is not an Nsight Systems SQLite export: it has no StringIds "
                                              r"table \(tables found: \['results'\]\)"):
        read_nsys_sqlite(path)


def test_not_sqlite_and_missing_file(tmp_path: Path):
    text = tmp_path / "trace.sqlite"
    text.write_text("this is a CSV, not a database\n" * 10)
    with pytest.raises(NsysExportError, match="not an SQLite database"):
        read_nsys_sqlite(text)
    missing = tmp_path / "absent.sqlite"
    with pytest.raises(NsysExportError, match="no such file"):
        read_nsys_sqlite(missing)
    assert not missing.exists()                          # reading never creates a file


def test_unknown_schema_names_the_missing_columns(fixture_copy: Path):
    con = sqlite3.connect(fixture_copy)
    con.execute("ALTER TABLE CUPTI_ACTIVITY_KIND_MEMCPY DROP COLUMN srcKind")
    con.commit()
    con.close()
    with pytest.raises(NsysExportError, match=r"CUPTI_ACTIVITY_KIND_MEMCPY lacks column\(s\) \['srcKind'\]"):
        read_nsys_sqlite(fixture_copy)


def test_fixture_is_read_only_opened(fixture_copy: Path):
    before = fixture_copy.read_bytes()
    nsys_rows(fixture_copy)
    assert fixture_copy.read_bytes() == before
