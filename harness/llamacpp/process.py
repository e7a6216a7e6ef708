"""The harness's child servers as processes: never left behind, started clean, read from /proc.

Owns: the set of live servers and stopping them all when the harness ends (atexit) or gets
SIGTERM, the child's death with its parent (PR_SET_PDEATHSIG), the environment a server gets
(none of llama.cpp's own LLAMA_ARG_* knobs or LLAMA_API_KEY: everything comes from argv and the
key file), a free localhost port to offer it, and /proc/PID/status readings. Does not own: what a
server is or how it is talked to (harness.llamacpp.server), which process listens on a port
(harness.llamacpp.listener).
"""
from __future__ import annotations

import atexit
import ctypes
import logging
import os
import signal
import socket
import threading
from pathlib import Path
from typing import Any, Protocol

from engine.kernels.openmp import as_given

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
# llama-server reads each knob from these too (and a key from LLAMA_API_KEY): a stray one would
# change a run, or add a key, without showing in its argv
IGNORED_ENV_PREFIX = "LLAMA_ARG_"
IGNORED_ENV = ("LLAMA_API_KEY",)


class Stoppable(Protocol):
    def stop(self) -> Any: ...


_live: set[Stoppable] = set()
_live_lock = threading.RLock()       # re-entrant: the SIGTERM handler may run while it is held
_prev_sigterm: Any = None


def register(server: Stoppable) -> None:
    """Stop `server` when the harness ends or gets SIGTERM (until `unregister`)."""
    _install_sigterm()
    with _live_lock:
        _live.add(server)


def unregister(server: Stoppable) -> None:
    with _live_lock:
        _live.discard(server)


def _stop_all() -> None:
    with _live_lock:
        servers = list(_live)
    for s in servers:
        s.stop()


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM in the parent: stop every server we started, then behave as before."""
    _stop_all()
    prev = _prev_sigterm
    if callable(prev):
        prev(signum, frame)
    elif prev != signal.SIG_IGN:
        raise SystemExit(128 + signum)


def _install_sigterm() -> None:
    global _prev_sigterm
    if threading.current_thread() is not threading.main_thread():
        return                       # signal handlers can only be set from the main thread
    current = signal.getsignal(signal.SIGTERM)
    if current is not _on_sigterm:
        _prev_sigterm = current
        signal.signal(signal.SIGTERM, _on_sigterm)


atexit.register(_stop_all)


def die_with_parent() -> None:
    """In the child before exec: get SIGKILL when the parent dies (Linux), so a SIGKILLed
    harness leaves no server behind."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except OSError:
        pass


def server_env() -> dict[str, str]:
    """The parent's environment as the user gave it (engine.kernels.openmp.as_given: not the
    OpenMP spin count the engine sets for its own threads) less LLAMA_ARG_* and LLAMA_API_KEY."""
    environ = as_given()
    dropped = sorted(k for k in environ if k.startswith(IGNORED_ENV_PREFIX) or k in IGNORED_ENV)
    if dropped:
        log.warning("not passing %s to llama-server: knobs come from argv only", ", ".join(dropped))
    return {k: v for k, v in environ.items() if k not in dropped}


def free_port(host: str = HOST) -> int:
    """A port nothing listened on a moment ago (the server's listener is verified once it binds)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def proc_status_bytes(pid: int, key: str) -> int | None:
    """A kB field of /proc/PID/status (VmHWM, VmRSS) in bytes; None when it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024          # kB
    except (OSError, ValueError, IndexError):
        return None
    return None
