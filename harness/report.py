"""User-facing output: progress while a job runs and a readable summary table at the end.

Owns: everything the CLI prints (library code logs instead). Quiet mode (run.quiet=true,
for CI) prints only errors and the results path. Does not own: numbers (it reads a table).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pandas as pd
from rich.console import Console
from rich.table import Table

KEY_METRICS = (("time_s", "time s", "{:.4f}"), ("ttft_s", "TTFT s", "{:.4f}"), ("tok_per_s", "tok/s", "{:.1f}"), ("tpot_s_p50", "TPOT p50 s", "{:.4f}"),
               ("h2d_bytes", "h2d MiB", "{:.2f}"), ("hit_rate", "hit rate", "{:.3f}"),
               ("reused_tokens", "reused", "{:.0f}"), ("peak_host_rss_bytes", "host RSS MiB", "{:.0f}"),
               ("peak_device_bytes", "device MiB", "{:.1f}"), ("max_abs_logit_diff", "max|Δlogit|", "{:.1e}"))
SCALE = {"h2d_bytes": 2**20, "peak_host_rss_bytes": 2**20, "peak_device_bytes": 2**20}
PHASE_ORDER = ("load", "prefill_fresh", "decode", "prefill_continuation", "prefill_restored")
TRANSFER_METRICS = (("copy_busy_s", "copy busy s", "{:.4f}"), ("overlap_s", "overlap s", "{:.4f}"),
                    ("exposed_copy_s", "exposed s", "{:.4f}"), ("overlap_frac", "overlap frac", "{:.2f}"),
                    ("link_gbps", "link GB/s", "{:.1f}"), ("prefetch_issued", "pf issued", "{:.0f}"),
                    ("prefetch_used", "pf used", "{:.0f}"), ("prefetch_wasted_bytes", "pf wasted MiB", "{:.2f}"),
                    ("exposed_copy_ablation_s", "ablation s", "{:.4f}"))
SCALE["prefetch_wasted_bytes"] = 2**20


class Reporter:
    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet
        self.console = Console(stderr=True, width=160)

    def info(self, msg: str) -> None:
        if not self.quiet:
            self.console.print(msg)

    @contextmanager
    def step(self, label: str) -> Iterator[None]:
        if self.quiet:
            yield
            return
        with self.console.status(label):
            yield

    def summary(self, df: pd.DataFrame, title: str) -> None:
        """Per job: the speed table (phase x key metrics, medians over un-instrumented
        repeats) and, when present, the transfer table from the instrumented timeline pass."""
        if self.quiet or df.empty:
            return
        ok = df[df["status"] == "ok"]
        failed = df[df["status"] == "failed"]
        profiler = ok["profiler"] if "profiler" in ok.columns else pd.Series("none", index=ok.index)
        for job_id, job in ok.groupby("job_id", sort=True):
            first = job.iloc[0]
            head = (f"{title} job {job_id}: {first['engine']} {first['model']} placement={first['placement']} "
                    f"capacity={first['cache_capacity']} prefetch={first['prefetch']} {first['workload']}@"
                    f"{first['context_tokens']} batch={first['batch']} "
                    f"({'emulated ' if first['emulated'] else ''}{first['device_name']})")
            plain = job[profiler[job.index].fillna("none") == "none"]
            self.console.print(self._table(head, plain, KEY_METRICS))
            transfers = pd.concat([job[profiler[job.index] == "timeline"],
                                   plain[plain["metric"] == "exposed_copy_ablation_s"]])
            if not transfers.empty:
                self.console.print(self._table("transfers (timeline pass, instrumented; ablation from the speed runs)",
                                               transfers, TRANSFER_METRICS))
        for _, row in failed.iterrows():
            self.console.print(f"[red]job {row['job_id']} failed:[/red] {row.get('error')}")

    @staticmethod
    def _table(title: str, rows: pd.DataFrame, metrics: tuple) -> Table:
        t = Table(title=title)
        t.add_column("phase")
        for _, label, _ in metrics:
            t.add_column(label, justify="right")
        med = rows.groupby(["phase", "metric"])["value"].median()
        for phase in PHASE_ORDER:
            if phase not in med.index.get_level_values(0):
                continue
            cells = []
            for metric, _, fmt in metrics:
                v = med.get((phase, metric))
                cells.append("—" if v is None or pd.isna(v) else fmt.format(v / SCALE.get(metric, 1)))
            t.add_row(phase, *cells)
        return t
