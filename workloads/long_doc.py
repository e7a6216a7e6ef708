"""Long-document sessions: one long real document, then a question about it.

Owns: `conversation`. The document is the Python language reference shipped with this
interpreter (``pydoc_data/topics.py``, one section per topic in seeded order),
continued with module documentation (module and definition docstrings) when a context
needs more text than the reference holds.

    head    system prompt + the opening of the user's message (never trimmed)
    middle  document sections in order; trimming cuts the *end* of the document, so
            the first section -- the one the question is about -- survives
    tail    close of the document, the measured question, generation prompt
    next    a follow-up question quoting another real section, then more sections

Does not own: tokenization or exact lengths (``workloads.base``), the text source
(``workloads.corpus``).
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np

from workloads import corpus
from workloads.base import GENERATION_PROMPT, Segment, Conversation, pick, turn

NAME = "long_doc"
_QUESTIONS = (
    'What does the document say about "{title}"? Quote the key sentence.',
    'Summarise the section "{title}" in three sentences.',
    'According to the section "{title}", what are the rules? Give an example.',
)


def _section(title: str, text: str) -> str:
    return f"## {title}\n\n{text}\n\n"


def _segments(sections: Iterator[tuple[str, str, str]]) -> Iterator[Segment]:
    for title, text, source in sections:
        yield Segment(_section(title, text), (source,))


def _continuation(rng: np.random.Generator) -> Iterator[Segment]:
    sections = corpus.iter_sections(rng)
    title, text, source = next(sections)
    yield Segment(turn("user", f'Follow-up: how does that relate to "{title}"? That '
                               f"section reads:\n\n{text}"), (source,))
    yield from _segments(sections)


def conversation(rng: np.random.Generator) -> Conversation:
    """One document whose measured question asks about its first section."""
    mid_rng, cont_rng = rng.spawn(2)
    sections = corpus.iter_sections(mid_rng)
    opening = next(sections)  # drawn now so the question can name it
    title = opening[0]
    question = pick(rng, _QUESTIONS).format(title=title)
    return Conversation(
        head=(turn("system", "Answer using only the document.")
              + "<|user|>\nRead this document; my question follows it.\n<document>\n"),
        middle=_segments(itertools.chain([opening], sections)),
        tail=f"</document>\n\n{question}\n" + GENERATION_PROMPT,
        continuation=_continuation(cont_rng),
        keep="oldest",
        meta={"first_section": title, "question": question},
    )
