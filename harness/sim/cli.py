"""`moebench-sim`: replay a routing trace (recorded or synthetic) through cache policies.

Owns: argument parsing and everything the simulator prints (library modules log instead).
Does not own: the replay, statistics or generation (harness.sim.replay / stats / synthetic).

    moebench-sim TRACE.npz --policy lru,lfu,fifo,static,belady --capacity 2,4,8
    moebench-sim TRACE.npz --curve --stats --out sim.parquet
    moebench-sim --synthetic mixtral-like --tokens 10000 --capacity 2,4 --prefetch oracle
    moebench-sim --synthetic olmoe-like --tokens 20000 --save-trace olmoe.npz --stats
    moebench-sim counts.npz --popularity --capacity 2,4     # the hot-expert table; count-only traces too
    moebench-sim chat.npz --profile agent.npz --capacity 2,4   # static pinned by another workload's profile

Without --capacity, --curve, --stats or --popularity it replays at capacities n_experts/4 and
n_experts/2 (at least top_k: the engine refuses a smaller cache). --popularity prints the share of
routings to each layer's c most popular experts (harness.sim.stats.popularity) instead of a replay
(capacities default as above); it is the one analysis a count-only trace (an imported SGLang `stat`
dump: counts, no token order) supports -- replays, curves and --stats refuse it in one line.
--out (.parquet or .csv) gets the tidy replay (+ curve) rows with a `kind` column
("replay" | "curve"); with --stats too, the stats table goes to `<out stem>.stats<suffix>`.
Parquet cannot hold a column mixing ints and "all", so `layer` is written as text there.
--profile P.npz replays `static` pinned by P's expert counts (another workload's trace, recorded,
imported or count-only) beside static pinned by the trace's own counts, and prints the transfer
figure, profile hit rate / own hit rate (harness.sim.replay.profile_transfer), instead of a replay.
Exit status: 0 on success, 2 on a bad argument or trace (the message says what was wrong), an empty
trace or `--tokens` below 1 included: there is nothing to replay, so no row.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from engine.trace import RoutingTrace, load_trace, save_trace
from harness.sim.replay import PREFETCH, lru_curve, profile_transfer, replay
from harness.sim.stats import format_stats, popularity, trace_stats
from harness.sim.synthetic import PRESETS, generate_preset

DEFAULT_POLICIES = "lru,lfu,fifo,static,belady"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moebench-sim", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", nargs="?", type=Path, help="routing trace .npz (or use --synthetic)")
    p.add_argument("--synthetic", metavar="PRESET", help=f"generate a trace: {', '.join(sorted(PRESETS))}")
    p.add_argument("--tokens", type=int, default=10_000, help="tokens of a synthetic trace (default 10000)")
    p.add_argument("--seed", type=int, default=0, help="seed of a synthetic trace (default 0)")
    p.add_argument("--save-trace", type=Path, metavar="PATH", help="write the (synthetic) trace as .npz")
    p.add_argument("--policy", default=DEFAULT_POLICIES, help=f"comma-separated policies (default {DEFAULT_POLICIES})")
    p.add_argument("--capacity", help="comma-separated cache capacities (slots per layer)")
    p.add_argument("--prefetch", default="none", help=f"prefetch accounting: {', '.join(PREFETCH)}")
    p.add_argument("--curve", action="store_true", help="LRU hit rate at every capacity (stack distances)")
    p.add_argument("--stats", action="store_true", help="routing statistics per layer")
    p.add_argument("--popularity", action="store_true",
                   help="share of routings to each layer's c most popular experts (count-only traces too)")
    p.add_argument("--profile", type=Path, metavar="P.npz",
                   help="static pinned by this trace's expert counts against the trace's own: the transfer figure")
    p.add_argument("--per-layer", action="store_true", help="print per-layer rows, not just the totals")
    p.add_argument("--reference", action="store_true",
                   help="run belady through the engine's class instead of the fast kernel (slow; same counts)")
    p.add_argument("--out", type=Path, help="write the rows to .parquet or .csv")
    return p


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None


def _load(args: argparse.Namespace) -> RoutingTrace:
    if (args.trace is None) == (args.synthetic is None):
        raise ValueError("give either a TRACE.npz or --synthetic PRESET (exactly one)")
    if args.synthetic is not None:
        if args.tokens < 1:
            raise ValueError(f"--tokens must be >= 1 (the length of the synthetic trace), got {args.tokens}")
        tr = generate_preset(args.synthetic, args.tokens, args.seed)
        if args.save_trace:
            save_trace(args.save_trace, tr)
            print(f"saved trace: {args.save_trace}")
        return tr
    if args.save_trace:
        raise ValueError("--save-trace is for --synthetic traces; the input trace is already a file")
    tr = load_trace(args.trace)
    if tr.n_tokens == 0 and not tr.count_only:   # every hit rate would be 0/0: no row, an error
        raise ValueError(f"{args.trace}: the trace holds 0 tokens, so nothing can be replayed; allowed: a trace of "
                         ">= 1 token")
    return tr


def _check_out(path: Path) -> None:
    """Refuse an --out that could not be written before any work: its suffix, its directory."""
    if path.suffix not in (".parquet", ".csv"):
        raise ValueError(f"--out must end in .parquet or .csv, got {path.name!r}")
    parent = path.parent
    if not parent.is_dir():
        raise ValueError(f"--out {path}: its directory {parent} does not exist; allowed: a file in an existing "
                         "directory")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"--out {path}: its directory {parent} is not writable")


def _write(df: pd.DataFrame, path: Path) -> None:
    try:
        if path.suffix == ".parquet":
            df = df.astype({"layer": str}) if "layer" in df else df
            df.to_parquet(path, index=False)
        else:
            df.to_csv(path, index=False)
    except OSError as err:                 # full disk, removed meanwhile: one line, not a traceback
        raise ValueError(f"--out {path}: cannot write it ({err.strerror or err})") from err


def _show(df: pd.DataFrame, title: str, per_layer: bool) -> None:
    rows = df if per_layer else df[df["layer"] == "all"]
    cols = ["policy", "capacity", "prefetch", "layer", "hit_rate", "hits", "misses", "miss_bytes"]
    if (rows["prefetch"] != "none").any():
        cols += ["hidden_misses", "exposed_misses"]
    t = rows[cols].copy()
    t["miss_GiB"] = pd.to_numeric(t.pop("miss_bytes"), errors="coerce") / 2**30   # null: experts' bytes vary
    _print_table(t, title, per_layer=True)                                         # rows already chosen


def _describe(tr: RoutingTrace) -> str:
    if tr.count_only:
        return (f"trace: count-only ({int(tr.counts.sum())} routings over {tr.n_layers} layers of {tr.n_experts} "
                f"experts, no token order), {tr.expert_bytes} B per expert")
    return (f"trace: {tr.n_tokens} tokens x {tr.n_layers} layers x top-{tr.top_k} of {tr.n_experts} experts, "
            f"{tr.expert_bytes} B per expert{'' if tr.step is None else f', {int(tr.step_ids()[-1]) + 1} steps'}")


def _print_table(df: pd.DataFrame, title: str, per_layer: bool) -> pd.DataFrame:
    """Print `df` (its "all" rows unless per_layer) under `title`; return all of it."""
    rows = df if per_layer else df[df["layer"] == "all"]
    print(f"== {title}")
    print(rows.to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    return df


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.out:
            _check_out(args.out)
        tr = _load(args)
        print(_describe(tr))
        tables = []
        stats = trace_stats(tr) if args.stats else None
        if stats is not None:
            print("== routing statistics")
            print(format_stats(stats))
        caps = _ints(args.capacity, "--capacity") if args.capacity else None
        default_caps = sorted({max(tr.top_k, tr.n_experts // 4), max(tr.top_k, tr.n_experts // 2)})
        if args.popularity:
            tables.append(_print_table(popularity(tr, caps or default_caps), "popularity: share of routings to "
                                       "each layer's c most popular experts", args.per_layer).assign(kind="popularity"))
            caps = None                                   # the popularity table instead of a replay
        elif args.profile:
            tables.append(_print_table(profile_transfer(tr, load_trace(args.profile), caps or default_caps),
                                       "static pinned by the profile's counts against the trace's own "
                                       "(transfer = profile / own)", args.per_layer).assign(kind="transfer"))
            caps = None                                   # the transfer table instead of a replay
        elif caps is None and not (args.curve or args.stats):
            caps = default_caps
        if caps:
            policies = [p.strip() for p in args.policy.split(",") if p.strip()]
            df = replay(tr, policies, caps, prefetch=args.prefetch, fast=not args.reference)
            _show(df, "replay", args.per_layer)
            tables.append(df.assign(kind="replay"))
        if args.curve:
            curve = lru_curve(tr)
            _show(curve, "LRU curve (stack distances)", args.per_layer)
            tables.append(curve.assign(kind="curve"))
        if args.out:
            if tables:
                _write(pd.concat(tables, ignore_index=True), args.out)
                if stats is not None:
                    _write(stats, args.out.with_name(f"{args.out.stem}.stats{args.out.suffix}"))
            elif stats is not None:
                _write(stats, args.out)
            print(f"results: {args.out}")
    except (ValueError, FileNotFoundError, TypeError) as err:
        print(f"moebench-sim: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
