"""What the analysis notebooks show beside the figures: where their results are, the tables they
print, and -- where a results set lacks what a cell needs -- a visible line saying what is not
shown and why, instead of a traceback.

Owns: `results_dir` (the notebooks' data, wherever they run from), `load` and `overview` (the
jobs, with every failed one and its error), `show` (run a figure or table function; on
`MissingData` say why nothing is shown), and the notebooks' tables (`decode_table`,
`prefill_table`, `treatment_table`, `failed_jobs`, the simulator-vs-engine tables). Each table
raises `MissingData` naming what it needed, as `harness.plots`' figures do.
Does not own: figures (`harness.plots`), loading and summarising rows (`harness.results`),
the replay simulator (`harness.sim`). Notebooks only read results (DESIGN §1): nothing here
measures or writes.

    from harness import notebook as nb, plots
    RESULTS = nb.results_dir("MOEBENCH_RESULTS")
    df = nb.load(RESULTS)
    nb.overview(df, RESULTS)
    nb.show(plots.capacity_sweep, df)      # the figure, or a line saying why there is none
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from harness import results
from harness.contract import QUALITY_PHASE, profiled_rows, speed_values
from harness.plots import MissingData
from harness.results import CONFIG_COLUMNS

REPO = Path(__file__).resolve().parents[1]
QUALITY_METRICS = ("kl_div_mean", "top1_agreement", "ppl_ratio", "token_agreement")
POLICIES = ("lru", "lfu", "fifo", "static", "belady")


def results_dir(*env_vars: str, default: str = "samples") -> Path:
    """The first of `env_vars` that is set, else this checkout's `results/<default>` (found from
    this module, so a notebook run from any directory finds it)."""
    for name in env_vars:
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    return REPO / "results" / default


def note(markdown: str) -> None:
    """A visible line in the notebook (printed outside one)."""
    try:
        from IPython.display import Markdown, display
    except ImportError:
        print(markdown)
        return
    display(Markdown(markdown))


def _not_shown(why: str) -> None:
    """`why` names what is not shown first ("overlap: no profiler=timeline rows"), as MissingData does."""
    note(f"**Not shown:** {why}")


def load(path: Path) -> pd.DataFrame:
    """`results.load(path)`; where nothing can be read there, an empty table, after saying why."""
    try:
        return results.load(path)
    except (OSError, results.ResultsError) as exc:
        _not_shown(f"any result: nothing could be read from `{path}` ({exc})")
        return pd.DataFrame(columns=[*results.REQUIRED_COLUMNS, "profiler", "error"])


def finished_jobs(df: pd.DataFrame) -> int:
    """Jobs with at least one status-ok row."""
    return df.loc[df["status"] == "ok", ["sweep_id", "job_id"]].drop_duplicates().shape[0]


def show(fn: Callable[..., Any], *args: Any, what: str | None = None, **kw: Any) -> Any:
    """`fn(*args, **kw)` (a figure or a table, for the cell to display), or None after a visible
    line saying why it is not shown: no job finished, or the `MissingData` `fn` raised. A
    DataFrame among `args` with no finished job is reason enough, without calling `fn`."""
    what = what or fn.__name__.replace("_", " ")
    tables = [a for a in args if isinstance(a, pd.DataFrame) and "status" in a.columns]
    if tables and not any(finished_jobs(t) for t in tables):
        failed = sum(t.loc[t["status"] == "failed", ["sweep_id", "job_id"]].drop_duplicates().shape[0]
                     for t in tables)
        _not_shown(f"{what}: no job finished ({failed} failed; the errors are listed above), nothing to show")
        return None
    try:
        return fn(*args, **kw)
    except MissingData as exc:
        _not_shown(str(exc))
        return None


# ----------------------------------------------------------------------------- jobs

def _varying(df: pd.DataFrame, always: Sequence[str] = ("placement",)) -> list[str]:
    """The config columns that tell the jobs of `df` apart (`always` kept)."""
    return [c for c in CONFIG_COLUMNS if c in df.columns and (c in always or df[c].nunique(dropna=True) > 1)]


def failed_jobs(df: pd.DataFrame) -> pd.DataFrame:
    """One row per failed job (or failed part of a job): what tells it apart, the phase that
    failed, and the first line of its error."""
    failed = df[df["status"] == "failed"]
    if failed.empty:
        raise MissingData("failed jobs: none, every job finished")
    error = failed["error"] if "error" in failed.columns else pd.Series(pd.NA, index=failed.index)
    failed = failed.assign(error=error.astype("string").str.split("\n").str[0])
    cols = [*_varying(df), "phase", "error", "job_id"]
    return failed.drop_duplicates(["sweep_id", "job_id", "phase"])[cols].reset_index(drop=True)


def overview(df: pd.DataFrame, path: Path) -> pd.DataFrame | None:
    """Say what `df` holds -- jobs finished and failed, placements, contexts, device -- and list
    the failed jobs with their errors; returns that list (None when no job failed)."""
    jobs = df[["sweep_id", "job_id"]].drop_duplicates()
    ok = finished_jobs(df)
    shown = path.resolve().relative_to(REPO) if path.resolve().is_relative_to(REPO) else path
    note(f"**{len(jobs)} jobs** from `{shown}`: {ok} finished, {len(jobs) - ok} failed; "
         f"placements {sorted(df['placement'].dropna().unique().tolist())}; "
         f"contexts {sorted(df['context_tokens'].dropna().unique().tolist())}; "
         f"device {sorted(df['device_name'].dropna().unique().tolist()) or 'not recorded (no job reached it)'}"
         + ("; **emulated device** (CPU stands in for the GPU: no link speeds, device memory null)"
            if all_emulated(df) else ""))
    if len(jobs) and not ok:
        note("**No job finished**: every figure and table below says so instead of showing one.")
    if len(jobs) == ok:
        return None
    return failed_jobs(df)


def all_emulated(df: pd.DataFrame) -> bool:
    """Whether every row of `df` ran on the CPU-emulated device (False for an empty table)."""
    return "emulated" in df.columns and len(df) > 0 and bool(df["emulated"].astype("boolean").fillna(False).all())


def metrics_by_phase(df: pd.DataFrame) -> pd.DataFrame:
    """How many metrics each (profiler, phase) of the finished jobs recorded."""
    ok = df[df["status"] == "ok"]
    if ok.empty:
        raise MissingData("metrics per phase: no status-ok rows")
    return ok.groupby(["profiler", "phase"])["metric"].nunique().unstack("phase")


# ----------------------------------------------------------------------------- tables

def decode_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per finished job: decode tok/s and p50 per-token latency (client), host->device MiB and
    hit rate (engine), medians over repeats."""
    summary = results.summarize(df)
    decode = summary[(summary["phase"] == "decode") & (summary["status"] == "ok")]
    client, engine = decode[decode["source"] == "client"], decode[decode["source"] == "engine"]
    if client.empty:
        raise MissingData("decode table: no measured decode rows (source=client)")
    table = client.merge(engine[["sweep_id", "job_id", "h2d_bytes", "hit_rate"]], on=["sweep_id", "job_id"],
                         how="left", suffixes=("", "_engine"))
    table = table.assign(h2d_MiB=table["h2d_bytes_engine"] / 2**20, hit_rate=table["hit_rate_engine"])
    cols = [*_varying(table), "n_repeats", "tok_per_s", "tpot_s_p50", "h2d_MiB", "hit_rate"]
    return table[[c for c in cols if c in table.columns]].sort_values(_varying(table)).reset_index(drop=True)


