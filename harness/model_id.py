"""A model's identity: what tells the models of two runs apart, recorded in each job's manifest
(`model_id`) and read by `moebench-compare`.

Owns: `weights_label(name)` (what a model's weights are: random, small trained, a checkpoint: how
tables label what was measured on them), `model_id(model)` -- a preset is its name, seed and
truncation (its weights are seeded from those by this code; a change to that code is what a
comparison tests, like any other commit); a checkpoint is the sha256 of its content, never its path:
a copy elsewhere is the same model, a file rewritten in place is another -- and
`manifest_model_id(manifest)`, the identity a manifest records or, for a preset, implies.
Does not own: the manifest (harness.manifest), how a comparison uses the identity (harness.compare).

    from harness.model_id import model_id
    model_id({"name": "tiny-mixtral", "path": None, "seed": 0})    # 'preset tiny-mixtral seed=0'
    model_id({"name": "hf-checkpoint", "path": "ckpt/"})            # 'checkpoint sha256:3f9a...'

A checkpoint's content is every regular file at the top of its dir (config, weights, index,
tokenizer, ...; hidden files such as a hub client's download metadata aside), by name and bytes.
Hashing reads every byte once; the digest is remembered in the process and on disk under
`<MOEBENCH_CACHE or ~/.cache/moebench>/model-ids/`, keyed by each file's name, size, mtime and
inode, so a sweep (or a sweep of fresh processes) reads a checkpoint once.
"""
from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.config import PRESETS
from engine.shipped import SHIPPED

log = logging.getLogger(__name__)

#: What a model's weights are, by its name, for labelling what is measured on them (quality above all):
#: a preset's are seeded random; a shipped checkpoint's trained, but small; anything else a checkpoint.
WEIGHTS_CAVEATS: dict[str, str] = {
    "random weights": "routing and logits no trained model produces",
    "small trained model": "magnitudes do not transfer to large models",
}


def weights_label(name: str) -> str:
    """'small trained model' (a shipped checkpoint), 'random weights' (a preset) or 'checkpoint'."""
    return "small trained model" if name in SHIPPED else "random weights" if name in PRESETS else "checkpoint"

DIGEST_HEX = 16                    # 64 bits of sha256: distinct checkpoints never collide in practice
_CHUNK = 1 << 22
_MEMO: dict[str, str] = {}


def model_id(model: Mapping[str, Any]) -> str | None:
    """The identity of the model a resolved `model` config node names; None when its checkpoint
    cannot be read (the job fails on it anyway)."""
    layers = model.get("num_layers")
    suffix = f" layers={layers}" if layers is not None else ""
    path = model.get("path")
    if not path:
        return f"preset {model.get('name')} seed={model.get('seed', 0)}{suffix}"
    try:
        return f"checkpoint sha256:{checkpoint_digest(Path(path))}{suffix}"
    except OSError as exc:
        log.warning("model.path=%s: cannot read the checkpoint to identify it: %s", path, exc)
        return None


def manifest_model_id(manifest: Mapping[str, Any]) -> str | None:
    """The identity a manifest records (`model_id`), or a preset's from its resolved config.
    A checkpoint whose manifest records no content hash: None (which model it was is unknown)."""
    recorded = manifest.get("model_id")
    if recorded:
        return str(recorded)
    model = (manifest.get("config") or {}).get("model")
    if not isinstance(model, Mapping) or model.get("path") or not model.get("name"):
        return None
    return model_id(model)


def checkpoint_digest(path: Path) -> str:
    """sha256 over the checkpoint's files (see the module docstring), DIGEST_HEX hex digits."""
    files = _files(path)
    if not files:
        raise FileNotFoundError(f"{path}: no files to identify a checkpoint by")
    stat_key = hashlib.sha256(json.dumps(
        [str(path.resolve()), *[(f.name, *_stat(f)) for f in files]]).encode()).hexdigest()
    if stat_key in _MEMO:
        return _MEMO[stat_key]
    cached = _cache_dir() / f"{stat_key[:32]}.json"
    try:
        digest = json.loads(cached.read_text())["digest"]
    except (OSError, ValueError, KeyError, TypeError):
        digest = _hash(files)
        try:
            from harness.results import atomic_write_text
            cached.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(cached, json.dumps({"path": str(path.resolve()), "digest": digest}) + "\n")
        except OSError as exc:     # the identity is still right; only the next job hashes again
            log.warning("could not cache the checkpoint's digest in %s: %s", cached, exc)
    _MEMO[stat_key] = digest
    return digest


def _files(path: Path) -> list[Path]:
    return sorted(f for f in path.iterdir() if f.is_file() and not f.name.startswith("."))


def _stat(f: Path) -> tuple[int, int, int]:
    st = f.stat()
    return st.st_size, st.st_mtime_ns, st.st_ino


def _hash(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{f.stat().st_size}\0".encode())   # names and lengths delimit the contents
        with open(f, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()[:DIGEST_HEX]


def _cache_dir() -> Path:
    from harness.contract import cache_root
    return cache_root() / "model-ids"

