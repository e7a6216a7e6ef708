"""What every workload shares: the sample type, the session shape, exact-length assembly.

Owns: `WorkloadSample` (what the harness feeds the engine), `Conversation` (the text-level
shape each workload module returns: a fixed head, an endless chronological middle, a
fixed measured turn, an endless continuation), the role-tag rendering, argument
checks, and the assembly that turns one `Conversation` per batch row into ids of *exactly*
`context_tokens` and `turn_tokens` -- trimming only the middle, never the head or the
measured turn -- plus the uniform-random baseline.
Does not own: what the text says (``coding_agent``, ``chat``, ``long_doc``), where it
comes from (``corpus``), or tokenization (``tokenize``).

Determinism: row `r` of a sample built with `seed` draws from
``np.random.default_rng([seed, r])``, so a sample is a pure function of
(workload, tokenizer, context_tokens, turn_tokens, batch, seed) and row 0 does not
change with `batch`.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from workloads.corpus import corpus_id
from workloads.tokenize import Tokenizer

TOKEN_SOURCES: tuple[str, ...] = ("text", "random")
RANDOM_BASELINE_LABEL = "uniform-random token ids (labelled baseline, not a workload)"
#: Put where the middle was cut; fixed text so its token count does not depend on the cut.
TRUNCATION_MARKER = "\n[... truncated ...]\n"
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")


def turn(role: str, text: str) -> str:
    """One message: ``<|role|>`` on its own line, the text, a newline."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {list(ROLES)}, got {role!r}")
    return f"<|{role}|>\n{text}\n"


#: Ends the measured turn, like a chat template's generation prompt.
GENERATION_PROMPT = "<|assistant|>\n"


@dataclass(frozen=True)
class Segment:
    """A piece of session text and the stdlib files it quotes."""

    text: str
    sources: tuple[str, ...] = ()


@dataclass
class Conversation:
    """One conversation, as text, before tokenization and trimming.

    `head` and `tail` are kept whole; `middle` is read lazily, oldest first, until it
    covers the token budget between them (and `min_segments` were read), then cut from
    the end opposite `keep`.
    `continuation` is read until it covers `turn_tokens`.
    """

    head: str                       # system prompt (and tools): never trimmed
    middle: Iterator[Segment]       # endless, chronological
    tail: str                       # the measured turn, ending the context
    continuation: Iterator[Segment]  # endless: the turn after the model's reply
    keep: Literal["newest", "oldest"] = "newest"  # which end of the middle survives
    min_segments: int = 1           # read at least this many, so a short context still
                                    # ends with recent turns rather than the oldest ones
    sources: tuple[str, ...] = ()   # files quoted by head/tail
    head_label: str = "system prompt"  # names the head in the too-small error
    meta: dict[str, Any] = field(default_factory=dict)


ConversationBuilder = Callable[[np.random.Generator], Conversation]


@dataclass
class WorkloadSample:
    """Token ids for one measured turn, per batch row, with what they were built from.

    Every row of `contexts` has exactly `context_tokens` ids (everything up to and
    including the measured turn); every row of `continuations` exactly `turn_tokens`
    ids (the next turn, appended after the model's reply). Rows differ in content.
    """

    name: str
    contexts: list[list[int]]
    continuations: list[list[int]]
    token_source: str               # "text" or "random"
    tokenizer_kind: str             # "byte" or "hf"
    meta: dict[str, Any] = field(default_factory=dict)


