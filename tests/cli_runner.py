"""Run `python -m harness.cli ARGS` for a test, fast: in a process forked from a warm one.

A CLI process spends most of a tiny job importing torch, Hydra and the harness (~4 of ~5 s on
2 cores); a test suite that runs the CLI hundreds of times pays that each time. `run_cli` forks
each run from a zygote -- one per test process, started on first use, that imported what the CLI
imports and then runs nothing (no torch op, no thread pool: forking it is safe) -- so the child
starts warm, then behaves as `python -m harness.cli` would: its own pid, the given cwd, argv and
environment, stdout and stderr captured, its exit status (or -signal) returned as a
`subprocess.CompletedProcess`, killed at `timeout` with `subprocess.TimeoutExpired`.

What a fork cannot give falls back to a real subprocess, so nothing a test asserts changes:
environment variables read when a library loads (OpenMP's, MKL's, GOMP_SPINCOUNT, PYTHONPATH and
other interpreter settings differing from the zygote's), `input=` on stdin, or
MOEBENCH_TEST_FORK=0 in the environment (every run real). Tests of signals, stalls and servers
use real processes (`subprocess.Popen`) and never this.
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# read when a library or the interpreter starts: a child forked from the zygote would not see them
LOAD_TIME = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "PYTHON", "LD_", "MALLOC_", "CUDA_", "TORCH_",
             "MOEBENCH_CPU_KERNELS")

_zygote: subprocess.Popen | None = None


def zygote_env() -> dict[str, str]:
    """The zygote's environment: this process's, with the checkout first on PYTHONPATH (as every
    CLI helper sets it); a run whose load-time variables differ from it runs as a real process."""
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _load_time(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(LOAD_TIME)}


def _start(env: dict[str, str]) -> subprocess.Popen:
    global _zygote
    _zygote = subprocess.Popen([sys.executable, "-c", ZYGOTE], env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, cwd=REPO)
    if _zygote.stdout.readline().strip() != b"ready":
        raise RuntimeError("the CLI zygote did not start")
    return _zygote


def run_cli(args: list[str], cwd: str | Path, env: dict[str, str] | None = None, timeout: float | None = 600,
            input: str | None = None) -> subprocess.CompletedProcess:
    """`python -m harness.cli *args` in `cwd` with `env` (default: this process's), as
    subprocess.run(..., capture_output=True, text=True) would return it."""
    env = dict(os.environ if env is None else env)
    argv = [sys.executable, "-m", "harness.cli", *map(str, args)]
    if input is not None or env.get("MOEBENCH_TEST_FORK") == "0" or _load_time(env) != _load_time(zygote_env()):
        return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, input=input)
    zygote = _zygote if _zygote is not None and _zygote.poll() is None else _start(zygote_env())
    with tempfile.TemporaryDirectory(prefix="cli-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        request = {"args": argv[3:], "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err),
                   "timeout": timeout}
        zygote.stdin.write(json.dumps(request).encode() + b"\n")
        zygote.stdin.flush()
        code, = struct.unpack("!i", zygote.stdout.read(4))
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    if code == TIMED_OUT:
        raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr)
    return subprocess.CompletedProcess(argv, code, stdout, stderr)


TIMED_OUT = -(2 ** 31)

# The zygote: import what the CLI imports, then per request fork a child that runs the CLI as
# `python -m harness.cli` and report its exit status (-N for signal N) on stdout, 4 bytes.
ZYGOTE = r'''
import json, os, runpy, signal, struct, sys, time
before = dict(os.environ)
import harness.cli, harness.runner, harness.results, harness.report   # noqa: F401,E402 -- warm imports
import hydra, pandas, pyarrow.parquet                               # noqa: F401,E402
# what those imports set in the environment (engine: GOMP_SPINCOUNT before torch loads): a real
# process's imports would set it in its own environment, so each child gets it too
set_at_import = {k: v for k, v in os.environ.items() if before.get(k) != v}


def child(req):
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for key, value in set_at_import.items():
        os.environ.setdefault(key, value)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False, buffering=1)
    sys.argv = ["harness.cli", *req["args"]]          # run_module sets argv[0] to the module's file, as -m does
    sys.modules.pop("harness.cli", None)              # run afresh as __main__, as -m does (the warm copy stays
    try:                                              # with the modules that imported it)
        runpy.run_module("harness.cli", run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1


out = sys.stdout.buffer
out.write(b"ready\n")
out.flush()
for line in sys.stdin.buffer:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = child(req)
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    deadline = None if req["timeout"] is None else time.monotonic() + req["timeout"]
    while True:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got:
            code = os.waitstatus_to_exitcode(status)
            break
        if deadline is not None and time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            code = TIMED_OUT
            break
        time.sleep(0.005)
    out.write(struct.pack("!i", code))
    out.flush()
'''.replace("TIMED_OUT", str(TIMED_OUT))
