"""Code shipped inside a checkpoint: finding it, refusing it, and staging a checkpoint without it.

A Hugging Face checkpoint dir can carry Python (`modeling_*.py`, `tokenization_*.py`) that
transformers imports -- and so runs -- when a loader passes `trust_remote_code=True` and a JSON
file's `auto_map` names a class in it (`config.json` for AutoConfig/AutoModel,
`tokenizer_config.json` for AutoTokenizer, `processor_config.json` ...). llama.cpp's converter
always passes it. moebench runs no such code unless `model.trust_remote_code=true`:

- `refuse_checkpoint_code(dir, trusted, loader)`: before an engine that hands the checkpoint to
  such a loader starts, one line naming the first file found and the flag;
- `stage_files(dir, stage, trusted)`: the files a converter reads, linked into a scratch dir
  with no `.py` file and no subdirectory, and every JSON file that has an `auto_map` copied
  without it, so that even a loader that hard-codes `trust_remote_code=True` finds nothing to
  import (a second line of defence should a refusal be missed).

Owns: what counts as checkpoint code and the refusal's wording. Does not own: which engines
hand a checkpoint to such a loader (each adapter says so: `EngineAdapter.runs_checkpoint_loader`)
or converting (harness.llamacpp.convert).

    refuse_checkpoint_code(Path("ckpt"), trusted=False, loader="llama.cpp's converter")
    stage_files(Path("ckpt"), Path(tmp) / "checkpoint", trusted=False)
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FLAG = "model.trust_remote_code"
AUTO_MAP = "auto_map"
CODE_SUFFIXES = (".py",)        # what transformers' dynamic modules import from a checkpoint dir


class RemoteCodeRefused(ValueError):
    """The checkpoint ships code a loader would run, and the user did not trust it."""


@dataclass(frozen=True)
class CheckpointCode:
    """One place in a checkpoint dir through which code would run."""
    file: Path
    what: str           # what in the file makes it code, e.g. "its auto_map names code to import (...)"


def _auto_map(path: Path) -> dict[str, Any] | None:
    """The top-level `auto_map` of a JSON file, None when it has none (or is not a JSON object).
    The text is searched first, so a large tokenizer.json without one is never parsed."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    if b'"' + AUTO_MAP.encode() + b'"' not in raw:
        return None
    try:
        d = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None             # not ours to judge: the loader that reads it reports it
    value = d.get(AUTO_MAP) if isinstance(d, dict) else None
    return value if value else None


def checkpoint_code(model_dir: Path | str) -> list[CheckpointCode]:
    """Every `auto_map` in the dir's top-level JSON files, then every `.py` file under it."""
    root = Path(model_dir)
    found: list[CheckpointCode] = []
    for p in sorted(root.glob("*.json")):
        amap = _auto_map(p) if p.is_file() else None
        if amap is not None:
            named = "; ".join(f"{k}: {v}" for k, v in amap.items()) if isinstance(amap, dict) else str(amap)
            found.append(CheckpointCode(p, f"its auto_map names code to import ({named})"))
    for p in sorted(root.rglob("*")):
        if p.suffix in CODE_SUFFIXES and p.is_file():
            found.append(CheckpointCode(p, "Python source shipped with the checkpoint"))
    return found


def refuse_checkpoint_code(model_dir: Path | str, trusted: bool, loader: str) -> list[CheckpointCode]:
    """Raise RemoteCodeRefused, one line naming the first file and the flag, when the dir holds
    code `loader` could run and `trusted` is False; the code found (logged) when trusted."""
    found = checkpoint_code(model_dir)
    if not found:
        return found
    if trusted:
        log.warning("%s=true: %s may run code shipped with %s: %s", FLAG, loader, model_dir,
                    ", ".join(str(c.file) for c in found))
        return found
    first, others = found[0], [c.file.name for c in found[1:]]
    also = f"; also {', '.join(others[:3])}{' ...' if len(others) > 3 else ''}" if others else ""
    raise RemoteCodeRefused(
        f"{first.file}: {first.what}, which {loader} would run{also}; moebench runs no code shipped with a "
        f"checkpoint unless {FLAG}=true (given: false). Allowed: {FLAG}=true for a checkpoint whose code you "
        f"trust, or a copy of it without code (no auto_map entries, no .py files) to load with transformers' "
        f"own classes")


def stage_files(model_dir: Path | str, stage: Path, trusted: bool) -> None:
    """Link the checkpoint's files into `stage` (created) for a loader to read. Untrusted: top-level
    files only, no `.py` file, and a JSON file with an `auto_map` copied without it."""
    src = Path(model_dir).resolve()
    stage.mkdir(parents=True)
    for p in sorted(src.iterdir()):
        if trusted:
            (stage / p.name).symlink_to(p)
            continue
        if not p.is_file() or p.suffix in CODE_SUFFIXES:
            log.debug("not staged for the loader: %s", p)
            continue
        if p.suffix == ".json" and _auto_map(p) is not None:
            d = json.loads(p.read_bytes())
            d.pop(AUTO_MAP)
            (stage / p.name).write_text(json.dumps(d, indent=2))
            continue
        (stage / p.name).symlink_to(p)
