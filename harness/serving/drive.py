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
And `drive_requests` (a server: llama-server over HTTP) -- one loop on the caller's thread over
every request in flight: each request's Exchange made before the run (its bytes built), opened at
its arrival time while one of `max_concurrency` slots is free, read whenever its socket is readable
(poll), each read stamped with the clock as it returns, so every streamed token's time is
when its bytes were received; the replies are parsed after the run. The harness's own time there is
the client process's CPU time from the start of the run to the last reply's end, per request (the
server is another process). One thread and poll, not a thread per request: a woken thread
per event, and threads contending for the GIL, cost more client CPU on the cores the server uses
than the reads themselves (docs/history/2026-12-05-serving-client-overhead.md).
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

import select
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from harness.serving.metrics import RequestTimeline

OVERDUE_CHECK_S = 0.1        # how often requests in flight are held to their limits (stall, request time)

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


class Exchange(Protocol):
    """One request to a server as `drive_requests` runs it: made before the run, opened (connected,
    request sent) when its time comes, read on the driver's thread whenever its socket is readable,
    its reply read from what it kept once the run is over (harness.llamacpp.client.StreamedCompletion)."""

    def open(self, clock: Callable[[], float]) -> socket.socket:
        """Send the request; the socket to watch (non-blocking). `clock` stamps every read."""

    def readable(self) -> bool:
        """Read what has arrived, stamped with the clock as the read returns; True when the reply
        is over. Cheap: it runs while the server serves."""

    def overdue(self, now: float) -> None:
        """Raise the request's error if it has outlived its limits at clock reading `now`."""

    def close(self) -> None:
        """Close the socket (the reply over, or the request failed)."""

    def reply(self) -> Served:
        """After the run: what the reply said; raises the request's error."""


@dataclass(frozen=True)
class Served:
    token_times: list[float]                  # each output token's receipt time: the client clock's reading
    cached_prompt_tokens: int | None          # the server's count of prompt tokens served from its cache (None: not said)


def drive_requests(exchange: Callable[[Request], Exchange], requests: list[Request], max_concurrency: int | None,
                   clock: Callable[[], float] = time.perf_counter) -> Driven:
    """Run `requests` against a server on this thread (module docstring): `exchange(request)` makes
    each one's Exchange before the run; each is opened at its arrival time once a slot is free, read
    whenever its socket is readable, held to its limits every OVERDUE_CHECK_S, and closed when its
    reply is over; the replies are read after the run. An exception from an exchange is that
    request's error (the others go on). `overhead_s`: the client's CPU time from the start of the
    run to the end of the last reply (reading the replies after that cannot perturb the run)."""
    order = sorted(requests, key=_arrival_order)
    made = {r.request_id: exchange(r) for r in order}
    sent: dict[str, float] = {}
    errors: dict[str, str] = {}
    in_flight: dict[int, tuple[Request, Exchange]] = {}      # by file descriptor
    poller = select.poll()                                   # few sockets at once: poll is as cheap as epoll
    queue = deque(order)
    slots = max_concurrency or len(order)

    def drop(fd: int, r: Request, ex: Exchange, exc: BaseException | None = None) -> None:
        del in_flight[fd]
        poller.unregister(fd)
        ex.close()
        if exc is not None:
            errors[r.request_id] = f"{type(exc).__name__}: {exc}"

    cpu0 = time.process_time()
    t0 = clock()
    next_check = t0 + OVERDUE_CHECK_S
    try:
        while True:
            now = clock()
            while queue and len(in_flight) < slots and queue[0].arrival_s <= now - t0:
                r = queue.popleft()
                ex = made[r.request_id]
                sent[r.request_id] = clock() - t0
                try:
                    fd = ex.open(clock).fileno()
                except Exception as exc:  # noqa: BLE001 -- a failed request is a row, the run goes on
                    errors[r.request_id] = f"{type(exc).__name__}: {exc}"
                    ex.close()
                    continue
                in_flight[fd] = (r, ex)
                poller.register(fd, select.POLLIN)
                now = clock()
            if not in_flight:                                # idle until the next arrival
                if not queue:
                    break
                wait = queue[0].arrival_s - (now - t0)
                if wait > 0:
                    time.sleep(wait)
                continue
            if now >= next_check:
                for fd, (r, ex) in list(in_flight.items()):
                    try:
                        ex.overdue(now)
                    except Exception as exc:  # noqa: BLE001 -- as above
                        drop(fd, r, ex, exc)
                next_check = now + OVERDUE_CHECK_S
            wait = next_check - now
            if queue and len(in_flight) < slots:
                wait = min(wait, queue[0].arrival_s - (now - t0))
            for fd, _ in poller.poll(wait * 1e3 if wait > 0 else 0):
                r, ex = in_flight[fd]
                try:
                    if ex.readable():
                        drop(fd, r, ex)
                except Exception as exc:  # noqa: BLE001 -- as above
                    drop(fd, r, ex, exc)
        wall, cpu = clock() - t0, time.process_time() - cpu0
    finally:
        for _, ex in in_flight.values():                     # an exception of our own: nothing left open
            ex.close()
    times: dict[str, list[float]] = {r.request_id: [] for r in requests}
    cached: dict[str, int | None] = {}
    for rid in sent:
        if rid in errors:
            continue
        try:
            got = made[rid].reply()
        except Exception as exc:  # noqa: BLE001 -- as above
            errors[rid] = f"{type(exc).__name__}: {exc}"
            continue
        times[rid] = [t - t0 for t in got.token_times]
        cached[rid] = got.cached_prompt_tokens
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
