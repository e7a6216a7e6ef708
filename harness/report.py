"""User-facing output: progress while a job runs and readable summary tables at the end.

Owns: everything the CLI prints (library code logs instead): a job's steps (`Reporter`, which
reports into the sweep's progress display when its run has one), the sweep's progress
(`SweepProgress`, held by the run's harness.session.RunSession), and the tables. Quiet mode
(run.quiet=true, for CI) prints no progress and no tables, only warnings, errors and the results
path. Text is printed literally (no rich markup), so square brackets in messages survive.
Does not own: numbers (it reads a table and `harness.results.spread_table`).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import pandas as pd
from rich.console import Console
from rich.table import Table
from rich.text import Text

from harness.contract import EMULATED_OVERLAP_NOTE, SERVE_PHASE, phase_rank, served_summary_rows
from harness.results import spread_table

if TYPE_CHECKING:
    from harness.checks import JobCheck
    from harness.outliers import JobFlags

# (metric, label, format, scale) of the speed table and the transfer table
KEY_METRICS = (("time_s", "time s", "{:.4f}", 1), ("ttft_s", "TTFT s", "{:.4f}", 1),
               ("tok_per_s", "tok/s", "{:.1f}", 1), ("tpot_s_p50", "TPOT p50 s", "{:.4f}", 1),
               ("h2d_bytes", "h2d MiB", "{:.2f}", 2**20), ("d2h_bytes", "d2h MiB", "{:.2f}", 2**20),
               ("hit_rate", "hit rate", "{:.3f}", 1), ("reused_tokens", "reused", "{:.0f}", 1),
               ("peak_host_rss_bytes", "host RSS MiB", "{:.0f}", 2**20),
               ("peak_device_bytes", "device MiB", "{:.1f}", 2**20),
               ("max_abs_logit_diff", "max|Δlogit|", "{:.1e}", 1), ("max_abs_logprob_diff", "max|Δlogprob|", "{:.1e}", 1),
               ("token_agreement", "token agr.", "{:.3f}", 1), ("saved_state_bytes", "saved state MiB", "{:.2f}", 2**20),
               ("restore_s", "restore s", "{:.4f}", 1), ("roofline_tok_per_s", "roofline tok/s", "{:.0f}", 1),
               ("frac_of_roofline", "of roofline", "{:.3f}", 1))
TRANSFER_METRICS = (("copy_busy_s", "copy busy s", "{:.4f}", 1), ("overlap_s", "overlap s", "{:.4f}", 1),
                    ("exposed_copy_s", "exposed s", "{:.4f}", 1), ("overlap_frac", "overlap frac", "{:.2f}", 1),
                    ("link_gbps", "link GB/s", "{:.1f}", 1), ("prefetch_issued", "pf issued", "{:.0f}", 1),
                    ("prefetch_used", "pf used", "{:.0f}", 1),
                    ("prefetch_wasted_bytes", "pf wasted MiB", "{:.2f}", 2**20))
QUALITY_TABLE = (("kl_div_mean", "KL mean nat", "{:.2e}", 1), ("kl_div_max", "KL max nat", "{:.2e}", 1),
                 ("top1_agreement", "top-1 agr.", "{:.3f}", 1), ("ppl_ratio", "ppl ratio", "{:.5f}", 1),
                 ("max_abs_logit_diff", "max|Δlogit|", "{:.1e}", 1), ("token_agreement", "token agr.", "{:.3f}", 1),
                 ("quality_positions", "positions", "{:.0f}", 1))
PREDICTION_TABLE = (("predicted_tok_per_s", "predicted tok/s", "{:.1f}", 1),
                    ("prediction_residual", "measured/pred. - 1", "{:+.2f}", 1))
SERVE_TABLE = (("requests", "requests", "{:.0f}", 1), ("completed", "completed", "{:.0f}", 1),
               ("request_throughput", "req/s", "{:.2f}", 1), ("output_throughput", "out tok/s", "{:.1f}", 1),
               ("ttft_s_p50", "TTFT p50 s", "{:.4f}", 1), ("ttft_s_p99", "TTFT p99 s", "{:.4f}", 1),
               ("tpot_s_p50", "TPOT p50 s", "{:.4f}", 1), ("tpot_s_p99", "TPOT p99 s", "{:.4f}", 1),
               ("itl_s_p99", "ITL p99 s", "{:.4f}", 1), ("e2el_s_p99", "E2EL p99 s", "{:.4f}", 1),
               ("request_goodput", "goodput req/s", "{:.2f}", 1), ("slo_met", "SLO met", "{:.0f}", 1),
               ("output_mismatch", "length mismatches", "{:.0f}", 1),
               ("sequences_per_step", "seqs/step", "{:.2f}", 1), ("tokens_per_step", "tokens/step", "{:.1f}", 1),
               ("distinct_experts_per_layer_step", "experts/layer/step", "{:.2f}", 1),
               ("serve_hit_rate", "hit rate", "{:.3f}", 1), ("serve_h2d_bytes", "h2d MiB", "{:.2f}", 2**20),
               ("harness_overhead_s_per_request", "harness s/request", "{:.1e}", 1))
ABLATION_METRICS = (("exposed_copy_ablation_s", "ablation s", "{:.4f}", 1),
                    ("exposed_copy_ablation_ci_low_s", "95% low", "{:.4f}", 1),
                    ("exposed_copy_ablation_ci_high_s", "95% high", "{:.4f}", 1))


IQR_MIN_N = 4


PROGRESS_LOG_EVERY_S = 5.0     # in a log (not a terminal), long-work progress at most this often
LOG_WIDTH = 160                # a log's width (not a terminal): wide enough for the tables


def terminal_console() -> Console:
    """stderr at the terminal's width (COLUMNS, else the terminal's size), so live lines fit it;
    in a log (not a terminal) LOG_WIDTH wide."""
    console = Console(stderr=True)
    return console if console.is_terminal else Console(stderr=True, width=LOG_WIDTH)


class Reporter:
    def __init__(self, quiet: bool = False, sweep: SweepProgress | None = None) -> None:
        self.quiet = quiet
        self.sweep = sweep               # the sweep's progress display, where the job's steps show
        self.console = terminal_console()
        self._step = ""                  # the current step's label
        self._status = None              # its live status line, on a terminal
        self._last_log = 0.0

    def info(self, msg: str) -> None:
        if not self.quiet:
            self.console.print(msg, markup=False, highlight=False)

    def warn(self, msg: str) -> None:
        """Printed even when quiet: a warning about the measurement belongs in CI logs too."""
        self.console.print(Text(msg, style="yellow"))

    @contextmanager
    def step(self, label: str) -> Iterator[None]:
        """A step of the current job (warm-up, repeat k/n, a pass): a status line on a terminal,
        one plain line in a log."""
        self._step = label
        try:
            if self.quiet:
                yield
            elif self.sweep is not None:     # inside a sweep: the sweep's progress shows the step
                self.sweep.step(label)
                yield
            elif not self.console.is_terminal:
                self.console.print(Text(f"  {label}"), soft_wrap=True)
                yield
            else:
                with self.console.status(_line(label)) as status:
                    self._status = status
                    yield
        finally:
            self._step, self._status = "", None

    def progress(self, what: str, done: int, total: int) -> None:
        """Progress of long engine work inside the current step (a big model's load, a long
        prefill): kept up to date on a terminal; in a log, at most every few seconds and at the end."""
        if self.quiet:
            return
        text = f"{self._step}: {what} {done}/{total}" if self._step else f"{what} {done}/{total}"
        live = self.sweep.progress is not None if self.sweep is not None else self._status is not None
        if live:
            if self.sweep is not None:
                self.sweep.step(text)
            else:
                self._status.update(_line(text))
            return
        now = time.perf_counter()
        if done == total or now - self._last_log >= PROGRESS_LOG_EVERY_S:
            self._last_log = now
            self.console.print(Text(f"    {text}"), soft_wrap=True)

    def sweep_table(self, df: pd.DataFrame, title: str) -> None:
        """The end of a sweep: one row per configuration (harness.table), failed jobs with their error."""
        if self.quiet or df.empty:
            return
        from harness.table import COLUMNS, display_rows, notes, sweep_table
        table = sweep_table(df)
        header, rows = display_rows(table)
        metrics = {c.label for c in COLUMNS}
        t = Table(title=Text(f"{title}: median ± half the min-max range over repeats (speed rows only, "
                             "flagged repeats excluded)"), title_justify="left")
        for h in header:
            t.add_column(Text(h), justify="right" if h in metrics else "left", overflow="fold")
        for r in rows:
            t.add_row(*(Text(c) for c in r))
        self.console.print(t)
        for line in notes(table):
            self.console.print(Text(line, style="red" if " FAIL " in line else ""), soft_wrap=True)

    def summary(self, df: pd.DataFrame, title: str) -> None:
        """Per job: the speed table (median, min-max, n over un-instrumented repeats, per phase,
        flagged repeats excluded), its reference check and flagged repeats, the transfer table
        from the instrumented timeline pass when present, the paired ablation, the quality pass
        against the exact reference, the cost model's prediction beside the measurement, and every
        failed job or pass with its error."""
        if self.quiet or df.empty:
            return
        from harness.checks import job_checks
        from harness.outliers import job_flags
        spread = spread_table(df)
        checks, flags = job_checks(df), job_flags(df)
        ok = spread[spread["status"] == "ok"]
        for job_id, job in ok.groupby("job_id", sort=False):
            first = df[df["job_id"] == job_id].iloc[0]
            cap = "—" if pd.isna(first["cache_capacity"]) else first["cache_capacity"]
            head = (f"{title} job {job_id}: {first['engine']} {first['model']} placement={first['placement']} "
                    f"capacity={cap} prefetch={first['prefetch']} {first['workload']}@"
                    f"{first['context_tokens']} batch={first['batch']} "
                    f"{'kv=' + str(first['kv_dtype']) + ' (lossy) ' if first.get('lossy') == True else ''}"  # noqa: E712 (a numpy bool)
                    f"({'emulated ' if first['emulated'] else ''}{first['device_name']})")
            self.console.print(self._table(head, job, KEY_METRICS))
            key = (first["sweep_id"], job_id)
            if line := _check_line(checks.get(key), flags.get(key)):
                self.console.print(Text(line, style="red" if key in checks and checks[key].failed else ""),
                                   soft_wrap=True)
            abl = job[job["metric"].isin([m for m, *_ in ABLATION_METRICS])]
            if not abl.empty and abl["median"].notna().any():
                self.console.print(self._table("paired copy ablation: this placement minus every expert resident "
                                               "(median difference; 95% interval of the sign-flip test, from 6 pairs)",
                                               abl, ABLATION_METRICS, spread=False))
        for job_id, job, tl in _pass_rows(df, "timeline"):
            caption = "transfers (timeline pass, instrumented)"
            if bool(job["emulated"].iloc[0]):
                caption += f" -- {EMULATED_OVERLAP_NOTE}"
            self.console.print(self._table(f"job {job_id} {caption}", tl, TRANSFER_METRICS, spread=False))
        for job_id, job, q in _pass_rows(df, "quality"):
            if q["median"].notna().any():
                self.console.print(self._table(f"job {job_id} quality vs the exact reference (kv_dtype="
                                               f"{job['kv_dtype'].iloc[0]})", q, QUALITY_TABLE, spread=False))
        for job_id, job, sv in _pass_rows(served_summary_rows(df), SERVE_PHASE):
            first = job.iloc[0]
            slo = next(iter(job["slo"].dropna()), None) if "slo" in job else None
            self.console.print(Text(
                f"job {job_id} serving: load={first.get('load')} rate={first.get('load_rate')} max_concurrency="
                f"{first.get('load_max_concurrency')}; the steady window's requests"
                + (f"; goodput under SLO {slo}" if slo else "") + ("; emulated device" if bool(first["emulated"]) else "")),
                soft_wrap=True)
            self.console.print(self._table("", sv, SERVE_TABLE, spread=False))
        for job_id, job, p in _pass_rows(df, "prediction"):
            if p["median"].notna().any():
                self.console.print(self._table(f"job {job_id} predicted by the cost model (profile "
                                               f"{job['prediction_profile'].iloc[0]}, "
                                               f"{job['prediction_routing'].iloc[0]} routing)", p, PREDICTION_TABLE,
                                               spread=False))
        failed = df[df["status"] == "failed"]
        for _, row in failed.iterrows():
            self.console.print(Text(f"job {row['job_id']} failed ({row['phase']}): {row.get('error')}", style="red"))

    @staticmethod
    def _table(title: str, rows: pd.DataFrame, metrics: tuple, spread: bool = True) -> Table:
        """Metrics down, phases across (in the contract's order); a cell is the median and, with
        `spread` and more than one value, min–max under it, and with IQR_MIN_N or more values the
        interquartile range (fewer values have no meaningful quartiles); the header gives n."""
        phases = sorted(set(rows["phase"]), key=phase_rank)
        valued = rows[rows["median"].notna()]
        # a metric measured by more than one source (llama.cpp's own timings beside the client's) gets
        # one line per source: they are never mixed in one number (DESIGN.md §5)
        sources = valued.groupby("metric")["source"].agg(lambda s: sorted(set(s))).to_dict()
        cells: dict[tuple[str, str, str], str] = {}
        ns: dict[str, set[int]] = {p: set() for p in phases}
        for _, s in valued.iterrows():
            fmt_scale = next(((fmt, scale) for m, _, fmt, scale in metrics if m == s["metric"]), None)
            if fmt_scale is None:
                continue
            fmt, scale = fmt_scale
            ns[s["phase"]].add(int(s["n"]))
            cell = fmt.format(s["median"] / scale)
            if spread and s["n"] > 1:
                cell += f"\n{fmt.format(s['min'] / scale)}–{fmt.format(s['max'] / scale)}"
            if spread and s["n"] >= IQR_MIN_N:
                cell += f"\nIQR {fmt.format(s['p25'] / scale)}–{fmt.format(s['p75'] / scale)}"
            cells[(s["phase"], s["metric"], s["source"])] = cell
        phases = [p for p in phases if ns[p]]
        t = Table(title=Text(title), title_justify="left")
        t.add_column("metric")
        for p in phases:
            n = ",".join(map(str, sorted(ns[p])))
            t.add_column(Text(f"{p}\n(n={n})" if spread else p), justify="right")
        for metric, label, _, _ in metrics:
            many = len(sources.get(metric, [])) > 1
            for source in sources.get(metric, []):
                row = [cells.get((p, metric, source), "—") for p in phases]
                if any(c != "—" for c in row):
                    t.add_row(Text(f"{label} [{source}]" if many else label), *row)
        return t


def _check_line(check: "JobCheck | None", flags: "JobFlags | None") -> str:
    """`reference check: ok; flagged repeats: none of 3` for one job (harness.checks, harness.outliers)."""
    parts = []
    if check is not None:
        text = check.text()
        parts.append(f"reference check: {'not judged' if text == '—' else text}"
                     + (f" ({check.reason})" if check.reason and (check.failed or text == "—") else ""))
    if flags is not None:
        parts.append(f"flagged repeats: {flags.text()}")
    return "; ".join(parts)


class SweepProgress:
    """`job k/N` of a sweep with the job's factors, elapsed time and an estimate of the time left.

    On a terminal: two live lines, redrawn a few times a second at the terminal's width (COLUMNS,
    else its size) -- `job k/N`, elapsed, the time left counting down, a bar where there is room and
    the current job's factors, then the job's current step (warm-up, repeat r/R, a pass, a long
    load). A narrow terminal shortens the factors and the step, never the times. In a log (not a
    terminal): one plain line per job and step, with the same elapsed/left figures. Quiet: nothing.
    A `Reporter` given it reports its steps into it. `clock`: seconds, monotonic (tests pass theirs)."""

    def __init__(self, total: int, quiet: bool = False, console: Console | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.total, self.quiet, self.done = total, quiet, 0
        self.console = console or terminal_console()
        self.clock = clock
        self.t0 = clock()
        self.finished_s = 0.0            # elapsed when the last job finished
        self.what, self.step_label = "", ""
        self.live = not quiet and self.console.is_terminal
        self.progress = None             # the live display (rich.live.Live) on a terminal
        if self.live:
            from rich.live import Live
            self.progress = Live(_ProgressLines(self), console=self.console, refresh_per_second=4)
            self.progress.start()

    @staticmethod
    def _clock(s: float) -> str:
        s = int(round(s))
        return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"

    def left_s(self) -> float | None:
        """Seconds left: the mean time of the jobs done so far for each job still to run, less what
        the current one has run (never below the jobs after it) -- so it counts down between jobs
        and steps; None before any job finished."""
        if self.done == 0:
            return None
        per_job = self.finished_s / self.done
        running = self.clock() - self.t0 - self.finished_s
        return max(per_job - running, 0.0) + per_job * max(self.total - self.done - 1, 0)

    def times(self, compact: bool = False) -> str:
        """`job k/N (0:01:02 elapsed, ~0:03:00 left)`, or `k/N 0:01:02 ~0:03:00` where room is short."""
        elapsed, left = self._clock(self.clock() - self.t0), self.left_s()
        left_text = "?" if left is None else self._clock(left)
        k = min(self.done + 1, self.total)
        if compact:
            return f"{k}/{self.total} {elapsed} ~{left_text}"
        return f"job {k}/{self.total} ({elapsed} elapsed, ~{left_text} left)"

    def line(self, what: str) -> str:
        return f"{self.times()}: {what}"

    def status_lines(self, width: int) -> list[str]:
        """The live lines at `width` columns: the times whole, then as much of the rest as fits."""
        head = self.times()
        if len(head) + 2 > width:
            head = self.times(compact=True)
        rest = width - len(head)
        bar_w = min(20, rest // 4) if rest >= 60 else 0         # a bar only where the factors keep most room
        bar = ""
        if bar_w:
            full = bar_w * self.done // max(self.total, 1)
            bar = " " + "━" * full + "─" * (bar_w - full)
        lines = [head + bar + _fit(f": {self.what}" if self.what else "", width - len(head) - len(bar))]
        if self.step_label:
            lines.append(_fit(f"  {self.step_label}", width))
        return lines

    def start(self, what: str) -> None:
        self.what, self.step_label = what, ""
        if self.quiet or self.progress is not None:
            return
        self.console.print(Text(self.line(what)), soft_wrap=True)

    def step(self, label: str) -> None:
        self.step_label = label
        if self.progress is None and not self.quiet:
            self.console.print(Text(f"  {label}"), soft_wrap=True)

    def finish(self) -> None:
        self.done += 1
        self.finished_s = self.clock() - self.t0
        self.what = self.step_label = ""

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def _line(text: str) -> Text:
    """A live status line: one line however narrow the terminal, cut with an ellipsis."""
    return Text(text, no_wrap=True, overflow="ellipsis")


def _fit(text: str, width: int) -> str:
    """`text` in `width` columns: cut with an ellipsis when longer, nothing when there is no room."""
    if width <= 1:
        return ""
    return text if len(text) <= width else text[:width - 1] + "…"


class _ProgressLines:
    """The live display's renderable: SweepProgress.status_lines at the width rich lays it out in,
    recomputed at every refresh (so the time left counts down while a step runs)."""

    def __init__(self, progress: SweepProgress) -> None:
        self.sweep = progress

    def __rich_console__(self, console: Console, options: Any) -> Iterator[Text]:
        for line in self.sweep.status_lines(options.max_width):
            yield Text(line, no_wrap=True, overflow="crop")


def _pass_rows(df: pd.DataFrame, profiler: str):
    """(job id, its ok rows of a pass's `profiler` label, their spread table) per job that has some."""
    rows = df[(df["status"] == "ok") & (df.get("profiler", pd.Series(index=df.index)) == profiler)]
    for job_id, job in rows.groupby("job_id", sort=False):
        yield job_id, job, spread_table(job.assign(profiler="none"))
