"""One llama-server process: start, health, typed client, peak memory, always stopped.

Owns: launching `llama-server` for one GGUF and one knob set on a free localhost port, waiting
for `/health`, the HTTP client for `/completion` and `/slots` (stdlib `http.client` only), the
typed results (llama.cpp's own timings kept apart from the client's, DESIGN §7.6), the server
process's peak RSS, and stopping it whatever happens: `with` exit, an exception, Ctrl-C, SIGTERM
to the parent (terminate, then kill). Its stdout/stderr go to the log file the caller names; a
failed start, a timeout or a crash raises `LlamaServerError` carrying the log's last lines.
Does not own: building (`build`), converting (`convert`), knob validation (`flags`), or turning
results into tidy rows (the harness's llama.cpp engine adapter).

    bins = find_binaries()
    with LlamaServer(gguf.path, EXACT.replace(threads=2), log_path=job_dir / "llama-server.log",
                     slot_save_path=job_dir / "slots") as srv:
        r = srv.complete(prompt_ids, 16, cache_prompt=False)     # r.tokens, r.timings.prompt_ms, r.wall_s
        srv.slot_save(0, "s.bin")                                 # -> SlotResult(bytes=..., tokens=...)

The typed answers (`Completion`, `Timings`, `SlotResult`) and the field names llama-server
uses for them are in `harness.llamacpp.responses`.
"""
from __future__ import annotations

import atexit
import ctypes
import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from harness.llamacpp.build import Binaries, find_binaries
from harness.llamacpp.flags import DEFAULTS, LlamaFlags
from harness.llamacpp.responses import Completion, SlotResult, StreamChunk, parse_completion, sse_events

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
LOG_TAIL_LINES = 40


class LlamaServerError(RuntimeError):
    """The server failed to start, timed out, answered with an error, or died; `log_tail` holds
    the last lines of its log and `returncode` its exit status when it has exited."""

    def __init__(self, message: str, log_tail: str = "", returncode: int | None = None) -> None:
        super().__init__(f"{message}\n--- last lines of the llama-server log ---\n{log_tail}" if log_tail else message)
        self.log_tail = log_tail
        self.returncode = returncode


# ---------------------------------------------------------------- process bookkeeping

_live: set[LlamaServer] = set()
_live_lock = threading.RLock()       # re-entrant: the SIGTERM handler may run while it is held
_prev_sigterm: Any = None


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


