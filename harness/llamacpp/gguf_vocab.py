"""Give a GGUF the pass-through vocabulary: every id < vocab_size is a plain token, none is special.

Owns one rewrite, used by `convert` for checkpoints that have no tokenizer of their own
(moebench presets, random-weight benchmark models): moebench feeds token ids, so llama.cpp
must take every id unchanged and generate exactly the tokens requested. The converter only
accepts such a checkpoint with a tokenizer supplied, and any SentencePiece/BPE vocabulary it
writes makes llama.cpp treat some id as end-of-generation (the SPM defaults make id 2 EOS, the
text `</s>` is EOG): a greedy run would stop there, or, with `ignore_eos`, that id's logit
would be biased to -inf, so the tokens would no longer be the reference's. llama.cpp's `test`
vocabulary type has no special tokens at all (it detokenises an id as its hex digits), so
the rewrite sets `tokenizer.ggml.model = "test"`, one plain token per id, and drops every
other `tokenizer.*` key. Weights and all other metadata are copied unchanged.

Does not own: converting (`convert`), or checkpoints that bring a tokenizer (theirs is kept).

Runs with the pinned tree's `gguf-py` on PYTHONPATH (it imports `gguf`), in a subprocess:

    PYTHONPATH=<llama.cpp>/gguf-py python -m harness.llamacpp.gguf_vocab IN.gguf OUT.gguf
"""
from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

log = logging.getLogger(__name__)

VOCAB_MODEL = "test"


def token_text(i: int) -> str:
    """The text of token i: matches none of the strings llama.cpp treats as end-of-generation."""
    return f"<id:{i}>"


def rewrite(src: str, dst: str) -> int:
    """Copy GGUF src to dst with the pass-through vocabulary; returns the vocabulary size."""
    import gguf  # the pinned tree's gguf-py, from PYTHONPATH

    reader = gguf.GGUFReader(src, "r")
    arch_field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    tokens_field = reader.get_field(gguf.Keys.Tokenizer.LIST)
    if arch_field is None or tokens_field is None:
        raise ValueError(f"{src} has no {gguf.Keys.General.ARCHITECTURE} or {gguf.Keys.Tokenizer.LIST}: not a "
                         "converted model")
    arch = arch_field.contents()
    n_vocab = len(tokens_field.data)
    writer = gguf.GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    alignment = reader.get_field(gguf.Keys.General.ALIGNMENT)
    if alignment is not None:
        writer.data_alignment = alignment.contents()
    for field in reader.fields.values():
        # GGUF.* are the reader's virtual fields; the writer adds the architecture itself
        if (field.name.startswith("GGUF.") or field.name == gguf.Keys.General.ARCHITECTURE
                or field.name.startswith("tokenizer.")):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    writer.add_tokenizer_model(VOCAB_MODEL)
    writer.add_token_list([token_text(i) for i in range(n_vocab)])
    writer.add_token_types([gguf.TokenType.NORMAL] * n_vocab)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return n_vocab


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    n = rewrite(args.src, args.dst)
    log.info("pass-through vocabulary of %d tokens written to %s", n, args.dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
