"""Every example in the README runs as written: the ```bash blocks (moebench commands) and
the ```python blocks, in a fresh working directory; the Quick start is exactly two commands."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow     # subprocess/CLI or multi-second runs: `make test` runs them, `-m "not slow"` skips
REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_quick_start_is_two_commands():
    section = README.split("## Quick start", 1)[1].split("##", 1)[0]
    commands = re.findall(r"```\n(.*?)```", section, flags=re.S)[0].strip().splitlines()
    assert commands == ["make run", "make test"]
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_bash_examples_run(tmp_path):
    cmds = [line for b in blocks("bash") for line in b.strip().splitlines() if line.startswith("moebench")]
    assert len(cmds) >= 3
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # the console scripts, run through their modules; results/ paths as the README gives them
    entry = {"moebench": ["harness.cli"], "moebench-sim": ["harness.sim.cli"],
             "moebench-plot": ["harness.analysis_cli", "plot"], "moebench-compare": ["harness.analysis_cli", "compare"]}
    (tmp_path / "results").mkdir()
    os.symlink(REPO / "results" / "baselines", tmp_path / "results" / "baselines")
    for cmd in cmds:
        words = shlex.split(cmd)
        argv = [sys.executable, "-m", *entry[words[0]], *words[1:]]
        proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        # moebench-compare's verdicts (1 FAIL, 3 INCOMPLETE: another machine's baseline, 4 INCONCLUSIVE), not a crash
        allowed = (0, 1, 3, 4) if words[0] == "moebench-compare" else (0,)
        assert proc.returncode in allowed, f"{cmd}\n{proc.stdout}\n{proc.stderr}"
    assert list((tmp_path / "figures").glob("*.png")) and (tmp_path / "report.md").is_file()
    assert list((tmp_path / "results").rglob("rows.parquet"))


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_python_examples_run(index, tmp_path):
    if "results.load" in blocks("python")[index]:     # the README's own sweep dir, smaller
        subprocess.run([sys.executable, "-m", "harness.cli", "-m", "placement=resident,fetch", "workload=chat",
                        "workload.context_tokens=256", "run.repeats=1", "run.quiet=true", "run.sweep_id=first"],
                       cwd=tmp_path, check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    proc = subprocess.run([sys.executable, "-c", blocks("python")[index]], cwd=tmp_path, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert proc.returncode == 0, proc.stderr
