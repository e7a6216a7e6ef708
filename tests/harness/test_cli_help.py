"""`moebench --help` and every sub-command's --help, through the CLI in subprocesses: each prints
help (never a Hydra parse error or a traceback), and the help and `moebench plan` start without
loading what a run loads -- torch, pandas, llama.cpp's modules (the help reads the registered
adapters' declarations of their sub-commands, so it loads llama.cpp's adapter module and what that
imports, nothing more) -- which is what keeps them fast (the measured start-up times are in
docs/ci.md; no timed assertion here)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness.cli import COMMANDS
from harness.passes import DEFAULT_PASSES
from harness.plan import gpu_driver_present
from tests.harness.test_trust import REPO, cli
from tests.plugins import needs_engine

HEAVY = ("torch", "pandas")          # and any module of the llama.cpp adapter (a name holding "llamacpp")


def test_the_help_lists_every_command_the_passes_the_groups_and_the_config():
    proc = cli(["--help"], REPO)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for command in [*COMMANDS, "rerun"]:
        assert f"    moebench {command}" in out, command
    for name in DEFAULT_PASSES:
        assert any(line.split()[:1] == [name] for line in out.splitlines()), name
    placement_line = next(line for line in out.splitlines() if line.startswith("placement"))
    # the registry as a fresh process sees it (another test may have registered one in this one)
    registered = subprocess.run([sys.executable, "-c", "from engine.registry import PLACEMENTS; "
                                 "print(' '.join(PLACEMENTS.names()))"], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.split()
    assert registered and all(name in placement_line for name in registered)
    assert "\nmodel:\n  name: tiny-moe-trained" in out                   # the default config, composed
    assert "Traceback" not in proc.stderr


def test_the_help_shows_the_config_its_overrides_compose():
    proc = cli(["--help", "-m", "placement=hybrid,fetch", "placement.n_cpu_layers=1"], REPO)
    assert proc.returncode == 0, proc.stderr
    assert "placement (now hybrid):" in proc.stdout
    assert "placement:\n  name: hybrid\n  n_cpu_layers: 1" in proc.stdout
    bad = cli(["--help", "placement=nonesuch"], REPO)
    assert bad.returncode == 2
    assert "nonesuch" in bad.stderr and "Traceback" not in bad.stderr


# a two-word command's first word alone lists the commands it begins (`moebench setup --help`)
@pytest.mark.parametrize("command", [*COMMANDS, "rerun", *sorted({c.split()[0] for c in COMMANDS if " " in c})])
def test_every_sub_command_prints_its_help(command):
    proc = cli([*command.split(), "--help"], REPO)
    assert proc.returncode == 0, proc.stderr
    assert f"moebench {command}" in proc.stdout
    for failure in ("Traceback", "LexerNoViableAlt", "Error parsing override"):
        assert failure not in proc.stdout + proc.stderr


@pytest.mark.parametrize("argv,message", [
    pytest.param(["import"], "moebench import: one of: moebench import llama-bench", marks=needs_engine("llamacpp")),
    (["plna"], "moebench: unknown command 'plna'; allowed: calibrate, fit, "),
])
def test_a_word_that_is_no_command_is_refused_in_one_line(argv, message):
    proc = cli(argv, REPO)
    assert proc.returncode == 2
    assert proc.stderr.startswith(message) and proc.stderr.count("\n") == 1, proc.stderr


LOADED = """
import atexit, json, sys
atexit.register(lambda: print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r}
                                                 or "llamacpp" in m)), file=sys.stderr))
from harness.cli import main
sys.argv = ["moebench", *{argv!r}]
main()
"""


@pytest.mark.parametrize("argv", [["--help"], ["plan"], ["plan", "-m", "placement=fetch,hybrid,cpu"],
                                  ["plan", "model=mixtral-8x7b", "hardware.device_memory=24GiB"]])
def test_help_and_plan_load_no_torch_pandas_or_llamacpp(argv):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", LOADED.format(heavy=set(HEAVY), argv=argv)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 1), proc.stderr                    # plan: 1 when it does not fit
    assert proc.stdout.strip()
    loaded = json.loads(proc.stderr.strip().splitlines()[-1])
    if argv[0] == "plan" and gpu_driver_present():                    # device=auto: torch is asked for the card
        loaded = [m for m in loaded if m.split(".")[0] != "torch"]
    if argv[0] == "--help":                                           # the adapters' declarations, no more
        loaded = [m for m in loaded if m not in adapter_modules(env)]
    assert loaded == []


def adapter_modules(env: dict[str, str]) -> set[str]:
    """The llama.cpp modules importing its adapter's declaration loads (none without the plugin)."""
    code = ("import json, sys\ntry:\n    import harness.llamacpp.adapter\nexcept ImportError:\n    pass\n"
            "print(json.dumps(sorted(m for m in sys.modules if 'llamacpp' in m)))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300, check=True)
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))
