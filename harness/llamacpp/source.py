"""The pinned llama.cpp source: which tree moebench measures and where the cache keeps it.

Owns: the pin (one `llama-cpp-python` sdist from PyPI, checked by hash), fetching it with pip,
extracting its `vendor/llama.cpp` tree once (`source_dir`), the llama.cpp commit it vendors
(`vendored_commit`), its `gguf-py` as a module (`gguf_module`), its place under moebench's cache (`llamacpp_root`: `cache_root()/llama.cpp`,
harness.contract) and `LlamaCppBuildError`. Does not own: compiling the tree or finding
the binaries (`harness.llamacpp.build`, which re-exports these names).

    src = source_dir()                  # <cache>/llama.cpp/src-<v>/llama.cpp
    vendored_commit(src)                # the commit the sdist vendors, e.g. "0c1e57098"
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from harness.contract import cache_root

log = logging.getLogger(__name__)

# The pin: one sdist, checked by hash, so every machine compiles the same tree.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SDIST_NAME = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"


class LlamaCppBuildError(RuntimeError):
    """The pinned llama.cpp could not be fetched, built or found."""


def llamacpp_root() -> Path:
    return cache_root() / "llama.cpp"


def fetch_sdist(downloads: Path | None = None) -> Path:
    """The pinned sdist in the cache, downloaded with pip from PyPI when missing; hash-checked."""
    downloads = downloads or llamacpp_root() / "downloads"
    path = downloads / SDIST_NAME
    if not path.is_file():
        downloads.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--dest", str(downloads), f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"]
        log.info("downloading %s: %s", SDIST_NAME, " ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not path.is_file():
            raise LlamaCppBuildError(f"could not download {SDIST_NAME} with pip (exit {proc.returncode}); "
                                     f"place it at {path} by hand. pip said:\n{proc.stderr[-2000:]}")
    digest = _sha256(path)
    if digest != SDIST_SHA256:
        raise LlamaCppBuildError(f"{path} has sha256 {digest}, the pin is {SDIST_SHA256}; delete it and rerun")
    return path


def gguf_module():
    """The pinned tree's gguf-py (the reader and type sizes its converter writes with), imported
    from that tree; an installed `gguf` of another version is not used."""
    path = str(source_dir() / "gguf-py")
    if path not in sys.path:
        sys.path.insert(0, path)
    import gguf
    if not str(getattr(gguf, "__file__", "")).startswith(path):
        raise LlamaCppBuildError(f"an installed gguf package ({gguf.__file__}) shadows the pinned tree's {path}")
    return gguf


def source_dir() -> Path:
    """The pinned llama.cpp tree (`vendor/llama.cpp` of the sdist), extracted once."""
    root = llamacpp_root()
    dest = root / f"src-{LLAMA_CPP_PYTHON_VERSION}"
    done = dest / ".moebench-extracted"
    if done.is_file():
        return dest / "llama.cpp"
    sdist = fetch_sdist()
    root.mkdir(parents=True, exist_ok=True)
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/"
    tmp = Path(tempfile.mkdtemp(prefix=".src-", dir=root))
    try:
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                rel = m.name[len(prefix):] if m.name.startswith(prefix) else None
                if rel is None or not (rel.startswith("vendor/llama.cpp/") or rel == "CHANGELOG.md"):
                    continue
                m.name = rel[len("vendor/"):] if rel.startswith("vendor/") else rel
                members.append(m)
            tar.extractall(tmp, members=members, filter="data")
        # the tree's .git file points into the sdist's absent .git/modules: drop it, so no
        # git command in cmake mistakes a parent repository for this tree
        (tmp / "llama.cpp" / ".git").unlink(missing_ok=True)
        (tmp / ".moebench-extracted").write_text(sdist.name + "\n")
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest / "llama.cpp"


def vendored_commit(src: Path) -> str:
    """The llama.cpp commit the sdist's CHANGELOG names for its version ("unknown" if none)."""
    changelog = src.parent / "CHANGELOG.md"
    text = changelog.read_text() if changelog.is_file() else ""
    section = re.search(rf"^## \[{re.escape(LLAMA_CPP_PYTHON_VERSION)}\](.*?)^## \[", text, re.S | re.M)
    hit = re.search(r"llama\.cpp@([0-9a-f]{7,40})", section.group(1)) if section else None
    return hit.group(1) if hit else "unknown"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
