"""The CI workflows and launcher presets refer only to things that exist: console scripts
declared in pyproject, Hydra overrides that compose and validate, checks that parse, the
test entry point. (Parsing only: nothing here runs a workflow.)"""
from __future__ import annotations

import itertools
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import harness.cli  # noqa: F401 -- registers the ConfigStore
from harness.cli import CONF_DIR
from harness.analysis_cli import compare_parser
from harness.compare import Check
from harness.config import ConfigError, validate

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[2]
WORKFLOWS = REPO / ".github" / "workflows"
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def workflow(name: str) -> dict:
    wf = yaml.safe_load((WORKFLOWS / name).read_text())
    wf["on"] = wf.pop(True, wf.get("on"))          # YAML 1.1 reads the key `on` as True
    return wf


def run_lines(wf: dict) -> list[str]:
    return [line.strip() for job in wf["jobs"].values() for step in job["steps"] if "run" in step
            for line in step["run"].splitlines() if line.strip()]


def sweep_jobs(overrides: str) -> list[list[str]]:
    """A multirun's override string -> the override list of every job (comma lists expanded)."""
    parts = [o.split("=", 1) for o in shlex.split(overrides)]
    choices = [[f"{k}={v}" for v in v.split(",")] for k, v in parts]
    return [list(c) for c in itertools.product(*choices)]


def compose_ok(overrides: list[str]) -> None:
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    assert validate(cfg) is not None


def test_workflows_are_valid_yaml_with_jobs() -> None:
    names = sorted(p.name for p in WORKFLOWS.glob("*.yml"))
    assert names == ["ci.yml", "gpu-regression.yml"]
    for name in names:
        wf = workflow(name)
        assert wf["on"] and wf["jobs"], name
        for job in wf["jobs"].values():
            assert job["steps"] and job.get("timeout-minutes"), name


def test_ci_runs_the_project_test_entry_point() -> None:
    wf = workflow("ci.yml")
    assert "bash .ci/run" in run_lines(wf)
    assert (REPO / ".ci" / "run").is_file()
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_gpu_workflow_runs_on_the_gpu_runner_one_at_a_time() -> None:
    wf = workflow("gpu-regression.yml")
    job = wf["jobs"]["regression"]
    assert job["runs-on"] == ["self-hosted", "gpu"]
    assert wf["concurrency"]["cancel-in-progress"] is False        # never two runs on the one GPU
    upload = [s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact")]
    paths = upload[0]["with"]["path"]
    for wanted in ("results.parquet", "comparison.csv", "figures/", ".nsys-rep"):
        assert wanted in paths, wanted


def test_every_command_the_workflows_run_exists() -> None:
    for name in ("ci.yml", "gpu-regression.yml"):
        for line in run_lines(workflow(name)):
            for word in re.findall(r"(?<![\w./-])(moebench[\w-]*)", line):
                assert word in SCRIPTS, f"{name}: `{word}` is not a console script in pyproject ({sorted(SCRIPTS)})"
    assert SCRIPTS.get("moebench-plot") == "harness.analysis_cli:plot_main"
    assert SCRIPTS.get("moebench-compare") == "harness.analysis_cli:compare_main"


@pytest.mark.slow
def test_gpu_workflow_overrides_compose_and_validate() -> None:
    env = workflow("gpu-regression.yml")["env"]
    jobs = sweep_jobs(env["REGRESSION_SWEEP"])
    assert len(jobs) == 3 and all("hardware.device=cuda" in j for j in jobs)
    for overrides in jobs:
        compose_ok(overrides)
    assert "run.profiler=nsys" in env["NSYS_RUN"]
    for overrides in sweep_jobs(env["NSYS_RUN"]):     # validation refuses nsys runs where nsys is missing
        try:
            compose_ok(overrides)
        except ConfigError as exc:
            assert shutil.which("nsys") is None and "run.profiler=nsys" in str(exc)


def test_gpu_workflow_checks_parse() -> None:
    env = workflow("gpu-regression.yml")["env"]
    args = compare_parser().parse_args(["base", "new", *shlex.split(env["REGRESSION_CHECKS"])])
    checks = [Check.parse(c) for c in args.check]
    assert {str(c) for c in checks} >= {"decode.tok_per_s:-10%", "prefill_fresh.ttft_s:+15%"}


def test_the_cpu_baseline_is_the_gpu_regression_sweep_on_the_cpu() -> None:
    """The committed CPU baseline ran the workflow's sweep minus hardware.device=cuda."""
    env = workflow("gpu-regression.yml")["env"]
    want = {o for o in shlex.split(env["REGRESSION_SWEEP"]) if not o.startswith("hardware.device=")}
    for multirun in (REPO / "results" / "baselines").glob("*/sweeps/regression/multirun.yaml"):
        task = set(OmegaConf.load(multirun).hydra.overrides.task)
        assert want <= task, f"{multirun}: {sorted(want - task)} missing"


@pytest.mark.parametrize("preset, target", [("slurm_gpu", "SlurmLauncher"), ("local_cpu", "LocalLauncher")])
@pytest.mark.slow
def test_launcher_presets_compose(preset: str, target: str) -> None:
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=[f"hydra/launcher={preset}"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith(target)
    if preset == "slurm_gpu":
        assert launcher.gpus_per_node == 1 and launcher.tasks_per_node == 1
        assert launcher.partition and launcher.timeout_min > 0 and launcher.additional_parameters.exclusive
    else:
        assert launcher.gpus_per_node == 0 and any("OMP_NUM_THREADS=1" in s for s in launcher.setup)
