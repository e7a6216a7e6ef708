"""The serving client's stream reader (harness.llamacpp.sse; client.StreamedCompletion) and the
driver that runs it (harness.serving.drive.drive_requests).

The parser is fed a real llama-server reply (golden/completion_stream.http: build 0c1e57098, the
f32 tiny-moe-trained GGUF, 24 prompt tokens, n_predict 6, ignore_eos, prompt-progress events, the
request as `ServerClient.exchange` builds it) split among reads every way that matters; the driver
runs against a local server that replays those bytes on a script of timed writes, so when each byte
was sent is known; and against the real llama-server it must agree with the http.client reader."""
from __future__ import annotations

import json
import random
import socket
import threading
import time
from pathlib import Path

import pytest

from harness.llamacpp.client import LlamaServerError, LlamaServerStall, ServerClient
from harness.llamacpp.responses import StreamAssembly
from harness.llamacpp.sse import LAST_CHUNK, dechunk, split_head, sse_payloads, stamped_events
from harness.serving.drive import Request, drive_requests

GOLDEN = (Path(__file__).parent / "golden" / "completion_stream.http").read_bytes()
TOKENS = [39, 32, 32, 32, 32, 32]                  # what the golden reply generated


def split_at(raw: bytes, cuts: list[int]) -> list[bytes]:
    edges = [0, *sorted(set(c for c in cuts if 0 < c < len(raw))), len(raw)]
    return [raw[a:b] for a, b in zip(edges, edges[1:])]


def chunked(head: bytes, payloads: list[bytes]) -> bytes:
    """A chunked reply as llama-server writes one: each event `data: ...\\n\\n` in a chunk of its own."""
    out = [head]
    for p in payloads:
        event = b"data: " + p + b"\n\n"
        out.append(b"%x\r\n" % len(event) + event + b"\r\n")
    return b"".join(out) + b"0\r\n\r\n"


def golden_parts() -> tuple[bytes, list[bytes]]:
    """The golden reply's head and its events' JSON, as sent."""
    _, _, start = split_head(GOLDEN)
    body, _, _ = dechunk(GOLDEN, start)
    return GOLDEN[:start], [p for p, _ in sse_payloads(body)]


def event_ends(raw: bytes) -> list[int]:
    """Where each event's last byte is in the golden reply: the second newline before each chunk's CRLF."""
    ends, pos = [], 0
    while (pos := raw.find(b"\n\n\r\n", pos)) >= 0:
        ends.append(pos + 1)
        pos += 4
    return ends


def read_of(pieces: list[bytes], offset: int) -> int:
    """Which read brought byte `offset`, counted by walking the reads."""
    seen = 0
    for i, p in enumerate(pieces):
        seen += len(p)
        if offset < seen:
            return i
    raise AssertionError(f"byte {offset} is past the {seen} bytes read")


# ------------------------------------------------------------------ the parser, on real bytes

def test_the_golden_reply_is_what_the_server_streams():
    status, headers, _ = split_head(GOLDEN)
    assert status == 200 and headers["transfer-encoding"] == "chunked" and headers["connection"] == "close"
    _, payloads = golden_parts()
    events = [json.loads(p) for p in payloads]
    assert sum("prompt_progress" in e for e in events) == 2 and events[-1]["stop"] is True
    assert len(event_ends(GOLDEN)) == len(events) == 9 and GOLDEN.endswith(LAST_CHUNK)


@pytest.mark.parametrize("how", ["one read", "a byte a read", "every event cut in two", "random cuts"])
def test_a_real_reply_parses_the_same_however_its_bytes_were_read(how):
    ends = event_ends(GOLDEN)
    cuts = {"one read": [], "a byte a read": list(range(len(GOLDEN))),
            "every event cut in two": [e - 40 for e in ends] + [e + 1 for e in ends],
            "random cuts": random.Random(7).sample(range(1, len(GOLDEN)), 25)}[how]
    pieces = split_at(GOLDEN, cuts)
    stamps = [float(i) for i in range(len(pieces))]           # a read's stamp: its index
    status, _, events = stamped_events(pieces, stamps)
    assert status == 200
    _, payloads = golden_parts()
    assert [e for e, _ in events] == [json.loads(p) for p in payloads]
    assert [t for _, t in events] == [read_of(pieces, e) for e in ends]    # the read that brought its last byte
    if how == "a byte a read":
        assert [t for _, t in events] == ends


def test_the_final_event_gives_the_tokens_their_times_and_the_server_s_timings():
    pieces = split_at(GOLDEN, [e + 1 for e in event_ends(GOLDEN)])      # each event in a read of its own
    stamps = [10.0 + i for i in range(len(pieces))]
    _, _, events = stamped_events(pieces, stamps)
    assembly = StreamAssembly()
    chunks = [assembly.add(e, t - 10.0) for e, t in events]
    assert chunks[0] is None and chunks[1] is None                   # prompt progress: no token
    done = chunks[-1].final
    assert done.tokens == TOKENS and done.stop_type == "limit"
    assert done.token_times_s == [2.0, 3.0, 4.0, 5.0, 6.0, 7.0]        # the reads of events 3..8
    assert done.ttft_s == 2.0 and done.wall_s == 8.0
    assert done.timings.cache_n == 0 and done.timings.prompt_n == 24 and done.timings.predicted_n == 6


