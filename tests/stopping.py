"""A real `moebench` CLI run with a real process stopped in the middle of a measured repeat.

`run_stopped` starts the CLI in a subprocess and, when its progress on stderr says the last repeat
began, sends SIGSTOP to a process of the run (the CLI itself, or the llama-server it started),
then SIGCONT after `stop_s` -- or never, to leave it hung. Shared by the starvation tests
(tests/harness/test_starved.py) and the llama.cpp watchdog tests (tests/llamacpp/test_watchdog.py).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Stopped:
    returncode: int
    stderr: str
    pid: int                 # the process that was stopped
    stopped_at: float        # time.monotonic() of the SIGSTOP
    exited_at: float         # time.monotonic() when the CLI had exited
    outlived: bool           # the stopped process was still there when the CLI had exited


def cli_itself(cli: psutil.Process) -> psutil.Process:
    return cli


def its_llama_server(cli: psutil.Process) -> psutil.Process:
    servers = [c for c in cli.children(recursive=True) if "llama-server" in c.name()]
    assert len(servers) == 1, f"expected one llama-server under the CLI, found {servers}"
    return servers[0]


def alive(p: psutil.Process) -> bool:
    """Running or stopped, not gone and not a zombie."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def run_stopped(args: list[str], cwd: Path, target: Callable[[psutil.Process], psutil.Process],
                stop_s: float | None, marker: str, lead_s: float = 0.3, timeout: float = 600) -> Stopped:
    """Run `moebench ARGS` (progress on, so stderr names each repeat); `lead_s` after the line
    containing `marker`, SIGSTOP `target(cli)`; SIGCONT it after `stop_s` (None: leave it stopped)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-u", "-m", "harness.cli", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    lines: list[str] = []
    seen = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
            if marker in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    victim: psutil.Process | None = None
    try:
        deadline = time.monotonic() + timeout
        while not seen.wait(0.1):
            assert proc.poll() is None and time.monotonic() < deadline, \
                f"the run ended or timed out before {marker!r}:\n{''.join(lines)}"
        time.sleep(lead_s)
        victim = target(psutil.Process(proc.pid))
        victim.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        if stop_s is not None:
            time.sleep(stop_s)
            victim.send_signal(signal.SIGCONT)
        proc.wait(timeout)
        exited_at = time.monotonic()
        outlived = alive(victim)
        reader.join(10)
        return Stopped(proc.returncode, "".join(lines), victim.pid, stopped_at, exited_at, outlived)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if victim is not None and victim.is_running():      # never leave a stopped process behind
            try:
                victim.send_signal(signal.SIGCONT)
                victim.kill()
            except psutil.NoSuchProcess:
                pass