def check_args(context_tokens: int, turn_tokens: int, batch: int, seed: int,
               tokens: str) -> None:
    """Raise ValueError naming the first out-of-range argument."""
    for name, value, lo in (("context_tokens", context_tokens, 1), ("turn_tokens", turn_tokens, 0),
                            ("batch", batch, 1), ("seed", seed, 0)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < lo:
            raise ValueError(f"workload {name} must be an integer >= {lo}, got {value!r}")
    if tokens not in TOKEN_SOURCES:
        raise ValueError(f"workload tokens must be one of {list(TOKEN_SOURCES)}, got {tokens!r}")


def row_rng(seed: int, row: int) -> np.random.Generator:
    return np.random.default_rng([seed, row])


def pick(rng: np.random.Generator, items: Sequence[Any]) -> Any:
    """One element of `items`, uniformly (keeps the element's own type, unlike rng.choice)."""
    return items[int(rng.integers(len(items)))]


def first_paragraph(text: str, max_chars: int = 400) -> str:
    """The first blank-line-separated paragraph of `text`, at most `max_chars` long."""
    para = text.strip().split("\n\n", 1)[0].strip()
    return para if len(para) <= max_chars else para[:max_chars].rsplit(" ", 1)[0] + " ..."


def fit_middle(segments: Sequence[list[int]], budget: int, marker: list[int],
               keep: Literal["newest", "oldest"]) -> tuple[list[int], int, bool]:
    """Exactly `budget` ids from chronological `segments` (which must cover it).

    Whole segments are kept from the `keep` end; the first one that does not fit is
    cut, keeping its part nearest that end, with `marker` at the cut when there is room
    for it. Returns (ids, segments kept whole or in part, whether anything was cut).
    """
    if keep not in ("newest", "oldest"):
        raise ValueError(f"keep must be 'newest' or 'oldest', got {keep!r}")
    total = sum(len(s) for s in segments)
    if total < budget:
        raise ValueError(f"segments hold {total} ids, fewer than the budget of {budget}")
    order = list(reversed(segments)) if keep == "newest" else list(segments)
    kept: list[list[int]] = []
    used = 0
    for seg in order:
        room = budget - used
        if room == 0:
            break
        if len(seg) <= room:
            kept.append(seg)
            used += len(seg)
            continue
        body = room - len(marker) if room > len(marker) else room
        mark = marker if room > len(marker) else []
        kept.append(mark + seg[len(seg) - body:] if keep == "newest" else seg[:body] + mark)
        used = budget
    if keep == "newest":
        kept.reverse()
    return [t for s in kept for t in s], len(kept), total > budget


def take_exact(tok: Tokenizer, segments: Iterator[Segment], n: int,
               what: str) -> tuple[list[int], list[str]]:
    """The first `n` ids of the concatenated `segments`, and the files they quote."""
    ids: list[int] = []
    sources: list[str] = []
    while len(ids) < n:
        seg = next(segments, None)
        if seg is None:
            raise RuntimeError(f"{what}: text ran out after {len(ids)} of {n} tokens")
        ids += tok.encode(seg.text)
        sources += seg.sources
    return ids[:n], sources


def _assemble_row(name: str, tok: Tokenizer, s: Conversation, head: list[int], tail: list[int],
                  context_tokens: int, turn_tokens: int) -> tuple[list[int], list[int], dict]:
    budget = context_tokens - len(head) - len(tail)
    segs: list[tuple[Segment, list[int]]] = []
    total = 0
    while budget > 0 and (total < budget or len(segs) < s.min_segments):
        seg = next(s.middle, None)
        if seg is None:
            raise RuntimeError(f"{name}: text ran out after {total} of {budget} middle tokens")
        ids = tok.encode(seg.text)
        segs.append((seg, ids))
        total += len(ids)
    middle, n_kept, cut = fit_middle([ids for _, ids in segs], budget,
                                     tok.encode(TRUNCATION_MARKER), s.keep)
    kept = segs[len(segs) - n_kept:] if s.keep == "newest" else segs[:n_kept]
    cont, cont_sources = take_exact(tok, s.continuation, turn_tokens, f"{name} continuation")
    sources = list(s.sources) + [p for seg, _ in kept for p in seg.sources]
    meta = {
        "files": list(dict.fromkeys(sources)),
        "continuation_files": list(dict.fromkeys(cont_sources)),
        "head_tokens": len(head), "middle_tokens": len(middle), "tail_tokens": len(tail),
        "segments_generated": len(segs), "segments_kept": n_kept, "middle_trimmed": cut,
        "chars": {"head": len(s.head), "tail": len(s.tail),
                  "middle_generated": sum(len(seg.text) for seg, _ in segs)},
        "final_turn": s.tail,
        **s.meta,
    }
    return head + middle + tail, cont, meta


def text_sample(name: str, builder: ConversationBuilder, tok: Tokenizer, context_tokens: int,
                turn_tokens: int, batch: int, seed: int) -> WorkloadSample:
    """Build `batch` sessions with `builder` and assemble each to exact lengths.

    Raises ValueError when `context_tokens` cannot hold the head plus the measured turn
    of every row, naming the minimum.
    """
    sessions = [builder(row_rng(seed, r)) for r in range(batch)]
    heads = [list(tok.prefix_ids) + tok.encode(s.head) for s in sessions]
    tails = [tok.encode(s.tail) for s in sessions]
    need = [len(h) + len(t) for h, t in zip(heads, tails)]
    if context_tokens < max(need):
        r = int(np.argmax(need))
        raise ValueError(
            f"workload {name!r}: context_tokens={context_tokens} is too small; with the "
            f"{tok.kind} tokenizer the head ({sessions[r].head_label}) takes "
            f"{len(heads[r])} tokens and the measured turn {len(tails[r])}, so this sample "
            f"(seed={seed}, batch={batch}) needs context_tokens >= {max(need)}")
    rows = [_assemble_row(name, tok, s, h, t, context_tokens, turn_tokens)
            for s, h, t in zip(sessions, heads, tails)]
    return WorkloadSample(
        name=name,
        contexts=[c for c, _, _ in rows],
        continuations=[k for _, k, _ in rows],
        token_source="text",
        tokenizer_kind=tok.kind,
        meta={"workload": name, "context_tokens": context_tokens, "turn_tokens": turn_tokens,
              "batch": batch, "seed": seed, "corpus": corpus_id(),
              "min_context_tokens": max(need), "rows": [m for _, _, m in rows]},
    )


def random_sample(name: str, tok: Tokenizer, context_tokens: int, turn_tokens: int,
                  batch: int, seed: int) -> WorkloadSample:
    """Uniform ids in [0, tok.random_id_bound): a labelled baseline, not a workload."""
    contexts, continuations = [], []
    for r in range(batch):
        rng = row_rng(seed, r)
        ids = rng.integers(0, tok.random_id_bound, size=context_tokens + turn_tokens)
        contexts.append(ids[:context_tokens].tolist())
        continuations.append(ids[context_tokens:].tolist())
    return WorkloadSample(
        name=name, contexts=contexts, continuations=continuations, token_source="random",
        tokenizer_kind=tok.kind,
        meta={"workload": name, "baseline": RANDOM_BASELINE_LABEL,
              "context_tokens": context_tokens, "turn_tokens": turn_tokens, "batch": batch,
              "seed": seed, "id_range": [0, tok.random_id_bound]},
    )
