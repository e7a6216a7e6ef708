"""OpenMP's idle workers: importing `engine` before torch sets libgomp's spin count (a user's own
wait policy kept), says so when torch came first, and a llama-server the harness starts gets the
environment as the user gave it. Each case in a fresh interpreter: libgomp reads the variable when
torch loads it, once per process."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine.kernels.openmp import SPINCOUNT

SHOW = """
import json, os, sys
{first}
from engine.kernels.openmp import as_given, spin_state
print(json.dumps({{"env": os.environ.get("GOMP_SPINCOUNT"), "state": spin_state(),
                  "given": as_given().get("GOMP_SPINCOUNT")}}))
"""


def show(first: str, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    proc = subprocess.run([sys.executable, "-c", SHOW.format(first=first)], env={**environ, **env},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_engine_first_sets_the_spin_count_and_a_server_does_not_inherit_it():
    got = show("import engine\nimport torch")
    assert got == {"env": SPINCOUNT, "state": f"GOMP_SPINCOUNT={SPINCOUNT} (set by engine before torch loaded)",
                   "given": None}


@pytest.mark.parametrize("env", [{"GOMP_SPINCOUNT": "5"}, {"OMP_WAIT_POLICY": "PASSIVE"}])
def test_a_wait_policy_the_user_set_is_kept(env):
    got = show("import engine", **env)
    (key, value), = env.items()
    assert got["state"] == f"set by the environment ({key}={value})"
    assert got["env"] == env.get("GOMP_SPINCOUNT") and got["given"] == env.get("GOMP_SPINCOUNT")


def test_torch_first_leaves_libgomp_default_and_says_so():
    got = show("import torch\nimport engine")
    assert got["env"] is None and got["state"].startswith("libgomp's default (torch was imported before engine")
