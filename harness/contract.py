"""The measurement contract in one place (DESIGN.md §4-§7): phase names and their one order,
metric names and units, which rows make a speed table, the session length a job needs, which
config keys are cosmetic, and where moebench caches what it derives.

Owns: these decisions, as constants and tiny pure functions that every other module imports.
Does not own: measuring (harness.scenario), storing (harness.results), or printing
(harness.report). Nothing here imports torch, Hydra or the engine.

    from harness.contract import PHASES, speed_rows, session_tokens
    df = speed_rows(results.load("results/sweeps/s1"))
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

# --- phases (§4), in the order a job runs them -------------------------------------------------
PHASES = ("load", "prefill_fresh", "decode", "prefill_continuation", "prefill_restored")
MEASURED_PHASES = PHASES[1:]                      # the phases a scenario repeat produces
PREFILL_PHASES = ("prefill_fresh", "prefill_continuation", "prefill_restored")
# beyond §4: the displacement of a session's KV to host RAM between the continuation and the
# restored turn; its own phase, so its d2h bytes and time are recorded but are no prefill's
OFFLOAD_PHASE = "kv_offload"
FAILED_PHASE = "job"                              # the phase of the row a failed job records
QUALITY_PHASE = "quality"                         # a treatment's quality vs the exact reference (harness.quality)
SERVE_PHASE = "serve"                             # requests under a load: the serve pass's phase and profiler label
ALL_PHASES = (*PHASES, OFFLOAD_PHASE, QUALITY_PHASE, SERVE_PHASE)

# the KV state each phase starts from (rule 7.2: a prefix-cache hit is never a fresh prefill)
PREFIX_CACHE = {"load": "none", "prefill_fresh": "none", "decode": "device", "prefill_continuation": "device",
                OFFLOAD_PHASE: "device", "prefill_restored": "restored"}


# the expert-cache state a phase starts from (`expert_cache` column); run.expert_cache picks it for
# prefill_fresh, later phases start from what the earlier ones left (warm)
EXPERT_CACHE_STATES = ("cold", "warm")


def phase_rank(phase: str) -> int:
    """Sort key: the contract's order, then unknown phases, then the failed-job phase."""
    if phase in ALL_PHASES:
        return ALL_PHASES.index(phase)
    return len(ALL_PHASES) + (phase == FAILED_PHASE)


# --- metrics (§5) ------------------------------------------------------------------------------
METRIC_UNITS: dict[str, str] = {
    "time_s": "s",
    "tokens": "count",
    "tok_per_s": "tok/s",
    "ttft_s": "s",
    "tpot_s_p50": "s",
    "tpot_s_p90": "s",
    "tpot_s_p99": "s",
    "reused_tokens": "count",
    "restore_s": "s",
    "h2d_bytes": "B",
    "d2h_bytes": "B",
    "h2d_expert_bytes": "B",
    "h2d_activation_bytes": "B",
    "h2d_kv_bytes": "B",
    "d2h_expert_bytes": "B",
    "d2h_activation_bytes": "B",
    "d2h_kv_bytes": "B",
    "expert_hits": "count",
    "expert_misses": "count",
    "expert_hit_bytes": "B",
    "expert_miss_bytes": "B",
    "hit_rate": "ratio",
    "byte_hit_rate": "ratio",
    "copy_busy_s": "s",
    "overlap_s": "s",
    "exposed_copy_s": "s",
    "overlap_frac": "ratio",
    "link_gbps": "GB/s",
    "peak_device_bytes": "B",
    "peak_device_reserved_bytes": "B",
    "peak_host_rss_bytes": "B",
    # CPU time of the process doing a phase's work, and its share of the threads it was allowed
    # (harness.measure.starvation; the `starved` row column is judged from them)
    "cpu_time_s": "s",
    "cpu_util": "ratio",
    "max_abs_logit_diff": "-",
    "token_agreement": "ratio",
    "roofline_tok_per_s": "tok/s",     # the physical bound (source=model, harness.roofline)
    "frac_of_roofline": "ratio",
    "predicted_tok_per_s": "tok/s",    # the cost model's trace-free prediction (source=model, the prediction pass)
    "prediction_residual": "ratio",    # measured median / predicted - 1
    # beyond §5: prefetch accounting, the emulated device's accounted peak, the paired ablation
    "prefetch_issued": "count",
    "prefetch_used": "count",
    "prefetch_wasted_bytes": "B",
    "emulated_device_peak_bytes": "B",
    "exposed_copy_ablation_s": "s",
    "exposed_copy_ablation_ci_low_s": "s",
    "exposed_copy_ablation_ci_high_s": "s",
    "exposed_copy_ablation_significant": "bool",
    "exposed_copy_ablation_p_value": "-",
    # engines that report what they saved and their own top-k logprobs (llama.cpp)
    "saved_state_bytes": "B",
    "device_used_bytes": "B",          # device memory a process holds at the end of a phase (NVML; not a peak)
    "max_abs_logprob_diff": "-",
    # quality of a lossy treatment vs the exact reference (QUALITY_PHASE; §5's kl_div as mean and max)
    "kl_div_mean": "nat",              # mean over positions of KL(reference || treatment), full vocabulary
    "kl_div_max": "nat",               # the largest position's
    "top1_agreement": "ratio",         # positions whose argmax equals the reference's
    "ppl_ratio": "ratio",              # perplexity of the prompt text, treatment / reference
    "quality_positions": "count",      # positions the quality metrics are over
}

