"""Nsight Systems: the `nsys profile` command line, and its SQLite export read into tidy rows.

Owns:
  * the one `nsys profile` command line a profiled job runs under (`NSYS_COMMAND`,
    `nsys_command`), where its export lands (`trace_sqlite`), and finding the `nsys`
    binary (`find_nsys`, raising `NsysNotFound` with what to do);
  * reading an export (`read_nsys_sqlite`): host<->device copies, kernels and NVTX ranges
    as DataFrames, copy direction and host memory kind joined from the export's own enum
    tables *by name* (`CUDA_MEMCPY_KIND_HTOD`, `CUDA_MEMOPR_MEMORY_KIND_PINNED`, ...),
    never by numeric id, which nsys does not promise to keep;
  * tidy rows from it (`nsys_rows`): bytes, copy rates per host memory kind, and the
    DESIGN §5 overlap metrics, for the whole capture and per NVTX range name.
Does not own: interval arithmetic (`harness.profiling.overlap`), running the job, emitting
NVTX ranges (the engine's instrumentation hook), or storing rows (`harness.results`:
these rows carry `source="nsys"` and are diagnostic -- §7.5, speed tables come from runs
without a profiler).

    cmd = nsys_command(job_dir, ["moebench", "placement=fetch"], nsys=find_nsys())
    subprocess.run(cmd, check=True)       # the job calls cudaProfilerStart/Stop around what
    rows = nsys_rows(trace_sqlite(job_dir))   # it measures (--capture-range=cudaProfilerApi)

Timestamps in the export are integer nanoseconds; interval arithmetic stays in integer ns
and rows are in seconds, bytes and GB/s (1e9 B/s).

Decisions, so that readers of the rows can rely on them:
  * copy_busy_s is the union of *all* CUPTI memcpy intervals (every direction, every copy
    engine and stream: two concurrent copies count once); kernel_busy_s the union of all
    kernel intervals; overlap_s their intersection (`overlap.overlap_metrics`). Devices
    are pooled: moebench profiles one GPU per job.
  * A copy's host memory kind is its source kind for host->device copies and its
    destination kind for device->host copies. `h2d_time_s_<kind>` is the union of that
    kind's host->device intervals, so `h2d_gbps_<kind>` is the rate while such a copy was
    in flight; two concurrent copies are not counted as twice the time.
  * Per NVTX range: ranges (push/pop and start/end) are named by their text (registered
    strings resolved through StringIds); ranges of one name are merged into one window
    and every activity interval is clipped to it. A copy partly inside the window counts
    the same fraction of its bytes, so a clipped copy keeps its own rate. NVTX ranges are
    CPU-side times: GPU work launched inside a range but finishing after it is cut at the
    range's end unless the range ends after a synchronise (the harness's phases do).
  * Metric names: the §5 names where §5 defines them (h2d_bytes, d2h_bytes, copy_busy_s,
    overlap_s, exposed_copy_s, overlap_frac, link_gbps); the per-kind breakdown puts the
    kind last (`h2d_bytes_pinned`, `h2d_time_s_pinned`, `h2d_gbps_pageable`, like
    `tpot_s_p50`), so a wide table has one column per metric and nothing sums twice.
    A rate with no time under it is None, never 0.
"""
from __future__ import annotations

import bisect
import logging
import os
import shutil
import sqlite3
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from harness.profiling.overlap import Interval, intersection, merge, overlap_metrics, union_length

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- the command

NSYS_PROFILE_ARGS = ("profile", "--trace=cuda,nvtx,osrt", "--sample=none", "--cpuctxsw=none",
                     "--capture-range=cudaProfilerApi", "--capture-range-end=stop",
                     "--export=sqlite", "-f", "true")
TRACE_NAME = "trace"     # -o <job dir>/trace -> trace.nsys-rep and trace.sqlite
NSYS_COMMAND = " ".join(("nsys", *NSYS_PROFILE_ARGS, "-o", f"<job dir>/{TRACE_NAME}"))

NSYS_ENV = "NSYS"
_INSTALL_HINT = ("Install NVIDIA Nsight Systems (https://developer.nvidia.com/nsight-systems; the CUDA "
                 "Toolkit and NVIDIA's package repositories also ship it), then put the directory holding "
                 "`nsys` on PATH or set NSYS=/path/to/nsys.")


class NsysNotFound(RuntimeError):
    """The `nsys` command-line profiler is not installed, not on PATH, or NSYS is wrong."""


class NsysExportError(ValueError):
    """A file that is not a readable Nsight Systems SQLite export."""


