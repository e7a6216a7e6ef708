"""The sweep's live progress line: its times stay whole at any terminal width (the job's factors
and step are what a narrow terminal shortens), and the time left counts down while a job runs,
not only when a job ends -- checked on a fake clock and through the CLI under a real terminal."""
from __future__ import annotations

import io
import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest
from rich.console import Console

from harness.report import SweepProgress
from tests.harness.test_trust import REPO

TIMES = re.compile(r"job (\d+)/(\d+) \((\d+:\d\d:\d\d) elapsed, ~(\?|\d+:\d\d:\d\d) left\)")
COMPACT = re.compile(r"^(\d+)/(\d+) \d+:\d\d:\d\d ~(\?|\d+:\d\d:\d\d)")


def seconds(clock: str) -> int:
    h, m, s = map(int, clock.split(":"))
    return 3600 * h + 60 * m + s


def test_the_times_stay_whole_and_the_time_left_counts_down_on_a_clock():
    now = [100.0]
    progress = SweepProgress(4, console=Console(file=io.StringIO(), width=80), clock=lambda: now[0])
    factors = "placement=fetch,cache.capacity=4,workload=coding_agent,workload.context_tokens=4096"
    progress.start(factors)
    assert progress.left_s() is None and "~? left" in progress.status_lines(80)[0]
    now[0] += 10.0                                       # the first job took 10 s
    progress.finish()
    progress.start(factors)
    progress.step("repeat 2/3: loading the model: load 3/4")
    lefts = []
    for running in (0.0, 3.0, 6.0, 9.5, 30.0):          # inside the second job, between steps
        now[0] = 110.0 + running
        lefts.append(progress.left_s())
        for width in (24, 40, 60, 80, 120, 200):
            lines = progress.status_lines(width)
            assert all(len(line) <= width for line in lines), (width, lines)
            times = TIMES.search(lines[0]) or COMPACT.search(lines[0])
            assert times, (width, lines[0])
            if width >= 200:
                assert factors in lines[0] and lines[1] == "  repeat 2/3: loading the model: load 3/4"
            else:
                assert lines[0].endswith("…")            # the factors are cut, never the times
    # 10 s a job: 10 s for this one less what it ran, then 10 s for each of the 2 after it
    assert lefts == [30.0, 27.0, 24.0, 20.5, 20.0]


def _read_terminal(args: list[str], cwd, columns: int) -> str:
    """What `moebench args` writes to a real terminal `columns` wide (a pty), ANSI codes stripped."""
    master, slave = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "COLUMNS": str(columns), "LINES": "40",
           "TERM": "xterm"}
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", *args], cwd=cwd, env=env, stdin=slave,
                            stdout=slave, stderr=slave)
    os.close(slave)
    out, deadline = b"", time.monotonic() + 600
    while time.monotonic() < deadline:
        if select.select([master], [], [], 0.5)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:                              # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    assert proc.wait(timeout=60) == 0, out.decode(errors="replace")[-2000:]
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "\n", out.decode(errors="replace"))


def test_a_sweep_on_a_narrow_terminal_keeps_its_times_and_counts_down(tmp_path):
    text = _read_terminal(["-m", "placement=resident,cpu", "workload=chat", "workload.context_tokens=128",
                           "workload.gen_tokens=4", "run.repeats=3", "run.timeline=false", "run.ablation=false",
                           "run.passes=[speed]", "run.sweep_id=narrow"], tmp_path, columns=60)
    lines = [line for line in re.split(r"\r\n|\r|\n", text) if line.startswith("job ")]
    assert lines
    second = []
    for line in lines:
        times = TIMES.match(line)
        assert times and len(line) <= 60, line
        if times.group(1) == "2":
            second.append(seconds(times.group(4)))
    # redrawn while the second job runs: the time left goes down, not only when a job ends
    assert len(set(second)) >= 2 and second == sorted(second, reverse=True), second