def _die_with_parent() -> None:
    """In the child before exec: get SIGKILL when the parent dies (Linux), so a SIGKILLed
    harness leaves no server behind."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except OSError:
        pass


def server_env() -> dict[str, str]:
    """The parent's environment less LLAMA_ARG_* (llama-server reads every knob from those too,
    so a stray one would change a run without showing in its argv)."""
    dropped = sorted(k for k in os.environ if k.startswith("LLAMA_ARG_"))
    if dropped:
        log.warning("not passing %s to llama-server: knobs come from argv only", ", ".join(dropped))
    return {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}


def free_port(host: str = HOST) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- the server


class LlamaServer:
    """One llama-server for one model and knob set. Use as a context manager (or start/stop)."""

    def __init__(self, model: Path | str, flags: LlamaFlags = DEFAULTS, *, log_path: Path | str,
                 binaries: Binaries | None = None, port: int | None = None, startup_timeout_s: float = 180.0,
                 request_timeout_s: float = 600.0, slot_save_path: Path | str | None = None,
                 extra_args: Sequence[str] = ()) -> None:
        self.model = Path(model)
        if not self.model.is_file():
            raise FileNotFoundError(f"GGUF model {self.model} does not exist")
        self.flags = flags
        self.log_path = Path(log_path)
        self.binaries = binaries or find_binaries()
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        self.request_timeout_s = request_timeout_s
        self.slot_save_path = Path(slot_save_path) if slot_save_path else None
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen | None = None
        self.last_peak_rss_bytes: int | None = None
        self.load_s: float | None = None        # start -> /health ok (client wall time)
        self._log_start = 0

    # -------------------------------------------------------- lifecycle

    def argv(self, port: int) -> list[str]:
        argv = [str(self.binaries.server), "-m", str(self.model), "--host", HOST, "--port", str(port),
                *self.flags.server_argv(self.binaries.server)]
        if self.slot_save_path:
            argv += ["--slot-save-path", str(self.slot_save_path)]
        return argv + self.extra_args

    def start(self) -> LlamaServer:
        """Launch and wait for /health. A port picked here that another process took meanwhile
        is picked again (twice at most); every other startup failure raises LlamaServerError."""
        if self.proc is not None:
            raise RuntimeError("this LlamaServer is already started")
        if self.slot_save_path:
            self.slot_save_path.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        _install_sigterm()
        fixed_port = self.port is not None
        for attempt in range(3):
            self.port = self.port if fixed_port else free_port()
            try:
                self._launch()
                return self
            except LlamaServerError as e:
                if fixed_port or attempt == 2 or "bind" not in e.log_tail.lower():
                    raise
                log.info("port %d was taken before llama-server bound it; trying another", self.port)
                self.proc = None
        raise AssertionError("unreachable")

    def _launch(self) -> None:
        argv = self.argv(self.port)
        t0 = time.perf_counter()
        with open(self.log_path, "ab") as logf:
            self._log_start = logf.tell()          # the log may hold earlier runs: tails show this one
            logf.write(f"$ {' '.join(argv)}\n".encode())
            logf.flush()
            # own session: a Ctrl-C in the terminal reaches us, not the server; we stop it
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                         env=server_env(), start_new_session=True, preexec_fn=_die_with_parent)
        with _live_lock:
            _live.add(self)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.load_s = time.perf_counter() - t0
        log.info("llama-server pid %d up on port %d in %.2f s (log %s)", self.proc.pid, self.port, self.load_s,
                 self.log_path)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                raise LlamaServerError(f"llama-server exited with status {rc} during startup "
                                       f"({' '.join(self.argv(self.port))})", self.log_tail(), rc)
            try:
                status, body = self._request("GET", "/health", timeout=2.0)
                if status == 200:
                    return
                last = f"HTTP {status}: {body!r}"
            except (OSError, http.client.HTTPException) as e:
                last = f"{type(e).__name__}: {e}"
            time.sleep(0.02)                       # load_s is this fine-grained
        raise LlamaServerError(f"llama-server not healthy after {self.startup_timeout_s:.0f} s "
                               f"(last /health: {last})", self.log_tail())

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
        with _live_lock:
            _live.discard(self)
        return proc.returncode

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
        return _proc_status_bytes(self.pid, "VmHWM") if self.proc and self.proc.poll() is None else None

    def rss_bytes(self) -> int | None:
        return _proc_status_bytes(self.pid, "VmRSS") if self.proc and self.proc.poll() is None else None

    def reset_peak_rss(self) -> bool:
        """Reset VmHWM to the current RSS (Linux: write 5 to /proc/PID/clear_refs), so the next
        `peak_rss_bytes()` is the peak of one phase. False where that is not possible."""
        try:
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")
            return True
        except OSError:
            return False

    # -------------------------------------------------------- HTTP

    def _request(self, method: str, path: str, body: dict | None = None,
                 timeout: float | None = None) -> tuple[int, Any]:
        conn = http.client.HTTPConnection(HOST, self.port, timeout=timeout or self.request_timeout_s)
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
            resp = conn.getresponse()
            raw = resp.read()
            try:
                return resp.status, json.loads(raw) if raw else None
            except ValueError:
                return resp.status, raw.decode(errors="replace")
        finally:
            conn.close()

    def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        """A request that must succeed: HTTP errors and a dead server raise LlamaServerError."""
        try:
            status, out = self._request(method, path, body)
        except (OSError, http.client.HTTPException) as e:
            raise self._failure(f"{method} {path} failed: {type(e).__name__}: {e}") from e
        if status != 200:
            raise LlamaServerError(f"{method} {path} -> HTTP {status}: {out!r}", self.log_tail())
        return out

    def _failure(self, what: str) -> LlamaServerError:
        """The error for a broken connection: if the server died, say so with its status."""
        rc = None
        if self.proc is not None:
            try:
                rc = self.proc.wait(2.0)
            except subprocess.TimeoutExpired:
                rc = None
        if rc is not None:
            with _live_lock:
                _live.discard(self)
            return LlamaServerError(f"llama-server (pid {self.proc.pid}) died with status {rc}: {what}",
                                    self.log_tail(), rc)
        return LlamaServerError(what, self.log_tail())

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/health")

    def props(self) -> dict[str, Any]:
        """GET /props: the server's settings (n_ctx, total_slots, build_info, ...)."""
        return self._call("GET", "/props")

    def slots(self) -> list[dict[str, Any]]:
        return self._call("GET", "/slots")

    def _body(self, prompt_ids: Sequence[int], n_predict: int, slot: int, cache_prompt: bool, n_probs: int,
              stream: bool, timings_per_token: bool, ignore_eos: bool, extra: dict[str, Any] | None) -> dict[str, Any]:
        if n_predict < 1:
            raise ValueError(f"n_predict must be >= 1, got {n_predict}")
        return {"prompt": [int(t) for t in prompt_ids], "n_predict": n_predict, "temperature": 0.0,
                "top_k": 1, "samplers": ["top_k"], "id_slot": slot, "cache_prompt": cache_prompt,
                "return_tokens": True, "stream": stream, "timings_per_token": timings_per_token,
                "ignore_eos": ignore_eos, "n_probs": n_probs, **(extra or {})}

    def complete(self, prompt_ids: Sequence[int], n_predict: int, *, slot: int = 0, cache_prompt: bool = True,
                 n_probs: int = 0, stream: bool = False, timings_per_token: bool = False,
                 ignore_eos: bool = False, on_token: Callable[[int, float], None] | None = None,
                 extra: dict[str, Any] | None = None) -> Completion:
        """Greedy completion of token ids (temperature 0), exactly as given (no BOS added).
        `cache_prompt`: reuse the slot's KV for the common prefix. `n_probs`: top-k logprobs per
        generated token. `stream`: token events as they come, for ttft_s and per-token times.
        `ignore_eos`: keep generating past end-of-generation tokens (llama.cpp then biases them
        to -inf, which changes greedy tokens; the pass-through vocabulary has none to bias).
        `on_token(id, seconds_since_request)`: called per streamed token (needs stream=True)."""
        if (on_token is not None or timings_per_token) and not stream:
            raise ValueError("on_token and timings_per_token need stream=True (tokens arrive one by one "
                             "only when streamed)")
        if stream:
            chunks = self.stream(prompt_ids, n_predict, slot=slot, cache_prompt=cache_prompt, n_probs=n_probs,
                                 timings_per_token=timings_per_token, ignore_eos=ignore_eos, extra=extra)
            for chunk in chunks:
                for t in chunk.tokens:
                    if on_token is not None:
                        on_token(int(t), chunk.t)
                if chunk.final is not None:
                    return chunk.final
            raise AssertionError("unreachable: stream() ends with a final chunk or raises")
        body = self._body(prompt_ids, n_predict, slot, cache_prompt, n_probs, False, False, ignore_eos, extra)
        t0 = time.perf_counter()
        try:
            status, out = self._request("POST", "/completion", body)
        except (OSError, http.client.HTTPException) as e:
            raise self._failure(f"POST /completion failed: {type(e).__name__}: {e}") from e
        wall = time.perf_counter() - t0
        if status != 200:
            raise LlamaServerError(f"POST /completion -> HTTP {status}: {out!r}", self.log_tail())
        return parse_completion(out, list(out.get("tokens") or []), wall, None, None, None,
                                out.get("completion_probabilities"))

    def stream(self, prompt_ids: Sequence[int], n_predict: int, *, slot: int = 0, cache_prompt: bool = True,
               n_probs: int = 0, timings_per_token: bool = False, ignore_eos: bool = False,
               extra: dict[str, Any] | None = None) -> Iterator[StreamChunk]:
        """The same request streamed: one `StreamChunk` per server event as it arrives (its new
        tokens, seconds since the request, their top logprobs); the last chunk carries the whole
        `Completion` as `.final`. A caller that stops iterating early closes the connection."""
        body = self._body(prompt_ids, n_predict, slot, cache_prompt, n_probs, True, timings_per_token, ignore_eos,
                          extra)
        t0 = time.perf_counter()
        conn = http.client.HTTPConnection(HOST, self.port, timeout=self.request_timeout_s)
        tokens: list[int] = []
        times: list[float] = []
        server_ms: list[float] = []
        probs: list[dict] = []
        try:
            try:
                conn.request("POST", "/completion", body=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as e:
                raise self._failure(f"POST /completion (stream) failed: {type(e).__name__}: {e}") from e
            if resp.status != 200:
                raise LlamaServerError(f"POST /completion (stream) -> HTTP {resp.status}: {resp.read()!r}",
                                       self.log_tail())
            try:
                for event in sse_events(resp):
                    now = time.perf_counter() - t0
                    new = [int(t) for t in event.get("tokens") or []]
                    tokens += new
                    times += [now] * len(new)
                    if new and "timings" in event:
                        server_ms += [float(event["timings"]["predicted_ms"])] * len(new)
                    event_probs = event.get("completion_probabilities") or []
                    probs += event_probs
                    if event.get("stop"):
                        wall = time.perf_counter() - t0
                        final = parse_completion(event, tokens, wall, times[0] if times else None, times,
                                                 server_ms if len(server_ms) == len(tokens) and tokens else None,
                                                 probs or None)
                        yield StreamChunk(new, now, event_probs, final)
                        return
                    yield StreamChunk(new, now, event_probs, None)
            except (OSError, http.client.HTTPException, ValueError) as e:
                raise self._failure(f"stream broke: {type(e).__name__}: {e}") from e
            raise self._failure("stream ended without a final event")
        finally:
            conn.close()

    # -------------------------------------------------------- slots

    def _slot(self, slot: int, action: str, filename: str | None = None) -> SlotResult:
        if action in ("save", "restore") and not self.slot_save_path:
            raise ValueError(f"slot {action} needs the server started with slot_save_path=DIR")
        if filename is not None and (os.sep in filename or filename.startswith(".")):
            raise ValueError(f"slot filename must be a plain file name inside slot_save_path, got {filename!r}")
        out = self._call("POST", f"/slots/{slot}?action={action}", {"filename": filename} if filename else {})
        timings = out.get("timings") or {}
        if action == "save":
            return SlotResult(action, slot, int(out["n_saved"]), int(out["n_written"]), timings.get("save_ms"), out)
        if action == "restore":
            return SlotResult(action, slot, int(out["n_restored"]), int(out["n_read"]), timings.get("restore_ms"), out)
        return SlotResult(action, slot, int(out["n_erased"]), None, None, out)

    def slot_save(self, slot: int, filename: str) -> SlotResult:
        """Save slot's KV to slot_save_path/filename; `.bytes` = bytes written (the file's size)."""
        return self._slot(slot, "save", filename)

    def slot_restore(self, slot: int, filename: str) -> SlotResult:
        return self._slot(slot, "restore", filename)

    def slot_erase(self, slot: int) -> SlotResult:
        """Drop the slot's KV: the next request on it is a fresh prefill."""
        return self._slot(slot, "erase")


def _proc_status_bytes(pid: int, key: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024          # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


# the typed answers live in `responses`; importable from here too
__all__ = ["LlamaServer", "LlamaServerError", "Completion", "SlotResult", "free_port", "server_env"]