def test_several_tokens_in_one_event_share_its_receipt_time():
    head, payloads = golden_parts()
    merged = payloads[2].replace(b'"tokens":[39]', b'"tokens":[39,32,32]')
    raw = chunked(head, [*payloads[:2], merged, *payloads[5:]])
    pieces = split_at(raw, [e + 1 for e in event_ends(raw)])
    _, _, events = stamped_events(pieces, [float(i) for i in range(len(pieces))])
    assembly = StreamAssembly()
    done = [assembly.add(e, t) for e, t in events][-1].final
    assert done.tokens == TOKENS
    assert done.token_times_s == [2.0, 2.0, 2.0, 3.0, 4.0, 5.0]


def test_sse_lines_with_crlf_several_data_lines_and_comments():
    body = b": a comment\r\ndata: {\"a\":\r\ndata: 1}\r\n\r\nevent: x\ndata: [DONE]\n\ndata: {\"b\": 2}\n"
    got = list(sse_payloads(body))
    assert [p for p, _ in got] == [b'{"a":\n1}', b"[DONE]"]          # the last event is unfinished: not one
    assert [body[e] for _, e in got] == [ord("\n"), ord("\n")]


def test_a_reply_cut_short_or_malformed_is_refused():
    with pytest.raises(ValueError, match="without its last chunk"):
        stamped_events([GOLDEN[:-5]], [0.0])
    with pytest.raises(ValueError, match="ended inside its head"):
        stamped_events([GOLDEN[:40]], [0.0])
    bad = GOLDEN.replace(b"\r\n\r\nb5\r\n", b"\r\n\r\nzz\r\n", 1)
    with pytest.raises(ValueError, match="not a chunk size"):
        stamped_events([bad], [0.0])
    with pytest.raises(ValueError, match="reads but"):
        stamped_events([GOLDEN], [])
    error = b'HTTP/1.1 400 Bad Request\r\nContent-Length: 13\r\n\r\n{"error":"x"}'
    assert stamped_events(split_at(error, [20]), [0.0, 1.0]) == (400, b'{"error":"x"}', [])


# ------------------------------------------------------------------ the driver, on a replayed server

class Replay:
    """A local server that answers every connection with `script` -- (pause s, bytes) writes, the
    time just before each write recorded -- and then holds the connection open `hold_s` (so a
    client that waited for the server to close would wait that long)."""

    def __init__(self, script: list[tuple[float, bytes]], hold_s: float = 0.0) -> None:
        self.script, self.hold_s = script, hold_s
        self.accepted: list[float] = []
        self.writes: list[list[float]] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted.append(time.perf_counter())
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        got = b""
        while b"\r\n\r\n" not in got:
            got += conn.recv(65536)
        head, _, body = got.partition(b"\r\n\r\n")
        size = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        while len(body) < size:
            body += conn.recv(65536)
        times: list[float] = []
        self.writes.append(times)
        try:
            for pause, data in self.script:
                time.sleep(pause)
                times.append(time.perf_counter())
                conn.sendall(data)
            time.sleep(self.hold_s)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.listener.close()


class Local(ServerClient):
    """ServerClient's requests to a Replay (its port taken as verified); a kill is only recorded."""

    def __init__(self, port: int, stall_timeout_s: float = 30.0) -> None:
        self.port = self._verified_port = port
        self.proc, self.broken, self.slot_save_path, self._key = None, None, None, "test-key"
        self.stall_timeout_s, self.request_timeout_s = stall_timeout_s, 60.0
        self.kills: list[str] = []

    def kill(self, why: str) -> None:
        self.kills.append(why)
        self.broken = why

    def log_tail(self, n: int = 40) -> str:
        return ""


class Clock:
    """time.perf_counter, its first reading kept: the driver's t0, so its times can be set against ours."""

    def __init__(self) -> None:
        self.first: float | None = None

    def __call__(self) -> float:
        t = time.perf_counter()
        if self.first is None:
            self.first = t
        return t


def serve_with(client: Local, n: int, max_concurrency: int | None = None, gap_s: float = 0.0,
               clock: Clock | None = None):
    requests = [Request(f"r{i}", i * gap_s, [1, 2, 3], len(TOKENS), False) for i in range(n)]
    return drive_requests(lambda r: client.exchange(r.prompt, r.output_len, ignore_eos=True), requests,
                          max_concurrency, clock or Clock())


