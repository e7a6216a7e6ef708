"""Text <-> token ids for workloads: the checkpoint's own tokenizer, or a byte fallback.

Owns: the `Tokenizer` protocol the workload builders use, `ByteTokenizer` (UTF-8 bytes
as ids 0..255 plus a few special ids after them), `HFTokenizer` (a `tokenizers`
tokenizer.json) and `load_tokenizer`, which picks between them and checks that every
id the tokenizer can produce is a valid row of the model's embedding table.
Does not own: what text is tokenized (the workload modules), chat templates (the
workloads render roles as literal tags such as ``<|user|>``; the byte tokenizer maps
those tags to its special ids, an HF tokenizer encodes them however its vocabulary
does), or the model (only its `vocab_size` is needed here).
A checkpoint's tokenizer is read from its tokenizer.json with the `tokenizers` library only, never
through transformers' AutoTokenizer: no code shipped with a checkpoint (an `auto_map`) runs here,
whatever `model.trust_remote_code` says.

Usage::

    tok = load_tokenizer(checkpoint_dir, vocab_size=cfg.vocab_size)  # None -> bytes
    ids = tok.encode("<|user|>\\nhello\\n")
    text = tok.decode(ids)
"""
from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import tokenizers

log = logging.getLogger(__name__)

#: Role tags the workloads write into their text; the byte tokenizer gives each one id.
ROLE_TAGS: tuple[str, ...] = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")


@runtime_checkable
class Tokenizer(Protocol):
    """What a workload builder needs from a tokenizer."""

    kind: str            # "byte" or "hf"; recorded in every sample
    vocab_size: int      # the model's vocabulary size every id must stay below
    prefix_ids: list[int]  # ids that open a sequence (BOS), possibly empty
    random_id_bound: int   # ids in [0, random_id_bound) for the uniform-random baseline

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; special tokens take the ids right after them.

    Special ids: bos=256, eos=257, then one per role tag in `ROLE_TAGS`
    (system=258, user=259, assistant=260, tool=261). The literal strings
    ``<|bos|>``, ``<|eos|>`` and the role tags are encoded as their special id, and
    decoded back to the same strings, so ``decode(encode(s)) == s`` for any `s`.
    """

    kind = "byte"
    SPECIAL_TOKENS: tuple[str, ...] = ("<|bos|>", "<|eos|>", *ROLE_TAGS)
    N_BYTES = 256
    _SPLIT = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")

    def __init__(self, vocab_size: int) -> None:
        need = self.N_BYTES + len(self.SPECIAL_TOKENS)
        if vocab_size < need:
            raise ValueError(
                f"ByteTokenizer needs vocab_size >= {need} ({self.N_BYTES} byte ids plus "
                f"{len(self.SPECIAL_TOKENS)} special ids {list(self.SPECIAL_TOKENS)}), "
                f"got vocab_size={vocab_size}")
        self.vocab_size = vocab_size
        self.special_ids: dict[str, int] = {
            s: self.N_BYTES + i for i, s in enumerate(self.SPECIAL_TOKENS)}
        self._special_by_id = {i: s for s, i in self.special_ids.items()}
        self.bos_id = self.special_ids["<|bos|>"]
        self.eos_id = self.special_ids["<|eos|>"]
        self.prefix_ids = [self.bos_id]
        # The random baseline stays on byte ids: special ids are not "text".
        self.random_id_bound = self.N_BYTES

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self._SPLIT.split(text):
            special = self.special_ids.get(piece)
            if special is not None:
                ids.append(special)
            elif piece:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Inverse of `encode`; a byte run cut mid-character decodes with U+FFFD."""
        out: list[str] = []
        run = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < self.N_BYTES:
                run.append(i)
                continue
            if i not in self._special_by_id:
                raise ValueError(
                    f"ByteTokenizer cannot decode id {i}: allowed ids are 0..{self.N_BYTES - 1} "
                    f"(bytes) and {min(self._special_by_id)}..{max(self._special_by_id)} "
                    f"(special tokens)")
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            out.append(self._special_by_id[i])
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` (tokenizer.json), checked against the model.

    `encode` adds no special tokens (segments are encoded separately and joined);
    `prefix_ids` holds whatever the tokenizer's post-processor puts in front of a
    single sequence (e.g. ``<s>`` for Mixtral), found by encoding a probe string.
    """

    kind = "hf"

    def __init__(self, tokenizer: tokenizers.Tokenizer, vocab_size: int,
                 source: str = "<in-memory tokenizer>") -> None:
        self._tok = tokenizer
        self.source = source
        self.vocab_size = vocab_size
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        if not vocab:
            raise ValueError(f"tokenizer {source} has an empty vocabulary")
        self.max_id = max(vocab.values())
        if self.max_id >= vocab_size:
            raise ValueError(
                f"tokenizer {source} produces ids up to {self.max_id} "
                f"({len(vocab)} tokens including added ones), but the model's vocab_size is "
                f"{vocab_size}: every id must be < vocab_size. Use the checkpoint's own "
                f"tokenizer.json, or a model config with vocab_size >= {self.max_id + 1}")
        self.random_id_bound = self.max_id + 1
        self.prefix_ids = self._find_prefix()

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], vocab_size: int) -> "HFTokenizer":
        from tokenizers import Tokenizer as _HFTok  # local: the byte path never needs it

        return cls(_HFTok.from_file(str(path)), vocab_size, source=str(path))

    def _find_prefix(self) -> list[int]:
        probe = "moebench probe"
        plain = self._tok.encode(probe, add_special_tokens=False).ids
        full = self._tok.encode(probe, add_special_tokens=True).ids
        for k in range(len(full) - len(plain) + 1):
            if full[k:k + len(plain)] == plain:
                return list(full[:k])
        return []

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.source!r}, vocab_size={self.vocab_size})"


class IdRange:
    """No tokenizer at all: ids in [0, vocab_size) for the uniform-random baseline only (a model
    whose vocabulary is too small for the byte tokenizer can still run `tokens=random`)."""

    kind = "ids"
    prefix_ids: list[int] = []

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = self.random_id_bound = vocab_size

    def encode(self, text: str) -> list[int]:
        raise ValueError("IdRange has no text encoding; use workload.tokens=random, or a tokenizer")

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def load_tokenizer(checkpoint_dir: str | os.PathLike[str] | None,
                   vocab_size: int, tokens: str = "text") -> ByteTokenizer | HFTokenizer | IdRange:
    """The checkpoint's tokenizer.json when there is one, the byte tokenizer otherwise.

    Raises ValueError when the chosen tokenizer cannot fit `vocab_size` (an HF
    tokenizer with ids >= vocab_size, or vocab_size too small for the byte tokenizer),
    and NotADirectoryError when `checkpoint_dir` is given but is not a directory.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if checkpoint_dir is not None:
        d = Path(checkpoint_dir)
        if not d.is_dir():
            raise NotADirectoryError(
                f"checkpoint_dir {str(d)!r} is not a directory; pass an existing checkpoint "
                f"directory, or None for the byte tokenizer")
        path = d / "tokenizer.json"
        if path.is_file():
            log.info("workload tokenizer: %s", path)
            return HFTokenizer.from_file(path, vocab_size)
        log.info("workload tokenizer: bytes (no tokenizer.json in %s)", d)
    if tokens == "random" and vocab_size < ByteTokenizer.N_BYTES + len(ByteTokenizer.SPECIAL_TOKENS):
        return IdRange(vocab_size)
    return ByteTokenizer(vocab_size)
