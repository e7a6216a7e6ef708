"""Paths stay where they belong: what a config names under the results root stays under it; a
reference-cache file that is no reference is set aside and recomputed, never a failure of every
job sharing it; a job whose files were damaged after it finished runs again. The real CLI in
subprocesses, on real files, asserting on the loaded tables."""
from __future__ import annotations

import fractions
import json
import os
import re
from pathlib import Path

import pytest
import torch

from harness import results
from tests.harness.test_trust import SMALL, cli, done_times, table

pytestmark = pytest.mark.slow


def said(proc) -> str:
    """What the run printed, without whitespace: the console folds a long line, a path in it too."""
    return "".join((proc.stdout + proc.stderr).split())


def outside(tmp_path: Path) -> list[Path]:
    """What a run left in `tmp_path` beside the results root."""
    return sorted(p for p in tmp_path.iterdir() if p.name != "results")


# ----------------------------------------------------------------------------- dirs under the root

@pytest.mark.parametrize("given, says", [
    (["-m", "run.sweep_id=../../x"], "run.sweep_id=../../x: it names one dir under <run.out>/sweeps"),
    (["-m", "run.sweep_id=/tmp/moebench-anywhere"], "run.sweep_id=/tmp/moebench-anywhere: it names one dir"),
    (["-m", "hydra.sweep.subdir=../y"], "hydra.sweep.subdir=../y: a job's dir lies under its sweep dir"),
    (["-m", "hydra.sweep.dir=."], "hydra.sweep.dir=.: that is the results root (results) or a dir above it"),
    (["hydra.run.dir=results"], "hydra.run.dir=results: that is the results root"),
])
def test_a_dir_that_would_leave_its_place_is_refused_in_one_line(tmp_path, given, says):
    proc = cli([*given, "placement=resident", *SMALL], tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"moebench: {says}") and "allowed:" in lines[0], proc.stderr
    assert outside(tmp_path) == [] and not (tmp_path / "results" / "sweeps").exists()
    assert not Path("/tmp/moebench-anywhere").exists()


@pytest.mark.parametrize("given", [["run.sweep_id=.."], ["run.sweep_id=a/b"], ["run.sweep_id=."],
                                   ["hydra.sweep.dir=results"], ["run.out=/tmp/r", "hydra.sweep.dir=/tmp"],
                                   ["hydra.sweep.subdir=/abs"]])
def test_every_way_out_of_the_root_is_refused(given):
    from harness.cli_args import sweep_dir_of
    from harness.sweep import SweepError
    with pytest.raises(SweepError, match="allowed: "):
        sweep_dir_of(["-m", *given])


def test_a_dir_given_in_full_may_be_anywhere_but_the_root(tmp_path):
    """run.out is the root itself and hydra.sweep.dir a dir of the sweep's own: both the user's
    choice, outside the working dir too."""
    root, sweep, work = tmp_path / "elsewhere" / "root", tmp_path / "other" / "S", tmp_path / "work"
    work.mkdir()
    proc = cli(["-m", "placement=resident", f"run.out={root}", f"hydra.sweep.dir={sweep}", *SMALL], work)
    assert proc.returncode == 0, proc.stderr
    assert table(sweep).job_id.nunique() == 1 and list(root.glob(".reference/*.pt"))


# ----------------------------------------------------------------------------- the reference cache

def references(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "results" / ".reference").iterdir())


def reference_origin(tmp_path: Path) -> str:
    """The `reference` column of the latest single run: computed, or read from the cache file."""
    run = max((tmp_path / "results" / "runs").iterdir(), key=lambda d: d.stat().st_mtime_ns)
    df = results.load(run)
    assert set(df.status) == {"ok"}, df[df.status == "failed"].error.tolist()
    return df.reference.dropna().unique().tolist()[0]


def test_a_reference_file_that_is_no_reference_is_set_aside_and_recomputed(tmp_path):
    args = ["placement=cpu", *SMALL]
    assert cli(args, tmp_path).returncode == 0 and reference_origin(tmp_path) == "computed"
    [cached] = references(tmp_path)
    # what torch.load(weights_only=True) refuses (a pickled object of a class it does not allow), then garbage
    bad_object = tmp_path / "object.pt"
    torch.save({"format": 2, "key": cached.stem, "phases": fractions.Fraction(1, 3)}, bad_object)
    for bad in (bad_object.read_bytes(), b"\x80\x02 not a torch file" * 64):
        cached.write_bytes(bad)
        proc = cli(args, tmp_path)
        assert proc.returncode == 0 and reference_origin(tmp_path) == "computed", proc.stderr[-2000:]
        out = proc.stdout + proc.stderr
        named = cached.relative_to(tmp_path)                          # as the run names it: under run.out=results
        assert f"reference cache file {named} is not a reference" in out and "computed again" in out
        aside = [p for p in references(tmp_path) if p.name.startswith(f"{cached.name}.bad-")]
        assert any(p.read_bytes() == bad for p in aside)              # moved aside, kept for a look
        assert cached.read_bytes() != bad                             # and a real reference in its place
    assert cli(args, tmp_path).returncode == 0 and reference_origin(tmp_path) == "file"


# ----------------------------------------------------------------------------- a damaged job

def test_a_job_whose_rows_were_damaged_after_it_finished_runs_again(tmp_path):
    args = ["-m", "placement=resident,cpu", "run.sweep_id=D", *SMALL]
    assert cli(args, tmp_path).returncode == 0
    sweep = tmp_path / "results" / "sweeps" / "D"
    first = done_times(sweep)
    resident = next(j for j in first if j.startswith("placement=resident"))
    cpu = next(j for j in first if j.startswith("placement=cpu"))
    done = json.loads((sweep / cpu / results.DONE_FILE).read_text())
    assert done["files"][results.ROWS_FILE]["bytes"] == (sweep / cpu / results.ROWS_FILE).stat().st_size

    # truncated: half the file gone
    rows = sweep / resident / results.ROWS_FILE
    os.truncate(rows, rows.stat().st_size // 2)
    proc = cli(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    now = done_times(sweep)
    assert now[resident] > first[resident] and now[cpu] == first[cpu]      # re-run; the other one skipped
    assert f"{rows}has" in said(proc) and "itsDONErecords" in said(proc) and "itrunsagain" in said(proc)
    assert table(sweep).job_id.nunique() == 2 and set(results.load(sweep).status) == {"ok"}

    # bytes overwritten in the middle, its Parquet footer and size intact: only the hash tells
    rows = sweep / cpu / results.ROWS_FILE
    data = bytearray(rows.read_bytes())
    data[len(data) // 3: len(data) // 3 + 64] = bytes(64)
    rows.write_bytes(bytes(data))
    named = rf"{re.escape(cpu)}/rows\.parquet: (unreadable Parquet|.*SHA-256 differs)"
    with pytest.raises(results.ResultsError, match=named):     # a load names it, never reads it (parsed or not)
        results.load(sweep / cpu)
    before = done_times(sweep)
    proc = cli(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    now = done_times(sweep)
    assert now[cpu] > before[cpu] and now[resident] == before[resident]
    assert f"{rows}isnotthefileitsDONErecords" in said(proc)
    df = table(sweep)
    assert df.job_id.nunique() == 2 and set(df.status) == {"ok"}
    assert set(results.load(sweep).job_id) == set(df.job_id)
