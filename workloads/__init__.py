"""Workloads: token ids for a measured turn of a realistic session, at an exact length.

Owns: the registry of workloads (`WORKLOADS`, name -> "module:conversation builder", loaded
lazily) and `build`, the one entry point the harness calls. A workload is a session of
turns -- `coding_agent` (system prompt with tool JSON schemas, repository files,
growing history), `chat`, `long_doc` -- rendered from real text on this machine (the
Python standard library) and tokenized with the checkpoint's tokenizer when there is
one, bytes otherwise (`workloads.tokenize.load_tokenizer`). ``tokens="random"`` gives
uniform-random ids instead: a labelled baseline, not a workload.
Does not own: running the engine, timing, or caching anything on disk.

Usage::

    from workloads import build
    from workloads.tokenize import load_tokenizer

    tok = load_tokenizer(None, vocab_size=512)                  # byte tokenizer
    s = build("chat", tok, context_tokens=1024, turn_tokens=64, batch=2, seed=0)
    s.contexts      # 2 rows x 1024 ids, ending with the measured user turn
    s.continuations  # 2 rows x 64 ids: the next turn, for prefix-cache continuation
"""
from __future__ import annotations

import importlib

from workloads.base import (RANDOM_BASELINE_LABEL, TOKEN_SOURCES, Conversation, ConversationBuilder,
                            WorkloadSample, check_args, random_sample, text_sample)
from workloads.tokenize import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = ["WORKLOADS", "TOKEN_SOURCES", "RANDOM_BASELINE_LABEL", "WorkloadSample",
           "Conversation", "build", "conversation_builder", "load_tokenizer", "ByteTokenizer",
           "HFTokenizer", "Tokenizer"]

WORKLOADS: dict[str, str] = {
    "coding_agent": "workloads.coding_agent:conversation",
    "chat": "workloads.chat:conversation",
    "long_doc": "workloads.long_doc:conversation",
}


def conversation_builder(name: str) -> ConversationBuilder:
    """The text-level conversation builder registered as `name`."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known workloads: {sorted(WORKLOADS)}")
    module, attr = WORKLOADS[name].split(":")
    return getattr(importlib.import_module(module), attr)


def build(name: str, tokenizer: Tokenizer, context_tokens: int, turn_tokens: int = 64,
          batch: int = 1, seed: int = 0, tokens: str = "text") -> WorkloadSample:
    """`batch` rows of exactly `context_tokens` context ids and `turn_tokens` continuation
    ids for workload `name`, deterministic in all arguments.

    Raises ValueError for an unknown `name` or `tokens`, an out-of-range size or seed,
    or a `context_tokens` too small for the workload's head plus measured turn.
    """
    builder = conversation_builder(name)
    check_args(context_tokens, turn_tokens, batch, seed, tokens)
    if tokens == "random":
        return random_sample(name, tokenizer, context_tokens, turn_tokens, batch, seed)
    return text_sample(name, builder, tokenizer, context_tokens, turn_tokens, batch, seed)
