"""The README is a front door: at most 15 KB; the Quick start is exactly two commands, the second
the one CI runs; it links every page of the guide; and its Layout names each top-level folder git
tracks, once, and no other. Its examples run in tests/test_docs.py, with the guide's."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
MAX_BYTES = 15 * 1024


def section(title: str) -> str:
    return README.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_readme_is_a_front_door() -> None:
    size = len(README.encode())
    assert size <= MAX_BYTES, f"README.md is {size} bytes, over {MAX_BYTES}: move the detail into docs/"


def test_quick_start_is_two_commands() -> None:
    commands = re.findall(r"```\n(.*?)```", section("Quick start"), flags=re.S)[0].strip().splitlines()
    assert commands == ["make run", "make test"]
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_the_index_links_every_page_of_the_guide() -> None:
    linked = {(REPO / t).resolve() for t in re.findall(r"\]\((docs/[^)#\s]+)", README)}
    pages = {p.resolve() for p in (REPO / "docs").glob("*.md")} | {(REPO / "docs" / "history" / "README.md").resolve()}
    missing = sorted(str(p.relative_to(REPO)) for p in pages - linked)
    assert not missing, f"README's guide index does not link {missing}"


def tracked_top_level_folders() -> set[str]:
    try:
        names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"not a git checkout, so its tracked folders cannot be listed: {exc}")
    return {n.split("/", 1)[0] for n in names if "/" in n}


def test_layout_names_each_tracked_folder_once() -> None:
    block = re.findall(r"```\n(.*?)```", section("Layout"), flags=re.S)[0]
    listed = [m.group(1) for line in block.splitlines() if (m := re.match(r"(\S+)/\s", line))]
    twice = sorted({f for f in listed if listed.count(f) > 1})
    assert not twice, f"README's Layout lists {twice} more than once"
    tracked = tracked_top_level_folders()
    assert set(listed) == tracked, (f"README's Layout and the tree differ: missing {sorted(tracked - set(listed))}, "
                                    f"not in the tree {sorted(set(listed) - tracked)}")
