"""Chat sessions: a user asking an assistant about Python, answered with real docs.

Owns: `conversation`, one multi-turn user/assistant conversation. Each exchange is about a
function or class of this machine's standard library: the user asks about it
(sometimes pasting its source), the assistant answers with its real docstring.

    head    short system prompt (never trimmed)
    middle  exchanges, oldest first; trimming drops the oldest
    tail    the measured user question + generation prompt (never trimmed)
    next    the user's follow-up (pasting more real source), then further exchanges

Does not own: tokenization or exact lengths (``workloads.base``), the text source
(``workloads.corpus``).
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from workloads import corpus
from workloads.base import GENERATION_PROMPT, Segment, Conversation, pick, turn
from workloads.corpus import Definition

NAME = "chat"
MIN_EXCHANGES = 4  # exchanges always generated (the oldest are trimmed first)
SYSTEM = "You are a precise assistant for Python programmers."
_QUESTIONS = (
    "What does `{qualname}` in the `{module}` module do?",
    "Can you explain `{module}.{qualname}` to me?",
    "When would I use `{qualname}` from `{module}`?",
    "I keep running into `{module}.{qualname}`. What is it for, and are there gotchas?",
)
_FOLLOW_UPS = (
    "Thanks, that helps. Next I'm looking at `{module}.{qualname}`; here is its code:",
    "Got it. One more: what does this code from `{module}` do?",
    "Makes sense. How does that relate to `{qualname}`? The source is:",
)


def _paste(d: Definition, max_lines: int = 40) -> str:
    return f"```python\n{corpus.definition_source(d, max_lines)}\n```"


def _question(rng: np.random.Generator, d: Definition) -> str:
    q = pick(rng, _QUESTIONS).format(qualname=d.qualname, module=d.module)
    if rng.random() < 0.3:
        q += f"\n\nThis is the code I mean:\n{_paste(d)}"
    return q


def _answer(d: Definition) -> str:
    what = "class" if d.kind == "class" else "function"
    return (f"`{d.qualname}` is a {what} defined in `{d.module}` "
            f"({d.path}, line {d.lineno}). Its documentation says:\n\n{d.docstring}")


def _exchanges(rng: np.random.Generator) -> Iterator[Segment]:
    for d in corpus.iter_documented(rng):
        yield Segment(turn("user", _question(rng, d)) + turn("assistant", _answer(d)), (d.path,))


def _continuation(rng: np.random.Generator) -> Iterator[Segment]:
    docs = corpus.iter_documented(rng)
    d = next(docs)
    ask = pick(rng, _FOLLOW_UPS).format(qualname=d.qualname, module=d.module)
    yield Segment(turn("user", f"{ask}\n{_paste(d, 200)}"), (d.path,))
    yield from _exchanges(rng)


def conversation(rng: np.random.Generator) -> Conversation:
    """One conversation whose measured turn asks about a seeded stdlib definition."""
    target = next(corpus.iter_documented(rng))
    mid_rng, cont_rng = rng.spawn(2)
    return Conversation(
        head=turn("system", SYSTEM),
        middle=_exchanges(mid_rng),
        tail=turn("user", pick(rng, _QUESTIONS).format(qualname=target.qualname,
                                                        module=target.module))
        + GENERATION_PROMPT,
        continuation=_continuation(cont_rng),
        keep="newest",
        min_segments=MIN_EXCHANGES,
        sources=(target.path,),
        meta={"target": target.path, "target_definition": target.qualname},
    )
