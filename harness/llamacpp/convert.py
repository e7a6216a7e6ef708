"""Weights for llama.cpp: a Hugging Face checkpoint dir or a moebench preset -> a cached GGUF.

Owns: running the pinned converter (`convert_hf_to_gguf.py` with its own `gguf-py`, from the
tree `build.source_dir()` extracted) in a subprocess; the GGUF types it offers and the ones
made from its f32 output with `llama-quantize`; supplying a tokenizer when the checkpoint has
none and then giving the GGUF the pass-through vocabulary (`gguf_vocab`), so that the same
token ids reach both engines; and the cache, keyed by model identity and type. Does not own:
building llama.cpp (`build`), running it (`server`), or exporting presets (`engine.export`).

    g = convert("path/to/hf-dir", "f32")                 # -> GGUFModel(path=..., vocab_size=..., ...)
    g = convert_preset("tiny-mixtral", seed=0, outtype="q8_0")

Cache: `<cache_root>/gguf/<identity hash>/model-<type>.gguf` beside `model-<type>.json` (the
record, written last: a GGUF without it is not trusted). A checkpoint's identity is its resolved
path plus the name, size and mtime of each file in it; a preset's is its name, seed and the
full ModelConfig. Change any file of a checkpoint and it is converted again.

Code in a checkpoint: the pinned converter loads tokenizers with `trust_remote_code=True`, so a
checkpoint whose JSON has an `auto_map` (or that ships `.py` files) is refused unless
`trust_remote_code=True` is passed (`model.trust_remote_code=true`); and the converter only ever
sees a staged copy of the dir with no `.py` file and no `auto_map` unless it is
(harness.remote_code). A trusted conversion is cached apart from an untrusted one.

A failed conversion raises ConversionError: one line with the converter's own error, the source
line that raised it (file, line, function and the code, quoted from its traceback: a bare
`AssertionError` says nothing alone) and the file holding its whole output; the hint about supplied tokenizers comes only when the traceback shows
the tokenizer failed.

Tokenizer-less checkpoints: supported for the llama-family converter (Mixtral, and so every
mixtral preset), which reads a SentencePiece `tokenizer.model`; the Qwen/OLMoE converters read
a BPE tokenizer through transformers and need the model's own tokenizer files. A checkpoint with
its own tokenizer keeps it (and its EOS: pass `ignore_eos` for fixed-length generation).
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from harness.llamacpp import build
from harness.remote_code import refuse_checkpoint_code, stage_files

if TYPE_CHECKING:
    from engine.config import ModelConfig

log = logging.getLogger(__name__)

# What the pinned convert_hf_to_gguf.py writes itself (its --outtype choices, less "auto")
CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0", "tq1_0", "tq2_0")
# What llama-quantize makes from the f32 GGUF (a selection of its types; names as it takes them)
QUANTIZE_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s",
                  "q4_k_m", "q5_k_s", "q5_k_m", "q6_k")
GGUF_TYPES = CONVERTER_TYPES + QUANTIZE_TYPES

TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tekken.json")
REPO_ROOT = Path(__file__).resolve().parents[2]
LOADER = "llama.cpp's converter (convert_hf_to_gguf.py)"     # as a refusal names it (harness.remote_code)
TRUSTED = "\ntrust_remote_code=true"      # ends the identity of a GGUF converted with the checkpoint's code


class ConversionError(RuntimeError):
    """The converter or quantizer failed; the message is one line (its own error and where its
    whole output was saved), `output` the output itself."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output


@dataclass(frozen=True)
class GGUFModel:
    """A converted model, as recorded in the cache."""
    path: Path
    outtype: str
    vocab_size: int
    passthrough_vocab: bool     # True: moebench supplied the vocabulary (ids pass unchanged, no EOS/EOG)
    source: str                 # the checkpoint dir converted
    identity: str               # what the cache key was computed from
    llama_cpp_commit: str
    size_bytes: int

    def to_json(self) -> dict:
        d = asdict(self)
        d["path"] = str(self.path)
        return d


def gguf_root() -> Path:
    return build.cache_root() / "gguf"


def checkpoint_identity(model_dir: Path) -> str:
    """Resolved path + (name, size, mtime_ns) of every file in the dir, recursively."""
    model_dir = Path(model_dir).resolve()
    parts = [str(model_dir)]
    for p in sorted(model_dir.rglob("*")):
        if p.is_file():
            st = p.stat()
            parts.append(f"{p.relative_to(model_dir)}:{st.st_size}:{st.st_mtime_ns}")
    return "\n".join(parts)


def cache_dir(identity: str, root: Path | None = None) -> Path:
    """The dir of a model identity's GGUFs (and of what else is known of its weights) under `root`
    (default `gguf_root()`)."""
    return Path(root or gguf_root()) / hashlib.sha256(identity.encode()).hexdigest()[:16]


