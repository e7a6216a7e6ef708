"""The file half of the results store: atomic writes and job directories.

Owns (DESIGN.md §6, §7):
  * writing files atomically (temp file in the same directory, fsync, `os.replace`);
  * writing one job (`write_job`: rows.parquet, optional steps.parquet, manifest.json, then
    the DONE record) and reading its record back, verified against the files it lists
    (`read_done`, `inspect_job`, `job_status`, `job_complete`); making a job dir ready for a
    run's files before it is measured (`prepare_job_dir`), retiring one (`remove_job`).
Does not own: the schema (harness.results.schema), reading results back
(harness.results.reader: `load`, `load_steps`), a sweep's tables
(harness.results.sweep_table: `write_sweep`), summaries (harness.results.summary), what goes
into a manifest (harness.manifest), or deciding that a sweep failed.

A job directory holds, written in this order, each atomically:

    rows.parquet     the job's rows
    steps.parquet    raw per-step decode latencies (optional)
    manifest.json    the manifest (`harness.manifest.collect_manifest`)
    DONE             JSON {"status", "rows", "config_hash", "files", ...}; written last

A job is *complete* when its DONE record exists and agrees with the files beside it: the
row count of rows.parquet and, for every file DONE lists under "files" (rows, steps,
manifest), its size and SHA-256 -- a rows.parquet damaged after the job finished, even with
its Parquet footer intact, makes the job incomplete, so a resume measures it again (DONE
records written before "files" existed are checked by row count alone). Temp files
(`.<name>.*.tmp`) are never read, and the next write in their directory removes them.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from harness.results.schema import (DONE_FILE, MANIFEST_FILE, ROWS_FILE, SCHEMA_VERSION, STATUSES, STEPS_FILE,
                                    ResultsError, rows_to_table)

log = logging.getLogger(__name__)

_TMP_SUFFIX = ".tmp"
STEP_COLUMNS = ["sweep_id", "job_id", "repeat", "profiler", "phase", "step", "tpot_s"]


# ----------------------------------------------------------------------------- atomic writes

def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` so a reader sees the old file or the new one, never a part.

    Raises OSError (naming nothing: callers say which file) when the write or rename fails;
    the temp file is removed then."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=_TMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; results are shared
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # platforms without directory fds; the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def _file_record(data: bytes) -> dict[str, Any]:
    """What DONE records of one file it vouches for: its size and SHA-256."""
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def is_temp_file(path: Path) -> bool:
    return path.name.startswith(".") and path.name.endswith(_TMP_SUFFIX)


def remove_temp_files(directory: Path) -> int:
    """Delete temp files left in `directory` by killed writes; returns how many."""
    n = 0
    if directory.is_dir():
        for leftover in directory.iterdir():
            if is_temp_file(leftover) and leftover.is_file():
                with contextlib.suppress(FileNotFoundError):
                    leftover.unlink()
                    n += 1
    return n


# ----------------------------------------------------------------------------- jobs

def steps_table(steps: Sequence[Mapping[str, Any]]) -> pa.Table:
    """Per-step latency rows ({sweep_id, job_id, repeat, profiler, phase, step, tpot_s}) as Arrow."""
    types = {"sweep_id": pa.string(), "job_id": pa.string(), "repeat": pa.int64(), "profiler": pa.string(),
             "phase": pa.string(), "step": pa.int64(), "tpot_s": pa.float64()}
    return pa.table({c: pa.array([s.get(c) for s in steps], type=types[c]) for c in STEP_COLUMNS})


def write_job(job_dir: str | os.PathLike[str], rows: Sequence[Mapping[str, Any]], manifest: Mapping[str, Any],
              *, config_hash: str | None = None, steps: Sequence[Mapping[str, Any]] | None = None,
              measurement_key: str | None = None) -> None:
    """Write one job: rows.parquet, steps.parquet (when given), manifest.json, then DONE.

    All rows must belong to one (sweep_id, job_id). A DONE from an earlier run is removed
    first, so a crash part-way leaves the job incomplete (never read) rather than mixed.
    `config_hash` (harness.sweep.job_fingerprint) goes into DONE for resume decisions, and
    `measurement_key` (harness.sweep.measurement_key) for a sweep's twin jobs.
    Raises ResultsError for bad rows or manifest, OSError when a file cannot be written.
    """
    job_dir = Path(job_dir)
    if not rows:
        raise ResultsError(f"write_job({job_dir}): no rows; a failed job records failed_row(...)")
    table = rows_to_table(rows)
    jobs = sorted(set(zip(table.column("sweep_id").to_pylist(), table.column("job_id").to_pylist())))
    if len(jobs) != 1:
        raise ResultsError(f"write_job({job_dir}): rows must belong to one (sweep_id, job_id); got {jobs}")
    try:
        manifest_text = json.dumps(manifest, indent=2, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ResultsError(f"write_job({job_dir}): manifest is not JSON-serialisable: {exc}") from exc
    status = "failed" if "failed" in table.column("status").to_pylist() else "ok"

    files = {ROWS_FILE: parquet_bytes(table)}
    if steps:
        files[STEPS_FILE] = parquet_bytes(steps_table(steps))
    files[MANIFEST_FILE] = (manifest_text + "\n").encode()

    job_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        (job_dir / DONE_FILE).unlink()
    remove_temp_files(job_dir)
    if not steps:
        with contextlib.suppress(FileNotFoundError):
            (job_dir / STEPS_FILE).unlink()
    for name, data in files.items():             # rows, steps, manifest: in this order, each atomically
        atomic_write_bytes(job_dir / name, data)
    done = {"status": status, "rows": table.num_rows, "schema_version": SCHEMA_VERSION,
            "sweep_id": jobs[0][0], "job_id": jobs[0][1], "config_hash": config_hash,
            "measurement_key": measurement_key, "files": {name: _file_record(data) for name, data in files.items()}}
    atomic_write_text(job_dir / DONE_FILE, json.dumps(done) + "\n")
    log.debug("wrote job %s (%d rows, %s)", job_dir, table.num_rows, status)


def prepare_job_dir(job_dir: str | os.PathLike[str]) -> None:
    """Make a job dir ready for this run's files before the job is measured: created, shown to be
    writable (a temp file made and removed, so a dir no one may write is found now, not after an
    hour of measuring), and marked incomplete (`invalidate_job`). Raises OSError, with the path,
    when the dir cannot be made or written."""
    job_dir = Path(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=job_dir, prefix=".probe.", suffix=_TMP_SUFFIX)
    os.close(fd)
    os.unlink(probe)
    invalidate_job(job_dir)


def invalidate_job(job_dir: str | os.PathLike[str]) -> None:
    """Mark a job incomplete (its DONE removed) before it is measured again: until the new
    results are written, no load, table or interrupted sweep reads its old rows -- of another
    config, or a failed attempt -- as this run's. The old files stay until they are replaced."""
    with contextlib.suppress(FileNotFoundError):
        (Path(job_dir) / DONE_FILE).unlink()


