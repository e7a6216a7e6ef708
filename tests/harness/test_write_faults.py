"""Faults end in one line and the sweep goes on: a job dir that is full or cannot be written is
that job's failed row while the others run; a results dir that cannot be written at all, or a
write of Hydra's own that fails, ends the run in one line naming the path and the OS error,
after the table of the finished jobs, with a non-zero exit. Real filesystems: small tmpfs
mounts filled up (blocks or inodes) and read-only mounts; where mounting is not permitted (no
root), the tests that need it skip, and a job dir that cannot be written is made with chmod."""
from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import results
from tests.harness.test_trust import SMALL, cli, table

pytestmark = pytest.mark.slow
ROOT = os.geteuid() == 0          # root ignores permissions: a read-only mount stands in for chmod


def _mount(*args: str) -> None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"mounting is not permitted here (mount {' '.join(args)}: {proc.stderr.strip()})")


@contextlib.contextmanager
def tmpfs(path: Path, options: str) -> Iterator[Path]:
    """A real tmpfs of its own at `path` (options: size=, nr_inodes=, ro)."""
    path.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", options, "tmpfs", str(path))
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[Path]:
    """`path` (and, when mounted, everything under it) made read-only: a read-only bind mount as
    root, chmod 0555 otherwise (which holds for a user who is not root)."""
    if not ROOT:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    _mount("--bind", str(path), str(path))
    try:
        _mount("-o", "remount,bind,ro", str(path))
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def fill(directory: Path, *, inodes: bool = False) -> None:
    """Fill the filesystem under `directory`: its data blocks, or (`inodes`) its inodes."""
    filler = directory / ".filler"
    filler.mkdir(exist_ok=True)
    with contextlib.suppress(OSError):
        if inodes:
            for i in range(1 << 20):
                (filler / str(i)).touch()
        else:
            with open(filler / "blocks", "wb") as f:
                while True:
                    f.write(bytes(1 << 16))
                    f.flush()


def job_dir(sweep: Path, placement: str) -> Path:
    return next(p for p in sweep.iterdir() if p.name.startswith(f"placement={placement},"))


def no_hydra_files(sweep: Path) -> None:
    """Hydra writes nothing into a job's dir but the dir (no .hydra/, no <job>.log)."""
    assert not list(sweep.glob("*/.hydra")) and not list(sweep.glob("*/*.log"))


# ----------------------------------------------------------------------------- one job's dir

@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_a_job_dir_that_cannot_be_written_is_a_failed_row_and_the_sweep_goes_on(tmp_path, fault):
    first = ["-m", "placement=resident,cpu", "run.sweep_id=F", *SMALL]
    assert cli(first, tmp_path).returncode == 0
    sweep = tmp_path / "results" / "sweeps" / "F"
    no_hydra_files(sweep)
    cpu = job_dir(sweep, "cpu")
    for f in cpu.iterdir():
        f.unlink()                                   # the cpu job not run yet, and its dir...
    with contextlib.ExitStack() as stack:
        if fault == "full":                          # ...a filesystem of its own, full
            fill(stack.enter_context(tmpfs(cpu, "size=64k")))
        else:                                        # ...one no one may write
            stack.enter_context(read_only(cpu))
        # the cpu job is measured (or refused) into it, and the hybrid job after it runs as ever
        proc = cli(["-m", "placement=resident,cpu,hybrid", "run.sweep_id=F", "run.resume=add", *SMALL], tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    df = table(sweep)
    assert df.job_id.nunique() == 3 and set(df[df.status == "ok"].placement) == {"resident", "hybrid"}
    failed = df[df.status == "failed"]
    assert len(failed) == 1 and failed.iloc[0]["placement"] == "cpu"
    why = {"full": "No space left on device", "read-only": "Read-only file system" if ROOT else "Permission denied"}
    assert f"cannot write the job's files in {cpu}" in failed.iloc[0]["error"] and why[fault] in failed.iloc[0]["error"]
    assert set(results.load(sweep).job_id) == set(df.job_id)          # the dir as any load reads it
    no_hydra_files(sweep)


# ----------------------------------------------------------------------------- the whole results dir

@pytest.mark.skipif(not ROOT, reason="needs a read-only mount (root): chmod leaves the files under a dir writable")
def test_a_read_only_results_root_ends_in_one_line_after_the_finished_jobs_table(tmp_path):
    args = ["-m", "placement=resident", "run.sweep_id=R", *SMALL]
    assert cli(args, tmp_path).returncode == 0
    loud = [a for a in args if a != "run.quiet=true"]
    with read_only(tmp_path / "results"):
        sweep = cli(loud, tmp_path)
        single = cli(["placement=resident", *SMALL], tmp_path)
    assert sweep.returncode == 1 and "Traceback" not in sweep.stderr
    [line] = [ln for ln in sweep.stderr.splitlines() if ln.startswith("moebench:")]
    assert line.startswith("moebench: cannot write the sweep dir results/sweeps/R: [Errno 30] Read-only file system")
    assert "results/sweeps/R/.lock" in line and "it holds 1 finished job(s): the table above" in line
    table_shown = sweep.stderr[:sweep.stderr.index(line)]                       # the reporter's table, before the line
    assert "sweep R:" in table_shown and "resident" in table_shown
    assert single.returncode == 1 and "Traceback" not in single.stderr
    assert single.stderr.strip().splitlines()[-1] == ("moebench: cannot write the run's files: [Errno 30] "
                                                      "Read-only file system: 'results/runs'")


def test_a_full_disk_before_the_sweep_starts_ends_in_one_line(tmp_path):
    with tmpfs(tmp_path / "results", "size=64k") as root:
        fill(root)
        proc = cli(["-m", "placement=resident", "run.sweep_id=E", *SMALL], tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == "moebench: cannot write the sweep dir results/sweeps/E: [Errno 28] No space left on device"


def test_a_write_of_hydras_own_that_fails_ends_the_sweep_in_one_line(tmp_path):
    """Out of inodes, Hydra cannot make the next job's dir (a write of its own, before any job
    code of ours runs): the sweep cannot go on; the table of the finished job is shown (it cannot
    be written either) and the line names the dir and the OS error."""
    with tmpfs(tmp_path / "sweeps", "size=4m,nr_inodes=64") as mnt:
        sweep = mnt / "W"
        args = ["-m", "placement=resident,cpu", f"hydra.sweep.dir={sweep}", *SMALL]
        assert cli(args, tmp_path).returncode == 0
        cpu = job_dir(sweep, "cpu")
        for f in cpu.iterdir():
            f.unlink()
        cpu.rmdir()                                  # the cpu job not run yet, and no inode left for its dir
        fill(mnt, inodes=True)
        proc = cli([a for a in args if a != "run.quiet=true"], tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [line] = [ln for ln in proc.stderr.splitlines() if ln.startswith("moebench:")]
    assert line.startswith(f"moebench: the sweep in {sweep} cannot go on: [Errno 28] No space left on device: "
                           f"'{cpu}'")
    assert f"the table of its 1 finished job(s) could not be written (cannot write {sweep / results.SWEEP_TABLE}" in line
    table_shown = proc.stderr[:proc.stderr.index(line)]
    assert "sweep W (not written):" in table_shown and "resident" in table_shown
