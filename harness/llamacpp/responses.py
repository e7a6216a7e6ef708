"""The typed answers of llama-server's HTTP API, parsed from its JSON.

Owns: what moebench reads from `/completion` and `/slots`, under which field names, and which
clock each number comes from (llama.cpp's own `timings` = source engine; the client's wall
times = source client, DESIGN §7.6). Does not own: making the requests (`server`).

Field names as this llama.cpp build reports them (checked by tests/llamacpp):
`/completion` -> `tokens` (with `return_tokens`), `timings.{cache_n, prompt_n, prompt_ms,
predicted_n, predicted_ms}` (+ `*_per_token_ms`, `*_per_second`), `tokens_cached`, `stop_type`,
`completion_probabilities[i].{id, logprob, top_logprobs[j].{id, logprob}}`;
`/slots/N?action=save` -> `n_saved`, `n_written`, `timings.save_ms`; `restore` -> `n_restored`,
`n_read`, `timings.restore_ms`; `erase` -> `n_erased`.
"""
from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Timings:
    """llama.cpp's own per-request timings (source=engine), as its `timings` object reports them.
    `prompt_n` counts the prompt tokens computed, `cache_n` those taken from the slot's KV instead;
    `predicted_n` counts every generated token, the first included."""
    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    cache_n: int | None
    raw: dict[str, Any]

    @property
    def decode_steps(self) -> int:
        """Decode passes timed by predicted_ms: the first generated token comes free from the
        prompt's last logits, so predicted_ms covers predicted_n - 1 steps (llama.cpp's own rule)."""
        return max(self.predicted_n - 1, 0)

    @property
    def prefill_tok_per_s(self) -> float | None:
        return self.prompt_n / self.prompt_ms * 1e3 if self.prompt_ms > 0 and self.prompt_n else None

    @property
    def decode_tok_per_s(self) -> float | None:
        return self.decode_steps / self.predicted_ms * 1e3 if self.predicted_ms > 0 and self.decode_steps else None

    @classmethod
    def parse(cls, t: dict[str, Any]) -> Timings:
        return cls(prompt_n=int(t["prompt_n"]), prompt_ms=float(t["prompt_ms"]),
                   predicted_n=int(t["predicted_n"]), predicted_ms=float(t["predicted_ms"]),
                   cache_n=int(t["cache_n"]) if "cache_n" in t else None, raw=dict(t))


@dataclass(frozen=True)
class TopLogprob:
    id: int
    logprob: float


def logprob_of(value: Any) -> float:
    """A logprob as the server sent it: a number, or null where it computed NaN (its JSON writer
    has no NaN), read back as NaN for the caller to refuse (harness.scenario.check_received)."""
    return float("nan") if value is None else float(value)


@dataclass(frozen=True)
class Completion:
    """One /completion answer. `wall_s` (request sent -> answer complete) and, when streamed,
    `ttft_s` (request sent -> first token received) and `token_times_s` (arrival time of each
    token, from the request) are the client's (source=client); `timings` is the server's."""
    tokens: list[int]
    timings: Timings
    wall_s: float
    ttft_s: float | None
    token_times_s: list[float] | None
    token_server_ms: list[float] | None   # server clock per token: cumulative predicted_ms (stream +
                                          # timings_per_token); diffs are per-step decode times
    tokens_cached: int | None             # tokens in the slot's KV after this request
    stop_type: str | None                 # "limit" (n_predict reached), "eos", "word", ...
    top_logprobs: list[list[TopLogprob]] | None
    raw: dict[str, Any]


@dataclass(frozen=True)
class SlotResult:
    """A slot save/restore/erase. `bytes` is what the server wrote/read (`n_written`/`n_read`);
    `tokens` the tokens saved/restored/erased; `ms` its own timing (null for erase)."""
    action: str
    slot: int
    tokens: int
    bytes: int | None
    ms: float | None
    raw: dict[str, Any]


@dataclass(frozen=True)
class StreamChunk:
    """One event of a streamed completion: the tokens it brought, when (seconds since the
    request, client clock), their top logprobs as the server sent them, and -- on the last
    event -- the whole Completion."""
    tokens: list[int]
    t: float
    probs: list[dict[str, Any]]
    final: Completion | None


def parse_completion(out: dict[str, Any], tokens: list[int], wall: float, ttft: float | None,
                times: list[float] | None, server_ms: list[float] | None, probs: list[dict] | None) -> Completion:
    top = None
    if probs:
        top = [[TopLogprob(int(c["id"]), logprob_of(c.get("logprob"))) for c in p.get("top_logprobs", [])]
               for p in probs]
    return Completion(tokens=[int(t) for t in tokens], timings=Timings.parse(out["timings"]), wall_s=wall,
                      ttft_s=ttft, token_times_s=times, token_server_ms=server_ms,
                      tokens_cached=out.get("tokens_cached"),
                      stop_type=out.get("stop_type"), top_logprobs=top, raw=out)


class StreamAssembly:
    """The Completion a streamed /completion adds up to, one event at a time: each event's new
    tokens stamped with the time it was received (seconds since the request, client clock), the
    server's cumulative predicted_ms per token (`timings_per_token`), their top logprobs; the final
    event (`stop`) closes it with the server's timings. Prompt-progress events bring no token (their
    `tokens` is a placeholder). Shared by the two readers of a stream (`ServerClient.stream`, event
    by event; `StreamedCompletion`, from the stamped reads after the request)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.times: list[float] = []
        self.server_ms: list[float] = []
        self.probs: list[dict[str, Any]] = []

    def add(self, event: dict[str, Any], t: float) -> StreamChunk | None:
        """Account for `event`, received `t` s after the request; its chunk (None for a
        prompt-progress event). The final event's chunk carries the Completion (wall_s = t)."""
        if "prompt_progress" in event:
            return None
        new = [int(x) for x in event.get("tokens") or []]
        self.tokens += new
        self.times += [t] * len(new)
        if new and "timings" in event:
            self.server_ms += [float(event["timings"]["predicted_ms"])] * len(new)
        event_probs = event.get("completion_probabilities") or []
        self.probs += event_probs
        final = None
        if event.get("stop"):
            tokens = self.tokens
            final = parse_completion(event, tokens, t, self.times[0] if self.times else None, self.times,
                                     self.server_ms if len(self.server_ms) == len(tokens) and tokens else None,
                                     self.probs or None)
        return StreamChunk(new, t, event_probs, final)


def sse_events(resp: http.client.HTTPResponse) -> Iterator[dict[str, Any]]:
    """`data: {...}` lines of a server-sent-event stream, parsed."""
    for line in resp:
        line = line.strip()
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            if payload and payload != b"[DONE]":
                yield json.loads(payload)
