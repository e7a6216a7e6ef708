"""The harness talks only to the llama-server it started: a real stand-in HTTP server on the port
the harness is about to use records every request it gets -- none -- and the start fails in one
line naming the port and the stand-in's pid, or moves to another port; the server we start
answers only requests that carry its per-start key."""
from __future__ import annotations

import http.client
import http.server
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import harness.llamacpp.server as server_mod
from harness.llamacpp.flags import EXACT
from harness.llamacpp.server import LlamaServer, LlamaServerError, PortTaken

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _built(bins):          # the real build (tests/llamacpp/conftest.py): skip or fail when missing
    return bins


@contextmanager
def stand_in(reuse_port: bool) -> Iterator[tuple[int, list[str]]]:
    """An HTTP server on 127.0.0.1 that answers 200 to everything and records each request line.
    With `reuse_port` it sets SO_REUSEPORT, as llama.cpp's HTTP library does, so llama-server can
    bind the same port beside it and the kernel would share connections between the two."""
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            seen.append(self.requestline)
            body = b'{"status": "ok"}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args) -> None:
            pass

    class Server(http.server.ThreadingHTTPServer):
        allow_reuse_port = reuse_port

    httpd = Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd.server_address[1], seen
    finally:
        httpd.shutdown()
        httpd.server_close()


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize("reuse_port", [False, True])
def test_a_stand_in_on_the_port_gets_nothing_and_the_start_fails_in_one_line(bins, gguf_f32, tmp_path, monkeypatch,
                                                                             reuse_port):
    """`free_port` hands out the stand-in's port, every time. llama-server fails to bind it (the
    pinned build's HTTP library sets SO_REUSEADDR only, so even a stand-in offering SO_REUSEPORT
    keeps it) and exits a few ms later -- before that, the harness used to ask the stand-in's
    /health, take its 200 and go on to /props. Now nothing is sent: after three ports the start
    fails in one line naming the port and the stand-in's pid."""
    with stand_in(reuse_port) as (port, seen):
        monkeypatch.setattr(server_mod, "free_port", lambda: port)      # the port the harness is about to use
        srv = LlamaServer(gguf_f32.path, EXACT.replace(threads=1), log_path=tmp_path / "s.log", binaries=bins)
        with pytest.raises(LlamaServerError) as e:
            srv.start()
        assert seen == []
    text = one_line(e.value)
    assert f"127.0.0.1:{port}" in text and f"pid {os.getpid()}" in text and "nothing was sent" in text
    assert srv.proc.poll() is not None
    assert (tmp_path / "s.log").read_text().count("$ ") == 3            # a port picked here is picked again


def test_a_process_listening_beside_ours_is_told_apart(tmp_path):
    """The listener check itself, on real sockets: a child process and this one both listen on one
    port (SO_REUSEPORT, as a server whose build sets it shares its port): neither is alone."""
    from harness.llamacpp.listener import Foreign, NotYet, Ours, check_port

    with stand_in(reuse_port=True) as (port, _seen):
        assert check_port(port, os.getpid()) == Ours()
        child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
            import socket, sys, time
            s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind(("127.0.0.1", {port})); s.listen(); print("up", flush=True); time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "up"
            verdict = check_port(port, child.pid)
            assert isinstance(verdict, Foreign) and len(verdict.holders) == 1
            assert verdict.holders[0].startswith(f"pid {os.getpid()} (")          # the stand-in, in this process
        finally:
            child.kill()
            child.wait()
        waiting = check_port(port, child.pid)          # only another process listens: not ours, not asked
        assert isinstance(waiting, NotYet) and f"pid {os.getpid()}" in waiting.holders[0]


def test_a_stand_in_holding_the_port_gets_nothing_and_another_port_is_used(bins, gguf_f32, tmp_path, monkeypatch):
    with stand_in(reuse_port=False) as (port, seen):
        with pytest.raises(PortTaken) as e:                               # a port asked for: not moved
            LlamaServer(gguf_f32.path, EXACT.replace(threads=1), log_path=tmp_path / "fixed.log", binaries=bins,
                        port=port).start()
        text = one_line(e.value)
        assert f"couldn't bind 127.0.0.1:{port}" in text and f"pid {os.getpid()}" in text
        picks = iter([port])
        real = server_mod.free_port
        monkeypatch.setattr(server_mod, "free_port", lambda: next(picks, None) or real())
        with LlamaServer(gguf_f32.path, EXACT.replace(threads=1), log_path=tmp_path / "moved.log",
                         binaries=bins) as srv:
            assert srv.port != port and srv.health()["status"] == "ok"
            assert srv.complete([1, 2, 3], 2).tokens
        assert seen == []


def test_only_requests_with_the_per_start_key_drive_the_server(exact_server):
    """Another local process, without the key, gets 401 from everything but /health; the key is
    in no argv and no log (read from a file the server read at start, removed since)."""
    def ask(method: str, path: str, key: str | None) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", exact_server.port, timeout=30)
        try:
            conn.request(method, path, body=b"{}" if method == "POST" else None,
                         headers={"Authorization": f"Bearer {key}"} if key else {})
            resp = conn.getresponse()
            resp.read()
            return resp.status
        finally:
            conn.close()

    for method, path in (("GET", "/props"), ("GET", "/slots"), ("POST", "/slots/0?action=erase"),
                         ("POST", "/completion")):
        assert ask(method, path, None) == 401 and ask(method, path, "guessed") == 401, (method, path)
    assert ask("GET", "/health", None) == 200                          # llama.cpp keeps /health public
    assert exact_server.props()["total_slots"] == 1                      # our client sends the key
    key = exact_server._key
    cmdline = Path(f"/proc/{exact_server.pid}/cmdline").read_bytes().decode()
    assert key not in cmdline and key not in exact_server.log_path.read_text()
    key_file = cmdline.split("--api-key-file\0")[1].split("\0")[0]
    assert not Path(key_file).exists()


def test_a_port_nobody_verified_gets_no_request(bins, gguf_f32, tmp_path):
    """A LlamaServer pointed at a port it did not start a server on refuses to send, before connecting."""
    with stand_in(reuse_port=False) as (port, seen):
        srv = LlamaServer(gguf_f32.path, EXACT, log_path=tmp_path / "n.log", binaries=bins, port=port)
        with pytest.raises(LlamaServerError, match=f"not sending GET /health: 127.0.0.1:{port} is not verified"):
            srv.health()
        assert seen == []
