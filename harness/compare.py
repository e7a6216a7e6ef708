"""Compare two result sets: per (config, phase, metric) medians, ratio, significance, a verdict.

Owns: matching the configurations of a BASE and a NEW result set, deciding whether a pair
can be compared at all, the comparison table, its verdict (`Comparison.verdict`, with the
exit code `moebench-compare` returns for it), the rules below, and the machine name under
which baselines are filed (`machine_name`).
Does not own: the significance test and the declarative regression checks
(`decode.tok_per_s:-5%`) that apply the rules (`harness.compare_checks`), reading results
(`harness.results.load`), the manifest's contents (`harness.manifest`; a model's identity:
`harness.model_id`), the markdown report (`harness.compare_report`), or the command line
(`harness.analysis_cli`, `moebench-compare`).

    from harness import compare
    cmp = compare.compare_paths("results/baselines/<machine>", "results/sweeps/regression",
                                checks=["decode.tok_per_s:-5%", "prefill_fresh.ttft_s:+10%"])
    print(cmp.verdict, cmp.markdown())  # PASS | FAIL | INCOMPLETE | INCONCLUSIVE; cmp.table is the DataFrame

Rules, so that a red CI job can be argued with:

* **Samples.** Only status-ok rows of un-instrumented runs (`profiler` "none" or null,
  DESIGN §7.7) with a non-null value. The samples of a (config, phase, metric, source) are
  its raw per-repeat values, pooled over every job of that config in the set. A serve pass's
  measured requests (phase `serve`, warm-up ones left out) are samples too: one per request of
  its per-request metrics (`serve.ttft_s`, `serve.tpot_s`, `serve.e2el_s`, ...).
* **Config.** `results.CONFIG_COLUMNS` (the swept factors plus every column a job adds that
  tells settings apart: placement options, ubatch, token source, expert-cache start, threads,
  llama.cpp's configuration, GGUF type and knobs), where present. A column only one side has
  splits the configs only where it varies on that side (a side written before the column
  existed ran one setting of it). A config present on one side only is *not comparable*; its
  note names the config columns in which the other side's nearest configs differ, with both
  values (`only in base: placement_options differs: base {...} vs new {...}`), or the metric
  the other side did not record for that config.
* **Model.** A pair is of one model. Its identity is the manifest's (`harness.model_id`): a
  preset's name, seed and truncation, a checkpoint's content hash -- never its path, nor the
  `model` column, which for a checkpoint is only the `model.name` label. It is part of the
  config; a config whose counterpart on the other side differs only in the model is *not
  comparable*, "model differs", naming both. A checkpoint whose manifest records no content
  hash is not comparable (which model it was is unknown). A side without manifests is paired
  by the `model` column, with a note.
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
  (counters and bytes are exact). That is `stat_significant`.
* **Practical floor.** A change is *significant* (`significant`: what the report lists
  among the other significant changes and the command line counts) only when it is
  `stat_significant` and at least `min_change` (default `MIN_CHANGE`, 2%) of the base median:
  a 0.1% shift of a peak RSS can be statistically certain and still mean nothing. Checks keep
  their own thresholds and test against `stat_significant`.
* **Checks.** `PHASE.METRIC:-X%` says a *decrease* beyond X% is a regression (rates);
  `PHASE.METRIC:+X%` an *increase* beyond X% (times, bytes). `*` matches any phase. A
  check applies to every comparable config with that phase and metric (every source). Its
  verdict per config: `regression` (statistically significant and beyond the threshold in the
  bad direction), `improvement` (significant and beyond it the other way), `inconclusive`
  (beyond the threshold in the bad direction but not significant), `ok` otherwise;
  `not comparable` for pairs that cannot be compared.
* **Verdict** of the comparison, the first that holds (`moebench-compare` exits with its code):
  - `FAIL` (1): a check has a regression.
  - `INCOMPLETE` (3): nothing was compared; or a config of the base has no comparable
    counterpart in the new set (missing there, another model, device or engine version); or
    a checked metric of a base config has none; or a check matched no comparable pair.
  - `INCONCLUSIVE` (4): a check went beyond its threshold without significance (too few
    repeats, or too much noise), or every pair a check applied to had too few samples
    (fewer than 2 a side) to be tested at all, or -- checks or none -- no compared pair has
    2 samples on each side (one repeat a side: nothing could have been significant).
  - `PASS` (0): none of these: every base config compared, every check applied, none beyond
    its threshold. (Exit code 2 is the command line's: bad arguments or unreadable results.)
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from harness import results
from harness.compare_checks import (ALPHA, EXIT_CODES, VERDICTS, Check, CompareError, difference, min_mwu_p,
                                    unit_of)
from harness.compare_manifests import UNRECORDED, machine_name, read_manifests
from harness.compare_report import render
from harness.contract import served_request_values, speed_values
from harness.results import CONFIG_COLUMNS

__all__ = ["Check", "Comparison", "CompareError", "CONFIG_COLUMNS", "EXIT_CODES", "compare", "compare_paths",
           "difference", "min_mwu_p", "read_manifests", "machine_name", "speed_samples"]

MIN_CHANGE = 0.02            # the practical floor: a smaller relative change is never listed as significant
# an engine's version, as (name, column): another version is another engine; moebench's otherwise
ENGINE_VERSIONS = {"hf": ("transformers", "transformers_version"), "llamacpp": ("llama.cpp", "llamacpp_commit")}
KEY_COLUMNS = ("phase", "metric", "source")
MODEL_COLUMNS = ("model", "model_id")
NA = "<na>"


# ----------------------------------------------------------------------------- comparison

def speed_samples(df: pd.DataFrame) -> pd.DataFrame:
    """The rows a comparison reads (harness.contract): the speed rows, and each measured request of
    a serve pass as one sample of its per-request metrics (phase `serve`)."""
    return pd.concat([speed_values(df), served_request_values(df)], ignore_index=True)


@dataclass
class Comparison:
    """The comparison table, its verdict, and what the report says about the two sides."""

    table: pd.DataFrame
    checks: list[Check]
    base: dict[str, Any] = field(default_factory=dict)
    new: dict[str, Any] = field(default_factory=dict)
    alpha: float = ALPHA
    min_change: float = MIN_CHANGE

    @property
    def regressions(self) -> pd.DataFrame:
        return self.table[self.table["verdict"] == "regression"]

    @property
    def compared(self) -> pd.DataFrame:
        return self.table[self.table["verdict"] != "not comparable"]

    @property
    def unmatched_checks(self) -> list[Check]:
        """Checks that matched no comparable pair."""
        t = self.compared[self.compared["check"] != ""]
        applied = {c for joined in t["check"] for c in joined.split(", ")}
        return [c for c in self.checks if str(c) not in applied]

    def incomplete_reasons(self) -> list[str]:
        """Why the comparison is INCOMPLETE (empty when it is not); see the module docstring."""
        t, compared = self.table, self.compared
        out = []
        if compared.empty:
            out.append(f"nothing compared ({len(t)} pair(s), none comparable)" if len(t)
                       else "nothing compared (no (config, phase, metric) in either set)")
        done = set(compared["config"])
        in_base = t[t["n_base"] > 0]
        for cfg, g in in_base[~in_base["config"].isin(done)].groupby("config", sort=True):
            out.append(f"base config `{cfg or '(the only one)'}` has no comparable counterpart: "
                       + "; ".join(sorted(set(g["note"]))))
        lost = in_base[(in_base["check"] != "") & (in_base["verdict"] == "not comparable") & in_base["config"].isin(done)]
        for r in lost.itertuples():
            out.append(f"{r.check}: `{r.config}` {r.phase}.{r.metric} ({r.source}) is not comparable: {r.note}")
        out += [f"check {c} matched no comparable pair" for c in self.unmatched_checks]
        return out

    def inconclusive_reasons(self) -> list[str]:
        """Why the comparison is INCONCLUSIVE (empty when it is not); see the module docstring."""
        checked = self.compared[self.compared["check"] != ""]
        out = [f"{r.check}: `{r.config}` {r.phase}.{r.metric} ({r.source}) x{r.ratio:.3g} is beyond the threshold "
               f"but not significant ({r.test}, {r.n_base} + {r.n_new} samples)"
               for r in checked[checked["verdict"] == "inconclusive"].itertuples()]
        compared = self.compared
        if len(compared) and (compared["test"] == "too few").all():
            out.append(f"every compared pair ({len(compared)}) has fewer than 2 samples on a side: nothing could be "
                       "significant (run.repeats >= 2 on both sides)")
        elif len(checked) and (checked["test"] == "too few").all():
            out.append(f"every checked pair ({len(checked)}) has fewer than 2 samples on a side: nothing could be "
                       "significant (run more repeats)")
        return out

    @property
    def verdict(self) -> str:
        """FAIL | INCOMPLETE | INCONCLUSIVE | PASS: the first that holds (module docstring)."""
        if len(self.regressions):
            return "FAIL"
        if self.incomplete_reasons():
            return "INCOMPLETE"
        return "INCONCLUSIVE" if self.inconclusive_reasons() else "PASS"

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    @property
    def failed(self) -> bool:
        """A check has a regression (verdict FAIL)."""
        return self.verdict == "FAIL"

    def markdown(self, max_rows: int = 200) -> str:
        """The report: verdict and its reasons first, then checks, regressions, not comparable, changes."""
        return render(self, max_rows)


def compare(base: pd.DataFrame, new: pd.DataFrame, checks: Iterable[Check | str] = (), *,
            base_manifests: pd.DataFrame | None = None, new_manifests: pd.DataFrame | None = None,
            alpha: float = ALPHA, min_change: float = MIN_CHANGE) -> Comparison:
    """Compare two loaded result sets (see the module docstring for every rule)."""
    checks = [c if isinstance(c, Check) else Check.parse(c) for c in checks]
    if not 0 < alpha < 1:
        raise CompareError(f"alpha must be in (0, 1); got {alpha}")
    if not (min_change >= 0 and math.isfinite(min_change)):
        raise CompareError(f"min_change must be a fraction >= 0 (0.02 = 2%); got {min_change}")
    sides = {}
    for name, df, man in (("base", base, base_manifests), ("new", new, new_manifests)):
        sides[name] = _side(speed_samples(df), man)
    cfg_cols = [c for c in CONFIG_COLUMNS if _splits(c, sides["base"], sides["new"])]
    if all((side["model_id"] != NA).any() for side in sides.values()):     # both sides know their models
        cfg_cols.insert(cfg_cols.index("model") + 1 if "model" in cfg_cols else 0, "model_id")
    groups = {name: _groups(side, cfg_cols) for name, side in sides.items()}
    facts = {name: _facts(side, cfg_cols) for name, side in sides.items()}
    configs = {name: {k[:len(cfg_cols)] for k in g} for name, g in groups.items()}
    rows = []
    for key in sorted(set(groups["base"]) | set(groups["new"]), key=lambda k: tuple(map(str, k))):
        config, (phase, metric, source) = key[:len(cfg_cols)], key[len(cfg_cols):]
        a, b = groups["base"].get(key), groups["new"].get(key)
        row = {**dict(zip(cfg_cols, config)), "phase": phase, "metric": metric, "source": source,
               "unit": unit_of(metric) or "",
               "n_base": 0 if a is None else len(a), "n_new": 0 if b is None else len(b),
               "median_base": None if a is None else float(np.median(a)),
               "median_new": None if b is None else float(np.median(b)),
               "ratio": None, "p_value": None, "test": "", "stat_significant": False, "significant": False,
               "check": ", ".join(str(c) for c in checks if c.matches(phase, metric)), "verdict": "", "note": ""}
        if a is None or b is None:
            present = "base" if b is None else "new"
            why = (_model_change(config, present, configs, facts, cfg_cols)
                   or _missing_counterpart(config, (phase, metric, source), present, configs, cfg_cols))
        else:
            why = _not_comparable(dict(zip(cfg_cols, config)), facts)
        if why:
            row.update(verdict="not comparable", note=why)
        else:
            row["ratio"] = _ratio(row["median_base"], row["median_new"])
            sig, p, test = difference(a, b, alpha)
            row.update(stat_significant=sig, significant=sig and abs(row["ratio"] - 1) >= min_change * (1 - 1e-9),
                       p_value=p, test=test, note=_notes(config, facts))
            matched = [c for c in checks if c.matches(phase, metric)]
            if matched:
                verdicts = [c.verdict(row["ratio"], sig) for c in matched]
                row["verdict"] = min(verdicts, key=VERDICTS.index)
        rows.append(row)
    columns = ["config", *cfg_cols, "phase", "metric", "source", "unit", "n_base", "n_new", "median_base",
               "median_new", "ratio", "p_value", "test", "stat_significant", "significant", "check", "verdict", "note"]
    table = pd.DataFrame(rows, columns=[c for c in columns if c != "config"])
    table.insert(0, "config", _labels(table, cfg_cols))
    return Comparison(table, checks, _summary(sides["base"]), _summary(sides["new"]), alpha, min_change)


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
            df[c] = df[c].astype("string").fillna(NA)
    man = manifests if manifests is not None and len(manifests) else None
    if man is not None:   # a fact the rows already carry (e.g. a `host` column) wins over the manifest's
        man = man.drop(columns=[c for c in man.columns if c in df.columns and c not in ("sweep_id", "job_id")])
        df = df.merge(man, on=["sweep_id", "job_id"], how="left")
    for c in ("cpu_model", "cpu_cores", "gpu_name", "git_commit", "git_dirty", "schema_version", "moebench_version",
              "transformers_version", "llamacpp_commit", "torch_version", "host", "model_id", "model_path"):
        if c not in df.columns:
            df[c] = None
    df["model_id"] = df["model_id"].astype("string").fillna(NA)     # no manifest: the model is unidentified
    return df

def _splits(col: str, base: pd.DataFrame, new: pd.DataFrame) -> bool:
    """Whether config column `col` tells configs apart: both sides have it, or the one side that
    has it holds more than one value of it (a null -- rows that did not record it -- is not one)."""
    have = [df for df in (base, new) if col in df.columns]
    return len(have) == 2 or (len(have) == 1 and have[0][col][have[0][col] != NA].nunique() > 1)


def _groups(df: pd.DataFrame, cfg_cols: list[str]) -> dict[tuple, np.ndarray]:
    for c in cfg_cols:
        if c not in df.columns:
            df[c] = NA
    return {k: g["value"].to_numpy(dtype=float) for k, g in df.groupby([*cfg_cols, *KEY_COLUMNS], sort=False)}


def _facts(df: pd.DataFrame, cfg_cols: list[str]) -> dict[tuple, dict[str, set]]:
    """Per config: the set of device identities, engine versions, commits and models seen."""
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
            "models": {_model_name(r) for r in g.drop_duplicates(["model", "model_id", "model_path"]).itertuples()},
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


def _model_name(r: Any) -> str:
    """A row's model as the report names it: its label, and its identity where a manifest gave one."""
    label = getattr(r, "model", NA)
    if r.model_id == NA:
        return f"{label} (identity not recorded: no manifest)"
    where = f" at {r.model_path}" if isinstance(r.model_path, str) and UNRECORDED not in r.model_id else ""
    return f"{label}: {r.model_id}{where}"


