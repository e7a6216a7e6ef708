"""harness.compare and `moebench-compare`: a real slowdown is flagged, noise is not, and pairs
that cannot be compared (config, device, engine version) say so instead of a verdict."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from tests.plugins import needs_engine

from harness import compare as C
from harness import results as R
from harness.analysis_cli import compare_main
from harness.session import write_sweep_table

FACTORS = {"engine": "moebench", "model": "tiny-mixtral", "placement": "fetch", "cache_capacity": "4",
           "cache_policy": "lru", "prefetch": "none", "workload": "chat", "context_tokens": 512, "gen_tokens": 32,
           "batch": 1, "dtype": "float32"}
DEVICE = {"device_kind": "cpu", "device_name": "cpu (emulated device)", "emulated": True}


def manifest(sweep_id: str, job_id: str, version: str = "0.1.0", cpu: str = "AMD EPYC", commit: str = "a" * 40) -> dict:
    return {"schema_version": 1, "config": {}, "git": {"commit": commit, "dirty": False},
            "packages": {"moebench": version, "torch": "2.13.0", "transformers": "5.17.0"},
            "host": {"hostname": "h1", "platform": "Linux-6-x86_64", "machine": "x86_64", "cpu_model": cpu,
                     "cpu_cores_available": 2}, "gpu": {"count": 0, "name": None},
            "sweep_id": sweep_id, "job_id": job_id}


def job_rows(sweep_id: str, job_id: str, tok_per_s: list[float], factors: dict | None = None,
             device: dict | None = None, h2d: float = 1e6) -> list[dict]:
    rows: list[dict] = []
    for rep, rate in enumerate(tok_per_s):
        common = (factors or FACTORS, device or DEVICE, sweep_id, job_id, rep)
        rows += R.make_rows(*common, "decode", {"tok_per_s": rate, "time_s": 31 / rate, "tokens": 31.0}, "client",
                            extra={"profiler": "none"})
        rows += R.make_rows(*common, "decode", {"h2d_bytes": h2d, "hit_rate": 0.5}, "engine", extra={"profiler": "none"})
        rows += R.make_rows(*common, "prefill_fresh", {"ttft_s": 512 / (rate * 10)}, "client",
                            extra={"profiler": "none"})
    # an instrumented pass: never compared (DESIGN 7.5)
    rows += R.make_rows(factors or FACTORS, device or DEVICE, sweep_id, job_id, 0, "decode", {"tok_per_s": 1.0},
                        "client", extra={"profiler": "timeline"})
    return rows


def write(root: Path, sweep_id: str, tok_per_s: list[float], **kw) -> Path:
    man = {k: kw.pop(k) for k in ("version", "cpu") if k in kw}
    sweep = root / "sweeps" / sweep_id
    R.write_job(sweep / "0", job_rows(sweep_id, "0:placement=fetch", tok_per_s, **kw),
                manifest(sweep_id, "0:placement=fetch", **man))
    return sweep


def samples(mean: float, n: int, seed: int, sd: float = 0.02) -> list[float]:
    return list(np.random.default_rng(seed).normal(mean, mean * sd, n))


CHECKS = ["decode.tok_per_s:-5%", "prefill_fresh.ttft_s:+10%"]


@pytest.mark.slow
def test_a_20_percent_slowdown_is_a_regression(tmp_path: Path) -> None:
    base = write(tmp_path / "base", "s", samples(1000, 5, 0))
    new = write(tmp_path / "new", "s", samples(800, 5, 1))
    cmp = C.compare_paths(base, new, CHECKS)
    row = cmp.table[(cmp.table.phase == "decode") & (cmp.table.metric == "tok_per_s")].iloc[0]
    assert row.test == "mwu" and row.p_value < 0.01 and row.significant
    assert row.ratio == pytest.approx(0.8, abs=0.03) and row.verdict == "regression"
    ttft = cmp.table[(cmp.table.phase == "prefill_fresh") & (cmp.table.metric == "ttft_s")].iloc[0]
    assert ttft.verdict == "regression"          # TTFT went up 25% > 10%
    assert cmp.failed
    md = cmp.markdown()
    assert "**FAIL**" in md and "## Regressions" in md and "decode.tok_per_s:-5%" in md
    # the CLI: exit 1, a markdown report and a table
    report, table = tmp_path / "report.md", tmp_path / "cmp.csv"
    assert compare_main([str(base), str(new), *sum((["--check", c] for c in CHECKS), []),
                         "--report", str(report), "--table", str(table)]) == 1
    assert "**FAIL**" in report.read_text()
    assert set(pd.read_csv(table)["verdict"].dropna()) >= {"regression"}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.slow
def test_same_distribution_is_not_flagged(tmp_path: Path, seed: int) -> None:
    base = write(tmp_path / "base", "s", samples(1000, 5, 10 + seed))
    new = write(tmp_path / "new", "s", samples(1000, 5, 20 + seed))
    cmp = C.compare_paths(base, new, CHECKS)
    assert not cmp.failed and len(cmp.regressions) == 0
    assert set(cmp.table["verdict"]) <= {"ok", "", "inconclusive"}
    assert compare_main([str(base), str(new), "--check", CHECKS[0], "--report", str(tmp_path / "r.md")]) == 0
    assert "**PASS**" in (tmp_path / "r.md").read_text()


@pytest.mark.slow
def test_improvement_is_not_a_regression(tmp_path: Path) -> None:
    cmp = C.compare_paths(write(tmp_path / "b", "s", samples(800, 5, 0)), write(tmp_path / "n", "s", samples(1000, 5, 1)),
                          CHECKS)
    assert not cmp.failed
    assert "improvement" in set(cmp.table["verdict"])


@pytest.mark.slow
def test_different_configs_are_not_comparable(tmp_path: Path) -> None:
    base = write(tmp_path / "base", "s", samples(1000, 5, 0))
    new = write(tmp_path / "new", "s", samples(500, 5, 1), factors={**FACTORS, "cache_capacity": "2"})
    cmp = C.compare_paths(base, new, CHECKS)
    assert set(cmp.table["verdict"]) == {"not comparable"}
    assert set(cmp.table["note"]) == {"only in base: cache_capacity differs: base 4 vs new 2",
                                      "only in new: cache_capacity differs: base 4 vs new 2"}
    assert not cmp.failed and cmp.verdict == "INCOMPLETE" and cmp.exit_code == 3    # nothing compared: never PASS
    assert [str(c) for c in cmp.unmatched_checks] == CHECKS
    md = cmp.markdown()
    assert "**INCOMPLETE**" in md and "**PASS**" not in md and "nothing compared" in md
    assert all(f"check {c} matched no comparable pair" in md for c in CHECKS)


@pytest.mark.slow
@needs_engine("llamacpp")             # its knob column n_cpu_moe
def test_a_knob_outside_the_factors_is_its_own_config(tmp_path: Path) -> None:
    """Jobs that differ only in a column a job adds (llama.cpp's n_cpu_moe) are two configs: a
    regression in one is caught, not pooled away with the other's samples."""
    def side(root: Path, slow: bool) -> Path:
        sweep = root / "sweeps" / "s"
        for job, knob, rate in (("0", 0, 1000.0), ("1", 2, 500.0)):
            rate *= 0.5 if slow and knob == 2 else 1.0
            R.write_job(sweep / job, job_rows("s", job, samples(rate, 5, knob + 10 * slow),
                                              factors={**FACTORS, "n_cpu_moe": knob}), manifest("s", job))
        return sweep
    cmp = C.compare_paths(side(tmp_path / "b", False), side(tmp_path / "n", True), CHECKS)
    dec = cmp.table[(cmp.table.phase == "decode") & (cmp.table.metric == "tok_per_s")].set_index("n_cpu_moe")
    assert set(dec["n_base"]) == {5} and dec.loc["0", "verdict"] == "ok" and dec.loc["2", "verdict"] == "regression"
    assert cmp.failed


@pytest.mark.slow
def test_a_column_only_one_side_has_splits_only_where_it_varies(tmp_path: Path) -> None:
    """A baseline written before a column existed ran one setting of it: still comparable with
    new results that hold one value of it; configs the new side tells apart by it are not."""
    base = write(tmp_path / "base", "s", samples(1000, 5, 0))
    cmp = C.compare_paths(base, write(tmp_path / "new", "s", samples(1000, 5, 1),
                                      factors={**FACTORS, "expert_cache_mode": "cold"}), CHECKS)
    assert "not comparable" not in set(cmp.table["verdict"]) and set(cmp.table["n_base"]) == {5}
    new = tmp_path / "new2" / "sweeps" / "s"
    for job, mode in (("0", "cold"), ("1", "warm")):
        R.write_job(new / job, job_rows("s", job, samples(1000, 5, 2), factors={**FACTORS, "expert_cache_mode": mode}),
                    manifest("s", job))
    assert set(C.compare_paths(base, new, CHECKS).table["verdict"]) == {"not comparable"}
    # rows of the new side that did not record it (null) are not a second value of it
    mixed = tmp_path / "new3" / "sweeps" / "s"
    rows = job_rows("s", "0", samples(1000, 5, 3), factors={**FACTORS, "expert_cache_mode": "cold"})
    rows += R.make_rows(FACTORS, DEVICE, "s", "0", 0, "load", {"time_s": 1.0}, "client", extra={"profiler": "none"})
    R.write_job(mixed / "0", rows, manifest("s", "0"))
    t = C.compare_paths(base, mixed, CHECKS).table
    assert set(t[t["phase"] == "load"]["note"]) == {"only in new: base ran this config but recorded no "
                                                    "load.time_s (client)"}         # the base has no load rows
    assert "not comparable" not in set(t[t["phase"] != "load"]["verdict"]) and set(t[t["phase"] != "load"]["n_base"]) == {5}


def test_a_cache_given_in_bytes_is_its_own_config(tmp_path: Path) -> None:
    """cache.capacity_bytes=768KiB and =3MiB are both cache_capacity "bytes": the bytes tell them apart."""
    sides = {}
    for name, size in (("base", "3MiB"), ("new", "768KiB")):
        f = {**FACTORS, "cache_capacity": "bytes", "cache_capacity_bytes": size}
        sides[name] = write(tmp_path / name, "s", samples(1000, 5, 0), factors=f)
    assert set(C.compare_paths(sides["base"], sides["new"], CHECKS).table["verdict"]) == {"not comparable"}


def test_a_side_without_manifests_is_compared_with_a_note(tmp_path: Path) -> None:
    """A results file alone (no job dirs beside it) is compared on its device, with a note that the
    host CPU and engine version went unchecked; beside its sweep's job dirs it finds their manifests."""
    base = write(tmp_path / "b", "s", samples(1000, 5, 0))
    write_sweep_table(base)                                       # the sweep's results.parquet beside its job dirs
    lone = tmp_path / "lone" / "rows.parquet"
    lone.parent.mkdir()
    lone.write_bytes((base / "0" / "rows.parquet").read_bytes())
    cmp = C.compare_paths(lone, write(tmp_path / "n", "s", samples(1000, 5, 1)), CHECKS)
    compared = cmp.table[cmp.table["verdict"] != "not comparable"]
    assert len(compared) == len(cmp.table) > 0
    assert compared["note"].str.contains("no manifest on base").all()
    beside = C.compare_paths(base / "results.parquet", write(tmp_path / "n2", "s", samples(1000, 5, 1)), CHECKS)
    assert len(beside.table) and not beside.table["note"].str.contains("no manifest").any()


@pytest.mark.parametrize("change, why", [
    ({"device": {**DEVICE, "device_kind": "cuda", "device_name": "NVIDIA H200", "emulated": False}}, "device differs"),
    ({"cpu": "Intel Xeon"}, "device differs"),
    ({"version": "0.2.0"}, "engine version differs"),
])
def test_device_or_engine_version_change_is_not_comparable(tmp_path: Path, change: dict, why: str) -> None:
    base = write(tmp_path / "base", "s", samples(1000, 5, 0))
    new = write(tmp_path / "new", "s", samples(500, 5, 1), **change)
    cmp = C.compare_paths(base, new, CHECKS)
    assert set(cmp.table["verdict"]) == {"not comparable"}
    assert all(n.startswith(why) for n in cmp.table["note"])
    assert len(cmp.regressions) == 0


def test_another_llamacpp_build_is_not_comparable(tmp_path: Path) -> None:
    """llama.cpp's version is its build commit (a row column), as transformers' is its package version."""
    sides = {}
    for name, commit in (("base", "0c1e57098"), ("new", "bc64a43d2")):
        sweep = tmp_path / name / "sweeps" / "s"
        R.write_job(sweep / "0", job_rows("s", "0", samples(500, 5, 0),
                                          factors={**FACTORS, "engine": "llamacpp", "llamacpp_commit": commit}),
                    manifest("s", "0"))
        sides[name] = sweep
    cmp = C.compare_paths(sides["base"], sides["new"], ["kv_offload.time_s:+10%", *CHECKS])
    assert set(cmp.table["verdict"]) == {"not comparable"}
    assert all(n.startswith("engine version differs") and "llama.cpp 0c1e57098" in n for n in cmp.table["note"])


@pytest.mark.slow
def test_git_commit_is_not_a_reason(tmp_path: Path) -> None:
    base = write(tmp_path / "base", "s", samples(1000, 5, 0))
    new = tmp_path / "new" / "sweeps" / "s"
    R.write_job(new / "0", job_rows("s", "0:placement=fetch", samples(1000, 5, 1)),
                manifest("s", "0:placement=fetch", commit="b" * 40))
    cmp = C.compare_paths(base, new, CHECKS)
    assert "not comparable" not in set(cmp.table["verdict"])
    assert "aaaaaaaaaa" in cmp.markdown() and "bbbbbbbbbb" in cmp.markdown()


@pytest.mark.slow
def test_small_samples_fall_back_to_confidence_intervals() -> None:
    # 3 + 3: Mann-Whitney cannot go below p = 0.1, so the t-interval rule decides
    assert C.min_mwu_p(3, 3) == pytest.approx(0.1) and C.min_mwu_p(4, 4) < 0.05
    sig, p, test = C.difference([1000, 1010, 990], [800, 805, 795])
    assert (sig, p, test) == (True, None, "ci")
    sig, _, test = C.difference([1000, 1100, 900], [980, 1080, 900])
    assert (sig, test) == (False, "ci")
    assert C.difference([1000], [500]) == (False, None, "too few")
    assert C.difference([5.0] * 3, [5.0] * 3)[0] is False            # exact counters, unchanged
    assert C.difference([5.0] * 3, [6.0] * 3) == (True, None, "constant")
    # one sample is never significant, however many the other side has (a U test would give p < 0.05)
    assert C.difference([1000], samples(500, 40, 0)) == (False, None, "too few")
    assert C.difference(samples(500, 40, 0), [5.0]) == (False, None, "too few")


def test_check_parsing() -> None:
    c = C.Check.parse("decode.tok_per_s:-5%")
    assert (c.phase, c.metric, c.threshold) == ("decode", "tok_per_s", -0.05) and str(c) == "decode.tok_per_s:-5%"
    assert c.verdict(0.90, True) == "regression" and c.verdict(0.90, False) == "inconclusive"
    assert c.verdict(0.97, True) == "ok" and c.verdict(1.10, True) == "improvement"
    up = C.Check.parse("*.h2d_bytes:+1%")
    assert up.matches("prefill_fresh", "h2d_bytes") and up.verdict(1.5, True) == "regression"
    # a change of exactly the threshold is not beyond it (exact counters: 1.01e6 / 1e6 - 1 > 0.01 in floats)
    assert up.verdict(1_010_000 / 1_000_000, True) == "ok" and up.verdict(1_010_001 / 1_000_000, True) == "regression"
    assert c.verdict(950 / 1000, True) == "ok" and c.verdict(949 / 1000, True) == "regression"
    assert up.verdict(990_000 / 1_000_000, True) == "ok" and up.verdict(989_999 / 1_000_000, True) == "improvement"
    for bad in ("decode.tok_per_s", "decode.tok_per_s:5%", "nophase.tok_per_s:-5%", "decode.nometric:-5%",
                "decode.tok_per_s:-0%"):
        with pytest.raises(C.CompareError):
            C.Check.parse(bad)
    assert compare_main(["a", "b", "--check", "decode.tok_per_s"]) == 2


def test_machine_name(tmp_path: Path) -> None:
    m = manifest("s", "0")
    assert C.machine_name(m) == "linux-x86_64-amd-epyc-2c"
    m["gpu"]["name"] = "NVIDIA H200"
    m["host"]["cpu_model"] = "Intel(R) Xeon(R) Platinum 8480+ CPU @ 2.00GHz"
    assert C.machine_name(m) == "linux-x86_64-intel-xeon-platinum-8480-2c-nvidia-h200"
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "manifest.json").write_text(json.dumps(m))
    row = C.read_manifests(tmp_path).iloc[0].to_dict()        # the read_manifests form: same name
    assert C.machine_name(row) == "linux-x86_64-intel-xeon-platinum-8480-2c-nvidia-h200"
    assert C.machine_name().startswith(("linux-", "darwin-", "windows-"))


