"""How busy other processes keep the cores, over a window that may span this process's own work:
the machine's busy CPU time less this process's own, per second of the window, never negative;
closing a window waits only for what is left of it; a child process's CPU (a server the job
started) is the job's own."""
from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from harness import machine


@pytest.fixture
def clock(monkeypatch):
    """Scripted time and CPU counters: `state` is what the next reading returns."""
    state = {"t": 100.0, "own": 5.0, "busy": 50.0, "slept": []}
    monkeypatch.setattr(machine.time, "perf_counter", lambda: state["t"])
    monkeypatch.setattr(machine.time, "sleep", lambda s: (state["slept"].append(s), state.update(t=state["t"] + s)))
    monkeypatch.setattr(machine, "_own_cpu", lambda p: state["own"])
    monkeypatch.setattr(machine, "_busy_cpu", lambda: state["busy"])
    monkeypatch.setattr(machine, "available_cores", lambda: 4)
    return state


def test_own_work_in_the_window_is_not_counted_as_other(clock) -> None:
    window = machine.LoadWindow(threads=1, window_s=0.1)
    clock.update(t=100.5, own=5.5, busy=51.25)            # 0.5 s: this process 0.5 s of CPU, the machine 1.25 s
    load = window.close()
    assert clock["slept"] == [0.0]                         # past its length: no wait
    assert load.other_busy_cores == pytest.approx(1.5)     # (1.25 - 0.5) / 0.5
    assert load.free_cores == 3 and not load.busy


def test_a_short_window_waits_for_the_rest_and_counts_others(clock) -> None:
    window = machine.LoadWindow(threads=2, window_s=0.1)
    clock.update(t=100.04, busy=50.3)                      # others: 0.3 s of CPU so far
    load = window.close()
    assert clock["slept"] == [pytest.approx(0.06)]
    assert load.other_busy_cores == pytest.approx(3.0) and load.busy     # 0.3 s / 0.1 s, beyond the 2 free


def test_other_use_is_never_negative(clock) -> None:
    window = machine.LoadWindow(threads=1, window_s=0.1)
    clock.update(t=100.2, own=5.3, busy=50.2)              # counters sampled apart: own ahead of the total
    assert window.close().other_busy_cores == 0.0


def test_a_running_childs_cpu_is_the_processs_own() -> None:
    me = psutil.Process()
    before = machine._own_cpu(me)
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.3: pass\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while sum(psutil.Process(child.pid).cpu_times()[:2]) < 0.25 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert machine._own_cpu(me) - before >= 0.25      # its CPU while it runs, not only once reaped
    finally:
        child.kill()
        child.wait()
