"""A third-party placement and policy, declared through the entry-point groups of a temporary
distribution (tests/test_plugins.py's), are held to the invariant with no edit to the test: the
registry parametrises it, so pytest collects and passes their cases."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_plugins import plugin_path  # noqa: F401  (the fixture: the plugin's distribution)

pytestmark = pytest.mark.slow     # a pytest subprocess
REPO = Path(__file__).resolve().parents[2]


def test_a_registered_placement_and_policy_are_covered(plugin_path):  # noqa: F811
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{plugin_path}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA",
                           "tests/engine/test_invariant.py", "-k", "parity_cpu or mru"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    passed = re.findall(r"^PASSED (\S+)", proc.stdout, re.M)
    # the placement in every model and batch, its representative case under every micro-batch and a window
    placement = [t for t in passed if "parity_cpu" in t]
    assert len([t for t in placement if "test_every_registered_placement" in t]) == 2 * 4
    assert any("test_every_ubatch" in t for t in placement) and any("sliding_window" in t for t in placement)
    # the policy in fetch's capacity grid: every capacity from top_k to all 8 experts, per model and batch
    mru = [t for t in passed if "cache_policy=mru" in t and "test_every_registered_placement" in t]
    assert len(mru) == 7 * 4 * 2