def _model_change(config: tuple, present: str, configs: dict, facts: dict, cfg_cols: list[str]) -> str:
    """'model differs: ...' for a config of side `present` that the other side lacks while it has
    one that differs from it only in the model ("" otherwise)."""
    other = "new" if present == "base" else "base"
    if config in configs[other]:            # the config is there: only this phase or metric is missing
        return ""
    keep = [i for i, c in enumerate(cfg_cols) if c not in MODEL_COLUMNS]
    same = [c for c in configs[other] if all(c[i] == config[i] for i in keep)]
    if not same:
        return ""
    mine = sorted(facts[present][config]["models"])
    theirs = sorted({m for c in same for m in facts[other][c]["models"]})
    base, new = (mine, theirs) if present == "base" else (theirs, mine)
    return f"model differs: base {base} vs new {new}"


def _missing_counterpart(config: tuple, key: tuple[str, str, str], present: str, configs: dict,
                         cfg_cols: list[str]) -> str:
    """Why a (config, phase, metric, source) of side `present` has no counterpart, naming what differs:
    the other side ran the config but not this metric; or the config columns in which the other
    side's nearest configs (fewest columns apart) differ, with both values ("(not recorded)": a
    column the rows leave null)."""
    other = "new" if present == "base" else "base"
    phase, metric, source = key
    if config in configs[other]:
        return f"only in {present}: {other} ran this config but recorded no {phase}.{metric} ({source})"
    if not configs[other]:
        return f"only in {present}: {other} has no speed rows"
    apart = {c: [i for i, col in enumerate(cfg_cols) if c[i] != config[i]] for c in configs[other]}
    fewest = min(len(cols) for cols in apart.values())
    nearest = [c for c, cols in apart.items() if len(cols) == fewest]
    shown = lambda v: "(not recorded)" if v == NA else str(v)  # noqa: E731
    parts = []
    for i in sorted({i for c in nearest for i in apart[c]}):
        mine, theirs = shown(config[i]), " or ".join(sorted({shown(c[i]) for c in nearest}))
        base, new = (mine, theirs) if present == "base" else (theirs, mine)
        parts.append(f"{cfg_cols[i]} differs: base {base} vs new {new}")
    return f"only in {present}: " + "; ".join(parts)


