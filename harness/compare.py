"""Compare two result sets: per (config, phase, metric) medians, ratio, significance, regressions.

Owns: matching the configurations of a BASE and a NEW result set, deciding whether a pair
can be compared at all, the significance test, declarative regression checks
(`decode.tok_per_s:-5%`), the comparison table and its markdown report (a CI job summary),
and the machine name under which baselines are filed (`machine_name`).
Does not own: reading results (`harness.results.load`), the manifest's contents
(`harness.manifest`), or the command line (`harness.analysis_cli`, `moebench-compare`).

    from harness import compare
    cmp = compare.compare_paths("results/baselines/<machine>", "results/sweeps/regression",
                                checks=["decode.tok_per_s:-5%", "prefill_fresh.ttft_s:+10%"])
    print(cmp.markdown())             # report; cmp.table is the DataFrame; cmp.failed -> exit 1

Rules, so that a red CI job can be argued with:

* **Samples.** Only status-ok rows of un-instrumented runs (`profiler` "none" or null,
  DESIGN §7.7) with a non-null value. The samples of a (config, phase, metric, source) are
  its raw per-repeat values, pooled over every job of that config in the set.
* **Config.** `results.CONFIG_COLUMNS` (the swept factors plus every column a job adds that
  tells settings apart: placement options, ubatch, token source, expert-cache start, threads,
  llama.cpp's configuration, GGUF type and knobs), where present. A column only one side has
  splits the configs only where it varies on that side (a side written before the column
  existed ran one setting of it). A config present on one side only is *not comparable*.
* **Not comparable** also when the pair ran on different devices -- `device_kind`,
  `device_name`, `emulated`, and the host CPU model and available cores from the manifest
  (on the CPU the emulated device *is* the host CPU; on a GPU the `cpu` placement runs on
  it) -- or with a different engine version (`ENGINE_VERSIONS`): the `moebench` package
  version for engine=moebench, the `transformers` version for engine=hf, the llama.cpp build
  commit for engine=llamacpp, and the results schema version. The git commit is *not* a
  reason: it is what a regression check is testing. It is shown in the report. A side without
  manifests is compared, with a note.
* **Significance.** Two-sided, level `alpha` (default 0.05). Mann-Whitney U (exact for
  small samples, `scipy.stats.mannwhitneyu`) when the smallest p-value it can give,
  2 / C(n_base + n_new, n_base), is below `alpha`: at 0.05 that needs 4 repeats a side
  (3 + 3 cannot go below p = 0.1), or e.g. 3 + 5. With fewer samples, and at least 2 a
  side, the pessimistic fallback: significant only when the two 95% t confidence
  intervals of the mean do not overlap (as asv does). With 1 sample on a side nothing is
  significant. Two constant samples differ significantly when their values differ
  (counters and bytes are exact).
* **Checks.** `PHASE.METRIC:-X%` says a *decrease* beyond X% is a regression (rates);
  `PHASE.METRIC:+X%` an *increase* beyond X% (times, bytes). `*` matches any phase. A
  check applies to every comparable config with that phase and metric (every source). Its
  verdict per config: `regression` (significant and beyond the threshold in the bad
  direction), `improvement` (significant and beyond it the other way), `inconclusive`
  (beyond the threshold but not significant), `ok` otherwise; `not comparable` for pairs
  that cannot be compared. The comparison fails when any check has a regression (and,
  with `require_comparable`, when a check matched no comparable pair).
"""
from __future__ import annotations

import json
import logging
import math
import os
import platform
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from harness import results
from harness.contract import ALL_PHASES, speed_values
from harness.results import CONFIG_COLUMNS, MANIFEST_FILE

log = logging.getLogger(__name__)

__all__ = ["Check", "Comparison", "CompareError", "CONFIG_COLUMNS", "compare", "compare_paths", "difference", "min_mwu_p",
           "read_manifests", "machine_name", "speed_samples"]

