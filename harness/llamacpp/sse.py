"""A streamed /completion read on a plain socket, for the serving client: the request's bytes, and
the reply parsed from the reads once the request is over, each event given the time of the read
that brought its last byte.

Owns: `completion_request` (the whole HTTP/1.1 request), and the parse of a reply kept as reads and
their stamps (`stamped_events`; its pieces `split_head`, `dechunk`, `sse_payloads`): HTTP status and
headers, chunked transfer coding, server-sent events, however the bytes were split among the reads.
Does not own: making the request and reading it as it arrives (`harness.llamacpp.client.
StreamedCompletion`), what the events mean (`harness.llamacpp.responses.StreamAssembly`).

Why a socket and not http.client: a 16-token streamed reply is ~19 events (two prompt-progress
events, a token each, the final one with the timings), and reading each through http.client's
chunked reader, in a thread per request, took ~1.9 ms of client CPU per request on the cores the
server runs on; a read that is a receive and a clock reading, with the parse after the run, costs
a fraction of it (docs/history/2026-12-05-serving-client-overhead.md). llama-server closes the
connection after every streamed reply, so each request connects anew (`Connection: close` says so).

    status, body, events = stamped_events(reads, stamps)     # events: [(event JSON, stamp), ...]
"""
from __future__ import annotations

import bisect
import json
from collections.abc import Iterator
from typing import Any

from harness.llamacpp.process import HOST

# the end of a chunked body without trailers: the last data chunk's CRLF, then the size-0 chunk; the
# events' JSON has no CR in it, so these bytes can only be the framing's
LAST_CHUNK = b"\r\n0\r\n\r\n"
TAIL = len(LAST_CHUNK)


def completion_request(port: int, key: str, body: bytes) -> bytes:
    """The whole HTTP/1.1 request for a streamed POST /completion of `body` (JSON) to our server on
    127.0.0.1:`port`, with this start's API key; the connection closes after the reply."""
    return (f"POST /completion HTTP/1.1\r\nHost: {HOST}:{port}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode() + body


def split_head(raw: bytes) -> tuple[int, dict[str, str], int]:
    """The status code, the headers (names lower-cased) and the offset of the body in a response's
    bytes. Raises ValueError when they are not an HTTP/1.x response head."""
    end = raw.find(b"\r\n\r\n")
    if end < 0:
        raise ValueError(f"the response ended inside its head ({len(raw)} bytes: {raw[:200]!r})")
    lines = raw[:end].decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest.partition(" ")[0]
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise ValueError(f"not an HTTP/1.x status line: {lines[0]!r}")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise ValueError(f"not a header line: {line!r}")
        headers[name.strip().lower()] = value.strip()
    return int(code), headers, end + 4


def dechunk(raw: bytes, start: int) -> tuple[bytes, list[int], list[int]]:
    """The body of a chunked response whose chunks begin at `raw[start]`, and where each chunk's
    data begins: in the body (`body_starts`) and in `raw` (`raw_starts`), so a body offset maps
    back to the byte that brought it. Raises ValueError on a malformed or unfinished body."""
    parts: list[bytes] = []
    body_starts: list[int] = []
    raw_starts: list[int] = []
    pos, size = start, 0
    while True:
        eol = raw.find(b"\r\n", pos)
        if eol < 0:
            raise ValueError(f"the chunked body ended without its last chunk (at byte {pos} of {len(raw)})")
        field = raw[pos:eol].split(b";", 1)[0].strip()          # a chunk extension is allowed, and ignored
        try:
            n = int(field, 16)
        except ValueError:
            raise ValueError(f"not a chunk size: {raw[pos:eol][:40]!r} at byte {pos}") from None
        if n == 0:
            return b"".join(parts), body_starts, raw_starts
        data = eol + 2
        if raw[data + n:data + n + 2] != b"\r\n":
            raise ValueError(f"a {n}-byte chunk at byte {pos} is cut short or not followed by CRLF")
        body_starts.append(size)
        raw_starts.append(data)
        parts.append(raw[data:data + n])
        size += n
        pos = data + n + 2


def sse_payloads(body: bytes) -> Iterator[tuple[bytes, int]]:
    """Each server-sent event's data (its `data:` lines joined by newlines) and the body offset of
    its last byte (the newline of the blank line that ends it). Other fields and comments are
    skipped; an unfinished last event is not an event."""
    data: list[bytes] = []
    pos = 0
    while True:
        eol = body.find(b"\n", pos)
        if eol < 0:
            return
        line = body[pos:eol]
        if line.endswith(b"\r"):
            line = line[:-1]
        if not line:
            if data:
                yield b"\n".join(data), eol
            data = []
        elif line.startswith(b"data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(b" ") else value)
        pos = eol + 1


def stamped_events(pieces: list[bytes], stamps: list[float]) -> tuple[int, bytes, list[tuple[dict[str, Any], float]]]:
    """A streamed response read as `pieces` (each read's bytes, in order) at `stamps` (the clock
    reading when each read returned): its status, its body, and -- for a 200 -- each JSON event with
    the stamp of the read that brought the event's last byte (an event split across reads is
    received when its last read is; several in one read share its stamp). `[DONE]` is not an event.
    Raises ValueError when the bytes are not a whole chunked reply."""
    if len(pieces) != len(stamps):
        raise ValueError(f"{len(pieces)} reads but {len(stamps)} stamps")
    raw = b"".join(pieces)
    status, headers, start = split_head(raw)
    if "chunked" not in headers.get("transfer-encoding", "").lower():
        size = headers.get("content-length")
        return status, raw[start:start + int(size)] if size and size.isdigit() else raw[start:], []
    body, body_starts, raw_starts = dechunk(raw, start)
    if status != 200:
        return status, body, []
    ends, total = [], 0
    for p in pieces:
        total += len(p)
        ends.append(total)
    events = []
    for payload, last in sse_payloads(body):
        if payload == b"[DONE]":
            continue
        c = bisect.bisect_right(body_starts, last) - 1
        at = raw_starts[c] + last - body_starts[c]             # the event's last byte, in the reads
        events.append((json.loads(payload), stamps[bisect.bisect_right(ends, at)]))
    return status, body, events