def convert(model_dir: Path | str, outtype: str = "f32", *, identity: str | None = None,
            root: Path | None = None, progress: Callable[[str], None] = log.info,
            trust_remote_code: bool = False) -> GGUFModel:
    """The GGUF of checkpoint `model_dir` at `outtype`, converted once and cached under `root`
    (default `gguf_root()`). Code shipped in the checkpoint is refused (RemoteCodeRefused) unless
    `trust_remote_code`."""
    if outtype not in GGUF_TYPES:
        raise ValueError(f"outtype {outtype!r} is not offered; the converter writes {list(CONVERTER_TYPES)}, "
                         f"llama-quantize makes {list(QUANTIZE_TYPES)}")
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} is not a Hugging Face checkpoint dir: it has no config.json")
    refuse_checkpoint_code(model_dir, trust_remote_code, LOADER)
    identity = identity or checkpoint_identity(model_dir)
    if trust_remote_code and not identity.endswith(TRUSTED):
        identity += TRUSTED           # what the checkpoint's own code did is part of this GGUF
    out_dir = cache_dir(identity, root)
    cached = _cached(out_dir, outtype)
    if cached is not None:
        return cached
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "identity.txt").write_text(identity + "\n")
    if outtype in QUANTIZE_TYPES:
        base = convert(model_dir, "f32", identity=identity, root=root, progress=progress,
                       trust_remote_code=trust_remote_code)
        return _quantize(base, outtype, out_dir, progress)
    return _convert(model_dir, outtype, identity, out_dir, progress, trust_remote_code)


def convert_preset(name: str, seed: int = 0, outtype: str = "f32", *, cfg: ModelConfig | None = None,
                   root: Path | None = None, progress: Callable[[str], None] = log.info) -> GGUFModel:
    """Preset `name` (or `cfg`, a ModelConfig with overrides) with seeded weights, exported through
    `engine.export.export_preset` into the cache, then converted."""
    from engine.config import preset
    from engine.export import export_preset

    cfg = cfg or preset(name)
    identity = f"preset:{name}:seed={seed}:{json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str)}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    ckpt = export_preset(name, seed, cfg, Path(root or build.cache_root()) / "checkpoints" / key)
    return convert(ckpt, outtype, identity=identity, root=root, progress=progress)


def _cached(out_dir: Path, outtype: str) -> GGUFModel | None:
    record = out_dir / f"model-{outtype}.json"
    if not record.is_file():
        return None
    d = json.loads(record.read_text())
    d["path"] = Path(d["path"])
    g = GGUFModel(**d)
    return g if g.path.is_file() and g.path.stat().st_size == g.size_bytes else None


def _convert(model_dir: Path, outtype: str, identity: str, out_dir: Path,
             progress: Callable[[str], None], trusted: bool) -> GGUFModel:
    src = build.source_dir()
    commit = build.vendored_commit(src)
    final = out_dir / f"model-{outtype}.gguf"
    with tempfile.TemporaryDirectory(prefix=".convert-", dir=out_dir) as tmp:
        stage = Path(tmp) / "checkpoint"
        supplied = _stage(model_dir, stage, trusted)
        raw = Path(tmp) / "converted.gguf"
        env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
        env.pop("NO_LOCAL_GGUF", None)
        cmd = [sys.executable, str(src / "convert_hf_to_gguf.py"), str(stage), "--outtype", outtype,
               "--outfile", str(raw), "--model-name", model_dir.resolve().name]
        progress(f"converting {model_dir} to GGUF {outtype}")
        saved = out_dir / f"convert-{outtype}.log"
        try:
            _run(cmd, env, "convert_hf_to_gguf.py", f"converting {model_dir} to GGUF {outtype}", saved)
        except ConversionError as e:
            if supplied and _tokenizer_failed(e.output):   # e.g. Qwen/OLMoE converters read a BPE tokenizer
                raise ConversionError(f"{e}; {model_dir} has no tokenizer, and moebench supplies one only in the "
                                      "form the llama-family converter (Mixtral) reads: put the model's "
                                      "tokenizer files beside its config.json", e.output) from e
            raise
        out = Path(tmp) / "model.gguf"
        if supplied:
            env["PYTHONPATH"] = os.pathsep.join([str(src / "gguf-py"), str(REPO_ROOT)])
            _run([sys.executable, "-m", "harness.llamacpp.gguf_vocab", str(raw), str(out)], env, "gguf_vocab",
                 f"writing the pass-through vocabulary of {model_dir}", saved)
        else:
            raw.rename(out)
        vocab = _vocab_size(model_dir)
        os.replace(out, final)
    return _record(GGUFModel(path=final, outtype=outtype, vocab_size=vocab, passthrough_vocab=supplied,
                             source=str(model_dir.resolve()), identity=identity, llama_cpp_commit=commit,
                             size_bytes=final.stat().st_size), out_dir)


def _quantize(base: GGUFModel, outtype: str, out_dir: Path, progress: Callable[[str], None]) -> GGUFModel:
    quantize = build.find_binaries().quantize
    if quantize is None:
        raise ConversionError(f"{outtype} needs llama-quantize, which this llama.cpp build lacks; {build.BUILD_HINT}")
    final = out_dir / f"model-{outtype}.gguf"
    tmp = out_dir / f".model-{outtype}.gguf.tmp"
    progress(f"quantizing {base.path.name} to {outtype}")
    _run([str(quantize), str(base.path), str(tmp), outtype.upper()], dict(os.environ), "llama-quantize",
         f"quantizing {base.path} to {outtype}", out_dir / f"quantize-{outtype}.log")
    os.replace(tmp, final)
    return _record(dataclasses.replace(base, path=final, outtype=outtype, size_bytes=final.stat().st_size), out_dir)


