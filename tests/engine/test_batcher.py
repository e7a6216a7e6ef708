"""Continuous batching (engine.batcher, Engine.step): requests of different lengths joining and
leaving, prompts prefilled in chunks beside other sequences' decode tokens, each sequence's tokens
and logits those of running it alone -- for every registered placement and the families whose
state differs (sliding windows and sinks, a recurrent state, an MLA latent, Gemma 4's per-layer
inputs) -- and the per-step counters: the token budget, the union of routed experts an expert
cache sees, counter changes that add up to the engine's totals."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from engine import Engine
from engine.batcher import ContinuousBatcher
from engine.config import preset
from tests.engine.test_invariant import MODEL, SECOND_WAVE, TOL, registered_cases, through_cache_only

# (prompt length, output length): longer and shorter than the budget, one that waits for room
REQUESTS = {"a": (13, 6), "b": (5, 3), "c": (21, 5), "d": (9, 4)}
LATE = ("c", "d")                  # submitted after two steps: they join a running batch
BUDGET, SEQS = 8, 3


def prompt(rid: str, length: int) -> list[int]:
    return np.random.default_rng(ord(rid)).integers(0, 512, size=length).tolist()


def alone(model: str) -> dict[str, tuple[list[int], list]]:
    """Each request's greedy tokens and logits, run by itself on resident."""
    eng = Engine.from_pretrained(model, device="cpu")
    out = {}
    for rid, (n, m) in REQUESTS.items():
        r = eng.generate([prompt(rid, n)], m)
        out[rid] = (r.tokens[0], [lg[0] for lg in r.logits])
    return out


_ALONE: dict[str, dict] = {}


def serve(eng: Engine, budget: int = BUDGET, seqs: int = SEQS) -> tuple[dict[str, tuple[list[int], list]], list]:
    """Run REQUESTS through a batcher; each request's tokens and logits, and the step reports."""
    b = ContinuousBatcher(eng, token_budget=budget, max_sequences=seqs, keep_logits=True)
    got: dict[str, tuple[list[int], list]] = {rid: ([], []) for rid in REQUESTS}
    reports = []
    for rid, (n, m) in REQUESTS.items():
        if rid not in LATE:
            b.submit(rid, prompt(rid, n), m)
    while b.busy:
        if len(reports) == 2:
            for rid in LATE:
                b.submit(rid, prompt(rid, REQUESTS[rid][0]), REQUESTS[rid][1])
        report = b.step()
        reports.append(report)
        for e in report.emitted:
            toks, logits = got[e.request_id]
            assert e.index == len(toks)
            toks.append(e.token)
            logits.append(e.logits)
    return got, reports


def assert_alone(got: dict, ref: dict) -> None:
    for rid in REQUESTS:
        (toks, logits), (rtoks, rlogits) = got[rid], ref[rid]
        assert toks == rtoks, rid
        assert max((a - b).abs().max().item() for a, b in zip(logits, rlogits)) <= TOL, rid


def ragged_cases(model: str) -> list[tuple[str, dict[str, Any]]]:
    """Every registered placement's cases that need no recording of the alone run's schedule (an
    offline policy's future, trace_oracle's steps: a ragged run looks up in another order)."""
    return [(n, c) for n, c in registered_cases(model)
            if c.get("cache_policy") not in ("belady", "static") and c.get("prefetch") != "trace_oracle"]


def first_cases(model: str) -> list[tuple[str, dict[str, Any]]]:
    first: dict[str, dict] = {}
    for name, case in ragged_cases(model):
        first.setdefault(name, case)
    return list(first.items())


def params(models: tuple[str, ...], every: bool) -> list:
    return [pytest.param(m, n, c, id=f"{m}-{n}" + "".join(f"-{k}={v}" for k, v in c.items()),
                         marks=[pytest.mark.slow] if every and "cache_policy" in c else [])
            for m in models for n, c in (ragged_cases(m) if every else first_cases(m))]


@pytest.mark.parametrize("model, placement, case", [*params((MODEL,), every=True),
                                                   *params((*SECOND_WAVE, "tiny-deepseek"), every=False)])
def test_each_sequence_is_what_it_gives_alone(model, placement, case):
    if model not in _ALONE:
        _ALONE[model] = alone(model)
    eng = Engine.from_pretrained(model, device="cpu", placement=placement, **case)
    got, reports = serve(eng)
    assert_alone(got, _ALONE[model])
    mixed = [r for r in reports if r.decode_tokens and r.prefill_tokens]
    assert mixed, "no step put a prompt chunk beside a decode token"
    assert any(r.joined for r in reports[1:]) and any(r.finished for r in reports[:-1])
    if through_cache_only(model, placement, case):      # one lookup per distinct expert per layer per step
        for r in reports:
            assert r.counters["expert_hits"] + r.counters["expert_misses"] == sum(r.experts.values())


def test_steps_keep_the_budget_and_never_hold_a_decode_back():
    eng = Engine.from_pretrained(MODEL, device="cpu", placement="fetch", cache_capacity=3)
    _, reports = serve(eng)
    running: set[str] = set()
    k, E = preset(MODEL).top_k, preset(MODEL).n_experts
    for r in reports:
        running |= set(r.joined)
        assert r.tokens == r.decode_tokens + r.prefill_tokens <= BUDGET
        assert r.sequences <= SEQS and len(running) <= SEQS
        for layer, n in r.experts.items():                  # the union of the step's rows' experts
            assert layer in eng.cfg.moe_layers and k <= n <= min(E, k * r.tokens)
        running -= set(r.finished)
    decoding = {rid for rid in REQUESTS}                   # every request emitted each step once its prompt was done
    for rid in decoding:
        steps = [i for i, r in enumerate(reports) for e in r.emitted if e.request_id == rid]
        assert steps == list(range(steps[0], steps[0] + REQUESTS[rid][1])), rid
    totals = eng.counters
    for key in ("h2d_bytes", "expert_hits", "expert_misses"):
        assert sum(r.counters[key] for r in reports) == totals[key] > 0


