"""Run `python -m harness.cli ARGS` for a test, fast: in a process forked from a warm one.

A CLI process spends most of a tiny job importing torch, Hydra and the harness (~4 of ~5 s on
2 cores); a test suite that runs the CLI hundreds of times pays that each time. `run_cli` forks
each run from a zygote -- one per test process, started on first use, that imported what the CLI
imports and then runs nothing (no torch op, no thread pool: forking it is safe) -- so the child
starts warm, then behaves as `python -m harness.cli` would: its own pid, the given cwd, argv and
environment, stdout and stderr captured, its exit status (or -signal) returned as a
`subprocess.CompletedProcess`, killed at `timeout` with `subprocess.TimeoutExpired`. `run_module`
does the same for the project's other modules (`python -m harness.sim.cli`), `run_python` for
`python -c CODE`.

Commands a shell runs (the guide's ```bash blocks) reach the zygote through `shim_env`: it puts
first on PATH a script per console script of the project (`moebench`, `moebench-sim`, ...) that
hands the zygote its argv, cwd, environment and its own stdin, stdout and stderr over a Unix
socket; the forked child runs the entry point on those, the script forwards SIGINT, SIGTERM and
SIGHUP to it and exits with its status (a signal's death as the same signal). A script whose
zygote is gone, or whose environment differs in what a library reads at load, runs the real
entry point instead.

What a fork cannot give falls back to a real subprocess, so nothing a test asserts changes:
environment variables read when a library loads (OpenMP's, MKL's, GOMP_SPINCOUNT, PYTHONPATH and
other interpreter settings differing from the zygote's), `input=` on stdin, or
MOEBENCH_TEST_FORK=0 in the environment (every run real). Tests of signals, stalls and servers
use real processes (`subprocess.Popen`) and never this.
"""
from __future__ import annotations

import json
import os
import stat
import struct
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# read when a library or the interpreter starts: a child forked from the zygote would not see them
LOAD_TIME = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "PYTHON", "LD_", "MALLOC_", "CUDA_", "TORCH_",
             "MOEBENCH_CPU_KERNELS")
SOCKET_VAR = "MOEBENCH_TEST_ZYGOTE"

_zygote: dict[str, object] = {}     # "proc": the zygote's Popen, "dir": its socket's and shims' folder


def zygote_env() -> dict[str, str]:
    """The zygote's environment: this process's, with the checkout first on PYTHONPATH (as every
    CLI helper sets it); a run whose load-time variables differ from it runs as a real process."""
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _load_time(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(LOAD_TIME)}


def _forkable(env: dict[str, str]) -> bool:
    return env.get("MOEBENCH_TEST_FORK") != "0" and _load_time(env) == _load_time(zygote_env())


def _running() -> subprocess.Popen:
    """The zygote, started on first use (or again, if it died)."""
    proc = _zygote.get("proc")
    if isinstance(proc, subprocess.Popen) and proc.poll() is None:
        return proc
    folder = Path(tempfile.mkdtemp(prefix="cli-zygote-"))
    proc = subprocess.Popen([sys.executable, "-c", ZYGOTE, str(folder / "socket")], env=zygote_env(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO)
    if proc.stdout.readline().strip() != b"ready":
        raise RuntimeError("the CLI zygote did not start")
    _zygote.update(proc=proc, dir=folder)
    return proc


def _forked(request: dict, argv: list[str], cwd: str | Path, env: dict[str, str],
            timeout: float | None) -> subprocess.CompletedProcess:
    zygote = _running()
    with tempfile.TemporaryDirectory(prefix="cli-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        request = {**request, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err), "timeout": timeout}
        zygote.stdin.write(json.dumps(request).encode() + b"\n")
        zygote.stdin.flush()
        code, = struct.unpack("!i", zygote.stdout.read(4))
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    if code == TIMED_OUT:
        raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr)
    return subprocess.CompletedProcess(argv, code, stdout, stderr)


def run_module(module: str, args: list[str], cwd: str | Path, env: dict[str, str] | None = None,
               timeout: float | None = 600, input: str | None = None) -> subprocess.CompletedProcess:
    """`python -m MODULE *args` in `cwd` with `env` (default: this process's), as
    subprocess.run(..., capture_output=True, text=True) would return it."""
    env = dict(os.environ if env is None else env)
    argv = [sys.executable, "-m", module, *map(str, args)]
    if input is not None or not _forkable(env):
        return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, input=input)
    return _forked({"module": module, "args": argv[3:]}, argv, cwd, env, timeout)