ALPHA = 0.05
# an engine's version, as (name, column): another version is another engine; moebench's otherwise
ENGINE_VERSIONS = {"hf": ("transformers", "transformers_version"), "llamacpp": ("llama.cpp", "llamacpp_commit")}
KEY_COLUMNS = ("phase", "metric", "source")
VERDICTS = ("regression", "improvement", "inconclusive", "ok", "not comparable")
_CHECK_RE = re.compile(r"^(?P<phase>[\w*]+)\.(?P<metric>\w+):(?P<sign>[+-])(?P<pct>\d+(?:\.\d+)?)%$")


class CompareError(ValueError):
    """A check string, a path or a result set that cannot be compared."""


# ----------------------------------------------------------------------------- checks

@dataclass(frozen=True)
class Check:
    """`decode.tok_per_s:-5%`: a decrease of more than 5% is a regression."""

    phase: str
    metric: str
    threshold: float          # signed fraction: -0.05 = "a decrease beyond 5% is bad"

    @classmethod
    def parse(cls, text: str) -> "Check":
        m = _CHECK_RE.match(text.strip())
        if not m:
            raise CompareError(f"check {text!r}: expected PHASE.METRIC:+X% or PHASE.METRIC:-X% "
                               f"(e.g. decode.tok_per_s:-5%, prefill_fresh.ttft_s:+10%); "
                               f"phases: {list(ALL_PHASES)} or *")
        phase, metric = m["phase"], m["metric"]
        if phase != "*" and phase not in ALL_PHASES:
            raise CompareError(f"check {text!r}: phase {phase!r} unknown; allowed {list(ALL_PHASES)} or *")
        if metric not in results.METRIC_UNITS:
            raise CompareError(f"check {text!r}: metric {metric!r} unknown; allowed {sorted(results.METRIC_UNITS)}")
        pct = float(m["pct"])
        if pct <= 0:
            raise CompareError(f"check {text!r}: the threshold must be above 0%")
        return cls(phase, metric, (-1 if m["sign"] == "-" else 1) * pct / 100)

    def matches(self, phase: str, metric: str) -> bool:
        return metric == self.metric and self.phase in ("*", phase)

    def verdict(self, ratio: float, significant: bool) -> str:
        change = ratio - 1
        t = self.threshold
        # beyond, not at: a change of exactly X% (exact counters: 1.01e6 / 1e6 - 1 > 0.01 in floating point) is not beyond X%
        at = math.isclose(abs(change), abs(t), rel_tol=1e-9)
        bad = not at and (change < t if t < 0 else change > t)
        good = not at and (change > -t if t < 0 else change < -t)
        if bad:
            return "regression" if significant else "inconclusive"
        if good and significant:
            return "improvement"
        return "ok"

    def __str__(self) -> str:
        return f"{self.phase}.{self.metric}:{'+' if self.threshold > 0 else '-'}{abs(self.threshold) * 100:g}%"


# ----------------------------------------------------------------------------- statistics

def min_mwu_p(n_a: int, n_b: int) -> float:
    """Smallest two-sided p-value an exact Mann-Whitney U test can give for these sizes."""
    return min(1.0, 2.0 / math.comb(n_a + n_b, n_a))


