"""Continuous batching: requests of different lengths join and leave a running batch between
steps, their prompts prefilled in chunks beside the others' decode tokens, as llama-server and
vLLM schedule.

Owns: the queue of submitted requests; admission (first come, up to `max_sequences` running, each
in a session of its own); each step's items -- every decoding sequence's next token first, then
prompt chunks of the sequences still prefilling, in admission order, within the step's
`token_budget` (a decode is never held back for a prompt); the greedy token each step gives a
sequence whose prompt is done; finishing a request at its output length (an end-of-sequence id
is not a stop: output lengths are what the load asks for); with `prefix_cache`, a request's
shareable prefix (a system prompt and tool schemas many conversations begin with) prefilled once
and its state copied on the device to every later request that begins with it (`Session.copy_to`:
exact for every state kind), counted per request as cached prompt tokens; and per-step counters -- sequences,
tokens, distinct experts per MoE layer (the union of the step's routing, which is what an expert
cache sees), and the change of every engine counter (bytes moved, hits, misses).
Does not own: the forward step (Engine.step: attention per sequence, the rest over the union of
rows), arrival times, clocks and metrics (harness.serving).

    b = ContinuousBatcher(engine, token_budget=64)
    b.submit("a", prompt_a, max_new_tokens=16)
    b.submit("b", prompt_b, max_new_tokens=4)
    while b.busy:
        report = b.step()
        for e in report.emitted:
            print(e.request_id, e.index, e.token, e.finished)

Each sequence's tokens and logits are those of running it alone (`Engine.generate`), whatever
joins or leaves around it (tests/engine/test_batcher.py, for every placement).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.hooks import RoutingHook

if TYPE_CHECKING:
    import torch

    from engine.engine import Engine
    from engine.kv import Session


@dataclass
class _Running:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    session: Session
    fed: int = 0                                    # prompt tokens fed so far (or copied from the prefix cache)
    out: list[int] = field(default_factory=list)    # tokens emitted so far
    prefix: int = 0                                 # its first `prefix` tokens are shareable
    cached: int = 0                                 # prompt tokens the prefix cache gave it
    key: tuple[int, ...] = field(init=False)        # its shareable prefix, as the prefix cache holds it

    def __post_init__(self) -> None:
        self.key = tuple(self.prompt[:self.prefix])


@dataclass(frozen=True)
class Emitted:
    """One output token: its request, its index in the output (0: the first), and whether the
    request is done with it."""

    request_id: str
    index: int
    token: int
    finished: bool
    logits: torch.Tensor | None = None              # [V], with keep_logits
    cached: int | None = None                       # on the first token: prompt tokens the prefix cache gave


@dataclass(frozen=True)
class StepReport:
    index: int
    sequences: int                  # sequences in the step
    tokens: int                     # rows the step ran: decode_tokens + prefill_tokens
    decode_tokens: int
    prefill_tokens: int
    emitted: tuple[Emitted, ...]
    joined: tuple[str, ...]         # requests admitted before this step
    finished: tuple[str, ...]       # requests that left after it
    experts: dict[int, int]         # MoE layer -> distinct experts the step's rows routed to
    counters: dict[str, int]        # the change of each engine counter over the step


class _Union(RoutingHook):
    """The experts each MoE layer routed the step's rows to."""

    def __init__(self) -> None:
        self.ids: dict[int, list[torch.Tensor]] = {}

    def route(self, layer: int, ids, weights) -> None:
        self.ids.setdefault(layer, []).append(ids.reshape(-1))

    def distinct(self) -> dict[int, int]:
        import torch
        out = {layer: int(torch.cat(parts).unique().numel()) for layer, parts in sorted(self.ids.items())}
        self.ids = {}
        return out


