"""`moebench table` on real runs, through the CLI: the quality pass's columns (KL mean, top-1
agreement) where a job ran it, and the expert-cache slots each job's engine resolved (what
`cache.capacity=auto` came to); a run without the pass keeps the table it always had."""
from __future__ import annotations

import json

from harness import results
from tests.harness.test_trust import cli

TINY = ["workload=chat", "workload.context_tokens=128", "workload.gen_tokens=4", "run.repeats=1",
        "run.timeline=false", "run.ablation=false", "run.quiet=true"]


def test_the_table_shows_quality_and_the_resolved_cache_slots(tmp_path):
    proc = cli(["-m", "placement=resident,fetch", "cache.capacity=auto", "hardware.device_memory=8MiB", *TINY,
                "run.sweep_id=q"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    sweep = tmp_path / "results" / "sweeps" / "q"
    df = results.load(sweep)
    resolved = df[(df.placement == "fetch")]["resolved_capacity"].dropna().astype(float).astype(int).unique()
    assert len(resolved) == 1

    shown = cli(["table", str(sweep), "--format", "json"], tmp_path)
    assert shown.returncode == 0, shown.stderr
    rows = {r["placement"]: r for r in json.loads(shown.stdout)}
    assert rows["fetch"]["cache slots"] == resolved[0] and rows["resident"]["cache slots"] is None
    for r in rows.values():                              # exact runs: the quality pass measures no loss
        assert r["KL mean"] == 0.0 and r["top-1 agr."] == 1.0 and r["KL mean n"] == 1
    md = cli(["table", str(sweep)], tmp_path).stdout
    header = md.splitlines()[0]
    assert all(f"| {c} |" in header for c in ("cache slots", "KL mean", "top-1 agr."))
    fetch_line = next(line for line in md.splitlines() if line.startswith("| fetch"))
    assert f"| {resolved[0]} |" in fetch_line and "| 0.00e+00 | 1.000 |" in fetch_line


def test_a_run_without_the_quality_pass_has_no_quality_columns(tmp_path):
    proc = cli(["placement=resident", *TINY, "run.passes=[speed]", "hydra.run.dir=lean"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    md = cli(["table", str(tmp_path / "lean")], tmp_path)
    assert md.returncode == 0, md.stderr
    header = md.stdout.splitlines()[0]
    assert "tg tok/s" in header and "KL mean" not in header and "top-1 agr." not in header


def test_quality_figures_say_what_weights_they_were_measured_on():
    """Under a table with quality figures, a line per kind of weights they came from: random presets
    and the small trained model each with their caveat; a user's checkpoint needs none."""
    import pandas as pd

    from harness.table import notes
    t = pd.DataFrame({"KL mean": [1e-3, 2e-3, None, 5e-4], "top-1 agr.": [0.99, 0.98, None, 1.0],
                      "weights": ["small trained model", "random weights", "random weights", "checkpoint"]})
    line = notes(t)[-1]
    assert line == ("KL mean, top-1 agr. measured on small trained model: magnitudes do not transfer to large "
                    "models; on random weights: routing and logits no trained model produces")
    assert not any("measured on" in n for n in notes(t.assign(weights="checkpoint")))
    assert not any("measured on" in n for n in notes(t.assign(**{"KL mean": None, "top-1 agr.": None})))