def remove_job(job_dir: str | os.PathLike[str]) -> None:
    """Retire a job dir's results (DONE first, so it is never read half-removed): for a job that a
    twin stands in for, whose dir may hold an older config's. Its rows.parquet stays, without DONE
    or manifest, as the mark of an incomplete job, so that until the sweep table is written again
    no load reads the job's older rows from the table; `write_sweep` then deletes it."""
    for name in (DONE_FILE, STEPS_FILE, MANIFEST_FILE):
        with contextlib.suppress(FileNotFoundError):
            (Path(job_dir) / name).unlink()


def remove_leftovers(job_dirs: Iterable[Path]) -> None:
    """Delete what incomplete jobs left (their rows, steps and manifest): called once the sweep
    table no longer holds their older rows, or holds their failed row instead."""
    for job_dir in job_dirs:
        for name in (ROWS_FILE, STEPS_FILE, MANIFEST_FILE):
            try:
                (job_dir / name).unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:      # the table is written; a leftover only stays marked incomplete
                log.warning("cannot remove %s: %s", job_dir / name, exc)


def read_done(job_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The DONE record of a complete job (see the module docstring), else None."""
    return inspect_job(job_dir)[0]


def inspect_job(job_dir: str | os.PathLike[str]) -> tuple[dict[str, Any] | None, str | None]:
    """(the DONE record of a complete job, None), or (None, why not): the why is None when the
    dir holds no DONE record at all (never finished, or being rewritten), and says what is wrong
    when it holds one that its files do not bear out (a file missing, damaged, or another size)."""
    job_dir = Path(job_dir)
    done = done_record(job_dir)
    if done is None:
        return None, None
    if done.get("status") not in STATUSES:
        return None, f"its {DONE_FILE} record has status {done.get('status')!r}, not one of {list(STATUSES)}"
    for name in (ROWS_FILE, MANIFEST_FILE):
        if not (job_dir / name).is_file():
            return None, f"its {name} is missing"
    listed = done.get("files") if isinstance(done.get("files"), dict) else {}
    for name in (ROWS_FILE, STEPS_FILE, MANIFEST_FILE):     # only the files a job has: never a path DONE names
        if name in listed:
            why = file_mismatch(job_dir / name, listed[name])
            if why:
                return None, why
    try:
        n = pq.read_metadata(job_dir / ROWS_FILE).num_rows
    except (pa.ArrowException, OSError) as exc:
        return None, f"its {ROWS_FILE} is unreadable ({type(exc).__name__}: {exc})"
    if n != done.get("rows"):
        return None, f"its {ROWS_FILE} holds {n} rows, its {DONE_FILE} records {done.get('rows')}"
    return done, None


def file_mismatch(path: Path, want: Any, data: bytes | None = None) -> str | None:
    """Why `path` (its bytes, when already read) is not the file DONE recorded (`_file_record`), or None."""
    if not isinstance(want, dict):
        return f"its {DONE_FILE} record of {path.name} is not a size and hash"
    if data is None:
        try:
            size = path.stat().st_size
            if size != want.get("bytes"):           # found without reading the file
                return f"{path} has {size} bytes, its {DONE_FILE} records {want.get('bytes')}"
            data = path.read_bytes()
        except OSError as exc:
            return f"{path} is unreadable ({exc.strerror or exc})"
    got = _file_record(data)
    if got["bytes"] != want.get("bytes"):
        return f"{path} has {got['bytes']} bytes, its {DONE_FILE} records {want.get('bytes')}"
    if got["sha256"] != want.get("sha256"):
        return f"{path} is not the file its {DONE_FILE} records (SHA-256 differs): it changed after the job finished"
    return None


def job_status(job_dir: str | os.PathLike[str]) -> str | None:
    """"ok" or "failed" for a complete job, None when incomplete."""
    done = read_done(job_dir)
    return None if done is None else done["status"]


def job_complete(job_dir: str | os.PathLike[str]) -> bool:
    return read_done(job_dir) is not None


def recorded_done(job_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The DONE record as written, its files not verified (None when there is none): a quick look
    across many jobs before `read_done` verifies the one that matters."""
    return done_record(Path(job_dir))


def done_record(job_dir: Path) -> dict[str, Any] | None:
    try:
        done = json.loads((job_dir / DONE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return done if isinstance(done, dict) else None