def test_one_sequence_at_a_time_is_plain_generation():
    """max_sequences=1 and a budget of the whole prompt: the steps are generate's passes."""
    ref = alone(MODEL)
    eng = Engine.from_pretrained(MODEL, device="cpu")
    got, reports = serve(eng, budget=64, seqs=1)
    assert_alone(got, ref)
    assert all(r.sequences == 1 for r in reports)


@pytest.mark.parametrize("call, message", [
    (lambda b, e: b.submit("a", [], 4), "request 'a': empty prompt"),
    (lambda b, e: b.submit("a", [1], 0), "max_new_tokens allowed a positive int, got 0"),
    (lambda b, e: (b.submit("a", [1], 2), b.submit("a", [2], 2)), "request id 'a' was submitted before"),
    (lambda b, e: b.submit("a", [1] * 4096, 2), "needs KV for 4097 tokens"),
    (lambda b, e: b.step(), "nothing to run"),
    (lambda b, e: e.step([(e.new_session(2), [1])]), "sessions of one sequence"),
    (lambda b, e: (lambda s: e.step([(s, [1]), (s, [2])]))(e.new_session(1)), "a session appears twice"),
    (lambda b, e: e.step([]), "at least one"),
])
def test_bad_input_is_refused(call, message):
    eng = Engine.from_pretrained(MODEL, device="cpu")
    with pytest.raises((ValueError, RuntimeError), match=message):
        call(ContinuousBatcher(eng), eng)


def test_a_budgeted_engine_runs_no_more_sequences_than_planned():
    eng = Engine.from_pretrained(MODEL, device="cpu", placement="fetch", cache_capacity=2, device_memory="64MiB",
                                 batch=2)
    with pytest.raises(ValueError, match="max_sequences=3 but the engine was planned for batch=2"):
        ContinuousBatcher(eng, max_sequences=3)
    with pytest.raises(ValueError, match="token_budget=4096 but the plan holds activations"):
        ContinuousBatcher(eng, token_budget=4096)
    assert ContinuousBatcher(eng).max_sequences == 2


SHARED = 4                                        # the prefix every request but "b" begins with


def shared_prompt(rid: str, length: int) -> list[int]:
    head = prompt("p", SHARED)
    return head + prompt(rid, length)[SHARED:] if rid != "b" else prompt(rid, length)


@pytest.mark.parametrize("model, placement, case", [pytest.param(m, n, c, id=f"{m}-{n}")
                                                   for m in (MODEL, *SECOND_WAVE, "tiny-deepseek")
                                                   for n, c in first_cases(m)])
def test_a_shared_prefix_is_computed_once_and_changes_no_output(model, placement, case):
    """Requests beginning with one prefix: the first computes it, the later ones get a copy of its
    state and compute only their own tokens; each gives what it gives alone."""
    ref_eng = Engine.from_pretrained(model, device="cpu")
    ref = {rid: ref_eng.generate([shared_prompt(rid, n)], m) for rid, (n, m) in REQUESTS.items()}
    eng = Engine.from_pretrained(model, device="cpu", placement=placement, **case)
    b = ContinuousBatcher(eng, token_budget=BUDGET, max_sequences=SEQS, keep_logits=True, prefix_cache=True)
    got: dict[str, list] = {rid: [] for rid in REQUESTS}
    cached: dict[str, int] = {}
    later = [rid for rid in REQUESTS if rid != "a"]      # they join once "a" has computed the prefix
    b.submit("a", shared_prompt("a", REQUESTS["a"][0]), REQUESTS["a"][1], prefix_len=SHARED)
    while b.busy:
        for e in b.step().emitted:
            got[e.request_id].append(e)
            if e.index == 0:
                cached[e.request_id] = e.cached
        while later and b.prefixes:
            rid = later.pop(0)
            b.submit(rid, shared_prompt(rid, REQUESTS[rid][0]), REQUESTS[rid][1], prefix_len=0 if rid == "b" else SHARED)
    for rid in REQUESTS:
        assert [e.token for e in got[rid]] == ref[rid].tokens[0], rid
        assert max((e.logits - lg[0]).abs().max().item() for e, lg in zip(got[rid], ref[rid].logits)) <= TOL
    assert cached["a"] == cached["b"] == 0                     # the one that computed it; one that does not share it
    assert cached["c"] == cached["d"] == SHARED                 # later ones: copied
    assert list(b.prefixes) == [tuple(prompt("p", SHARED))]
    b.close()


def test_a_primed_prefix_is_every_sharing_request_s_hit():
    eng = Engine.from_pretrained(MODEL, device="cpu")
    b = ContinuousBatcher(eng, prefix_cache=True)
    b.prime(prompt("p", SHARED))
    b.submit("a", shared_prompt("a", 13), 2, prefix_len=SHARED)
    first = [e for e in b.step().emitted]
    assert first[0].cached == SHARED
    with pytest.raises(ValueError, match=r"prefix_len allowed 0..12, got 13"):
        b.submit("x", shared_prompt("x", 13), 2, prefix_len=13)
    with pytest.raises(ValueError, match="prime needs the prefix cache"):
        ContinuousBatcher(eng).prime([1, 2])