def prefill_table(df: pd.DataFrame) -> pd.DataFrame:
    """TTFT (client, median over repeats) per config and prefill phase."""
    summary = results.summarize(df)
    ttft = summary[summary["phase"].str.startswith("prefill") & (summary["source"] == "client")
                   & (summary["status"] == "ok")]
    if ttft.empty or "ttft_s" not in ttft.columns or ttft["ttft_s"].isna().all():
        raise MissingData("TTFT table: no measured prefill rows with ttft_s (source=client)")
    index = [c for c in _varying(ttft) if c != "cache_policy"] or ["job_id"]
    return ttft.pivot_table(index=index, columns="phase", values="ttft_s", dropna=False).dropna(how="all")


def treatment_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per finished job: the treatment, the resolved slots, decode hit rate and tok/s (medians
    over repeats) and the quality metrics of its quality pass (missing where it ran none)."""
    ok = df[df["status"] == "ok"]
    if ok.empty:
        raise MissingData("treatment table: no status-ok rows")
    speed = results.summarize(df)
    decode = speed[(speed["phase"] == "decode") & (speed["status"] == "ok")]
    hit = decode[decode["source"] == "engine"].set_index("job_id")["hit_rate"] if "hit_rate" in decode else None
    rate = decode[decode["source"] == "client"].set_index("job_id")["tok_per_s"] if "tok_per_s" in decode else None
    first = ok.groupby("job_id").first()
    cols = [c for c in ("context_tokens", "kv_dtype", "expert_quant", "resolved_capacity", "lossy") if c in first]
    table = first[cols]
    for name, series in (("decode hit rate", hit), ("decode tok/s", rate)):
        if series is not None:
            table = table.join(series.rename(name))
    quality = profiled_rows(df, QUALITY_PHASE)                      # the quality pass's rows say profiler=quality
    if not quality.empty:
        wide = quality.pivot_table(index="job_id", columns="metric", values="value")
        table = table.join(wide[[c for c in QUALITY_METRICS if c in wide.columns]])
    return table.sort_values([c for c in ("context_tokens", "kv_dtype", "expert_quant") if c in table.columns])


# ----------------------------------------------------------------------------- simulator vs engine

def routing_traces(root: Path) -> list[Path]:
    """The routing traces (`routing.npz`) under `root`; says so when there are none."""
    traces = sorted(root.rglob("routing.npz")) if root.is_dir() else []
    if traces:
        note(f"{len(traces)} routing trace(s) under `{root.name}`")
    else:
        note(f"No routing trace under `{root}` (a sweep with `run.record_trace=true` writes one per job): the "
             "simulated curves of the recorded routing and the engine points on them are not shown.")
    return traces


def simulated_curves(traces: Sequence[Path], policies: Sequence[str] = POLICIES) -> pd.DataFrame:
    """Every policy's hit rate at every capacity from top_k to all experts, replayed over each
    trace (one per context length), with the one-pass LRU curve checked against the replay."""
    from engine.trace import load_trace
    from harness.sim.replay import lru_curve, replay
    if not traces:
        raise MissingData("simulated curves: no routing.npz (run a sweep with run.record_trace=true)")
    curves = []
    for path in traces:
        job = results.load(path.parent)
        ctx = int(job["context_tokens"].dropna().iloc[0])
        tr = load_trace(path)
        sim = replay(tr, list(policies), list(range(tr.top_k, tr.n_experts + 1)))
        one_pass = lru_curve(tr).query("layer == 'all'").hit_rate.to_numpy()
        if not np.allclose(sim[(sim.policy == "lru") & (sim.layer == "all")].hit_rate.to_numpy(), one_pass):
            raise AssertionError(f"{path}: the one-pass LRU curve differs from the LRU replay")
        curves.append(sim.assign(context_tokens=ctx, model=tr.meta.get("model")))
    return pd.concat(curves, ignore_index=True)


def curve_table(sim: pd.DataFrame | None) -> pd.DataFrame:
    """Hit rate over all layers per context, capacity and policy."""
    if sim is None or sim.empty:
        raise MissingData("curve table: no simulated curves (see above)")
    return sim[sim.layer == "all"].pivot_table(index=["context_tokens", "capacity"], columns="policy",
                                               values="hit_rate").round(3)


def measured_on_curves(df: pd.DataFrame, sim: pd.DataFrame | None) -> pd.DataFrame:
    """The engine's hit rate of each trace-recording repeat, at the contexts `sim` covers."""
    from harness.plots import measured_hit_rates
    if sim is None or sim.empty:
        raise MissingData("engine points: no simulated curves to put them on (see above)")
    measured = measured_hit_rates(df)
    return measured[measured["context_tokens"].isin(sim["context_tokens"].unique())]