def nsys_command(job_dir: str | os.PathLike[str], argv: Sequence[str], nsys: str = "nsys") -> list[str]:
    """`argv` run under `nsys profile` with the flags of `NSYS_COMMAND`, exporting to
    `<job_dir>/trace.sqlite`. `nsys` is the binary to call (`find_nsys()` resolves it)."""
    if isinstance(argv, (str, bytes)) or not argv:
        raise ValueError(f"argv must be a non-empty list of command-line words; got {argv!r}")
    return [nsys, *NSYS_PROFILE_ARGS, "-o", os.path.join(os.fspath(job_dir), TRACE_NAME), *map(str, argv)]


def trace_sqlite(job_dir: str | os.PathLike[str]) -> Path:
    """Where the command of `nsys_command(job_dir, ...)` leaves its SQLite export."""
    return Path(job_dir) / f"{TRACE_NAME}.sqlite"


def find_nsys() -> str:
    """Path of the `nsys` binary: `$NSYS` when set, else `nsys` on PATH.

    Raises NsysNotFound saying what was searched and how to install it."""
    env = os.environ.get(NSYS_ENV)
    if env:
        if os.path.isfile(env) and os.access(env, os.X_OK):
            return env
        found = shutil.which(env)
        if found:
            return found
        raise NsysNotFound(f"{NSYS_ENV}={env!r} is not an executable nsys binary; set {NSYS_ENV} to the full "
                           f"path of nsys (e.g. /opt/nvidia/nsight-systems/<version>/bin/nsys) or unset it "
                           f"to search PATH. {_INSTALL_HINT}")
    found = shutil.which("nsys")
    if found:
        return found
    raise NsysNotFound("nsys (the NVIDIA Nsight Systems command-line profiler) is not installed or not on "
                       f"PATH (searched PATH={os.environ.get('PATH', '')!r}); profiling with nsys needs it. "
                       + _INSTALL_HINT)


# ----------------------------------------------------------------------------- reading

MEMCPY_COLUMNS = ["start", "end", "deviceId", "contextId", "streamId", "correlationId", "globalPid",
                  "bytes", "copyKind", "srcKind", "dstKind", "copy_kind", "direction", "host_memory"]
KERNEL_COLUMNS = ["start", "end", "deviceId", "contextId", "streamId", "correlationId", "globalPid", "name"]
NVTX_COLUMNS = ["start", "end", "eventType", "globalTid", "domainId", "name", "range_kind"]

_MEMCPY_NEEDS = ("start", "end", "deviceId", "streamId", "bytes", "copyKind", "srcKind", "dstKind")
_KERNEL_NEEDS = ("start", "end", "deviceId", "streamId")
_NVTX_NEEDS = ("start", "end", "eventType")
_OPTIONAL_IDS = ("contextId", "correlationId", "globalPid")

# substrings of enum *names*, checked in this order (DEVICE_STATIC is device, MANAGED_STATIC managed)
_DIRECTIONS = (("HTOD", "h2d"), ("DTOH", "d2h"), ("DTOD", "d2d"), ("HTOH", "h2h"), ("PTOP", "p2p"))
_MEMORY_KINDS = (("PINNED", "pinned"), ("PAGEABLE", "pageable"), ("MANAGED", "managed"),
                 ("DEVICE", "device"), ("ARRAY", "array"))
_RANGE_KINDS = (("PUSHPOPRANGE", "push_pop"), ("STARTENDRANGE", "start_end"))


def _classify(name: str | None, table: tuple[tuple[str, str], ...], default: str | None) -> str | None:
    upper = (name or "").upper()
    return next((value for key, value in table if key in upper), default)


def _connect(path: Path) -> sqlite3.Connection:
    if not path.is_file():
        raise NsysExportError(f"no Nsight Systems export at {path}: no such file; expected the .sqlite that "
                              "`nsys profile --export=sqlite` or `nsys export --type sqlite REPORT` writes")
    con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)   # read-only: never creates a file
    try:
        con.execute("SELECT name FROM sqlite_master LIMIT 1").fetchall()
    except sqlite3.DatabaseError as e:
        con.close()
        raise NsysExportError(f"{path} is not an Nsight Systems SQLite export: not an SQLite database ({e})") from None
    return con