def _record(g: GGUFModel, out_dir: Path) -> GGUFModel:
    tmp = out_dir / f".model-{g.outtype}.json.tmp"
    tmp.write_text(json.dumps(g.to_json(), indent=2) + "\n")
    os.replace(tmp, out_dir / f"model-{g.outtype}.json")     # the record last
    return g


def _stage(model_dir: Path, stage: Path, trusted: bool) -> bool:
    """Link the checkpoint's files into `stage` (untrusted: without code, harness.remote_code);
    supply a tokenizer when it has none. Returns True when the tokenizer was supplied (the GGUF then
    gets the pass-through vocab)."""
    stage_files(model_dir, stage, trusted)
    if any((stage / f).exists() for f in TOKENIZER_FILES):
        return False
    (stage / "tokenizer.model").write_bytes(_placeholder_sentencepiece(_vocab_size(model_dir)))
    return True


def _placeholder_sentencepiece(vocab_size: int) -> bytes:
    """A few-piece SentencePiece model: only so the converter accepts the checkpoint (it pads
    the vocab to vocab_size); `gguf_vocab` replaces it with the pass-through vocab afterwards."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(["abcdefgh"] * 4), model_writer=buf,
                                   vocab_size=min(8, vocab_size), model_type="char", hard_vocab_limit=False,
                                   minloglevel=2)
    return buf.getvalue()


def _vocab_size(model_dir: Path) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    v = cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size")
    if not isinstance(v, int):
        raise ValueError(f"{model_dir}/config.json has no integer vocab_size (got {v!r})")
    return v


def _run(cmd: list[str], env: dict[str, str], what: str, doing: str, saved: Path) -> None:
    """Run one conversion step; on failure its whole output goes to `saved` and the error is one
    line: the step, what it was doing, its exit status and its own error line."""
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        try:
            saved.write_text(f"$ {' '.join(cmd)}\n{output}")
            where = f"its whole output is in {saved}"
        except OSError as exc:
            where = f"its output could not be saved to {saved} ({exc})"
        raise ConversionError(f"{what} failed (exit {proc.returncode}) {doing}: {_error_line(output)}; {where}",
                              output)
    log.debug("%s output:\n%s", what, output[-8000:])


_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b(: .*)?$")
_LOGGED_ERROR = re.compile(r"^(?:ERROR|CRITICAL):[\w.-]+:(.*)$")
# the converter's frames that read a tokenizer (its set_vocab, _set_vocab_gpt2, get_vocab_base, ...)
_VOCAB_FRAME = re.compile(r'^\s*File ".*", line \d+, in (set_vocab|_set_vocab\w*|get_vocab_base\w*|'
                          r'_create_vocab_sentencepiece)\s*$', re.M)


_FRAME = re.compile(r'^File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)$')


def _error_line(output: str, limit: int = 400, quote: bool = True) -> str:
    """The line of a tool's output that says why it failed: the last Python exception line with the
    source line that raised it quoted from the traceback (a bare `AssertionError` says nothing
    alone; `quote=False`: the exception line only), else the last logged ERROR, else the last line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    at = next((i for i in range(len(lines) - 1, -1, -1) if _EXCEPTION.match(lines[i])), None)
    if at is not None:
        line, where = lines[at], (_raised_at(lines[max(0, at - 4):at]) if quote else "")
    else:
        line = next((m.group(1).strip() for ln in reversed(lines) if (m := _LOGGED_ERROR.match(ln))), None)
        line, where = line or (lines[-1] if lines else "it printed nothing"), ""
    return _cut(line, limit) + where


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _raised_at(before: list[str]) -> str:
    """` at DIR/FILE:LINE in FUNC: `SOURCE`` for the traceback's last frame in `before` (the few
    lines right above an exception line), "" when there is none. Only the frame's file and its
    parent dir are shown: the rest is the converter's tree, the same for every frame."""
    for i in range(len(before) - 1, -1, -1):
        m = _FRAME.match(before[i])
        if m is None:
            continue
        where = "/".join(Path(m["file"]).parts[-2:])
        # the frame's source line, unless Python printed none (then the next line is another frame
        # or the exception); `^^^` / `~~~` lines only mark columns in it
        source = next((ln for ln in before[i + 1:] if not set(ln) <= set("^~ ")), "")
        quoted = f": `{_cut(source, 200)}`" if source and not _FRAME.match(source) else ""
        return f" at {where}:{m['line']} in {m['func']}{quoted}"
    return ""


def _tokenizer_failed(output: str) -> bool:
    """Whether the converter's output shows the tokenizer as the cause: its traceback passes
    through a vocabulary-reading frame, or its error line names the tokenizer."""
    return bool(_VOCAB_FRAME.search(output)) or "tokenizer" in _error_line(output, quote=False).lower()
