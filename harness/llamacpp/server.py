"""One llama-server process: start, health, typed client, peak memory, always stopped.

Owns: launching `llama-server` for one GGUF and one knob set on a free localhost port, waiting
for `/health`, the HTTP client for `/completion` and `/slots` (stdlib `http.client` only), the
typed results (llama.cpp's own timings kept apart from the client's, DESIGN §7.6), the server
process's peak RSS, and stopping it whatever happens: `with` exit, an exception, Ctrl-C, SIGTERM
to the parent (terminate, then kill). Its stdout/stderr go to the log file the caller names; a
failed start, a timeout or a crash raises `LlamaServerError` carrying the log's last lines.

Only our own server is talked to: before any request (/health included) the listening socket of
the port must be the child's and no other process's (harness.llamacpp.listener), and each start
gets a secret API key (`--api-key-file`, sent on every request), so no other local process can
drive it. Three limits: `startup_timeout_s` (launch -> /health ok), `stall_timeout_s` (no byte from
the server while a request is in flight; completions are streamed with prompt-progress events, so
a working server sends one at least every micro-batch and token) and `request_timeout_s` (one
request, start to end). A request that stalls or outlasts its limit gets the server SIGKILLed at
once and `LlamaServerStall` raised; that server gets no further request (`broken`).
Does not own: building (`build`), converting (`convert`), knob validation (`flags`), or turning
results into tidy rows (the harness's llama.cpp engine adapter).

    bins = find_binaries()
    with LlamaServer(gguf.path, EXACT.replace(threads=2), log_path=job_dir / "llama-server.log",
                     slot_save_path=job_dir / "slots") as srv:
        r = srv.complete(prompt_ids, 16, cache_prompt=False)     # r.tokens, r.timings.prompt_ms, r.wall_s
        srv.slot_save(0, "s.bin")                                 # -> SlotResult(bytes=..., tokens=...)

The requests themselves are `harness.llamacpp.client.ServerClient`'s, which this class
extends; the typed answers (`Completion`, `Timings`, `SlotResult`) and the field names
llama-server uses for them are in `harness.llamacpp.responses`.
"""
from __future__ import annotations

import http.client
import logging
import os
import secrets
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from harness.llamacpp.build import Binaries, find_binaries
from harness.llamacpp.client import LOG_TAIL_LINES, LlamaServerError, LlamaServerStall, ServerClient  # noqa: F401
from harness.llamacpp.flags import DEFAULTS, FlagError, LlamaFlags, help_spec
from harness.llamacpp.listener import Foreign, Ours, check_port, holder, listeners
from harness.llamacpp.process import HOST, die_with_parent, free_port, proc_status_bytes, register, server_env, unregister
from harness.llamacpp.responses import Completion, SlotResult  # noqa: F401 (importable here, see __all__)

log = logging.getLogger(__name__)


class PortTaken(LlamaServerError):
    """llama-server could not bind its port: another process holds it."""


# ---------------------------------------------------------------- the server