def difference(a: Sequence[float], b: Sequence[float], alpha: float = ALPHA) -> tuple[bool, float | None, str]:
    """(significant, p-value or None, test used: "mwu" | "ci" | "constant" | "too few").

    See the module docstring for the rule."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(a) < 1 or len(b) < 1:
        return False, None, "too few"
    if len(a) < 2 or len(b) < 2:                   # one sample on a side: never significant (1 vs 40: p < 0.05)
        return False, None, "too few"
    if np.ptp(a) == 0 and np.ptp(b) == 0:
        return bool(a[0] != b[0]), None, "constant"
    if min_mwu_p(len(a), len(b)) < alpha:
        from scipy.stats import mannwhitneyu
        p = float(mannwhitneyu(a, b, alternative="two-sided").pvalue)
        return p < alpha, p, "mwu"
    lo_a, hi_a = _t_interval(a)
    lo_b, hi_b = _t_interval(b)
    return bool(hi_a < lo_b or hi_b < lo_a), None, "ci"


def _t_interval(x: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    from scipy.stats import t
    half = t.ppf(0.5 + level / 2, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x))
    return float(x.mean() - half), float(x.mean() + half)


# ----------------------------------------------------------------------------- manifests

def read_manifests(path: str | os.PathLike[str]) -> pd.DataFrame:
    """One row per job manifest under `path` (or beside a results file): the facts compare
    needs -- host, CPU, GPU, git commit, engine versions -- keyed by (sweep_id, job_id)."""
    root = Path(path)
    # beside a results file: its job's manifest, or a sweep table's jobs' manifests in the dirs beside it
    files = sorted((root.parent if root.is_file() else root).rglob(MANIFEST_FILE))
    rows = []
    for file in files:
        try:
            m = json.loads(file.read_text())
        except (OSError, ValueError) as exc:
            log.warning("%s: unreadable manifest (%s); ignored", file, exc)
            continue
        if not isinstance(m, dict) or "sweep_id" not in m or "job_id" not in m:
            continue
        host, gpu, git, pkgs = (m.get(k) or {} for k in ("host", "gpu", "git", "packages"))
        rows.append({"sweep_id": str(m["sweep_id"]), "job_id": str(m["job_id"]),
                     "host": host.get("hostname"), "cpu_model": host.get("cpu_model"),
                     "cpu_cores": host.get("cpu_cores_available") or host.get("cpu_cores_logical"),
                     "platform": host.get("platform"), "arch": host.get("machine"),
                     "gpu_name": gpu.get("name"), "git_commit": git.get("commit"), "git_dirty": git.get("dirty"),
                     "schema_version": m.get("schema_version"), "moebench_version": pkgs.get("moebench"),
                     "transformers_version": pkgs.get("transformers"), "torch_version": pkgs.get("torch"),
                     "created": m.get("created")})
    cols = ["sweep_id", "job_id", "host", "cpu_model", "cpu_cores", "platform", "arch", "gpu_name", "git_commit",
            "git_dirty", "schema_version", "moebench_version", "transformers_version", "torch_version", "created"]
    return pd.DataFrame(rows, columns=cols).drop_duplicates(["sweep_id", "job_id"]).reset_index(drop=True)


def machine_name(manifest: Mapping[str, Any] | None = None) -> str:
    """The directory name a baseline is filed under: OS, architecture, CPU model, available
    cores, and the GPU when there is one -- e.g. `linux-x86_64-amd-epyc-2c` or
    `linux-x86_64-amd-epyc-16c-nvidia-h200`. From a manifest row/dict (`read_manifests`
    columns or a raw manifest), or this machine when None."""
    if manifest is None:
        from harness.manifest import gpu_info, host_info
        host, gpu = host_info(), gpu_info()
        system, arch, cpu = platform.system(), host.get("machine"), host.get("cpu_model")
        cores, gpu_name = host.get("cpu_cores_available") or host.get("cpu_cores_logical"), gpu.get("name")
    elif "host" in manifest and isinstance(manifest["host"], Mapping):
        host, gpu = manifest["host"], manifest.get("gpu") or {}
        system, arch, cpu = str(host.get("platform") or "").split("-")[0], host.get("machine"), host.get("cpu_model")
        cores, gpu_name = host.get("cpu_cores_available") or host.get("cpu_cores_logical"), gpu.get("name")
    else:
        system, arch, cpu = str(manifest.get("platform") or "").split("-")[0], manifest.get("arch"), manifest.get("cpu_model")
        cores, gpu_name = manifest.get("cpu_cores"), manifest.get("gpu_name")
    known = lambda v: v is not None and not (isinstance(v, float) and math.isnan(v)) and v != ""  # noqa: E731
    parts = [system or "unknown-os", arch if known(arch) else "unknown-arch", _cpu_slug(cpu if known(cpu) else None)]
    if known(cores) and cores:
        parts.append(f"{int(cores)}c")
    if known(gpu_name):
        parts.append(str(gpu_name))
    return "-".join(p for p in (_slug(p) for p in parts) if p)


def _cpu_slug(cpu: str | None) -> str:
    if not cpu:
        return "unknown-cpu"
    cpu = re.sub(r"\((r|tm)\)|\bcpu\b|@.*$|\bprocessor\b|\b\d+-core\b", " ", cpu, flags=re.IGNORECASE)
    return cpu


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9_]+", "-", str(text).lower()).strip("-")


# ----------------------------------------------------------------------------- comparison

speed_samples = speed_values     # the rows a comparison reads (harness.contract)


@dataclass
class Comparison:
    """The comparison table plus what the report says about the two sides."""

    table: pd.DataFrame
    checks: list[Check]
    base: dict[str, Any] = field(default_factory=dict)
    new: dict[str, Any] = field(default_factory=dict)
    alpha: float = ALPHA
    require_comparable: bool = False

    @property
    def regressions(self) -> pd.DataFrame:
        return self.table[self.table["verdict"] == "regression"]

    @property
    def unmatched_checks(self) -> list[Check]:
        """Checks that matched no comparable pair."""
        t = self.table[(self.table["check"] != "") & (self.table["verdict"] != "not comparable")]
        applied = {c for joined in t["check"] for c in joined.split(", ")}
        return [c for c in self.checks if str(c) not in applied]

    @property
    def failed(self) -> bool:
        return bool(len(self.regressions)) or (self.require_comparable and bool(self.unmatched_checks))

    def markdown(self, max_rows: int = 200) -> str:
        """The report: verdict first, then checks, regressions, not comparable, all changes."""
        return _render(self, max_rows)


def compare(base: pd.DataFrame, new: pd.DataFrame, checks: Iterable[Check | str] = (), *,
            base_manifests: pd.DataFrame | None = None, new_manifests: pd.DataFrame | None = None,
            alpha: float = ALPHA, require_comparable: bool = False) -> Comparison:
    """Compare two loaded result sets (see the module docstring for every rule)."""
    checks = [c if isinstance(c, Check) else Check.parse(c) for c in checks]
    if not 0 < alpha < 1:
        raise CompareError(f"alpha must be in (0, 1); got {alpha}")
    sides = {}
    for name, df, man in (("base", base, base_manifests), ("new", new, new_manifests)):
        sides[name] = _side(speed_samples(df), man)
    cfg_cols = [c for c in CONFIG_COLUMNS if _splits(c, sides["base"], sides["new"])]
    groups = {name: _groups(side, cfg_cols) for name, side in sides.items()}
    facts = {name: _facts(side, cfg_cols) for name, side in sides.items()}
    rows = []
    for key in sorted(set(groups["base"]) | set(groups["new"]), key=lambda k: tuple(map(str, k))):
        config, (phase, metric, source) = key[:len(cfg_cols)], key[len(cfg_cols):]
        a, b = groups["base"].get(key), groups["new"].get(key)
        row = {**dict(zip(cfg_cols, config)), "phase": phase, "metric": metric, "source": source,
               "unit": results.METRIC_UNITS.get(metric, ""),
               "n_base": 0 if a is None else len(a), "n_new": 0 if b is None else len(b),
               "median_base": None if a is None else float(np.median(a)),
               "median_new": None if b is None else float(np.median(b)),
               "ratio": None, "p_value": None, "test": "", "significant": False,
               "check": ", ".join(str(c) for c in checks if c.matches(phase, metric)), "verdict": "", "note": ""}
        why = _not_comparable(config, a, b, facts)
        if why:
            row.update(verdict="not comparable", note=why)
        else:
            row["ratio"] = _ratio(row["median_base"], row["median_new"])
            sig, p, test = difference(a, b, alpha)
            row.update(significant=sig, p_value=p, test=test, note=_notes(config, facts))
            matched = [c for c in checks if c.matches(phase, metric)]
            if matched:
                verdicts = [c.verdict(row["ratio"], sig) for c in matched]
                row["verdict"] = min(verdicts, key=VERDICTS.index)
        rows.append(row)
    columns = ["config", *cfg_cols, "phase", "metric", "source", "unit", "n_base", "n_new", "median_base",
               "median_new", "ratio", "p_value", "test", "significant", "check", "verdict", "note"]
    table = pd.DataFrame(rows, columns=[c for c in columns if c != "config"])
    table.insert(0, "config", _labels(table, cfg_cols))
    return Comparison(table, checks, _summary(sides["base"]), _summary(sides["new"]), alpha, require_comparable)


def compare_paths(base: str | os.PathLike[str], new: str | os.PathLike[str], checks: Iterable[Check | str] = (),
                  **kw: Any) -> Comparison:
    """`compare` on two result paths (job dir, sweep dir, tree or one Parquet file)."""
    loaded = {}
    for name, path in (("base", base), ("new", new)):
        try:
            loaded[name] = results.load(path)
        except (FileNotFoundError, results.ResultsError) as exc:
            raise CompareError(f"{name} {path}: {exc}") from exc
    cmp = compare(loaded["base"], loaded["new"], checks, base_manifests=read_manifests(base),
                  new_manifests=read_manifests(new), **kw)
    cmp.base["path"], cmp.new["path"] = str(base), str(new)
    return cmp


# ----------------------------------------------------------------------------- helpers

def _side(df: pd.DataFrame, manifests: pd.DataFrame | None) -> pd.DataFrame:
    df = df.copy()
    for c in CONFIG_COLUMNS:
        if c in df.columns:
            df[c] = df[c].astype("string").fillna("<na>")
    man = manifests if manifests is not None and len(manifests) else None
    if man is not None:   # a fact the rows already carry (e.g. a `host` column) wins over the manifest's
        man = man.drop(columns=[c for c in man.columns if c in df.columns and c not in ("sweep_id", "job_id")])
        df = df.merge(man, on=["sweep_id", "job_id"], how="left")
    for c in ("cpu_model", "cpu_cores", "gpu_name", "git_commit", "git_dirty", "schema_version", "moebench_version",
              "transformers_version", "llamacpp_commit", "torch_version", "host"):
        if c not in df.columns:
            df[c] = None
    return df


def _splits(col: str, base: pd.DataFrame, new: pd.DataFrame) -> bool:
    """Whether config column `col` tells configs apart: both sides have it, or the one side that
    has it holds more than one value of it (a null -- rows that did not record it -- is not one)."""
    have = [df for df in (base, new) if col in df.columns]
    return len(have) == 2 or (len(have) == 1 and have[0][col][have[0][col] != "<na>"].nunique() > 1)


def _groups(df: pd.DataFrame, cfg_cols: list[str]) -> dict[tuple, np.ndarray]:
    for c in cfg_cols:
        if c not in df.columns:
            df[c] = "<na>"
    return {k: g["value"].to_numpy(dtype=float) for k, g in df.groupby([*cfg_cols, *KEY_COLUMNS], sort=False)}


def _facts(df: pd.DataFrame, cfg_cols: list[str]) -> dict[tuple, dict[str, set]]:
    """Per config: the set of device identities, engine versions and commits seen."""
    out: dict[tuple, dict[str, set]] = {}
    for key, g in df.groupby(cfg_cols, sort=False):
        key = key if isinstance(key, tuple) else (key,)
        engine = g["engine"].iloc[0] if "engine" in g.columns else "moebench"
        name, version_col = ENGINE_VERSIONS.get(engine, ("moebench", "moebench_version"))
        devices = list(g.drop_duplicates(["device_kind", "device_name", "emulated", "cpu_model", "cpu_cores"]).itertuples())
        out[key] = {
            "device": {_device_id(r) for r in devices},
            "device_only": {_device_id(r, host=False) for r in devices},
            "version": {f"{name} {v}" for v in g[version_col].dropna().unique()},
            "schema": {str(v) for v in g["schema_version"].dropna().unique()},
            "commit": {f"{str(c)[:10]}{'+dirty' if d else ''}" for c, d in
                       g[["git_commit", "git_dirty"]].dropna(subset=["git_commit"]).itertuples(index=False)},
            "manifest": {bool(g["cpu_model"].notna().any() or g["moebench_version"].notna().any())},
        }
    return out


def _device_id(r: Any, host: bool = True) -> str:
    """The device a row ran on, and with `host` the host CPU its manifest names ('?' when it names none)."""
    emu = " (emulated)" if (pd.notna(r.emulated) and bool(r.emulated)) else ""
    if not host:
        return f"{r.device_kind}:{r.device_name}{emu}"
    model = r.cpu_model if pd.notna(r.cpu_model) and r.cpu_model else "?"
    cpu = f"{model} x{int(r.cpu_cores)}" if pd.notna(r.cpu_cores) and r.cpu_cores else model
    return f"{r.device_kind}:{r.device_name}{emu} on {cpu}"


def _not_comparable(config: tuple, a: np.ndarray | None, b: np.ndarray | None, facts: dict) -> str:
    if a is None or b is None:
        return f"only in {'new' if a is None else 'base'}"
    fb, fn = facts["base"][config], facts["new"][config]
    # a side with no manifest names no host CPU: its device alone is checked (`_notes` says so)
    device = "device_only" if {False} in (fb["manifest"], fn["manifest"]) else "device"
    for what, label in ((device, "device differs"), ("version", "engine version differs"),
                        ("schema", "results schema differs")):
        if fb[what] and fn[what] and fb[what] != fn[what]:
            return f"{label}: base {sorted(fb[what])} vs new {sorted(fn[what])}"
    return ""


def _notes(config: tuple, facts: dict) -> str:
    missing = [s for s in ("base", "new") if facts[s][config]["manifest"] == {False}]
    return f"no manifest on {' and '.join(missing)}: device CPU and engine version unchecked" if missing else ""


def _ratio(base: float, new: float) -> float:
    if base == 0:
        return 1.0 if new == 0 else math.copysign(math.inf, new)
    return new / base


def _labels(table: pd.DataFrame, cfg_cols: list[str]) -> list[str]:
    """Short config labels: the config columns that vary, placement always."""
    if table.empty:
        return []
    varying = [c for c in cfg_cols if table[c].nunique(dropna=False) > 1 or c == "placement"]
    out = []
    for r in table[varying].itertuples(index=False):
        out.append(" ".join(f"{c}={v}" for c, v in zip(varying, r) if v != "<na>"))
    return out


def _summary(side: pd.DataFrame) -> dict[str, Any]:
    def uniq(col: str) -> list[str]:
        return sorted({str(v) for v in side[col].dropna().unique()}) if col in side.columns else []
    return {"jobs": int(side[["sweep_id", "job_id"]].drop_duplicates().shape[0]) if len(side) else 0,
            "sweeps": uniq("sweep_id"), "commits": sorted({c[:10] for c in uniq("git_commit")}),
            "dirty": bool(side["git_dirty"].fillna(False).astype(bool).any()) if "git_dirty" in side else False,
            "devices": sorted({_device_id(r) for r in side.drop_duplicates(
                ["device_kind", "device_name", "emulated", "cpu_model", "cpu_cores"]).itertuples()}) if len(side) else [],
            "hosts": uniq("host"), "moebench": uniq("moebench_version"), "torch": uniq("torch_version")}


# ----------------------------------------------------------------------------- report

_REPORT_COLUMNS = ("config", "phase", "metric", "source", "n_base", "n_new", "median_base", "median_new", "ratio",
                   "p_value", "test", "check", "verdict", "note")


def _render(cmp: Comparison, max_rows: int) -> str:
    t = cmp.table
    regress = cmp.regressions
    status = (f"**FAIL** -- {len(regress)} regression(s)" if len(regress) else "**PASS** -- no regression")
    if cmp.require_comparable and cmp.unmatched_checks:
        status = (f"**FAIL** -- checks with nothing comparable: {', '.join(map(str, cmp.unmatched_checks))}"
                  + (f"; {len(regress)} regression(s)" if len(regress) else ""))
    lines = ["# moebench comparison", "", status, ""]
    for name, side in (("base", cmp.base), ("new", cmp.new)):
        commits = ", ".join(side.get("commits") or ["unknown"]) + (" (dirty)" if side.get("dirty") else "")
        lines.append(f"- **{name}**: `{side.get('path', '')}` -- {side.get('jobs', 0)} job(s), commit {commits}, "
                     f"moebench {', '.join(side.get('moebench') or ['?'])}, torch {', '.join(side.get('torch') or ['?'])}; "
                     f"device {'; '.join(side.get('devices') or ['?'])}")
    lines += ["", f"Rule: Mann-Whitney U (two-sided, alpha={cmp.alpha:g}) when the sample sizes allow p < alpha "
                  "(4+ repeats a side), else non-overlap of 95% t intervals (2-3 a side); 1 sample: never significant. "
                  "Medians over un-instrumented repeats; ratio = new / base.", ""]
    if cmp.checks:
        lines += ["## Checks", "", "| check | compared | regression | improvement | inconclusive | ok | not comparable |",
                  "|---|---|---|---|---|---|---|"]
        for c in cmp.checks:
            sub = t[t["check"].map(lambda joined, c=c: str(c) in joined.split(", "))]
            counts = {v: int((sub["verdict"] == v).sum()) for v in VERDICTS}
            compared = len(sub) - counts["not comparable"]
            lines.append(f"| `{c}` | {compared} | {counts['regression']} | {counts['improvement']} | "
                         f"{counts['inconclusive']} | {counts['ok']} | {counts['not comparable']} |")
        lines.append("")
    else:
        lines += ["No checks given: nothing gates; significant changes are listed below.", ""]
    if len(regress):
        lines += ["## Regressions", "", _md_table(regress, max_rows), ""]
    checked = t[(t["check"] != "") & (t["verdict"] != "not comparable") & (t["verdict"] != "regression")]
    if len(checked):
        lines += ["<details><summary>Checked metrics without a regression ({})</summary>".format(len(checked)), "",
                  _md_table(checked, max_rows), "", "</details>", ""]
    nc = t[t["verdict"] == "not comparable"]
    if len(nc):
        reasons = nc.groupby("note")["config"].nunique()
        lines += ["## Not comparable", ""]
        lines += [f"- {why} ({n} config(s))" for why, n in reasons.items()]
        lines.append("")
    changed = t[t["significant"] & (t["check"] == "")]
    if len(changed):
        lines += ["<details><summary>Other significant changes, unchecked ({})</summary>".format(len(changed)), "",
                  _md_table(changed, max_rows), "", "</details>", ""]
    return "\n".join(lines)


def _md_table(df: pd.DataFrame, max_rows: int) -> str:
    cols = [c for c in _REPORT_COLUMNS if c in df.columns]
    head = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)
    body = ["| " + " | ".join(_fmt(r[c]) for c in cols) + " |" for _, r in df.head(max_rows).iterrows()]
    more = [f"\n... {len(df) - max_rows} more rows in the table file"] if len(df) > max_rows else []
    return "\n".join([head, *body, *more])


def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, (bool, np.bool_)):
        return "yes" if v else "no"
    if isinstance(v, (float, np.floating)):
        return f"{v:.4g}"
    return str(v).replace("|", "\\|")