def _tables(con: sqlite3.Connection) -> set[str]:
    return {name for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def _columns(con: sqlite3.Connection, table: str) -> list[str]:
    return [row[1] for row in con.execute(f'PRAGMA table_info("{table}")')]


def _select(con: sqlite3.Connection, path: Path, table: str, needs: Sequence[str],
            optional: Sequence[str]) -> pd.DataFrame:
    have = _columns(con, table)
    missing = [c for c in needs if c not in have]
    if missing:
        raise NsysExportError(f"{path}: table {table} lacks column(s) {missing}; needs {list(needs)}, "
                              f"has {have} -- an export schema this reader does not know")
    cols = [*needs, *(c for c in optional if c in have and c not in needs)]
    quoted = ", ".join(f'"{c}"' for c in cols)   # "end" is an SQL keyword
    rows = con.execute(f'SELECT {quoted} FROM "{table}"').fetchall()
    df = pd.DataFrame(rows, columns=cols)
    for c in optional:
        if c not in df.columns:
            df[c] = None
    return df


def _enum(con: sqlite3.Connection, path: Path, tables: set[str], table: str, used_by: str) -> dict[int, str]:
    if table not in tables:
        raise NsysExportError(f"{path}: has {used_by} but no {table} table to name its kinds; this reader "
                              "joins enums by name, never by numeric id -- re-export with a newer nsys "
                              "(`nsys export --type sqlite`)")
    if "name" not in _columns(con, table):
        raise NsysExportError(f"{path}: table {table} has no `name` column (has {_columns(con, table)})")
    return {int(i): str(n) for i, n in con.execute(f'SELECT id, name FROM "{table}"')}


def read_nsys_sqlite(path: str | os.PathLike[str]) -> dict[str, pd.DataFrame]:
    """Read an Nsight Systems SQLite export into DataFrames (timestamps in integer ns).

    Keys:
      memcpy   one row per CUPTI memcpy: the export's columns plus `copy_kind` (the enum
               name, e.g. CUDA_MEMCPY_KIND_HTOD), `direction` (h2d, d2h, d2d, h2h, p2p,
               other) and `host_memory` (pinned, pageable, managed, ... for h2d/d2h; None
               otherwise)
      kernel   one row per kernel, `name` = its short name from StringIds
      nvtx     one row per NVTX push/pop or start/end range with an end, `name` = its text,
               `range_kind` = push_pop | start_end
      strings  StringIds (id, value)
      meta     META_DATA_EXPORT (name, value): export product and schema version

    Tables nsys did not create (no copies, no kernels, no NVTX ranges) give empty frames.
    Raises NsysExportError for a missing file, a file that is not SQLite, a database that
    is not an nsys export (no StringIds), or an export whose copy/memory kinds cannot be
    named (no ENUM_CUDA_MEMCPY_OPER / ENUM_CUDA_MEM_KIND tables).
    """
    p = Path(path)
    con = _connect(p)
    try:
        tables = _tables(con)
        if "StringIds" not in tables:
            raise NsysExportError(f"{p} is not an Nsight Systems SQLite export: it has no StringIds table "
                                  f"(tables found: {sorted(tables)}); expected StringIds, "
                                  "CUPTI_ACTIVITY_KIND_MEMCPY/KERNEL, NVTX_EVENTS, ... as "
                                  "`nsys export --type sqlite` writes them")
        strings_df = pd.DataFrame(con.execute("SELECT id, value FROM StringIds").fetchall(), columns=["id", "value"])
        strings = dict(zip(strings_df["id"].tolist(), strings_df["value"].tolist()))
        meta = (pd.DataFrame(con.execute("SELECT name, value FROM META_DATA_EXPORT").fetchall(),
                             columns=["name", "value"])
                if "META_DATA_EXPORT" in tables else pd.DataFrame(columns=["name", "value"]))
        out = {"memcpy": _read_memcpy(con, p, tables), "kernel": _read_kernels(con, p, tables, strings),
               "nvtx": _read_nvtx(con, p, tables, strings), "strings": strings_df, "meta": meta}
    finally:
        con.close()
    version = dict(zip(meta["name"], meta["value"]))
    log.debug("read %s (nsys %s, schema %s): %d copies, %d kernels, %d NVTX ranges", p,
              version.get("EXPORT_PRODUCT_VERSION"), version.get("EXPORT_SCHEMA_VERSION"),
              len(out["memcpy"]), len(out["kernel"]), len(out["nvtx"]))
    return out


def _read_memcpy(con: sqlite3.Connection, path: Path, tables: set[str]) -> pd.DataFrame:
    table = "CUPTI_ACTIVITY_KIND_MEMCPY"
    if table not in tables:
        return pd.DataFrame(columns=MEMCPY_COLUMNS)
    df = _select(con, path, table, _MEMCPY_NEEDS, _OPTIONAL_IDS)
    oper = _enum(con, path, tables, "ENUM_CUDA_MEMCPY_OPER", f"{table}.copyKind")
    kinds = _enum(con, path, tables, "ENUM_CUDA_MEM_KIND", f"{table}.srcKind/dstKind")
    unknown = sorted(set(df["copyKind"].dropna().astype(int)) - set(oper))
    if unknown:
        log.warning("%s: copyKind id(s) %s not in ENUM_CUDA_MEMCPY_OPER %s; those copies count as 'other'",
                    path, unknown, oper)
    df["copy_kind"] = [oper.get(int(k)) if k is not None else None for k in df["copyKind"]]
    df["direction"] = [_classify(n, _DIRECTIONS, "other") for n in df["copy_kind"]]

    def host_kind(direction: str, src: Any, dst: Any) -> str | None:
        side = src if direction == "h2d" else dst if direction == "d2h" else None
        if side is None or pd.isna(side):
            return None
        return _classify(kinds.get(int(side)), _MEMORY_KINDS, "unknown")

    df["host_memory"] = [host_kind(d, s, t) for d, s, t in zip(df["direction"], df["srcKind"], df["dstKind"])]
    return df[MEMCPY_COLUMNS]


def _read_kernels(con: sqlite3.Connection, path: Path, tables: set[str], strings: Mapping[int, str]) -> pd.DataFrame:
    table = "CUPTI_ACTIVITY_KIND_KERNEL"
    if table not in tables:
        return pd.DataFrame(columns=KERNEL_COLUMNS)
    df = _select(con, path, table, _KERNEL_NEEDS, (*_OPTIONAL_IDS, "shortName", "demangledName"))
    name_ids = df["shortName"].where(df["shortName"].notna(), df["demangledName"])
    df["name"] = [strings.get(int(i)) if i is not None and not pd.isna(i) else None for i in name_ids]
    return df[KERNEL_COLUMNS]


def _read_nvtx(con: sqlite3.Connection, path: Path, tables: set[str], strings: Mapping[int, str]) -> pd.DataFrame:
    table = "NVTX_EVENTS"
    if table not in tables:
        return pd.DataFrame(columns=NVTX_COLUMNS)
    df = _select(con, path, table, _NVTX_NEEDS, ("text", "textId", "globalTid", "domainId"))
    if "ENUM_NSYS_EVENT_TYPE" in tables:
        types = {int(i): _classify(n, _RANGE_KINDS, None)
                 for i, n in con.execute("SELECT id, name FROM ENUM_NSYS_EVENT_TYPE")}
        df["range_kind"] = [types.get(int(t)) for t in df["eventType"]]
    else:   # older exports: a range is an event with an end (marks have none, or end = 0)
        log.debug("%s: no ENUM_NSYS_EVENT_TYPE table; NVTX ranges are the events with an end", path)
        df["range_kind"] = "range"
    ok = df["range_kind"].notna() & df["end"].notna()
    ok &= df["end"].fillna(-1) >= df["start"]
    unended = int((df["range_kind"].notna() & df["end"].isna()).sum())
    if unended:
        log.warning("%s: %d NVTX range(s) without an end (still open when capture stopped) are ignored",
                    path, unended)
    df = df[ok].copy()

    def text(t: Any, tid: Any) -> str | None:
        if t is not None and not pd.isna(t):
            return str(t)
        if tid is not None and not pd.isna(tid):
            return strings.get(int(tid))
        return None

    df["name"] = [text(t, i) for t, i in zip(df["text"], df["textId"])]
    df["start"] = df["start"].astype("int64")
    df["end"] = df["end"].astype("int64")
    return df[NVTX_COLUMNS].reset_index(drop=True)


# ----------------------------------------------------------------------------- tidy rows

NS = 1e-9                 # seconds per export timestamp unit
SOURCE = "nsys"
HOST_MEMORY_KINDS = ("pinned", "pageable")
ROW_UNITS: dict[str, str] = {
    "h2d_bytes": "B", "d2h_bytes": "B",
    **{f"{m}_{kind}": u for kind in HOST_MEMORY_KINDS
       for m, u in (("h2d_bytes", "B"), ("h2d_time_s", "s"), ("h2d_gbps", "GB/s"))},
    "copy_busy_s": "s", "kernel_busy_s": "s", "overlap_s": "s", "exposed_copy_s": "s",
    "overlap_frac": "ratio", "link_gbps": "GB/s",
}
ALL_SCOPE = "all"
Row = dict[str, Any]


def _inside(window: list[Interval], starts: list[int], start: int, end: int) -> tuple[list[Interval], float]:
    """Pieces of [start, end] inside the merged `window`, and the fraction of it they cover."""
    if end == start:   # an instantaneous copy belongs to the window holding its instant
        i = bisect.bisect_right(starts, start) - 1
        hit = i >= 0 and window[i][0] <= start < window[i][1]
        return [], 1.0 if hit else 0.0
    pieces = []
    i = max(bisect.bisect_right(starts, start) - 1, 0)
    while i < len(window) and window[i][0] < end:
        lo, hi = max(window[i][0], start), min(window[i][1], end)
        if hi > lo:
            pieces.append((lo, hi))
        i += 1
    return pieces, sum(hi - lo for lo, hi in pieces) / (end - start)


def _scope_rows(scope: str, memcpy: pd.DataFrame, kernel: pd.DataFrame,
                window: list[Interval] | None) -> list[Row]:
    copies: list[tuple[list[Interval], float, str, str | None]] = []   # (pieces, bytes, direction, host)
    starts = [lo for lo, _ in window] if window is not None else []
    for s, e, b, d, h in zip(memcpy["start"], memcpy["end"], memcpy["bytes"], memcpy["direction"],
                             memcpy["host_memory"]):
        s, e = int(s), int(e)
        if window is None:
            pieces, frac = ([(s, e)] if e > s else []), 1.0
        else:
            pieces, frac = _inside(window, starts, s, e)
        if frac > 0:
            copies.append((pieces, float(b) * frac, d, h))
    kernels = [(int(s), int(e)) for s, e in zip(kernel["start"], kernel["end"])]
    if window is not None:
        kernels = intersection(kernels, window)

    def total(direction: str, host: str | None = None) -> float:
        return float(sum(b for _, b, d, h in copies if d == direction and (host is None or h == host)))

    h2d_bytes = total("h2d")
    metrics: dict[str, float | None] = {"h2d_bytes": h2d_bytes, "d2h_bytes": total("d2h")}
    for kind in HOST_MEMORY_KINDS:
        nbytes = total("h2d", kind)
        busy_s = union_length(p for pieces, _, d, h in copies if d == "h2d" and h == kind for p in pieces) * NS
        metrics[f"h2d_bytes_{kind}"] = nbytes
        metrics[f"h2d_time_s_{kind}"] = float(busy_s)
        metrics[f"h2d_gbps_{kind}"] = nbytes / busy_s / 1e9 if busy_s > 0 else None
    copy_ivs = [p for pieces, _, _, _ in copies for p in pieces]
    metrics["kernel_busy_s"] = float(union_length(kernels) * NS)
    metrics.update(overlap_metrics(copy_ivs, kernels, h2d_bytes=h2d_bytes, time_unit_s=NS))
    return [{"scope": scope, "metric": m, "value": metrics[m], "unit": u, "source": SOURCE}
            for m, u in ROW_UNITS.items()]


def nsys_rows(source: str | os.PathLike[str] | Mapping[str, pd.DataFrame], *,
              prefix: str | None = None) -> list[Row]:
    """Tidy rows from an nsys export (a path, or what `read_nsys_sqlite` returned).

    One row per (scope, metric): `{"scope", "metric", "value", "unit", "source": "nsys"}`.
    Scope "all" is the whole capture; then one scope per NVTX range name (sorted), only
    names starting with `prefix` when given (e.g. "moebench:"). Metrics, in this order,
    are the keys of `ROW_UNITS` (see the module docstring for their definitions).
    """
    tables = source if isinstance(source, Mapping) else read_nsys_sqlite(source)
    memcpy, kernel, nvtx = tables["memcpy"], tables["kernel"], tables["nvtx"]
    if memcpy.empty and kernel.empty:
        log.warning("nsys export has no CUDA copies or kernels: was the capture range "
                    "(cudaProfilerStart/Stop) ever opened around GPU work?")
    windows: dict[str, list[Interval]] = {}
    for name, start, end in zip(nvtx["name"], nvtx["start"], nvtx["end"]):
        if name is None or (prefix is not None and not str(name).startswith(prefix)):
            continue
        if name == ALL_SCOPE:
            log.warning("NVTX range named %r is skipped: the name is the whole-capture scope", name)
            continue
        windows.setdefault(str(name), []).append((int(start), int(end)))
    rows = _scope_rows(ALL_SCOPE, memcpy, kernel, None)
    for name in sorted(windows):
        rows += _scope_rows(name, memcpy, kernel, merge(windows[name]))
    return rows