class LlamaServer(ServerClient):
    """One llama-server for one model and knob set. Use as a context manager (or start/stop)."""

    def __init__(self, model: Path | str, flags: LlamaFlags = DEFAULTS, *, log_path: Path | str,
                 binaries: Binaries | None = None, port: int | None = None, startup_timeout_s: float = 180.0,
                 request_timeout_s: float = 3600.0, stall_timeout_s: float = 300.0,
                 slot_save_path: Path | str | None = None, extra_args: Sequence[str] = ()) -> None:
        self.model = Path(model)
        if not self.model.is_file():
            raise FileNotFoundError(f"GGUF model {self.model} does not exist")
        self.flags = flags
        self.log_path = Path(log_path)
        self.binaries = binaries or find_binaries()
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        self.request_timeout_s = request_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.slot_save_path = Path(slot_save_path) if slot_save_path else None
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen | None = None
        self.last_peak_rss_bytes: int | None = None
        self.load_s: float | None = None        # start -> /health ok (client wall time)
        self.broken: str | None = None          # why this server gets no further request (killed after a stall)
        self._log_start = 0
        self._key = ""                           # this start's API key, sent on every request
        self._key_file: str | None = None        # where llama-server reads it (never argv: logs show argv)
        self._verified_port: int | None = None   # the port whose only listener is our child's

    # -------------------------------------------------------- lifecycle

    def argv(self, port: int) -> list[str]:
        argv = [str(self.binaries.server), "-m", str(self.model), "--host", HOST, "--port", str(port),
                *self.flags.server_argv(self.binaries.server)]
        if self.slot_save_path:
            argv += ["--slot-save-path", str(self.slot_save_path)]
        if self._key_file:
            argv += ["--api-key-file", self._key_file]
        return argv + self.extra_args

    def start(self) -> LlamaServer:
        """Launch and wait for /health. A port picked here that another process took meanwhile
        is picked again (twice at most); every other startup failure raises LlamaServerError."""
        if self.proc is not None:
            raise RuntimeError("this LlamaServer is already started")
        if "--api-key-file" not in help_spec(self.binaries.server).flags:
            raise FlagError(f"{self.binaries.server} has no --api-key-file option: without a per-start key any local "
                            "process could drive the server moebench measures; allowed: a build that has it (the "
                            "pinned one does)")
        if self.slot_save_path:
            self.slot_save_path.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        fixed_port = self.port is not None
        for attempt in range(3):
            self.port = self.port if fixed_port else free_port()
            try:
                self._launch()
                return self
            except PortTaken:
                if fixed_port or attempt == 2:
                    raise
                log.info("port %d was taken before llama-server bound it; trying another", self.port)
                self.proc = None
        raise AssertionError("unreachable")

    def _launch(self) -> None:
        self._key = secrets.token_urlsafe(32)
        fd, self._key_file = tempfile.mkstemp(prefix="moebench-llama-key-")       # mode 0600
        with os.fdopen(fd, "w") as f:
            f.write(self._key + "\n")
        self._verified_port = None
        argv = self.argv(self.port)
        t0 = time.perf_counter()
        with open(self.log_path, "ab") as logf:
            self._log_start = logf.tell()          # the log may hold earlier runs: tails show this one
            logf.write(f"$ {' '.join(argv)}\n".encode())
            logf.flush()
            # own session: a Ctrl-C in the terminal reaches us, not the server; we stop it
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                         env=server_env(), start_new_session=True, preexec_fn=die_with_parent)
        register(self)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        finally:                                   # read at argument parsing, long before /health answers
            Path(self._key_file).unlink(missing_ok=True)
        self.load_s = time.perf_counter() - t0
        log.info("llama-server pid %d up on port %d in %.2f s (log %s)", self.proc.pid, self.port, self.load_s,
                 self.log_path)

    def _wait_healthy(self) -> None:
        """Poll until /health says ok -- asked only once the port's one listener is our child's."""
        deadline = time.monotonic() + self.startup_timeout_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                raise self._exited(rc)
            if self._owned():
                try:
                    status, body = self._request("GET", "/health", timeout=2.0)
                    if status == 200:
                        return
                    last = f"HTTP {status}: {body!r}"
                except (OSError, http.client.HTTPException) as e:
                    last = f"{type(e).__name__}: {e}"
            else:
                others = [holder(i) for i in listeners(self.port)]
                last = f"not asked: {', '.join(others)} listens on the port" if others else "not listening yet"
            time.sleep(0.02)                       # load_s is this fine-grained
        raise LlamaServerError(f"llama-server not healthy after {self.startup_timeout_s:.0f} s "
                               f"(last /health: {last})", self.log_tail())

    def _owned(self) -> bool:
        """Whether 127.0.0.1:port is our child's alone (then it may be asked). Another process
        listening beside it fails the start, in one line, before anything is sent."""
        try:
            verdict = check_port(self.port, self.proc.pid)
        except OSError as e:
            raise LlamaServerError(f"cannot verify that 127.0.0.1:{self.port} is our llama-server's (pid "
                                   f"{self.proc.pid}): {e}; nothing was sent to it") from None
        if isinstance(verdict, Foreign):
            raise LlamaServerError(f"127.0.0.1:{self.port} is also listened on by {', '.join(verdict.holders)}, beside "
                                   f"the llama-server moebench started (pid {self.proc.pid}): nothing was sent to it")
        if isinstance(verdict, Ours):
            self._verified_port = self.port
            return True
        return False

    def _exited(self, rc: int) -> LlamaServerError:
        """The error for a server that exited during startup: a port another process holds, in one
        line (`start` picks another), or its status and log."""
        tail = self.log_tail()
        if "couldn't bind" in tail:
            held = ", ".join(holder(i) for i in listeners(self.port)) or "another process (gone since)"
            return PortTaken(f"llama-server couldn't bind 127.0.0.1:{self.port}: {held} holds it (exit status {rc}); "
                             "nothing was sent to the port", tail, rc, tail_in_message=False)
        return LlamaServerError(f"llama-server exited with status {rc} during startup "
                                f"({' '.join(self.argv(self.port))})", tail, rc)

    def stop(self, grace_s: float = 10.0) -> int | None:
        """Terminate, wait up to grace_s, then kill. Idempotent; returns the exit status."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            self.last_peak_rss_bytes = self.peak_rss_bytes() or self.last_peak_rss_bytes
            proc.terminate()
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                log.warning("llama-server pid %d ignored SIGTERM for %.0f s; killing it", proc.pid, grace_s)
                proc.kill()
                proc.wait()
        unregister(self)
        return proc.returncode

    def kill(self, why: str) -> None:
        """SIGKILL now (a stopped or hung process leaves SIGTERM pending) and send it nothing more."""
        self.broken = why
        proc = self.proc
        if proc is not None and proc.poll() is None:
            self.last_peak_rss_bytes = self.peak_rss_bytes() or self.last_peak_rss_bytes
            proc.kill()
            proc.wait()
        unregister(self)

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("llama-server is not started")
        return self.proc.pid

    def log_tail(self, n: int = LOG_TAIL_LINES) -> str:
        """The last n lines this server wrote to its log (not those of earlier runs there)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(self._log_start, f.tell() - 64 * 1024))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError as e:
            return f"(log {self.log_path} unreadable: {e})"
        return "\n".join(lines[-n:])

    # -------------------------------------------------------- memory

    def peak_rss_bytes(self) -> int | None:
        """Peak resident set of the server process (VmHWM) since start or the last
        `reset_peak_rss()`; None when the process is gone or /proc is not there."""
        return proc_status_bytes(self.pid, "VmHWM") if self.proc and self.proc.poll() is None else None

    def rss_bytes(self) -> int | None:
        return proc_status_bytes(self.pid, "VmRSS") if self.proc and self.proc.poll() is None else None

    def reset_peak_rss(self) -> bool:
        """Reset VmHWM to the current RSS (Linux: write 5 to /proc/PID/clear_refs), so the next
        `peak_rss_bytes()` is the peak of one phase. False where that is not possible."""
        try:
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")
            return True
        except OSError:
            return False

# the typed answers live in `responses`; importable from here too
__all__ = ["LlamaServer", "LlamaServerError", "LlamaServerStall", "PortTaken", "Completion", "SlotResult", "free_port",
           "server_env"]