def test_every_token_is_stamped_when_its_bytes_arrive_and_the_end_is_the_last_chunk():
    """Each event written 0.05 s after the one before, the last chunk in two writes (as llama-server
    writes it), then the connection held open for 5 s: each token's time is after the write that
    brought it, in order, and the request is over at its last chunk, not when the server closes."""
    pieces = split_at(GOLDEN, [e + 3 for e in event_ends(GOLDEN)] + [len(GOLDEN) - 2])
    assert pieces[-2:] == [b"0\r\n", b"\r\n"]
    server = Replay([(0.05, p) for p in pieces], hold_s=5.0)
    clock = Clock()
    try:
        out = serve_with(Local(server.port), 1, clock=clock)
    finally:
        server.close()
    (line,) = out.timelines
    assert line.error is None and len(line.token_times_s) == len(TOKENS)
    assert out.wall_s < 2.0                                     # the 5 s hold was not waited for
    writes = [w - clock.first for w in server.writes[0]]        # on the driver's clock
    for k, t in enumerate(line.token_times_s):                  # tokens are events 3..8, pieces 2..7
        assert t > writes[2 + k]                                # never before its bytes were written
    assert list(line.token_times_s) == sorted(set(line.token_times_s))
    assert line.arrival_s < writes[0] and line.cached_prompt_tokens == 0


def test_a_concurrency_slot_frees_when_a_reply_is_over():
    server = Replay([(0.02, p) for p in split_at(GOLDEN, [e + 3 for e in event_ends(GOLDEN)])], hold_s=2.0)
    try:
        out = serve_with(Local(server.port), 3, max_concurrency=1)
    finally:
        server.close()
    assert [t.error for t in out.timelines] == [None] * 3
    assert all(len(t.token_times_s) == len(TOKENS) for t in out.timelines)
    first, second, third = out.timelines
    assert second.arrival_s >= first.token_times_s[-1] and third.arrival_s >= second.token_times_s[-1]
    assert out.wall_s < 2.0 and out.overhead_s > 0


def test_a_server_that_sends_nothing_is_killed_as_stalled_and_asked_nothing_more():
    server = Replay([(3.0, GOLDEN)])
    client = Local(server.port, stall_timeout_s=0.3)
    try:
        t0 = time.perf_counter()
        out = serve_with(client, 2, gap_s=0.6)
        took = time.perf_counter() - t0
    finally:
        server.close()
    first, second = out.timelines
    assert first.error.startswith(LlamaServerStall.__name__) and "stalled" in first.error
    assert second.error.startswith(LlamaServerError.__name__) and "not sending" in second.error
    assert len(client.kills) == 1 and len(server.accepted) == 1 and took < 2.0


def test_an_http_error_is_the_request_s_error():
    error = b'HTTP/1.1 400 Bad Request\r\nContent-Length: 28\r\nConnection: close\r\n\r\n{"error":"prompt too long"}\n'
    server = Replay([(0.0, error)])
    try:
        out = serve_with(Local(server.port), 1)
    finally:
        server.close()
    assert "HTTP 400" in out.timelines[0].error and "prompt too long" in out.timelines[0].error


def test_a_reply_cut_off_mid_stream_is_the_request_s_error():
    server = Replay([(0.0, GOLDEN[:700])])                    # then the server closes the connection
    try:
        out = serve_with(Local(server.port), 1)
    finally:
        server.close()
    assert "stream broke" in out.timelines[0].error and "chunk" in out.timelines[0].error


# ------------------------------------------------------------------ on the real server

def test_the_socket_reader_agrees_with_http_client_on_a_real_server(exact_server, mixtral):
    """The same requests through the serving client and through `complete(stream=True)`: the same
    tokens, a time for each, and the server's cached-token count read from the final event."""
    from tests.llamacpp.conftest import prompt_ids
    model, _ = mixtral
    a = prompt_ids(40, model.config.vocab_size, seed=11)
    b = prompt_ids(10, model.config.vocab_size, seed=12)
    srv = exact_server

    def served(prompt: list[int], cache_prompt: bool):
        ex = srv.exchange(prompt, 8, cache_prompt=cache_prompt, ignore_eos=True)
        out = drive_requests(lambda _r: ex, [Request("r0", 0.0, prompt, 8, False)], None)
        return out.timelines[0], ex.completion()

    srv.slot_erase(0)
    line, first = served(a, True)
    assert line.error is None and line.cached_prompt_tokens == 0 == first.timings.cache_n
    line, cont = served(a + b, True)
    assert line.cached_prompt_tokens == len(a) == cont.timings.cache_n          # the prefix came from the slot
    reference = srv.complete(a + b, 8, cache_prompt=False, ignore_eos=True, stream=True)
    assert cont.tokens == reference.tokens and len(line.token_times_s) == 8
    assert cont.timings.prompt_n == len(b) and reference.timings.prompt_n == len(a + b)
    assert cont.token_times_s == sorted(cont.token_times_s) and 0 < cont.ttft_s <= cont.wall_s
