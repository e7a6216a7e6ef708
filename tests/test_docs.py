"""The guide runs as written, and keeps its promises.

Every ```bash and ```python block of README.md, of docs/ (the dated records under docs/history/
aside: they are what was run at the time, not examples) and of engine/families/README.md runs as
its own test, in a fresh directory where results/samples, results/samples-lossy and
results/baselines are the committed result sets. An HTML comment on the lines just above a block
changes how it runs:

    <!-- output: WHY -->          the block's stdout must equal what follows it: the next fenced
                                  block, or the text between <!-- begin output --> and <!-- end output -->
    <!-- requires: llamacpp -->   runs where the llama.cpp build exists; skips, saying so, elsewhere
                                  (fails instead with MOEBENCH_REQUIRE_LLAMACPP set, as CI does)
    <!-- exit 0|3: WHY -->        the exit statuses the block may end with (default 0)
    <!-- not run: WHY -->         illustrative only; the reason is required

Beside them: the data dictionary (docs/results.md) describes every metric of the contract with its
unit and every schema column; local links and their #anchors resolve; and no tracked text cites
tracker issues or review dates (text says what and why).
"""
from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cli_runner import run_python, shim_env

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
HISTORY = DOCS / "history"
GUIDES = [REPO / "README.md", *sorted(p for p in DOCS.rglob("*.md") if HISTORY not in p.parents),
          REPO / "engine" / "families" / "README.md"]
COMMITTED_RESULTS = ("samples", "samples-lossy", "baselines")
RUN_LANGS = ("bash", "python")
MARKER_KINDS = ("output", "requires", "exit", "not run")
BLOCK_TIMEOUT_S = 900

