"""Tests for the `workloads` package: exact lengths, realism checks, determinism, errors."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from workloads import (RANDOM_BASELINE_LABEL, WORKLOADS, ByteTokenizer, HFTokenizer, build,
                       load_tokenizer)
from workloads import coding_agent, corpus
from workloads.base import TRUNCATION_MARKER, fit_middle

VOCAB = 512  # tiny-mixtral's vocabulary: bytes + specials fit
SIZES = {"coding_agent": (4096, 8192), "chat": (256, 1024, 4096), "long_doc": (256, 1024, 4096)}
CASES = [(name, n) for name, sizes in SIZES.items() for n in sizes]


@pytest.fixture(scope="module")
def tok() -> ByteTokenizer:
    return ByteTokenizer(VOCAB)


# --- lengths, rows, determinism -----------------------------------------------------------
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize(("name", "context_tokens"), CASES)
def test_exact_lengths(tok: ByteTokenizer, name: str, context_tokens: int, batch: int) -> None:
    s = build(name, tok, context_tokens, turn_tokens=64, batch=batch, seed=7)
    assert s.name == name and s.token_source == "text" and s.tokenizer_kind == "byte"
    assert len(s.contexts) == len(s.continuations) == batch
    assert all(len(row) == context_tokens for row in s.contexts)
    assert all(len(row) == 64 for row in s.continuations)
    assert all(0 <= i < VOCAB for row in s.contexts + s.continuations for i in row)
    if batch > 1:
        assert len({tuple(r) for r in s.contexts}) == batch
        assert len({tuple(r) for r in s.continuations}) == batch


@pytest.mark.parametrize("turn_tokens", [0, 1, 5000])
def test_continuation_exact_for_any_turn_size(tok: ByteTokenizer, turn_tokens: int) -> None:
    for name in WORKLOADS:
        s = build(name, tok, 4096, turn_tokens=turn_tokens, batch=2, seed=1)
        assert [len(r) for r in s.continuations] == [turn_tokens] * 2


@pytest.mark.parametrize("name", sorted(WORKLOADS))
@pytest.mark.slow
def test_deterministic(tok: ByteTokenizer, name: str) -> None:
    a = build(name, tok, 4096, turn_tokens=32, batch=2, seed=3)
    b = build(name, tok, 4096, turn_tokens=32, batch=2, seed=3)
    assert a == b
    assert build(name, tok, 4096, turn_tokens=32, batch=2, seed=4).contexts != a.contexts
    # row r depends on (seed, r) only, not on the batch size
    one = build(name, tok, 4096, turn_tokens=32, batch=1, seed=3)
    assert one.contexts[0] == a.contexts[0] and one.continuations[0] == a.continuations[0]


# --- realism ------------------------------------------------------------------------------
def _tools_block(text: str) -> list[dict]:
    m = re.search(r"<tools>\n(.*?)\n</tools>", text, re.S)
    assert m, "no <tools> block in the coding-agent context"
    return [json.loads(line) for line in m.group(1).splitlines()]


def test_coding_agent_has_tool_json_schemas(tok: ByteTokenizer) -> None:
    s = build("coding_agent", tok, 4096, batch=2, seed=0)
    for row in s.contexts:
        tools = _tools_block(tok.decode(row))
        assert len(tools) >= 6
        assert tools == coding_agent.tool_schemas()
        names = {t["name"] for t in tools}
        assert {"read_file", "write_file", "list_dir", "grep", "run_tests", "run_shell"} <= names
        for t in tools:
            params = t["parameters"]
            assert params["type"] == "object" and isinstance(params["properties"], dict)
            assert set(params["required"]) <= set(params["properties"])


def test_coding_agent_quotes_real_stdlib_source(tok: ByteTokenizer) -> None:
    s = build("coding_agent", tok, 16384, batch=2, seed=0)
    for row, meta in zip(s.contexts, s.meta["rows"]):
        text = tok.decode(row)
        assert meta["files"], "no stdlib files recorded"
        on_disk = {line.strip() for f in meta["files"]
                   for line in (corpus.stdlib_root() / f).read_text(encoding="utf-8").splitlines()
                   if line.strip().startswith("def ")}
        quoted = {line.strip() for line in text.splitlines() if line.strip().startswith("def ")}
        assert quoted & on_disk, "no `def` line of a stdlib file on disk in the context"
        # history: tool calls are JSON objects naming a known tool
        calls = [json.loads(line) for line in text.splitlines() if line.startswith('{"tool": ')]
        assert calls and all(c["tool"] in {t["name"] for t in coding_agent.TOOLS} for c in calls)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
@pytest.mark.slow
def test_final_turn_survives_trimming(tok: ByteTokenizer, name: str) -> None:
    big = build(name, tok, 8192, batch=2, seed=5)
    for row, meta in zip(big.contexts, big.meta["rows"]):
        assert meta["middle_trimmed"]
        assert TRUNCATION_MARKER in tok.decode(row)
        assert tok.decode(row).endswith(meta["final_turn"])
        assert meta["final_turn"].endswith("<|assistant|>\n")
    # the smallest context that fits: head + measured turn, nothing in between
    least = big.meta["min_context_tokens"]
    tight = build(name, tok, least, batch=2, seed=5)
    for row, meta in zip(tight.contexts, tight.meta["rows"]):
        assert len(row) == least and tok.decode(row).endswith(meta["final_turn"])


def test_chat_is_a_conversation_of_real_docstrings(tok: ByteTokenizer) -> None:
    s = build("chat", tok, 4096, seed=2)
    text = tok.decode(s.contexts[0])
    assert text.count("<|user|>") >= 2 and text.count("<|assistant|>") >= 2
    d = corpus.definitions(s.meta["rows"][0]["target"])
    assert any(x.qualname == s.meta["rows"][0]["target_definition"] for x in d)


def test_long_doc_keeps_the_section_the_question_is_about(tok: ByteTokenizer) -> None:
    s = build("long_doc", tok, 1024, batch=3, seed=0)
    for row, meta in zip(s.contexts, s.meta["rows"]):
        text = tok.decode(row)
        assert f"<document>\n## {meta['first_section']}\n" in text
        assert meta["first_section"] in meta["question"]
        assert text.endswith(meta["question"] + "\n<|assistant|>\n")


# --- errors -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_too_small_context_names_the_minimum(tok: ByteTokenizer, name: str) -> None:
    least = build(name, tok, 8192, seed=0).meta["min_context_tokens"]
    with pytest.raises(ValueError, match=rf"context_tokens={least - 1} is too small.*"
                                         rf"needs context_tokens >= {least}"):
        build(name, tok, least - 1, seed=0)


def test_coding_agent_rejects_256_with_bytes(tok: ByteTokenizer) -> None:
    with pytest.raises(ValueError, match="tool schemas"):
        build("coding_agent", tok, 256)


def test_unknown_workload_lists_known(tok: ByteTokenizer) -> None:
    with pytest.raises(ValueError, match="unknown workload 'codeing'") as e:
        build("codeing", tok, 1024)
    for known in ("coding_agent", "chat", "long_doc"):
        assert known in str(e.value)


def test_bad_token_source_lists_allowed(tok: ByteTokenizer) -> None:
    with pytest.raises(ValueError, match=r"tokens must be one of \['text', 'random'\], got 'zipf'"):
        build("chat", tok, 1024, tokens="zipf")


@pytest.mark.parametrize(("kw", "field"), [({"context_tokens": 0}, "context_tokens"),
                                           ({"turn_tokens": -1}, "turn_tokens"),
                                           ({"batch": 0}, "batch"), ({"seed": -2}, "seed")])
def test_bad_sizes_name_the_field(tok: ByteTokenizer, kw: dict, field: str) -> None:
    args = {"context_tokens": 1024, **kw}
    with pytest.raises(ValueError, match=rf"{field} must be an integer >= \d+, got"):
        build("chat", tok, **args)


# --- random baseline ----------------------------------------------------------------------
def test_random_baseline_is_labelled(tok: ByteTokenizer) -> None:
    s = build("coding_agent", tok, 256, turn_tokens=16, batch=3, seed=1, tokens="random")
    assert s.token_source == "random" and s.meta["baseline"] == RANDOM_BASELINE_LABEL
    assert [len(r) for r in s.contexts] == [256] * 3
    assert [len(r) for r in s.continuations] == [16] * 3
    assert all(0 <= i < 256 for row in s.contexts + s.continuations for i in row)
    assert len({tuple(r) for r in s.contexts}) == 3
    assert s == build("coding_agent", tok, 256, turn_tokens=16, batch=3, seed=1, tokens="random")


# --- tokenizers ---------------------------------------------------------------------------
def test_byte_tokenizer_roundtrip_and_specials() -> None:
    t = ByteTokenizer(262)
    text = "<|system|>\nhé ✓\n<|user|>\nhi<|assistant|>\n"
    ids = t.encode(text)
    assert t.decode(ids) == text
    assert ids[0] == 258 and 259 in ids and 260 in ids and max(ids) < 262
    assert t.prefix_ids == [256]
    with pytest.raises(ValueError, match="cannot decode id 300"):
        t.decode([300])


def test_byte_tokenizer_vocab_too_small() -> None:
    with pytest.raises(ValueError, match=r"vocab_size >= 262 .* got vocab_size=256"):
        ByteTokenizer(256)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = corpus.read_source("json/decoder.py")
    t.train_from_iterator([text[i:i + 500] for i in range(0, len(text), 500)], trainer)
    t.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", t.token_to_id("<s>"))])
    d = tmp_path_factory.mktemp("ckpt")
    t.save(str(d / "tokenizer.json"))
    return d


def test_load_tokenizer_picks_hf_and_checks_vocab(hf_dir: Path, tmp_path: Path) -> None:
    t = load_tokenizer(hf_dir, vocab_size=1000)
    assert isinstance(t, HFTokenizer) and t.kind == "hf"
    assert t.prefix_ids == [t._tok.token_to_id("<s>")]
    assert t.decode(t.encode("def f(x):\n    return x\n")) == "def f(x):\n    return x\n"
    with pytest.raises(ValueError, match=rf"ids up to {t.max_id} .* vocab_size is 100"):
        load_tokenizer(hf_dir, vocab_size=100)
    assert isinstance(load_tokenizer(tmp_path, vocab_size=VOCAB), ByteTokenizer)  # no json
    assert isinstance(load_tokenizer(None, vocab_size=VOCAB), ByteTokenizer)
    with pytest.raises(NotADirectoryError, match="not a directory"):
        load_tokenizer(tmp_path / "missing", vocab_size=VOCAB)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_workloads_with_hf_tokenizer(hf_dir: Path, name: str) -> None:
    t = load_tokenizer(hf_dir, vocab_size=1000)
    s = build(name, t, 4096, turn_tokens=32, batch=2, seed=0)  # tiny BPE: ~1 token / 2 bytes
    assert s.tokenizer_kind == "hf"
    assert [len(r) for r in s.contexts] == [4096, 4096]
    assert [len(r) for r in s.continuations] == [32, 32]
    assert all(r[0] == t.prefix_ids[0] for r in s.contexts)
    assert all(0 <= i <= t.max_id for r in s.contexts + s.continuations for i in r)
    assert s.contexts[0] != s.contexts[1]
    r = build(name, t, 64, turn_tokens=8, seed=0, tokens="random")
    assert all(0 <= i < t.random_id_bound for i in r.contexts[0])


# --- trimming helper ----------------------------------------------------------------------
def test_fit_middle_keeps_the_requested_end() -> None:
    segs = [[1] * 10, [2] * 10, [3] * 10]
    marker = [9, 9]
    ids, kept, cut = fit_middle(segs, 15, marker, "newest")
    assert ids == [9, 9] + [2] * 3 + [3] * 10 and kept == 2 and cut
    ids, kept, cut = fit_middle(segs, 15, marker, "oldest")
    assert ids == [1] * 10 + [2] * 3 + [9, 9] and kept == 2 and cut
    ids, kept, cut = fit_middle(segs, 30, marker, "newest")
    assert ids == [1] * 10 + [2] * 10 + [3] * 10 and kept == 3 and not cut
    ids, _, _ = fit_middle(segs, 11, marker, "newest")  # room for the marker? no: 1 id
    assert ids == [2] + [3] * 10
    with pytest.raises(ValueError, match="fewer than the budget"):
        fit_middle(segs, 31, marker, "newest")
