"""Fixtures for the llama.cpp tests: the real pinned binaries (no mocks), a tiny Mixtral saved by
transformers, its GGUFs, one shared llama-server in the exact configuration.

Without a build the tests skip (`require_build`, here and wherever a test needs the build), all
in one `-ra` summary line that says how to include them (tests/conftest.py reports each such skip
at this file, so pytest folds them); with MOEBENCH_REQUIRE_LLAMACPP set (`.ci/run`) they fail
instead, so a missing build can never pass as green.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from harness.llamacpp.build import Binaries, LlamaCppBuildError, find_binaries

REQUIRE_ENV = "MOEBENCH_REQUIRE_LLAMACPP"
# a build's time is in its BUILD_OK.json (elapsed_s): about 400 s with 2 jobs on 2 cores
SKIP_REASON = (f"llama.cpp not built, its tests skipped: `make llamacpp` (about 7 min on 2 cores, once: cached) "
               f"to include them; {REQUIRE_ENV}=1 fails them instead")


def require_build() -> Binaries:
    """The real pinned build. Missing: the test skips with SKIP_REASON, or fails when REQUIRE_ENV is set."""
    try:
        return find_binaries()
    except LlamaCppBuildError as e:
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(f"{REQUIRE_ENV} is set and the llama.cpp build is missing: {e}")
        pytest.skip(SKIP_REASON)


@pytest.fixture(scope="session")
def bins() -> Binaries:
    return require_build()


@pytest.fixture(scope="session")
def gguf_root(tmp_path_factory) -> Path:
    """Converted GGUFs of this session (not the user's cache: test checkpoints are throwaway)."""
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="session")
def mixtral(hf_checkpoints):
    """(transformers model, checkpoint dir) of the tiny Mixtral from tests/conftest.py."""
    return hf_checkpoints["mixtral"]


@pytest.fixture(scope="session")
def gguf_f32(bins, mixtral, gguf_root):
    from harness.llamacpp.convert import convert
    return convert(mixtral[1], "f32", root=gguf_root)


@pytest.fixture(scope="session")
def exact_server(bins, gguf_f32, tmp_path_factory):
    """One llama-server on the f32 GGUF in the exact configuration, one thread, one slot."""
    from harness.llamacpp.flags import EXACT
    from harness.llamacpp.server import LlamaServer

    d = tmp_path_factory.mktemp("exact-server")
    with LlamaServer(gguf_f32.path, EXACT.replace(threads=1), log_path=d / "llama-server.log",
                     binaries=bins, slot_save_path=d / "slots") as srv:
        yield srv


def prompt_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    """n token ids over the whole vocabulary; ids 0..2 (SentencePiece's unk/bos/eos) included."""
    rng = random.Random(seed)
    return [0, 1, 2] + [rng.randrange(vocab) for _ in range(n - 3)]


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy tokens: argmax at every step, no stopping at EOS."""
    out_tokens = []
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
        for i in range(n):
            tok = int(out.logits[0, -1].argmax())
            out_tokens.append(tok)
            if i + 1 < n:
                out = model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return out_tokens
