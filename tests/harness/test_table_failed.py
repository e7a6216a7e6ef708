"""`moebench table` on a sweep where one job failed, through the CLI: the failed job's row leaves
its config columns null (it never got that far), and those nulls are no difference -- the table
shows the columns that really vary, the failed job with its one-line error."""
from __future__ import annotations

import json

from harness import results
from harness.results import CONFIG_COLUMNS
from tests.harness.test_trust import cli

# resident needs about 4.9 MiB here and fetch with 2 slots about 2.6 MiB: resident's plan is refused
RUN = ["-m", "placement=resident,fetch", "cache.capacity=2", "hardware.device_memory=3MiB", "workload=chat",
       "workload.tokens=random", "workload.context_tokens=64", "workload.gen_tokens=2", "run.repeats=1",
       "run.timeline=false", "run.ablation=false", "run.quiet=true", "run.sweep_id=f"]


def test_a_failed_jobs_nulls_do_not_make_every_config_column_vary(tmp_path):
    proc = cli(RUN, tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    sweep = tmp_path / "results" / "sweeps" / "f"
    df = results.load(sweep)
    status = df.groupby("placement").status.agg(set)
    assert status["resident"] == {"failed"} and status["fetch"] == {"ok"}
    ok = df[df.status == "ok"]
    assert ok.placement_options.notna().any() and ok.ubatch.notna().any()    # set on the ok job, null on the failed

    shown = cli(["table", str(sweep), "--format", "json"], tmp_path)
    assert shown.returncode == 0, shown.stderr
    rows = {r["placement"]: r for r in json.loads(shown.stdout)}
    assert set(rows) == {"resident", "fetch"}
    assert [c for c in CONFIG_COLUMNS if c in rows["fetch"]] == ["placement"]
    assert rows["resident"]["status"] == "failed" and "does not fit the device budget" in rows["resident"]["error"]
    md = cli(["table", str(sweep)], tmp_path).stdout
    header = md.splitlines()[0]
    assert header.startswith("| placement |") and all(f"| {c} |" not in header for c in
                                                      ("placement_options", "ubatch", "token_source", "threads"))