def _not_comparable(config: Mapping[str, str], facts: dict) -> str:
    """Why a pair present on both sides cannot be compared ("" when it can): an unidentified model,
    another device, engine version or results schema."""
    if config.get("model_id", "").endswith(UNRECORDED):
        return (f"model unknown: {config['model_id'].removesuffix(UNRECORDED)} has no content hash in its "
                "manifest, so whether the two sides ran the same model cannot be told")
    key = tuple(config.values())
    fb, fn = facts["base"][key], facts["new"][key]
    # a side with no manifest names no host CPU: its device alone is checked (`_notes` says so)
    device = "device_only" if {False} in (fb["manifest"], fn["manifest"]) else "device"
    for what, label in ((device, "device differs"), ("version", "engine version differs"),
                        ("schema", "results schema differs")):
        if fb[what] and fn[what] and fb[what] != fn[what]:
            return f"{label}: base {sorted(fb[what])} vs new {sorted(fn[what])}"
    return ""


def _notes(config: tuple, facts: dict) -> str:
    missing = [s for s in ("base", "new") if facts[s][config]["manifest"] == {False}]
    return (f"no manifest on {' and '.join(missing)}: device CPU, engine version and model identity unchecked"
            if missing else "")


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
        out.append(" ".join(f"{c}={v}" for c, v in zip(varying, r) if v != NA))
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


