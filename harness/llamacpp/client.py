"""The HTTP half of `LlamaServer`: every request to the llama-server moebench started.

Owns: `ServerClient` -- /health, /props, /slots, /completion (whole or streamed, with
prompt-progress events), slot save/restore/erase, each request sent only to a port verified as
our child's with this start's API key, the stall and request limits applied to it (a request
that stalls or outlasts its limit kills the server: `LlamaServerStall`); for the serving driver
(harness.serving.drive), `StreamedCompletion`: a streamed /completion built ahead (`exchange`),
made on a plain socket, each read stamped as it returns and parsed after the run
(harness.llamacpp.sse); and the errors `LlamaServerError` and `LlamaServerStall`. Does not own:
starting, verifying and stopping the process (`harness.llamacpp.server.LlamaServer`, which
subclasses this and sets the state listed on the class), or the typed answers
(`harness.llamacpp.responses`).
"""
from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.llamacpp.process import HOST, unregister
from harness.llamacpp.responses import (Completion, SlotResult, StreamAssembly, StreamChunk, parse_completion,
                                         sse_events)
from harness.llamacpp.sse import LAST_CHUNK, TAIL, completion_request, stamped_events

if TYPE_CHECKING:
    from harness.serving.drive import Served

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 40
RECV_BYTES = 65536             # a serving read takes whatever has arrived, up to this


class LlamaServerError(RuntimeError):
    """The server failed to start, timed out, answered with an error, or died; `log_tail` holds
    the last lines of its log (in the message too, unless `tail_in_message=False`: an error the
    log does not explain stays one line) and `returncode` its exit status when it has exited."""

    def __init__(self, message: str, log_tail: str = "", returncode: int | None = None,
                 tail_in_message: bool = True) -> None:
        shown = log_tail if tail_in_message else ""
        super().__init__(f"{message}\n--- last lines of the llama-server log ---\n{shown}" if shown else message)
        self.log_tail = log_tail
        self.returncode = returncode


class LlamaServerStall(LlamaServerError):
    """A request got no byte for `stall_timeout_s`, or outlasted `request_timeout_s`: the server was
    killed and gets no further request."""


