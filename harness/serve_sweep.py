"""`moebench serve-sweep`: the highest load each configuration serves within its SLO.

Owns: stepping the offered load up for each job the overrides make (a sweep over placements and
cache sizes, `-m` style comma lists) -- the `--step` key (`load.rate`, the default, or
`load.max_concurrency`, a closed loop's requests in flight) from `--start`, times `--factor` each
step, at most `--steps` steps -- until the job's serving summary says the SLO is not met (or the
job failed), each step a real `moebench` run in a results dir of its own under `--out`; then one
line per configuration (the highest load that met the SLO, and the first that did not) and the
figure of goodput and p99 TPOT against load (harness.plots.serving.load_curve) beside the runs.
Does not own: a run (the moebench CLI), the metrics (harness.serving.metrics), the load spec
(harness.serving.load).

    moebench serve-sweep placement=resident,fetch load=poisson load.requests=32 load.max_concurrency=4 \\
        load.slo=mixtral-8x7b workload=chat workload.context_tokens=256 --start 2 --factor 2 --steps 5
    moebench serve-sweep placement=resident,fetch load=poisson load.requests=32 load.slo=mixtral-8x7b \\
        --step load.max_concurrency --start 1 --factor 2 --steps 5        # a closed loop: load.rate=null

Exit 0: every configuration stepped until its SLO failed or its steps ran out (the table says
"not reached"); 1: a step's job failed (no serving summary); 2: bad input.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.predict import OneLineParser

RUN_DEFAULTS = ["run.passes=[speed,serve]", "run.repeats=1", "run.quiet=true"]


@dataclass(frozen=True)
class Axis:
    """A load key serve-sweep can step: how its values are named and what every step also sets."""

    noun: str                   # in the report: "highest <noun> within the SLO"
    unit: str                   # after a value ("" for a count)
    whole: bool                 # its values are counts: --start and --factor whole numbers
    also: tuple[str, ...] = ()  # overrides every step adds

    def shown(self, value: float) -> str:
        return f"{value:g}{self.unit}"


AXES: dict[str, Axis] = {
    "load.rate": Axis("rate", " req/s", whole=False),
    "load.max_concurrency": Axis("concurrency", "", whole=True, also=("load.rate=null",)),   # a closed loop
}


def _args(argv: Sequence[str]) -> argparse.Namespace:
    p = OneLineParser(prog="moebench serve-sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="the run's overrides; comma lists sweep configurations")
    p.add_argument("--step", choices=list(AXES), default="load.rate",
                   help="the load key stepped: load.rate (requests/s, default) or load.max_concurrency (requests "
                        "in flight, in a closed loop: load.rate=null)")
    p.add_argument("--start", type=float, default=1.0, help="the first value of the stepped key (default 1)")
    p.add_argument("--factor", type=float, default=2.0, help="each step's value over the last (default 2)")
    p.add_argument("--steps", type=int, default=6, help="values tried per configuration at most (default 6)")
    p.add_argument("--out", default="results/serve-sweep", help="where each step's run goes (default %(default)s)")
    a = p.parse_intermixed_args(list(argv))
    if not a.start > 0 or not a.factor > 1 or a.steps < 1:
        p.error(f"--start > 0, --factor > 1, --steps >= 1; got {a.start:g}, {a.factor:g}, {a.steps}")
    if AXES[a.step].whole and not (a.start.is_integer() and a.factor.is_integer()):
        p.error(f"--start and --factor: whole numbers with --step {a.step} (a count); got {a.start:g}, {a.factor:g}")
    keys = {o.split("=", 1)[0].lstrip("+~") for o in a.overrides}
    if a.step in keys:
        p.error(f"{a.step} is what serve-sweep steps: give --start and --factor instead")
    for fixed in AXES[a.step].also:
        if fixed.split("=", 1)[0] in keys:
            p.error(f"{fixed.split('=', 1)[0]}: serve-sweep --step {a.step} sets {fixed} itself (a closed loop); "
                    "give no value")
    if not any(o.startswith("load=") and o != "load=none" for o in a.overrides):
        p.error("give a load (load=poisson|constant|gamma) and its load.slo: the frontier is where the SLO fails")
    if "load.slo" not in keys:
        p.error("give load.slo=PRESET or load.slo=ttft=S,tpot=S: the frontier is where it fails")
    return a


def _step(job: list[str], load: list[str], out: Path) -> tuple[bool | None, Path | None]:
    """Run one job at the `load` overrides: whether its window met the SLO (None: no serving summary
    -- the job or its serve pass failed), and its job dir."""
    from harness import results
    from harness.contract import served_summary_rows
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "harness.cli", *job, *load, *RUN_DEFAULTS, f"run.out={out}"],
                   capture_output=True, text=True)
    runs = sorted((out / "runs").glob("*")) if (out / "runs").is_dir() else []
    if not runs:
        return None, None
    rows = served_summary_rows(results.load(runs[-1]))
    met = rows[rows["metric"] == "slo_met"]["value"].dropna()
    return (bool(met.iloc[0]) if len(met) else None), runs[-1]


def main(argv: Sequence[str]) -> int:
    import pandas as pd

    from harness import results
    from harness.config import BAD_CONFIG, config_error_line
    from harness.plan import expand
    from harness.plots.serving import load_curve
    a = _args(argv)
    try:
        jobs = expand(a.overrides)
    except BAD_CONFIG as exc:
        print(f"moebench serve-sweep: {config_error_line(exc)}", file=sys.stderr)
        return 2
    swept = {k for k, _, v in (o.partition("=") for o in a.overrides) if "," in v and v[:1] not in "'\""}
    axis = AXES[a.step]
    root, code, lines, dirs = Path(a.out), 0, [], []
    for i, job in enumerate(jobs):
        label = " ".join(o for o in job if o.split("=", 1)[0] in swept) or "job"
        best = first_fail = None
        for s in range(a.steps):
            value = a.start * a.factor ** s
            met, run_dir = _step(job, [f"{a.step}={value:g}", *axis.also],
                                 root / f"job{i}" / f"{axis.noun}{value:g}")
            print(f"moebench serve-sweep: {label} at {axis.noun} {axis.shown(value)}: "
                  f"{'no serving summary (the job failed)' if met is None else 'SLO met' if met else 'SLO not met'}",
                  file=sys.stderr)
            if met is None:
                code = 1
                break
            dirs.append(run_dir)
            if not met:
                first_fail = value
                break
            best = value
        lines.append(f"{label}: highest {axis.noun} within the SLO {'none' if best is None else axis.shown(best)}; "
                     f"first beyond it {'not reached' if first_fail is None else axis.shown(first_fail)}")
    print("\n".join(lines))
    if dirs:
        fig = load_curve(pd.concat([results.load(d) for d in dirs], ignore_index=True))
        fig.savefig(root / "serve_frontier.png", dpi=120)
        print(f"figure: {root / 'serve_frontier.png'}")
    return code