def curves_figure(sim: pd.DataFrame | None, measured: pd.DataFrame | None, emulated: bool = False) -> Any:
    """The simulated curves, one panel per context, with the engine's points on them where measured."""
    from harness.plots import hit_rate_curves
    if sim is None or sim.empty:
        raise MissingData("hit-rate curves: no simulated curves (see above)")
    return hit_rate_curves(sim, measured, facet="context_tokens", emulated=emulated)


def engine_vs_simulator(df: pd.DataFrame, sim: pd.DataFrame | None) -> pd.DataFrame:
    """Each engine point beside the simulator's hit rate at its policy, capacity and context,
    and their difference (`diff`; exactly 0 where the two agree)."""
    measured = measured_on_curves(df, sim)
    sim_all = sim[sim.layer == "all"].rename(columns={"policy": "cache_policy", "hit_rate": "sim_hit_rate",
                                                       "lookups": "sim_lookups"})
    check = measured.merge(sim_all, on=["cache_policy", "capacity", "context_tokens"], how="left")
    check = check.assign(diff=check["hit_rate"] - check["sim_hit_rate"])
    return check[["context_tokens", "cache_policy", "capacity", "lookups", "sim_lookups", "hit_rate",
                  "sim_hit_rate", "diff"]]


def decode_hit_rates(df: pd.DataFrame) -> pd.DataFrame:
    """The speed repeats' decode hit rate (median over repeats) per context and cache capacity."""
    rows = speed_values(df)
    rows = rows[(rows.phase == "decode") & (rows.metric == "hit_rate") & rows["value"].notna()]
    if rows.empty:
        raise MissingData("decode hit rates: no measured decode hit_rate (a placement with an expert cache)")
    return rows.groupby(["context_tokens", "cache_capacity"])["value"].median().unstack("cache_capacity").round(3)