class ServerClient(ABC):
    """Requests to a started llama-server. The state it reads is the server's (`LlamaServer` sets
    it at start); `kill` and `log_tail` are the server's too."""

    port: int | None
    proc: subprocess.Popen | None
    broken: str | None                   # why the server gets no further request
    stall_timeout_s: float
    request_timeout_s: float
    slot_save_path: Path | None
    _key: str                            # this start's API key
    _verified_port: int | None           # the port whose only listener is our child's

    @abstractmethod
    def kill(self, why: str) -> None:
        """SIGKILL the server and send it nothing more (`broken` = why)."""

    @abstractmethod
    def log_tail(self, n: int = LOG_TAIL_LINES) -> str:
        """The last n lines the server wrote to its log."""

    # -------------------------------------------------------- HTTP

    def _connect(self, what: str, timeout: float | None = None) -> http.client.HTTPConnection:
        """A connection for one request -- refused, with nothing sent, to a server that was killed
        after a stall or whose port is not verified as its own. Each read waits at most the smaller of
        the stall and request timeouts (or `timeout`)."""
        self._refuse_unless_ours(what)
        return http.client.HTTPConnection(HOST, self.port,
                                          timeout=timeout or min(self.stall_timeout_s, self.request_timeout_s))

    def _refuse_unless_ours(self, what: str) -> None:
        """Raise, before anything is sent, for a server killed after a stall or a port not verified as
        our child's."""
        if self.broken:
            raise LlamaServerError(f"not sending {what}: {self.broken}")
        if self._verified_port is None or self._verified_port != self.port:
            raise LlamaServerError(f"not sending {what}: 127.0.0.1:{self.port} is not verified as the llama-server "
                                   "moebench started")

    def _headers(self, data: bytes | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._key}", **({"Content-Type": "application/json"} if data else {})}

    def _stalled(self, what: str, overdue: bool = False) -> LlamaServerStall:
        """Kill the server that stalled (or outlasted request_timeout_s) during `what`; the error.
        A socket timeout is the smaller of the two limits (`_connect`): the message names that one."""
        pid = self.proc.pid if self.proc is not None else None
        overdue = overdue or self.request_timeout_s < self.stall_timeout_s
        why = (f"it did not finish {what} within request_timeout_s={self.request_timeout_s:g} s" if overdue else
               f"it sent nothing for stall_timeout_s={self.stall_timeout_s:g} s during {what} (stalled)")
        self.kill(f"llama-server (pid {pid}) was killed: {why}")
        log.error("llama-server pid %s: %s; killed it", pid, why)
        return LlamaServerStall(f"llama-server (pid {pid}) killed: {why}; it gets no further request",
                                self.log_tail(), self.proc.returncode if self.proc else None)

    def _request(self, method: str, path: str, body: dict | None = None,
                 timeout: float | None = None) -> tuple[int, Any]:
        conn = self._connect(f"{method} {path}", timeout)
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(method, path, body=data, headers=self._headers(data))
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
        except TimeoutError:
            raise self._stalled(f"{method} {path}") from None
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
            unregister(self)
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
        except TimeoutError:
            raise self._stalled("POST /completion") from None
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
        # prompt-progress events (one per micro-batch) and no keep-alive pings: every byte is progress
        body = {**self._body(prompt_ids, n_predict, slot, cache_prompt, n_probs, True, timings_per_token, ignore_eos,
                             extra), "return_progress": True, "sse_ping_interval": -1}
        what = "POST /completion (stream)"
        t0 = time.perf_counter()
        conn = self._connect(what)
        assembly = StreamAssembly()
        try:
            try:
                data = json.dumps(body).encode()
                conn.request("POST", "/completion", body=data, headers=self._headers(data))
                resp = conn.getresponse()
            except TimeoutError:
                raise self._stalled(what) from None
            except (OSError, http.client.HTTPException) as e:
                raise self._failure(f"{what} failed: {type(e).__name__}: {e}") from e
            if resp.status != 200:
                raise LlamaServerError(f"POST /completion (stream) -> HTTP {resp.status}: {resp.read()!r}",
                                       self.log_tail())
            try:
                for event in sse_events(resp):
                    now = time.perf_counter() - t0
                    if now > self.request_timeout_s:
                        raise self._stalled(what, overdue=True)
                    chunk = assembly.add(event, now)
                    if chunk is None:
                        continue
                    yield chunk
                    if chunk.final is not None:
                        return
            except TimeoutError:
                raise self._stalled(what) from None
            except (OSError, http.client.HTTPException, ValueError) as e:
                raise self._failure(f"stream broke: {type(e).__name__}: {e}") from e
            raise self._failure("stream ended without a final event")
        finally:
            conn.close()

    def exchange(self, prompt_ids: Sequence[int], n_predict: int, *, slot: int = -1, cache_prompt: bool = True,
                 ignore_eos: bool = False) -> StreamedCompletion:
        """The streamed request of `stream()` (greedy, prompt-progress events, no pings), built now
        and made later on a plain socket by a driver that runs many at once
        (`harness.serving.drive.drive_requests`; `StreamedCompletion` says how it is read)."""
        body = {**self._body(prompt_ids, n_predict, slot, cache_prompt, 0, True, False, ignore_eos, None),
                "return_progress": True, "sse_ping_interval": -1}
        return StreamedCompletion(self, completion_request(self.port, self._key, json.dumps(body).encode()))

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