class ContinuousBatcher:
    def __init__(self, engine: Engine, token_budget: int | None = None, max_sequences: int | None = None,
                 keep_logits: bool = False, prefix_cache: bool = False) -> None:
        """token_budget: rows a step runs at most (default: the engine's ubatch); max_sequences:
        requests running at once (default: the batch the engine was planned for). On a budgeted
        device neither may exceed what the plan holds room for: KV of the planned batch, and the
        activations of ubatch x batch rows. prefix_cache: a request's shareable prefix (`submit`'s
        prefix_len) is prefilled once and copied to every later request that begins with it; the
        copies (one per distinct prefix) are sessions of their own, so a budgeted plan needs a
        batch one larger per prefix."""
        plan = engine.plan
        budget = token_budget if token_budget is not None else engine.ubatch
        seqs = max_sequences if max_sequences is not None else plan.batch
        for name, value in (("token_budget", budget), ("max_sequences", seqs)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: allowed a positive int, got {value!r}")
        if engine.device.ledger.budget is not None:
            if seqs > plan.batch:
                raise ValueError(f"max_sequences={seqs} but the engine was planned for batch={plan.batch} (each "
                                 "running sequence holds its KV); pass batch= to Engine.from_pretrained")
            if budget > engine.ubatch * plan.batch:
                raise ValueError(f"token_budget={budget} but the plan holds activations for ubatch x batch = "
                                 f"{engine.ubatch * plan.batch} rows")
        self.engine, self.token_budget, self.max_sequences, self.keep_logits = engine, budget, seqs, keep_logits
        self.prefix_cache = prefix_cache
        self.prefixes: dict[tuple[int, ...], Session] = {}     # a shareable prefix -> a session holding it
        self.waiting: deque[tuple[str, list[int], int, int]] = deque()
        self.running: list[_Running] = []
        self.steps = 0
        self._ids: set[str] = set()
        self._union = _Union()

    @property
    def busy(self) -> bool:
        """Whether any request waits or runs."""
        return bool(self.waiting or self.running)

    def submit(self, request_id: str, prompt: list[int], max_new_tokens: int, prefix_len: int = 0) -> None:
        """Queue a request: it joins the batch at the first step with room for it. `prefix_len`: its
        first tokens that other requests share (a system prompt, tool schemas), which the prefix
        cache keeps; at most len(prompt) - 1 (a request computes at least its last token)."""
        if request_id in self._ids:
            raise ValueError(f"request id {request_id!r} was submitted before")
        if not prompt:
            raise ValueError(f"request {request_id!r}: empty prompt")
        if not 0 <= prefix_len < len(prompt):
            raise ValueError(f"request {request_id!r}: prefix_len allowed 0..{len(prompt) - 1}, got {prefix_len}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_new_tokens allowed a positive int, got {max_new_tokens!r}")
        need = len(prompt) + max_new_tokens - 1
        if need > self.engine.plan.context:
            raise ValueError(f"request {request_id!r} needs KV for {need} tokens; the engine was planned for "
                             f"max_context={self.engine.plan.context}")
        self._ids.add(request_id)
        self.waiting.append((request_id, list(prompt), max_new_tokens, prefix_len))

    def prime(self, prefix: list[int]) -> None:
        """Fill the prefix cache with `prefix` now (a warm-up: requests beginning with it then find it)."""
        if not self.prefix_cache:
            raise ValueError("prime needs the prefix cache (prefix_cache=True)")
        def fill(sess: Session) -> None:
            self.engine.prefill(sess, [list(prefix)])
            self.engine.check_finite(sess)
        self._hold(tuple(prefix), fill)

    def _hold(self, key: tuple[int, ...], fill) -> None:
        """Keep a session holding prefix `key`, filled by `fill(session)`, unless one is kept already."""
        if key not in self.prefixes:
            sess = self.engine.new_session(1)
            fill(sess)
            self.prefixes[key] = sess

    def _admit(self) -> list[str]:
        joined = []
        while self.waiting and len(self.running) < self.max_sequences:
            rid, prompt, n, prefix = self.waiting.popleft()
            r = _Running(rid, prompt, n, self.engine.new_session(1), prefix=prefix if self.prefix_cache else 0)
            held = self.prefixes.get(r.key) if r.prefix else None
            if held is not None:                        # a hit: the prefix's KV copied, not computed
                held.copy_to(r.session)
                r.fed = r.cached = r.prefix
            self.running.append(r)
            joined.append(rid)
        return joined

    def _items(self) -> tuple[list[tuple[_Running, list[int]]], int]:
        """The step's items and how many of them decode: decodes first, then prompt chunks."""
        items = [(r, [r.out[-1]]) for r in self.running if r.fed == len(r.prompt)]
        decodes = len(items)
        room = self.token_budget - decodes
        for r in self.running:
            if room <= 0:
                break
            if r.fed < len(r.prompt):
                end = r.prefix if r.fed < r.prefix and r.key not in self.prefixes \
                    else len(r.prompt)                  # a prefix to keep ends its own chunk
                chunk = r.prompt[r.fed:min(end, r.fed + room)]
                items.append((r, chunk))
                room -= len(chunk)
        return items, decodes

    def step(self) -> StepReport:
        """Admit what has room, run one step, emit its tokens, let finished requests leave."""
        if not self.busy:
            raise RuntimeError("nothing to run: submit a request first")
        joined = self._admit()
        items, decodes = self._items()
        before = self.engine.counters
        model = self.engine.model
        model.add_routing_hook(self._union)
        try:
            logits = self.engine.step([(r.session, toks) for r, toks in items])
            tokens = self.engine.greedy_step(logits)
        finally:
            model.remove_routing_hook(self._union)
        after = self.engine.counters
        emitted, finished = [], []
        for i, ((r, toks), tok) in enumerate(zip(items, tokens)):
            if r.fed < len(r.prompt):
                r.fed += len(toks)
                if r.prefix and r.fed == r.prefix:      # just fed its prefix: a copy for the requests after it
                    self._hold(r.key, r.session.copy_to)
                if r.fed < len(r.prompt):
                    continue                            # mid-prompt: its logits choose nothing
            r.out.append(tok)
            done = len(r.out) == r.max_new_tokens
            emitted.append(Emitted(r.request_id, len(r.out) - 1, tok, done, logits[i] if self.keep_logits else None,
                                   r.cached if len(r.out) == 1 else None))
            if done:
                finished.append(r)
        for r in finished:
            r.session.close()
            self.running.remove(r)
        n = sum(len(toks) for _, toks in items)
        report = StepReport(self.steps, len(items), n, decodes, n - decodes, tuple(emitted), tuple(joined),
                            tuple(r.request_id for r in finished), self._union.distinct(),
                            {k: after[k] - before.get(k, 0) for k in after})
        self.steps += 1
        return report

    def close(self) -> None:
        """Release every running request's session and the prefix cache's; waiting ones are dropped."""
        for sess in [r.session for r in self.running] + list(self.prefixes.values()):
            sess.close()
        self.running.clear()
        self.waiting.clear()
        self.prefixes.clear()