FENCE = re.compile(r"^```(?P<info>[^\n`]*)\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)
MARKER = re.compile(r"^<!--\s*(?P<kind>output|requires|exit|not run)\s*(?P<arg>[^:]*?)\s*:\s*(?P<why>.*?)\s*-->\s*$")
OUTPUT_REGION = re.compile(r"\A\s*<!-- begin output -->\n(?P<body>.*?)<!-- end output -->", re.S)


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    body: str
    markers: dict[str, tuple[str, str]]    # kind -> (argument, reason)
    expected: str | None                   # the stdout an `output` block must print

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def _markers(text: str, start: int) -> dict[str, tuple[str, str]]:
    """The marker comments on the lines right above offset `start` (blank lines between allowed)."""
    found: dict[str, tuple[str, str]] = {}
    for line in reversed(text[:start].rstrip("\n").splitlines()):
        if not line.strip():
            continue
        m = MARKER.match(line.strip())
        if not m:
            if line.strip().startswith("<!--") and not line.strip().startswith("<!-- end output"):
                raise AssertionError(f"unknown marker above a block: {line.strip()!r}; allowed: {MARKER_KINDS}, "
                                     "each as <!-- kind: reason -->")
            break
        found[m["kind"]] = (m["arg"], m["why"])
    return found


def _expected_output(text: str, end: int) -> str:
    rest = text[end:]
    region = OUTPUT_REGION.match(rest)
    if region:
        return region["body"]
    fence = FENCE.search(rest)
    if fence is None or rest[:fence.start()].strip():
        raise AssertionError("an `output` block must be followed by a fenced block or a <!-- begin output --> region")
    return fence["body"]


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        lang = m["info"].split()[0] if m["info"].strip() else ""
        if lang not in RUN_LANGS:
            continue
        markers = _markers(text, m.start())
        expected = _expected_output(text, m.end()) if "output" in markers else None
        out.append(Block(path, text.count("\n", 0, m.start()) + 1, lang, m["body"], markers, expected))
    return out


ALL_BLOCKS = [b for path in GUIDES for b in blocks(path)]


def _llamacpp_or_skip() -> None:
    try:
        build = importlib.import_module("harness.llamacpp.build")
    except ImportError as exc:
        pytest.skip(f"this block needs the llama.cpp adapter, which is not installed: {exc}")
    try:
        build.find_binaries()
    except build.LlamaCppBuildError as exc:
        if os.environ.get("MOEBENCH_REQUIRE_LLAMACPP"):
            pytest.fail(f"MOEBENCH_REQUIRE_LLAMACPP is set and the llama.cpp build is missing: {exc}")
        pytest.skip(f"llama.cpp is not built (`moebench setup llamacpp`; MOEBENCH_REQUIRE_LLAMACPP=1 to fail "
                    f"instead): {exc}")


def _workdir(tmp_path: Path) -> Path:
    (tmp_path / "results").mkdir()
    for name in COMMITTED_RESULTS:
        os.symlink(REPO / "results" / name, tmp_path / "results" / name)
    return tmp_path


@pytest.mark.slow     # subprocess/CLI or multi-second runs: `make test` runs them, `-m "not slow"` skips
@pytest.mark.parametrize("block", ALL_BLOCKS, ids=[b.id for b in ALL_BLOCKS])
def test_block_runs(block: Block, tmp_path: Path) -> None:
    if "not run" in block.markers:
        pytest.skip(f"not run: {block.markers['not run'][1]}")
    if "requires" in block.markers:
        assert block.markers["requires"][1] == "llamacpp", f"{block.id}: unknown requirement {block.markers['requires']}"
        _llamacpp_or_skip()
    allowed = {0}
    if "exit" in block.markers:
        allowed = {int(code) for code in block.markers["exit"][0].split("|")}
    env = {**os.environ, "PYTHONPATH": str(REPO),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    if block.lang == "bash":      # the project's commands in it forked warm (tests/cli_runner.py)
        proc = subprocess.run(["bash", "-eo", "pipefail", "-c", block.body], cwd=_workdir(tmp_path),
                              env=shim_env(env), capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    else:
        proc = run_python(block.body, _workdir(tmp_path), env, timeout=BLOCK_TIMEOUT_S)
    assert proc.returncode in allowed, (f"{block.id} exited {proc.returncode} (allowed {sorted(allowed)})\n"
                                        f"{block.body}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
    if block.expected is not None:
        assert proc.stdout.strip() == block.expected.strip(), (
            f"{block.id}: the block's output differs from the one the page shows; run it and paste its output\n"
            f"--- printed\n{proc.stdout}")


def test_markers_say_why() -> None:
    """Every marker has its reason (`requires` names what), and the guide runs real examples."""
    for b in ALL_BLOCKS:
        for kind, (arg, why) in b.markers.items():
            assert why, f"{b.id}: <!-- {kind}: ... --> needs a reason after the colon"
            if kind == "exit":
                assert re.fullmatch(r"\d+(\|\d+)*", arg), f"{b.id}: <!-- exit 0|3: why --> lists exit statuses"
    assert sum("not run" not in b.markers for b in ALL_BLOCKS) >= 20


# --- the data dictionary ---------------------------------------------------------------------------

RESULTS_DOC = (DOCS / "results.md").read_text()


def test_every_metric_has_its_unit_and_meaning() -> None:
    from harness.contract import METRIC_UNITS

    rows = dict(re.findall(r"^\| `([a-z0-9_]+)` \| ([^|]+?) \| [^|]+ \| .+\|$", RESULTS_DOC, re.M))
    missing = sorted(set(METRIC_UNITS) - set(rows))
    assert not missing, f"docs/results.md's metric table lacks {missing}"
    wrong = {m: (rows[m], unit) for m, unit in METRIC_UNITS.items() if rows[m] != unit}
    assert not wrong, f"docs/results.md gives these metrics other units than harness/contract.py: {wrong}"
    unknown = sorted(set(rows) - set(METRIC_UNITS))
    assert not unknown, f"docs/results.md's metric table names metrics the contract does not: {unknown}"


def test_every_column_is_described() -> None:
    from harness import results
    from harness.results.schema import CONFIG_COLUMNS, REQUIRED_COLUMNS

    committed = set()
    for name in ("samples", "samples-lossy"):
        committed |= set(results.load(REPO / "results" / name).columns)
    described = set(re.findall(r"`([a-z0-9_]+)`", RESULTS_DOC))
    missing = sorted((set(REQUIRED_COLUMNS) | set(CONFIG_COLUMNS) | committed) - described)
    assert not missing, f"docs/results.md does not describe the columns {missing}"


def test_the_nsys_command_is_the_one_run() -> None:
    from harness.profiling.nsys import NSYS_COMMAND

    assert NSYS_COMMAND in (DOCS / "profiling.md").read_text()


# --- links -------------------------------------------------------------------------------------------

LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


@pytest.mark.parametrize("page", [*GUIDES, *sorted(HISTORY.glob("*.md")), *sorted((REPO / "results").glob("*/README.md"))],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_local_links_resolve(page: Path) -> None:
    broken = []
    for m in LINK.finditer(FENCE.sub("", page.read_text())):
        target = m["target"]
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(REPO)})")
    assert not broken, f"{page.relative_to(REPO)}: {broken}"


# --- no tracker citations ------------------------------------------------------------------------------

# A reader cannot follow an internal tracker's numbers or a review's date: text says what and why.
# Precise on purpose: "issue-ahead", "pasting into issues", "interval #1" and llama.cpp's own
# discussion links are legitimate.
CITATION = re.compile(r"""
      \bissues?\s+\#?\d+                         # an issue by number, or a list of them
    | \(\s*points?\s+\d+                         # "(point 3", the numbered points of an issue
    | \bpoints?\s+\d+\s*,\s*issue                #
    | \bissue\s+\d+\s*,\s*point                  #
    | \bdesk[\s-]+review                         #
    | \breview(?:ed)?\s+(?:of|on|dated)\s+\d{4}-\d{2}-\d{2}
    | \b(?:fixes|closes|resolves|see)\s+\#\d+\b  # "#12" as a tracker reference
    | \(\#\d+\)                                  #
""", re.I | re.X)
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".ipynb", ".toml", ".cfg", ".txt", ".sh", ".ini"}


def tracked_text_files() -> list[Path]:
    try:
        names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"not a git checkout, so its tracked files cannot be listed: {exc}")
    return [REPO / n for n in names
            if Path(n).suffix in TEXT_SUFFIXES or n in ("Makefile", ".gitignore") or n.startswith((".ci/", ".github/"))]


def test_no_text_cites_tracker_issues_or_reviews() -> None:
    hits = []
    for path in tracked_text_files():
        if not path.is_file() or path == Path(__file__).resolve():     # this file holds the rule's own examples
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            m = CITATION.search(line)
            if m:
                hits.append(f"{path.relative_to(REPO)}:{n}: {m.group(0)!r} in {line.strip()[:100]!r}")
    assert not hits, "text cites a tracker or a review (say what and why instead):\n" + "\n".join(hits)


def test_the_citation_rule_fires_on_citations_only() -> None:
    cites = ["see issue 16", "(issue 16.4)", "(issues 13 and 14)", "(issue 10, point 2)", "(point 3): the copy stream",
             "a desk review found", "fixes #12", "(#7)"]
    fine = ["issue-ahead mode", "for pasting into issues and papers", "interval #1 must have start <= end",
            "https://github.com/ggml-org/llama.cpp/discussions/15396", "the 2 points of a curve", "issue copies ahead"]
    assert [c for c in cites if not CITATION.search(c)] == []
    assert [f for f in fine if CITATION.search(f)] == []
