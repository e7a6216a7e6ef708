"""Through the CLI: a sweep rejected while its overrides are parsed and composed leaves nothing
under the results root; an option a placement lacks is refused naming the placements that have
it; and in a sweep over placements such an option applies to those that have it -- the others
run without it, resume as themselves and rerun from their manifests."""
from __future__ import annotations

import dataclasses
import json

import pytest

from engine.registry import PLACEMENTS
from harness import results
from harness.rerun import plan_rerun
from tests.harness.test_trust import cli, done_times

TINY = ["workload=chat", "workload.context_tokens=128", "workload.gen_tokens=4", "run.repeats=1",
        "run.passes=[speed]", "run.quiet=true"]
HAVING = [p for p in PLACEMENTS.names() if "n_cpu_layers" in {f.name for f in dataclasses.fields(PLACEMENTS.get(p).Options)}]


@pytest.mark.parametrize("argv,says", [
    (["placement=nonesuch"], "placement=nonesuch: no such option; allowed: " + ", ".join(PLACEMENTS.names())),
    (["placement=fetch,nonesuch"], "placement=nonesuch: no such option"),
    (["workload.context_tokens=128,abc"], "workload.context_tokens: allowed an integer, got 'abc'"),
    (["cache.capcity=2,4"], "capcity"),
    (["placement=resident,"], "cannot parse the override 'placement=resident,'"),
    (["placement=resident,fetch", "placement.n_cpu_layers=2"], "the placements that have it: " + ", ".join(HAVING)),
])
def test_a_rejected_sweep_leaves_no_directory(tmp_path, argv, says):
    proc = cli(["-m", *argv, "run.quiet=true"], tmp_path)
    assert proc.returncode == 1
    assert says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "results").exists(), sorted(p.name for p in (tmp_path / "results").rglob("*"))


def test_an_option_the_placement_lacks_names_the_placements_that_have_it(tmp_path):
    for command, code in ((["placement=resident", "placement.n_cpu_layers=2"], 1),
                          (["plan", "placement=resident", "placement.n_cpu_layers=2"], 2)):
        proc = cli(command, tmp_path)
        assert proc.returncode == code
        line = proc.stderr.strip()
        assert "\n" not in line and "Traceback" not in line
        assert "placement 'resident' has no option 'n_cpu_layers'" in line
        assert f"the placements that have it: {', '.join(HAVING)}" in line and "+placement." not in line
    proc = cli(["placement.n_cpu_layrs=2"], tmp_path)
    assert proc.returncode == 1 and "no placement has an option 'n_cpu_layrs'" in proc.stderr
    assert not (tmp_path / "results").exists()


def test_a_placement_option_applies_where_it_exists_in_a_sweep(tmp_path):
    hybrid = HAVING[0]
    command = ["-m", f"placement=resident,{hybrid}", "placement.n_cpu_layers=1,2", *TINY, "run.sweep_id=scope"]
    proc = cli(command, tmp_path)
    assert proc.returncode == 0, proc.stderr
    sweep = tmp_path / "results" / "sweeps" / "scope"
    df = results.load(sweep)
    jobs = df.groupby("job_id")["placement_options"].first()
    assert sorted(jobs[[j for j in jobs.index if f"placement={hybrid}" in j]]) == \
        ["{'n_cpu_layers': 1}", "{'n_cpu_layers': 2}"]          # options added since, at their defaults, left out
    # resident has no such option: its two jobs are one configuration, measured once (the other its twin)
    resident = [j for j in jobs.index if "placement=resident" in j]
    assert len(resident) == 1 and jobs[resident[0]] == "{}"
    manifests = [json.loads(p.read_text()) for p in sweep.glob("*/manifest.json")]
    ran_resident = [m for m in manifests if m["config"]["placement"]["name"] == "resident"]
    assert ran_resident and all("n_cpu_layers" not in m["config"]["placement"] for m in ran_resident)
    assert all(any(o.startswith("++placement.n_cpu_layers=") for o in m["overrides"]) for m in ran_resident)

    before = done_times(sweep)                           # the same command resumes: nothing is measured again
    again = cli(command, tmp_path)
    assert again.returncode == 0, again.stderr
    assert done_times(sweep) == before and "retired" not in again.stderr
    job_dir = next(p.parent for p in sweep.glob("*/manifest.json")
                   if json.loads(p.read_text())["config"]["placement"]["name"] == "resident")
    assert "++placement.n_cpu_layers=" in " ".join(plan_rerun([str(job_dir)]).argv)   # its manifest replays
