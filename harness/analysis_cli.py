"""`moebench-plot` and `moebench-compare`: the command lines over `harness.plots` and `harness.compare`.

Owns: arguments, file output (PNGs, the figure provenance file, the markdown report, the
comparison table) and exit codes. Does not own: what a figure shows (`harness.plots`) or
how two result sets are judged (`harness.compare`).

    moebench-plot results/samples                      # -> ./figures/samples/*.png
    moebench-plot results/sweeps/S --out figs/
    moebench-compare BASE NEW --check decode.tok_per_s:-5% --check prefill_fresh.ttft_s:+10% \
        --report report.md --table comparison.csv
    moebench-compare --machine                         # this machine's baseline name

`moebench-compare` exits with its verdict's code (harness.compare has the rules):
  0 PASS          every base config compared, every check applied, none beyond its threshold
  1 FAIL          a check found a significant regression beyond its threshold
  2               bad arguments or unreadable results
  3 INCOMPLETE    nothing compared, a base config or checked metric without a comparable
                  counterpart (missing, another model, device or engine version), or a check
                  that matched no comparable pair (--allow-empty: 0 when nothing was compared)
  4 INCONCLUSIVE  a check beyond its threshold without significance, or no checked pair with
                  enough samples (2 a side) to test
Also `python -m harness.analysis_cli plot|compare ...`.

`moebench-plot` writes to `./figures/<name of the results dir>` unless `--out` says where, and
never into committed data (`results/samples`, `results/baselines`, `results/gpu`) unless
`--allow-committed` is given.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

FIGURES_FILE = "figures.json"
# results dirs that are committed to the repository: figures go there only when asked
COMMITTED_RESULTS = ("samples", "baselines", "gpu")


# ----------------------------------------------------------------------------- moebench-plot

def plot_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moebench-plot", description="Write the standard figures of a results dir as PNG.")
    p.add_argument("results", help="a job dir, a sweep dir or a results tree")
    p.add_argument("--out", help="output dir (default: ./figures/NAME, NAME the results dir's name)")
    p.add_argument("--allow-committed", action="store_true",
                   help="allow writing into committed results (results/samples, results/baselines, results/gpu)")
    p.add_argument("--only", action="append", default=None, metavar="NAME",
                   help="write only this figure (repeatable); default: every figure whose rows the results hold "
                        "(the others are skipped with the reason)")
    p.add_argument("--dpi", type=int, default=110)
    return p


def committed_dir(path: Path) -> str | None:
    """The committed results dir (e.g. "results/samples") that `path` lies in, if any."""
    parts = path.resolve().parts
    for a, b in zip(parts, parts[1:]):
        if a == "results" and b in COMMITTED_RESULTS:
            return f"{a}/{b}"
    return None


def default_out(src: Path) -> Path:
    """./figures/<name>: the results dir's name (a file's stem), in the current directory."""
    src = src.resolve()
    return Path("figures") / (src.name if src.is_dir() else src.stem)


def plot_main(argv: Sequence[str] | None = None) -> int:
    args = plot_parser().parse_args(argv)
    from harness import plots, results
    from harness.compare import read_manifests

    known = {**plots.STANDARD, **plots.EXPERIMENT_FIGURES}
    names = args.only or [*plots.STANDARD, *plots.EXPERIMENT_FIGURES]
    unknown = sorted(set(names) - set(known))
    if unknown:
        print(f"moebench-plot: unknown figure(s) {unknown}; known: {list(known)}", file=sys.stderr)
        return 2
    src = Path(args.results)
    out = Path(args.out) if args.out else default_out(src)
    committed = committed_dir(out)
    if committed and not args.allow_committed:
        print(f"moebench-plot: {out} is inside {committed}, which is committed data; give --out DIR elsewhere, "
              "or --allow-committed to write there", file=sys.stderr)
        return 2
    try:
        df = results.load(src)
    except (FileNotFoundError, results.ResultsError) as exc:
        print(f"moebench-plot: {exc}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    written, skipped = [], {}
    for name in names:
        try:
            fig = known[name](df)
        except plots.MissingData as exc:          # e.g. the treatment frontier of a sweep with no lossy run
            skipped[name] = str(exc)
            print(f"skipped {name}: {exc}")
            continue
        path = out / f"{name}.png"
        fig.savefig(path, dpi=args.dpi)
        written.append(path.name)
        print(f"wrote {path}")
    man = read_manifests(src)
    provenance = {  # DESIGN §7.9: every figure reproducible from what sits next to it
        "created": datetime.now(timezone.utc).isoformat(), "source": str(src.resolve()),
        "command": ["moebench-plot", *(argv if argv is not None else sys.argv[1:])],
        "figures": written, "skipped": skipped,
        "jobs": df[["sweep_id", "job_id"]].drop_duplicates().to_dict("records"),
        "git_commits": sorted({str(c) for c in man["git_commit"].dropna()}),
    }
    (out / FIGURES_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
    if not written:
        print("moebench-plot: no figure had its data", file=sys.stderr)
        return 1
    return 0


# ----------------------------------------------------------------------------- moebench-compare

COMPARE_EPILOG = """exit codes (the verdict; harness/compare.py has the rules):
  0  PASS          every base config compared, every check applied, none beyond its threshold
  1  FAIL          a check found a significant regression beyond its threshold
  2                bad arguments or unreadable results
  3  INCOMPLETE    nothing compared; a base config or checked metric without a comparable
                   counterpart in NEW (missing, another model, device or engine version); or a
                   check that matched no comparable pair
  4  INCONCLUSIVE  a check beyond its threshold without significance (too few repeats, noise),
                   or no checked pair -- with no checks, no pair -- with enough samples (2 a
                   side) to test"""


def compare_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moebench-compare", epilog=COMPARE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Compare two result sets per (config, phase, metric) and give a verdict: PASS, FAIL, "
                    "INCOMPLETE or INCONCLUSIVE. See harness/compare.py for the rules.")
    p.add_argument("base", nargs="?", help="baseline results (job dir, sweep dir, tree or .parquet)")
    p.add_argument("new", nargs="?", help="new results")
    p.add_argument("--check", action="append", default=[], metavar="PHASE.METRIC:±X%",
                   help="e.g. decode.tok_per_s:-5%% (a decrease beyond 5%% is a regression), "
                        "prefill_fresh.ttft_s:+10%% (an increase beyond 10%%); repeatable; phase * = any")
    p.add_argument("--alpha", type=float, default=0.05, help="significance level (default 0.05)")
    p.add_argument("--min-change", type=float, default=None, metavar="PCT",
                   help="the smallest relative change listed as significant, in percent (default 2); "
                        "checks keep their own thresholds")
    p.add_argument("--report", help="write the markdown report here (e.g. $GITHUB_STEP_SUMMARY)")
    p.add_argument("--table", help="write the full comparison table here (.csv or .parquet)")
    p.add_argument("--allow-empty", action="store_true",
                   help="exit 0 when nothing at all was compared (the verdict stays INCOMPLETE; default: exit 3)")
    p.add_argument("--machine", action="store_true",
                   help="print this machine's baseline name (results/baselines/<name>/) and exit")
    return p


def compare_main(argv: Sequence[str] | None = None) -> int:
    parser = compare_parser()
    args = parser.parse_args(argv)
    from harness import compare

    if args.machine:
        print(compare.machine_name())
        return 0
    if not args.base or not args.new:
        parser.error("BASE and NEW are required (or --machine)")
    min_change = compare.MIN_CHANGE if args.min_change is None else args.min_change / 100
    try:
        checks = [compare.Check.parse(c) for c in args.check]
        cmp = compare.compare_paths(args.base, args.new, checks, alpha=args.alpha, min_change=min_change)
    except compare.CompareError as exc:
        print(f"moebench-compare: {exc}", file=sys.stderr)
        return 2
    report = cmp.markdown()
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        summary = os.environ.get("GITHUB_STEP_SUMMARY")      # a CI job summary is appended to, never replaced
        with open(args.report, "a" if summary and Path(args.report) == Path(summary) else "w") as f:
            f.write(report + "\n")
    if args.table:
        Path(args.table).parent.mkdir(parents=True, exist_ok=True)
        if args.table.endswith(".parquet"):
            cmp.table.to_parquet(args.table, index=False)
        else:
            cmp.table.to_csv(args.table, index=False)
    t, compared = cmp.table, cmp.compared
    print(f"compared {len(compared)} (config, phase, metric, source) pairs, {len(t) - len(compared)} not comparable, "
          f"{int(t['significant'].sum())} significant changes (of {min_change * 100:g}% or more), "
          f"{len(cmp.regressions)} regression(s)")
    for _, r in cmp.regressions.iterrows():
        p = "" if r["p_value"] is None or r["p_value"] != r["p_value"] else f" p={r['p_value']:.3g}"
        print(f"REGRESSION {r['config']} {r['phase']}.{r['metric']} ({r['source']}): {r['median_base']:.4g} -> "
              f"{r['median_new']:.4g} {r['unit']} (x{r['ratio']:.3f}, {r['test']}{p}) check {r['check']}")
    if not args.report:
        print(report)
    verdict, reasons = cmp.verdict, cmp.incomplete_reasons() + cmp.inconclusive_reasons()
    if compared.empty and args.allow_empty:
        print(f"moebench-compare: {verdict}, nothing compared; --allow-empty given: exit 0", file=sys.stderr)
        return 0
    more = f" (and {len(reasons) - 1} more in the report)" if len(reasons) > 1 else ""
    why = f": {reasons[0]}{more}" if reasons and verdict != "FAIL" else ""
    print(f"moebench-compare: {verdict} (exit {cmp.exit_code}){why}", file=sys.stderr if cmp.exit_code else sys.stdout)
    return cmp.exit_code


# ----------------------------------------------------------------------------- python -m

def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"plot": plot_main, "compare": compare_main}
    if not argv or argv[0] not in commands:
        print(f"usage: python -m harness.analysis_cli {{{'|'.join(commands)}}} ...", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