def run_cli(args: list[str], cwd: str | Path, env: dict[str, str] | None = None, timeout: float | None = 600,
            input: str | None = None) -> subprocess.CompletedProcess:
    """`python -m harness.cli *args`: see run_module."""
    return run_module("harness.cli", args, cwd, env, timeout, input)


def run_python(code: str, cwd: str | Path, env: dict[str, str] | None = None,
               timeout: float | None = 600) -> subprocess.CompletedProcess:
    """`python -c CODE` in `cwd` with `env`, as run_cli returns it."""
    env = dict(os.environ if env is None else env)
    argv = [sys.executable, "-c", code]
    if not _forkable(env):
        return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return _forked({"code": code}, argv, cwd, env, timeout)


def shim_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with the project's console scripts served by the zygote: a folder of scripts of their
    names first on PATH, and the zygote's socket in MOEBENCH_TEST_ZYGOTE (unchanged where a run
    could not be forked)."""
    if not _forkable(env):
        return env
    _running()
    folder = Path(_zygote["dir"]) / "bin"
    if not folder.is_dir():
        folder.mkdir()
        for ep in metadata.distribution("moebench").entry_points.select(group="console_scripts"):
            script = folder / ep.name
            script.write_text(f"#!{sys.executable}\n" + SHIM.replace("ENTRY_POINT", repr(ep.value)))
            script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return {**env, "PATH": f"{folder}{os.pathsep}{env.get('PATH', '')}", SOCKET_VAR: str(Path(_zygote["dir"]) / "socket")}


TIMED_OUT = -(2 ** 31)

# A console script served by the zygote: sends its request and its stdin, stdout and stderr, gets
# the child's pid (signals go there) and then its exit status; the real entry point where the
# zygote says no or cannot be reached.
SHIM = r'''import json, os, signal, socket, sys
ENTRY = ENTRY_POINT


def real():
    module, func = ENTRY.split(":")
    code = f"import sys; from {module} import {func}; sys.argv[0] = {sys.argv[0]!r}; sys.exit({func}())"
    os.execv(sys.executable, [sys.executable, "-c", code, *sys.argv[1:]])


sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
try:
    sock.connect(os.environ["MOEBENCH_TEST_ZYGOTE"])
    request = {"entry": ENTRY, "args": [sys.argv[0], *sys.argv[1:]], "cwd": os.getcwd(), "env": dict(os.environ)}
    socket.send_fds(sock, [json.dumps(request).encode()], [0, 1, 2])
    reply = json.loads(sock.recv(1 << 16) or b"{}")
except (OSError, KeyError, ValueError):
    reply = {}
if "pid" not in reply:
    real()
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, lambda n, _: os.kill(reply["pid"], n))
code = json.loads(sock.recv(1 << 16) or b'{"code": 1}')["code"]
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
'''

# The zygote: import what the CLI imports, then per request fork a child that runs it. Requests
# come on stdin (one JSON line: a module as `python -m`, or code as `python -c`; output to files;
# the exit status, -N for signal N, answered on stdout in 4 bytes) and on a Unix socket (a shim's
# console script, run on the three descriptors it sends; its pid, then its status, answered).
ZYGOTE = r'''
import importlib, json, os, runpy, selectors, signal, socket, struct, sys, time, types
before = dict(os.environ)
import harness.cli, harness.runner, harness.results, harness.report   # noqa: F401,E402 -- warm imports
import hydra, pandas, pyarrow.parquet                               # noqa: F401,E402
# what those imports set in the environment (engine: GOMP_SPINCOUNT before torch loads): a real
# process's imports would set it in its own environment, so each child gets it too
set_at_import = {k: v for k, v in os.environ.items() if before.get(k) != v}
LOAD_TIME = LOAD_TIME_PREFIXES
# as the CLI freezes its import-time objects (harness.cli): a child's collections then walk none
# of them, nor copy the pages it shares with this process
import gc                                                           # noqa: E402
gc.freeze()


def load_time(env):
    return {k: v for k, v in env.items() if k.startswith(LOAD_TIME)}


def exit_code(e):
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1


def child(req, fds, closing):
    for f in closing:
        f.close()
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for key, value in set_at_import.items():
        os.environ.setdefault(key, value)
    if fds is None:
        fds = [os.open(os.devnull, os.O_RDONLY)]
        fds += [os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for path in (req["stdout"], req["stderr"])]
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False, buffering=1)
    try:
        if "code" in req:                             # python -c CODE
            sys.argv = ["-c"]
            for name in [m for m in sys.modules if m.split(".")[0] == "harness"]:
                del sys.modules[name]                 # imported afresh, in the code's order (a plugin it
                                                      # registers before importing the CLI is seen)
            main = types.ModuleType("__main__")      # its own __main__, as a fresh interpreter's
            sys.modules["__main__"] = main
            exec(compile(req["code"], "<string>", "exec"), main.__dict__)
        elif "entry" in req:                          # a console script: its function, as the script calls it
            sys.argv = list(req["args"])
            module, func = req["entry"].split(":")
            sys.exit(getattr(importlib.import_module(module), func)())
        else:                                         # python -m MODULE, run afresh as __main__ (the warm
            sys.argv = [req["module"], *req["args"]]  # copy stays with the modules that imported it)
            sys.modules.pop(req["module"], None)
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as e:
        return exit_code(e)


def fork(req, fds, closing):
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = child(req, fds, closing)
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    return pid


listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
listener.bind(sys.argv[1])
listener.listen(16)
sel = selectors.DefaultSelector()
sel.register(0, selectors.EVENT_READ, "pipe")
sel.register(listener, selectors.EVENT_READ, "listener")
running = {}          # pid -> (answer(code), deadline or None, the shim's connection or None)
out, pending = sys.stdout.buffer, b""


def answer_pipe(code):
    out.write(struct.pack("!i", code))
    out.flush()


def answer_shim(conn):
    def answer(code):
        try:
            conn.send(json.dumps({"code": code}).encode())
        except OSError:
            pass
        sel.unregister(conn)
        conn.close()
    return answer


out.write(b"ready\n")
out.flush()
while True:
    for key, _ in sel.select(timeout=0.005 if running else None):
        if key.data == "pipe":
            data = os.read(0, 1 << 20)
            if not data:
                sys.exit(0)
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                req = json.loads(line)
                timeout = req["timeout"]
                pid = fork(req, None, [listener])
                running[pid] = (answer_pipe, None if timeout is None else time.monotonic() + timeout, None)
        elif key.data == "listener":
            conn, _ = listener.accept()
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            req = json.loads(msg)
            if len(fds) != 3 or load_time(req["env"]) != load_time(before):
                conn.close()                          # the shim runs the real entry point
                for fd in fds:
                    os.close(fd)
                continue
            pid = fork(req, fds, [listener, conn])
            for fd in fds:
                os.close(fd)
            conn.send(json.dumps({"pid": pid}).encode())
            sel.register(conn, selectors.EVENT_READ, pid)
            running[pid] = (answer_shim(conn), None, conn)
        else:                                         # a shim's connection: closed, so its caller is gone
            pid = key.data
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            sel.unregister(key.fileobj)
            key.fileobj.close()                       # no answer is sent to it
    for pid, (answer, deadline, conn) in list(running.items()):
        got, status = os.waitpid(pid, os.WNOHANG)
        if got:
            code = os.waitstatus_to_exitcode(status)
        elif deadline is not None and time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            code = TIMED_OUT
        else:
            continue
        del running[pid]
        if conn is None or conn.fileno() >= 0:
            answer(code)
'''.replace("TIMED_OUT", str(TIMED_OUT)).replace("LOAD_TIME_PREFIXES", repr(LOAD_TIME))
