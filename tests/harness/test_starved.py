"""A phase whose process was stopped is flagged `starved`, its CPU time beside its wall time: the
rule (harness.measure.starvation) on its own, CPU time read from a real busy and a real stopped
process, and the real CLI stopped by a real SIGSTOP during a long prefill, asserted on the table."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest

from harness import results
from harness.measure import MIN_JUDGED_S, MIN_JUDGED_TICKS, STARVED_BELOW, PhaseProbe, cpu_resolution_s, starvation
from tests.stopping import cli_itself, run_stopped

TICK = cpu_resolution_s(1)            # /proc's clock tick (another process's CPU time)


def test_the_rule_judges_one_core_and_leaves_what_it_cannot_judge_null():
    busy = starvation(cpu_s=0.9, time_s=1.0, threads=2, resolution_s=1e-9)
    assert busy.starved is False and busy.cpu_util == pytest.approx(0.45) and busy.reason is None
    # one busy thread of two allowed is not starvation (a phase too small to split across threads)
    assert starvation(0.5, 1.0, 2, 1e-9).starved is False
    stopped = starvation(0.2, 1.0, 1, 1e-9)
    assert stopped.starved is True and "20% of one core" in stopped.reason
    assert starvation(STARVED_BELOW * 1.0 + 1e-6, 1.0, 1, 1e-9).starved is False     # the threshold itself
    short = starvation(0.0, MIN_JUDGED_S / 2, 1, 1e-9)
    assert short.starved is None and "too short" in short.reason and short.cpu_util == 0.0
    ticks = starvation(0.0, MIN_JUDGED_TICKS * TICK * 0.9, 1, TICK)                  # /proc's 10 ms ticks
    assert ticks.starved is None and "too short" in ticks.reason
    gpu = starvation(0.01, 5.0, 1, 1e-9, on_cpu=False)
    assert gpu.starved is None and "GPU" in gpu.reason
    gone = starvation(None, 5.0, 1, TICK)
    assert gone.cpu_util is None and gone.starved is None and gone.reason


def test_cpu_time_of_another_process_from_proc():
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with PhaseProbe("cpu", None, cpu_pid=spin.pid, threads=1) as running:
            time.sleep(1.0)
        spin.send_signal(signal.SIGSTOP)
        with PhaseProbe("cpu", None, cpu_pid=spin.pid, threads=1) as stopped:
            time.sleep(1.0)
    finally:
        spin.kill()
        spin.wait()
    assert running.cpu_time_s > 0.1 and running.starvation.starved is False
    assert stopped.cpu_time_s == 0.0 and stopped.starvation.starved is True
    assert stopped.starvation.cpu_util == 0.0
    with PhaseProbe("cpu", None, cpu_pid=spin.pid) as gone:     # the process has ended: null, never 0
        pass
    assert gone.cpu_time_s is None and gone.starvation.starved is None


def test_cpu_time_of_this_process_counts_every_thread():
    """The main thread sleeps while another spins: the window's CPU time is the other thread's."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    worker = threading.Thread(target=spin)
    with PhaseProbe("cpu", None, threads=1) as probe:
        worker.start()
        time.sleep(0.5)
        stop.set()
        worker.join()
    assert probe.cpu_time_s > 0.1 and probe.starvation.cpu_util == pytest.approx(probe.cpu_time_s / probe.time_s)


@pytest.mark.slow
def test_our_engine_stopped_mid_prefill_is_flagged_starved(tmp_path):
    """The moebench process itself gets SIGSTOP for 5 s during the second repeat's prefill of 6000
    tokens (about 1 s of CPU here), then SIGCONT: that phase's rows are starved=True, the first
    repeat's prefill is starved=False, and the short phases are null with the reason."""
    stop_s = 5.0
    args = ["workload=chat", "workload.context_tokens=6000", "workload.gen_tokens=2", "run.repeats=2",
            "run.warmup=0", "run.check_reference=false", "run.ablation=false", "run.timeline=false"]
    run = run_stopped(args, tmp_path, cli_itself, stop_s, marker="repeat 2/2", lead_s=0.2)
    assert run.returncode == 0, run.stderr
    df = results.load(next((tmp_path / "results" / "runs").iterdir()))
    speed = df[(df.profiler == "none") & df.repeat.notna()]
    client = speed[speed.source == "client"].pivot_table(index=["repeat", "phase"], columns="metric", values="value")
    stopped = client[client.time_s >= stop_s]
    assert list(stopped.index) == [(1, "prefill_fresh")], client
    assert (stopped.cpu_time_s < STARVED_BELOW * stopped.time_s).all() and (stopped.cpu_util < STARVED_BELOW).all()
    flags = speed.groupby(["repeat", "phase", "source"]).starved.agg(lambda s: set(s.tolist()))
    assert flags[(1, "prefill_fresh", "client")] == flags[(1, "prefill_fresh", "engine")] == {True}
    assert flags[(0, "prefill_fresh", "client")] == flags[(0, "prefill_fresh", "engine")] == {False}
    reasons = speed[(speed.repeat == 1) & (speed.phase == "prefill_fresh")].starved_reason
    assert reasons.str.contains("of one core").all()
    short = speed[(speed.phase == "kv_offload")]               # a millisecond window: not judged, and why
    assert short.starved.isna().all() and short.starved_reason.str.contains("too short").all()
    assert set(df[df.metric.isin(["cpu_time_s", "cpu_util"])].source) == {"client"}
    assert set(df[df.metric == "cpu_time_s"].unit) == {"s"} and set(df[df.metric == "cpu_util"].unit) == {"ratio"}
