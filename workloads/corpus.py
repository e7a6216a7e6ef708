"""Real text from this machine's Python standard library, for building workloads.

Owns: locating the stdlib (``sysconfig.get_paths()["stdlib"]``), listing its source
files in a stable order, reading them (UTF-8), extracting class/function definitions
with their source lines and docstrings (``ast``, never importing the modules), and
document sections (the language-reference topics in ``pydoc_data/topics.py``, then
module docstrings). Endless, seeded iterators over all of these.
Does not own: tokenization, sessions, trimming (``workloads.base``) or any cache on
disk -- parsed files are memoised in memory only.

Everything here is a pure function of the installed stdlib and the generator passed
in, so a workload built from a seed is reproducible on one machine (and on machines
with the same Python build; `corpus_id()` names that build for sample metadata).
"""
from __future__ import annotations

import ast
import functools
import os
import platform
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Directories that hold tests, third-party packages, caches or data, not library source.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                        "__pycache__", "pydoc_data"})
_MIN_BYTES, _MAX_BYTES = 1_000, 300_000


@dataclass(frozen=True)
class Definition:
    """One ``def``/``class`` in a stdlib file (lines are 1-based, inclusive)."""

    path: str          # relative to the stdlib root, posix separators
    qualname: str      # e.g. "JSONDecoder.decode"
    kind: str          # "def" or "class"
    lineno: int
    end_lineno: int
    docstring: str     # cleaned (ast.get_docstring), "" when absent

    @property
    def name(self) -> str:
        return self.qualname.rsplit(".", 1)[-1]

    @property
    def module(self) -> str:
        return module_name(self.path)


def module_name(path: str) -> str:
    """Dotted module name of a stdlib path: "json/decoder.py" -> "json.decoder"."""
    mod = path[:-3].replace("/", ".")
    return mod[:-len(".__init__")] if mod.endswith(".__init__") else mod


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_id() -> str:
    """Which text source a sample was built from (for sample metadata)."""
    return f"python-{platform.python_version()}-stdlib:{stdlib_root()}"


@functools.lru_cache(maxsize=1)
def source_files() -> tuple[str, ...]:
    """Library .py files under the stdlib root, relative posix paths, sorted."""
    root = stdlib_root()
    found: list[str] = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS)
        for f in files:
            if not f.endswith(".py"):
                continue
            p = Path(d) / f
            if _MIN_BYTES <= p.stat().st_size <= _MAX_BYTES:
                found.append(p.relative_to(root).as_posix())
    if not found:
        raise FileNotFoundError(
            f"no Python source files of {_MIN_BYTES}..{_MAX_BYTES} bytes under the stdlib "
            f"root {str(root)!r} (sysconfig.get_paths()['stdlib']); workloads need real text")
    return tuple(sorted(found))


def read_source(path: str) -> str:
    """Text of the stdlib file at `path` (relative to `stdlib_root()`)."""
    return (stdlib_root() / path).read_text(encoding="utf-8")


@functools.lru_cache(maxsize=2048)
def source_lines(path: str) -> tuple[str, ...]:
    return tuple(read_source(path).splitlines())


@functools.lru_cache(maxsize=2048)
def definitions(path: str) -> tuple[Definition, ...]:
    """Module-level and class-level definitions of `path`, in source order.

    A file that does not decode as UTF-8 or parse with this interpreter has none.
    """
    try:
        tree = ast.parse(read_source(path), filename=path)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return ()
    out: list[Definition] = []

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            qual = prefix + node.name
            kind = "class" if isinstance(node, ast.ClassDef) else "def"
            out.append(Definition(path, qual, kind, node.lineno,
                                  node.end_lineno or node.lineno,
                                  ast.get_docstring(node) or ""))
            if isinstance(node, ast.ClassDef):
                visit(node.body, qual + ".")

    visit(tree.body, "")
    return tuple(out)


@functools.lru_cache(maxsize=2048)
def module_docstring(path: str) -> str:
    try:
        return ast.get_docstring(ast.parse(read_source(path), filename=path)) or ""
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return ""


def definition_source(d: Definition, max_lines: int = 60) -> str:
    """The source lines of `d`, at most `max_lines` of them."""
    lines = source_lines(d.path)[d.lineno - 1:min(d.end_lineno, d.lineno - 1 + max_lines)]
    return "\n".join(lines)


def iter_files(rng: np.random.Generator) -> Iterator[str]:
    """Endless: stdlib files that have definitions, in seeded random order (re-shuffled
    after each full pass)."""
    files = source_files()
    while True:
        any_ok = False
        for i in rng.permutation(len(files)):
            if definitions(files[i]):
                any_ok = True
                yield files[i]
        if not any_ok:
            raise RuntimeError(
                f"none of the {len(files)} stdlib files under {str(stdlib_root())!r} parsed "
                f"with this interpreter; workloads need real source text")


def iter_documented(rng: np.random.Generator, min_chars: int = 80) -> Iterator[Definition]:
    """Endless: one randomly chosen definition with a docstring of >= `min_chars`
    characters from each file of `iter_files(rng)` that has one."""
    seen_files = 0
    for path in iter_files(rng):
        seen_files += 1
        documented = [d for d in definitions(path) if len(d.docstring) >= min_chars]
        if documented:
            seen_files = 0
            yield documented[int(rng.integers(len(documented)))]
        elif seen_files > 4 * len(source_files()):
            raise RuntimeError(
                f"no stdlib definition has a docstring of >= {min_chars} characters")


@functools.lru_cache(maxsize=1)
def reference_topics() -> tuple[tuple[str, str], ...]:
    """(topic, text) pairs of the language reference shipped in pydoc_data/topics.py,
    sorted by topic; empty when this Python was built without it."""
    path = stdlib_root() / "pydoc_data" / "topics.py"
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return ()
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "topics"):
            try:
                topics = ast.literal_eval(node.value)
            except ValueError:
                return ()
            return tuple(sorted((str(k), str(v).strip()) for k, v in topics.items()))
    return ()


def iter_sections(rng: np.random.Generator) -> Iterator[tuple[str, str, str]]:
    """Endless: (title, text, source) document sections. First every language-reference
    topic once in seeded order, then module documentation (module docstring followed by
    its definitions' docstrings) for files in `iter_files(rng)` order."""
    topics = reference_topics()
    for i in rng.permutation(len(topics)):
        title, text = topics[i]
        yield title, text, "pydoc_data/topics.py"
    for path in iter_files(rng):
        parts = [module_docstring(path)]
        parts += [f"{d.qualname}: {d.docstring}" for d in definitions(path) if d.docstring]
        text = "\n\n".join(p for p in parts if p)
        if text:
            yield f"module {module_name(path)}", text, path