@pytest.mark.slow
def test_committed_baseline_matches_its_machine_dir() -> None:
    """results/baselines/<machine>/ holds a real regression sweep recorded on <machine>."""
    root = Path(__file__).resolve().parents[2] / "results" / "baselines"
    machines = [p for p in root.iterdir() if p.is_dir()]
    assert machines, "no committed baseline under results/baselines/"
    for machine in machines:
        df = R.load(machine)
        assert (df["status"] == "ok").all() and df["repeat"].max() >= 4      # >= 5 repeats: MWU applies
        man = C.read_manifests(machine)
        assert len(man) == df[["sweep_id", "job_id"]].drop_duplicates().shape[0]
        for _, m in man.iterrows():
            assert C.machine_name(m.to_dict()) == machine.name
        # a baseline compared with itself: all comparable, nothing significant
        cmp = C.compare(df, df, CHECKS, base_manifests=man, new_manifests=man)
        assert "not comparable" not in set(cmp.table["verdict"]) and not cmp.table["significant"].any()


@pytest.mark.slow
def test_cli_with_nothing_comparable_exits_3_unless_allowed(tmp_path: Path, capsys) -> None:
    base = write(tmp_path / "base", "s", samples(1000, 5, 0))
    new = write(tmp_path / "new", "s", samples(1000, 5, 1), factors={**FACTORS, "cache_capacity": "2"})
    assert compare_main([str(base), str(new)]) == 3
    out = capsys.readouterr()
    assert "INCOMPLETE (exit 3): nothing compared" in out.err and "**INCOMPLETE**" in out.out
    assert "**PASS**" not in out.out
    assert compare_main([str(base), str(new), "--allow-empty"]) == 0
    assert compare_main([str(base), str(base)]) == 0          # something compared, nothing regressed