class StreamedCompletion:
    """One streamed /completion as `harness.serving.drive.drive_requests` runs it (its Exchange):
    built before the run (`ServerClient.exchange`), opened when its time comes, each read a receive
    and a clock reading -- no parsing while the server serves -- and the reply parsed from the
    stamped reads afterwards (harness.llamacpp.sse), each event at the time of the read that brought
    its last byte. The stall and request limits hold while it is in flight (`overdue`)."""

    __slots__ = ("client", "request", "sock", "sent_at", "pieces", "stamps", "_tail", "_recv", "_clock")
    what = "POST /completion (stream)"

    def __init__(self, client: ServerClient, request: bytes) -> None:
        self.client = client
        self.request = request                  # the whole HTTP request (harness.llamacpp.sse.completion_request)
        self.sock: socket.socket | None = None
        self.sent_at: float | None = None       # clock reading just before connecting
        self.pieces: list[bytes] = []           # each read's bytes
        self.stamps: list[float] = []           # the clock as each read returned
        self._tail = b""                        # the last bytes read, to see the last chunk arrive
        self._recv: Callable[[int], bytes] | None = None
        self._clock: Callable[[], float] | None = None

    def open(self, clock: Callable[[], float]) -> socket.socket:
        """Connect to our server (refused, with nothing sent, to one that is not verified as ours
        or was killed) and send the request; the socket, non-blocking, to watch for reads."""
        c = self.client
        c._refuse_unless_ours(self.what)
        self._clock = clock
        self.sent_at = clock()
        limit = min(c.stall_timeout_s, c.request_timeout_s)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)    # not create_connection: no name lookup
        sock.settimeout(limit)
        try:
            sock.connect((HOST, c.port))
            sock.sendall(self.request)
        except TimeoutError:
            sock.close()
            raise c._stalled(self.what) from None
        except OSError as e:
            sock.close()
            raise c._failure(f"{self.what} failed: {type(e).__name__}: {e}") from e
        sock.setblocking(False)
        self.sock, self._recv = sock, sock.recv
        return sock

    def readable(self) -> bool:
        """Read what has arrived and stamp it; True when the reply is over (its last chunk read,
        or the server closed the connection)."""
        try:
            data = self._recv(RECV_BYTES)
        except BlockingIOError:
            return False
        except OSError as e:
            raise self.client._failure(f"stream broke: {type(e).__name__}: {e}") from e
        t = self._clock()
        if not data:
            return True
        self.pieces.append(data)
        self.stamps.append(t)
        self._tail = (self._tail + data[-TAIL:])[-TAIL:]
        return self._tail == LAST_CHUNK

    def overdue(self, now: float) -> None:
        """Kill the server and raise `LlamaServerStall` when nothing arrived for stall_timeout_s or
        the request outlasted request_timeout_s (`now`: a reading of the clock it was opened with)."""
        c = self.client
        if now - self.sent_at > c.request_timeout_s:
            raise c._stalled(self.what, overdue=True)
        if now - (self.stamps[-1] if self.stamps else self.sent_at) > c.stall_timeout_s:
            raise c._stalled(self.what)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()

    def completion(self, since: float | None = None) -> Completion:
        """The reply, from the stamped reads: its times in seconds since `since` (a clock reading;
        default: when the request was sent). Raises LlamaServerError for an HTTP error, a broken
        stream or one without a final event."""
        c = self.client
        try:
            status, body, events = stamped_events(self.pieces, self.stamps)
        except ValueError as e:
            raise c._failure(f"stream broke: {e}") from e
        if status != 200:
            raise LlamaServerError(f"{self.what} -> HTTP {status}: {body[:2000]!r}", c.log_tail())
        origin = self.sent_at if since is None else since
        assembly = StreamAssembly()
        for event, t in events:
            chunk = assembly.add(event, t - origin)
            if chunk is not None and chunk.final is not None:
                return chunk.final
        raise c._failure(f"{self.what}: the stream ended without a final event")

    def reply(self) -> Served:
        """What the serving driver keeps: each output token's receipt time (the driver's clock, as
        read) and the prompt tokens the server served from its cache (`timings.cache_n`)."""
        from harness.serving.drive import Served
        done = self.completion(since=0.0)
        return Served(list(done.token_times_s or []), done.timings.cache_n)
