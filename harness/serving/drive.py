"""The client side of a serving run on an engine that batches in process (engine.batcher): requests
sent at their scheduled arrival times, every output token stamped when the client gets it.

Owns: `drive` (an in-process batcher) -- the loop that sends each request when its arrival time has come and a
concurrency slot is free (`max_concurrency`: a client-side limit, as `vllm bench serve
--max-concurrency`; a request waiting for a slot is not yet sent, so its TTFT starts when it is),
runs the batcher's steps while anything is in flight, sleeps to the next arrival when nothing is,
and stamps each emitted token with the clock at the end of the step that produced it (what a
client streaming from the engine would see, less the transport); and the harness's own time
(`overhead_s`: the loop's wall time outside the engine's steps and the sleeps), so a run can show
that measuring did not perturb what it measured.
And `drive_requests` (a server: llama-server over HTTP) -- one client thread per request, started
at its arrival time, holding one of `max_concurrency` slots while in flight, stamping every
streamed token when it is received; the harness's own time there is the client process's CPU time
(the server is another process), per request.
Both follow the same clock rules: a request's time starts when it is sent, every token's when the
client has it, one monotonic clock (`clock`) for all.
Does not own: the schedule (harness.serving.load), the batching (engine.batcher, the server's
slots), the metrics (harness.serving.metrics).

    from engine import Engine
    from engine.batcher import ContinuousBatcher
    from harness.serving.drive import Request, drive
    eng = Engine.from_pretrained("tiny-mixtral")
    out = drive(ContinuousBatcher(eng), [Request("r0", 0.0, [1, 2, 3], 4, False)], max_concurrency=None)
    out.timelines[0].token_times_s         # four client-side times, seconds after the start
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from harness.serving.metrics import RequestTimeline

if TYPE_CHECKING:
    from engine.batcher import ContinuousBatcher, StepReport


@dataclass(frozen=True)
class Request:
    request_id: str
    arrival_s: float                # scheduled, seconds after the start
    prompt: list[int]
    output_len: int
    warmup: bool
    prefix_len: int = 0             # its first tokens are the load's shared prefix (a prefix cache may hold them)


@dataclass
class Driven:
    timelines: list[RequestTimeline]
    steps: list[StepReport]         # the engine's steps (an in-process batcher; empty for a server)
    wall_s: float                   # the whole run
    engine_s: float                 # inside the engine's steps (0 for a server: another process)
    overhead_s: float               # the harness's own time: wall - engine - sleeping; a server's client: its CPU time


def drive(batcher: ContinuousBatcher, requests: list[Request], max_concurrency: int | None,
          clock: Callable[[], float] = time.perf_counter) -> Driven:
    """Run `requests` through `batcher` on the client-side clock (module docstring)."""
    queue = deque(sorted(requests, key=_arrival_order))
    sent: dict[str, float] = {}
    times: dict[str, list[float]] = {r.request_id: [] for r in requests}
    cached: dict[str, int | None] = {}
    in_flight: set[str] = set()
    steps: list[StepReport] = []
    engine_s = slept_s = 0.0
    t0 = clock()
    while queue or in_flight:
        now = clock() - t0
        while queue and queue[0].arrival_s <= now and (max_concurrency is None or len(in_flight) < max_concurrency):
            r = queue.popleft()
            batcher.submit(r.request_id, r.prompt, r.output_len, r.prefix_len)
            sent[r.request_id] = clock() - t0
            in_flight.add(r.request_id)
        if not in_flight:                              # idle until the next arrival
            wait = queue[0].arrival_s - (clock() - t0)
            if wait > 0:
                time.sleep(wait)
                slept_s += wait
            continue
        start = clock()
        report = batcher.step()
        end = clock()
        engine_s += end - start
        steps.append(report)
        for e in report.emitted:
            times[e.request_id].append(end - t0)
            if e.index == 0:
                cached[e.request_id] = e.cached
            if e.finished:
                in_flight.discard(e.request_id)
    wall = clock() - t0
    return Driven(_timelines(requests, sent, times, cached, {}), steps, wall, engine_s,
                  max(0.0, wall - engine_s - slept_s))


def drive_requests(send: Callable[[Request, Callable[[], None]], int | None], requests: list[Request],
                   max_concurrency: int | None, clock: Callable[[], float] = time.perf_counter) -> Driven:
    """Run `requests` against a server, one client thread each (module docstring). `send(request,
    got_token)` makes the request, calls `got_token()` as each output token arrives, and returns
    the server's count of prompt tokens it served from its cache (None: it does not say); an
    exception is that request's error (the others go on)."""
    slots = threading.BoundedSemaphore(max_concurrency) if max_concurrency else None
    sent: dict[str, float] = {}
    times: dict[str, list[float]] = {r.request_id: [] for r in requests}
    cached: dict[str, int | None] = {}
    errors: dict[str, str] = {}
    t0 = clock()

    def client(r: Request) -> None:
        if slots is not None:
            slots.acquire()
        try:
            sent[r.request_id] = clock() - t0
            mine = times[r.request_id]
            try:
                cached[r.request_id] = send(r, lambda: mine.append(clock() - t0))
            except Exception as exc:  # noqa: BLE001 -- a failed request is a row, the run goes on
                errors[r.request_id] = f"{type(exc).__name__}: {exc}"
        finally:
            if slots is not None:
                slots.release()

    cpu0 = time.process_time()
    threads = []
    for r in sorted(requests, key=_arrival_order):
        wait = r.arrival_s - (clock() - t0)
        if wait > 0:
            time.sleep(wait)
        th = threading.Thread(target=client, args=(r,), name=f"moebench-client-{r.request_id}", daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    wall, cpu = clock() - t0, time.process_time() - cpu0
    return Driven(_timelines(requests, sent, times, cached, errors), [], wall, 0.0, cpu)


def _arrival_order(r: Request) -> tuple[float, str]:
    return r.arrival_s, r.request_id


def _timelines(requests: list[Request], sent: dict[str, float], times: dict[str, list[float]],
               cached: dict[str, int | None], errors: dict[str, str]) -> list[RequestTimeline]:
    """The requests that were sent, in the order they were, as the client saw them."""
    by_id = {r.request_id: r for r in requests}
    return [RequestTimeline(request_id=rid, arrival_s=sent[rid], token_times_s=tuple(times[rid]),
                            prompt_tokens=len(by_id[rid].prompt), output_tokens_asked=by_id[rid].output_len,
                            cached_prompt_tokens=cached.get(rid), error=errors.get(rid), warmup=by_id[rid].warmup)
            for rid in sorted(sent, key=sent.__getitem__)]