# how copy/compute overlap measured on the emulated device is labelled wherever it is shown (rule 7.8):
# its copies are memcpys on a worker thread, its "device compute" is the main thread
EMULATED_OVERLAP_NOTE = ("emulated device: copies are memcpys on a worker thread and compute is the main thread's "
                         "layer time -- a thread schedule, not a PCIe prediction")

# the numerical check of every measured phase against the exact reference (§5)
CHECK_METRICS = ("max_abs_logit_diff", "token_agreement")

# --- lossy treatments and their quality (§3, §5) ---------------------------------------------------
# A treatment is a factor column (kv_dtype, expert_quant); a job running one is `lossy=true`
# (row column and manifest). Its quality is measured against the exact reference on the same
# prompt in its own phase, `quality` (harness.quality): teacher-forced over the prompt's
# positions and the reference's greedy continuation, so every position compares the same
# prefix. Exact runs report it too and read kl 0, agreement 1, ratio 1. Its rows say
# profiler=quality: a pass of its own, never a speed row.
QUALITY_METRICS = ("kl_div_mean", "kl_div_max", "top1_agreement", "ppl_ratio", "max_abs_logit_diff",
                   "token_agreement", "quality_positions")


# --- which rows form a speed table (rule 7.5) ------------------------------------------------------
SPEED_PROFILER = "none"     # the `profiler` value of un-instrumented measurement rows


def is_speed_row(profiler: "pd.Series") -> "pd.Series":
    """Mask of rows from un-instrumented runs (a missing `profiler` counts as un-instrumented)."""
    return profiler.isna() | (profiler == SPEED_PROFILER)


def profiled_rows(df: "pd.DataFrame", profiler: str = SPEED_PROFILER) -> "pd.DataFrame":
    """The status-ok rows measured with `profiler` attached ("timeline", "torch", ...);
    `SPEED_PROFILER` (the default) selects the speed rows, where a missing `profiler` column or
    value counts as un-instrumented."""
    ok = df[df["status"] == "ok"]
    if "profiler" not in ok.columns:
        return ok if profiler == SPEED_PROFILER else ok.iloc[0:0]
    if profiler == SPEED_PROFILER:
        return ok[is_speed_row(ok["profiler"])]
    return ok[ok["profiler"] == profiler]


def speed_rows(df: "pd.DataFrame") -> "pd.DataFrame":
    """The status-ok rows measured with no instrumentation attached: what speed tables, summaries,
    plots, the cost model's validation and compare read (DESIGN.md rule 7.5)."""
    return profiled_rows(df, SPEED_PROFILER)


# a served request's rows that say what it was, not how it went: never a sample of a comparison
SERVE_FLAGS = ("warmup", "failed")


def served_summary_rows(df: "pd.DataFrame") -> "pd.DataFrame":
    """The serve pass's status-ok rows that are not one request's: each job's window summary
    (source client) and its engine's batch counters (source engine)."""
    rows = profiled_rows(df, SERVE_PHASE)
    return rows[rows["request_id"].isna()] if "request_id" in rows.columns else rows


def served_request_values(df: "pd.DataFrame") -> "pd.DataFrame":
    """The serve pass's per-request rows of its measured requests (warm-up ones left out) that hold
    a value: each request one sample of its metric (what compare reads beside the speed rows)."""
    rows = profiled_rows(df, SERVE_PHASE)
    if rows.empty or "request_id" not in rows.columns:
        return rows.iloc[0:0]
    rows = rows[rows["request_id"].notna() & rows["value"].notna()]
    keys = ["sweep_id", "job_id", "request_id"]
    warm = rows[(rows["metric"] == "warmup") & (rows["value"] == 1)][keys].drop_duplicates()
    rows = rows.merge(warm.assign(_warm=True), on=keys, how="left")
    return rows[rows["_warm"].isna() & ~rows["metric"].isin(SERVE_FLAGS)].drop(columns="_warm")


def speed_values(df: "pd.DataFrame") -> "pd.DataFrame":
    """Speed rows that hold a value (what plots and comparisons read)."""
    ok = speed_rows(df)
    return ok[ok["value"].notna()]


def repeat_rows(df: "pd.DataFrame") -> "pd.DataFrame":
    """Speed rows of the measured repeats (rows without a repeat -- load, the failed-job row -- left
    out): what medians over repeats and the outlier rule read."""
    ok = speed_rows(df)
    return ok[ok["repeat"].notna()]


# --- the session a job drives (§4) -----------------------------------------------------------------
def session_tokens(context_tokens: int, gen_tokens: int, turn_tokens: int) -> int:
    """KV a scenario needs: the context, the replies, and two further turns (continuation and
    restored), each the pending reply token plus `turn_tokens`."""
    return context_tokens + gen_tokens + 2 * (turn_tokens + 1)


# --- the cache --------------------------------------------------------------------------------------
def cache_root() -> Path:
    """Where moebench keeps what it derives once and reuses (model identities, an engine plugin's
    builds and converted weights): `$MOEBENCH_CACHE`, else `~/.cache/moebench` (never inside the repo)."""
    env = os.environ.get("MOEBENCH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "moebench"


# --- resuming a sweep ---------------------------------------------------------------------------
# run.resume: what to do with a sweep dir that holds a different sweep (harness.sweep.claim_sweep)
RESUME_MODES = ("auto", "add", "replace")

# --- config keys that never change what is measured ---------------------------------------------
# excluded from a job's config hash (resume) and from Hydra's job dir names
COSMETIC_KEYS = ("run.quiet", "run.out", "run.sweep_id", "run.resume", "run.retry_failed")
