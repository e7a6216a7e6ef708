"""The client side of a serving run on an engine that batches in process (engine.batcher): requests
sent at their scheduled arrival times, every output token stamped when the client gets it.

Owns: `drive` -- the loop that sends each request when its arrival time has come and a
concurrency slot is free (`max_concurrency`: a client-side limit, as `vllm bench serve
--max-concurrency`; a request waiting for a slot is not yet sent, so its TTFT starts when it is),
runs the batcher's steps while anything is in flight, sleeps to the next arrival when nothing is,
and stamps each emitted token with the clock at the end of the step that produced it (what a
client streaming from the engine would see, less the transport); and the harness's own time
(`overhead_s`: the loop's wall time outside the engine's steps and the sleeps), so a run can show
that measuring did not perturb what it measured.
Does not own: the schedule (harness.serving.load), the batching (engine.batcher), the metrics
(harness.serving.metrics).

    from engine import Engine
    from engine.batcher import ContinuousBatcher
    from harness.serving.drive import Request, drive
    eng = Engine.from_pretrained("tiny-mixtral")
    out = drive(ContinuousBatcher(eng), [Request("r0", 0.0, [1, 2, 3], 4, False)], max_concurrency=None)
    out.timelines[0].token_times_s         # four client-side times, seconds after the start
"""
from __future__ import annotations

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


@dataclass
class Driven:
    timelines: list[RequestTimeline]
    steps: list[StepReport]
    wall_s: float                   # the whole run
    engine_s: float                 # inside the engine's steps
    overhead_s: float               # the harness's own time: wall - engine - sleeping


def drive(batcher: ContinuousBatcher, requests: list[Request], max_concurrency: int | None,
          clock: Callable[[], float] = time.perf_counter) -> Driven:
    """Run `requests` through `batcher` on the client-side clock (module docstring)."""
    queue = deque(sorted(requests, key=lambda r: (r.arrival_s, r.request_id)))
    by_id = {r.request_id: r for r in requests}
    sent: dict[str, float] = {}
    times: dict[str, list[float]] = {r.request_id: [] for r in requests}
    in_flight: set[str] = set()
    steps: list[StepReport] = []
    engine_s = slept_s = 0.0
    t0 = clock()
    while queue or in_flight:
        now = clock() - t0
        while queue and queue[0].arrival_s <= now and (max_concurrency is None or len(in_flight) < max_concurrency):
            r = queue.popleft()
            batcher.submit(r.request_id, r.prompt, r.output_len)
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
            if e.finished:
                in_flight.discard(e.request_id)
    wall = clock() - t0
    timelines = [RequestTimeline(request_id=rid, arrival_s=sent[rid], token_times_s=tuple(times[rid]),
                                 prompt_tokens=len(by_id[rid].prompt), output_tokens_asked=by_id[rid].output_len,
                                 cached_prompt_tokens=0, error=None, warmup=by_id[rid].warmup)
                 for rid in sorted(sent, key=lambda k: sent[k])]
    return Driven(timelines, steps, wall, engine_s, max(0.0, wall - engine_s - slept_s))
