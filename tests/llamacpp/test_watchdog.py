"""A llama-server that stops answering: real SIGSTOPs of the real server process. With
`engine.stall_timeout_s` small the job fails within about that time naming the stall, the
server is killed and gets no further request (counted at the client), the next job gets a new
one; a server stopped for a while and then continued makes its phase `starved`."""
from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from harness import results
from harness.llamacpp.flags import EXACT
from harness.llamacpp.server import LlamaServer, LlamaServerError, LlamaServerStall
from harness.measure import STARVED_BELOW
from tests.llamacpp.conftest import prompt_ids
from tests.stopping import its_llama_server, run_stopped

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
# the tiny-mixtral preset (its own 8192-token context): a 3000-token prefill is about a second of
# one thread here, long enough for a stop to land inside it and for /proc's 10 ms ticks to judge it
LONG = ["engine=llamacpp", "workload=chat", "workload.context_tokens=3000", "workload.gen_tokens=2",
        "run.repeats=2", "run.warmup=0", "run.check_reference=false", "run.timeline=false"]


@pytest.fixture(autouse=True)
def _built(bins):          # the real build (tests/llamacpp/conftest.py): skip or fail when missing
    return bins


class Requests:
    """Every request this process sends over http.client: (monotonic time, method, url, port)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, before=None) -> None:
        self.sent: list[tuple[float, str, str, int]] = []
        real = http.client.HTTPConnection.request
        outer = self

        def request(conn, method, url, *args, **kw):
            outer.sent.append((time.monotonic(), method, url, conn.port))
            if before is not None:
                before(conn, method, url)
            return real(conn, method, url, *args, **kw)

        monkeypatch.setattr(http.client.HTTPConnection, "request", request)

    def after(self, t: float) -> list[tuple[float, str, str, int]]:
        return [r for r in self.sent if r[0] > t]


def test_a_stopped_server_is_killed_and_asked_nothing_more(bins, gguf_f32, tmp_path, monkeypatch):
    stall_s = 2.0
    srv = LlamaServer(gguf_f32.path, EXACT.replace(threads=1), log_path=tmp_path / "s.log", binaries=bins,
                      stall_timeout_s=stall_s).start()
    try:
        requests = Requests(monkeypatch)
        srv.complete([1, 2, 3], 2)                              # a working server answers
        os.kill(srv.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(LlamaServerStall, match=r"sent nothing for stall_timeout_s=2 s during POST /completion"):
            srv.complete(prompt_ids(64, 128), 8, stream=True)
        waited = time.monotonic() - t0
        assert waited >= stall_s
        assert srv.proc.returncode == -signal.SIGKILL and not psutil.pid_exists(srv.pid)
        stalled_at = time.monotonic()
        for ask in (lambda: srv.slot_erase(0), srv.health, lambda: srv.complete([1], 1)):
            with pytest.raises(LlamaServerError, match="not sending .*was killed: it sent nothing"):
                ask()
        assert requests.after(stalled_at) == []                 # refused before any connection
    finally:
        srv.stop()


@pytest.mark.parametrize("stream", [True, False])
def test_a_request_timeout_names_request_timeout_s(bins, gguf_f32, tmp_path, stream):
    """request_timeout_s below stall_timeout_s: the socket gives up after request_timeout_s, and
    the error names that setting and its value, not the stall limit that did not fire."""
    srv = LlamaServer(gguf_f32.path, EXACT.replace(threads=1), log_path=tmp_path / "s.log", binaries=bins,
                      request_timeout_s=2.0, stall_timeout_s=300.0).start()
    try:
        os.kill(srv.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(LlamaServerStall) as err:
            srv.complete(prompt_ids(64, 128), 8, stream=stream)
        assert 2.0 <= time.monotonic() - t0 < 60
        message = str(err.value).splitlines()[0]
        assert "did not finish POST /completion" in message and "within request_timeout_s=2 s" in message
        assert "stall_timeout_s" not in message
        assert srv.proc.returncode == -signal.SIGKILL
    finally:
        srv.stop()


def test_a_job_whose_server_stalls_fails_and_the_next_job_gets_a_new_server(tmp_path, monkeypatch):
    """In-process, the whole job path: the server is SIGSTOPped as the decode request goes out;
    the job is a failed row naming the stall within about engine.stall_timeout_s, no request goes
    out after it (not the session's close, not the failure path's), and the next job of the same
    configuration starts a new server and measures."""
    from hydra import compose, initialize_config_dir

    import harness.cli  # noqa: F401 -- registers the ConfigStore
    from harness.cli import CONF_DIR
    from harness.report import Reporter
    from harness.runner import JobContext, run_job
    from harness.session import RunSession

    stall_s = 2
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=[
            "engine=llamacpp", "workload=chat", "workload.context_tokens=256", "workload.gen_tokens=8",
            "run.repeats=1", "run.warmup=0", "run.timeline=false", "run.ablation=false", f"run.out={tmp_path}",
            f"engine.stall_timeout_s={stall_s}"])
    stopped: dict[str, float] = {}
    completions = []

    def stop_at_decode(conn, method, url):
        if (method, url) == ("POST", "/completion"):
            completions.append(url)
            if len(completions) == 2 and not stopped:           # prefill_fresh, then decode's request
                server = next(c for c in psutil.Process().children(recursive=True)
                              if "llama-server" in c.name() and str(conn.port) in c.cmdline())
                server.send_signal(signal.SIGSTOP)
                stopped.update(pid=server.pid, at=time.monotonic())

    requests = Requests(monkeypatch, before=stop_at_decode)
    session = RunSession()                                        # the two jobs of one run share its engine cache
    try:
        first = run_job(cfg, JobContext(tmp_path / "a", "s", "a"), Reporter(quiet=True), session)
        failed_at = time.monotonic()
        assert first.error and "stall_timeout_s=2 s during POST /completion (stream)" in first.error
        assert stall_s <= failed_at - stopped["at"] < stall_s + 30
        assert [r[1:3] for r in requests.after(stopped["at"])] == []     # no slot erase, nothing
        assert not psutil.pid_exists(stopped["pid"])
        assert [r["status"] for r in first.rows] == ["failed"]
        second = run_job(cfg, JobContext(tmp_path / "b", "s", "b"), Reporter(quiet=True), session)
        assert second.error is None
        load = {r["source"]: r for r in second.rows if r["phase"] == "load" and r["metric"] == "time_s"}
        assert load["client"]["model_load"] == "cold"             # a new server, not the killed one
    finally:
        session.close()


# (setting, its value, what the error says): the limit set low is the one that fires and is named;
# the request limit leaves the first repeat's requests (about a second each) room on a busy machine
LIMITS = [("stall_timeout_s", 3, "stalled"), ("request_timeout_s", 8, "did not finish")]


@pytest.mark.parametrize("setting,limit_s,says", LIMITS, ids=[s for s, _, _ in LIMITS])
def test_a_stalled_server_fails_the_job_within_the_limit(tmp_path, setting, limit_s, says):
    """Through the CLI: the server is SIGSTOPped in the second repeat and never continued. The run
    ends within about the limit set low (the defaults are minutes), the row names that setting and
    its value (and not the other one), the stopped server is gone, and the run exits non-zero."""
    run = run_stopped([*LONG, f"engine.{setting}={limit_s}"], tmp_path, its_llama_server, None,
                      marker="repeat 2/2")
    assert run.returncode == 1, run.stderr
    assert not run.outlived, "the stalled llama-server outlived the run"
    assert run.exited_at - run.stopped_at < limit_s + 60
    df = results.load(next((tmp_path / "results" / "runs").iterdir()))
    assert set(df.status) == {"failed"} and len(df) == 1
    error = df.error.iloc[0]
    assert f"pid {run.pid}" in error and f"{setting}={limit_s} s" in error and says in error
    other = next(s for s, _, _ in LIMITS if s != setting)
    assert other not in error.splitlines()[0]


def test_a_server_stopped_mid_phase_is_flagged_starved(tmp_path):
    """SIGSTOP for 8 s in the second repeat, then SIGCONT: the phase the stop fell in reads 8 s and
    more, its rows (client and engine) are starved=True from the server's own CPU time (/proc), and
    the first repeat's prefill is starved=False. The job itself is ok: the server came back."""
    stop_s = 8.0
    run = run_stopped(LONG, tmp_path, its_llama_server, stop_s, marker="repeat 2/2")
    assert run.returncode == 0, run.stderr
    df = results.load(next((tmp_path / "results" / "runs").iterdir()))
    speed = df[(df.profiler == "none") & df.repeat.notna()]
    client = speed[speed.source == "client"].pivot_table(index=["repeat", "phase"], columns="metric", values="value")
    stopped = client[client.time_s >= stop_s]
    assert len(stopped) == 1 and stopped.index[0][0] == 1, client
    assert (stopped.cpu_util < STARVED_BELOW).all()
    phase = stopped.index[0][1]
    flags = speed.groupby(["repeat", "phase", "source"]).starved.agg(lambda s: set(s.tolist()))
    assert flags[(1, phase, "client")] == flags[(1, phase, "engine")] == {True}
    assert flags[(0, "prefill_fresh", "client")] == flags[(0, "prefill_fresh", "engine")] == {False}


@pytest.mark.parametrize("value", ["0", "-1", "inf"])
def test_the_timeouts_are_checked(tmp_path, value):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "engine=llamacpp", f"engine.stall_timeout_s={value}",
                           "run.quiet=true"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    error = results.load(tmp_path / "results" / "runs").error.dropna().iloc[0]
    assert error.count("\n") == 0
    assert "stall_timeout_s: allowed a positive number of seconds, got" in error
