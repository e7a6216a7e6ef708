"""The passes of a job: each thing a job measures is one pass, run in the order `run.passes` lists.

Owns: the registry (`PASSES`, name -> "module:Class", lazily imported; third-party passes
through the entry-point group `moebench.passes`), the default list (`DEFAULT_PASSES`: the one
place it is written; RunConf's default, `moebench --help` and every manifest show it), checking a
list (`check_passes`: unknown names, repeats, a pass without the passes it reads before it, a
flag that asks for a pass the list leaves out -- each refused in one line) and the help text
(`describe`). Does not own: the interface (harness.passes.base), the loop that runs them
(harness.runner), what each one measures (harness.passes.<name>).

    from harness.passes import PASSES, DEFAULT_PASSES
    PASSES.get("roofline").needs          # ('speed',)
    PASSES.register("my_pass", MyPass)    # in-process; an entry point in `moebench.passes` for a package

`run.passes=[speed]` gives a lean run: the load and speed rows only. A pass the run's flags
leave off (`run.timeline=false`, `run.record_trace=false`, `run.profiler=none`,
`run.ablation=false`, `run.check_reference=false`) stays in the list and is skipped, its reason
recorded in the job's manifest (`passes`).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.registry import Registry, UnknownPluginError

DEFAULT_PASSES: tuple[str, ...] = ("speed", "serve", "quality", "roofline", "prediction", "timeline", "trace",
                                   "torch_profile", "nsys", "ablation")
PASSES = Registry("pass", "moebench.passes", {
    "speed": "harness.passes.speed:SpeedPass",
    "serve": "harness.passes.serve:ServePass",
    "quality": "harness.passes.quality:QualityPass",
    "roofline": "harness.passes.roofline:RooflinePass",
    "prediction": "harness.passes.prediction:PredictionPass",
    "timeline": "harness.passes.timeline:TimelinePass",
    "trace": "harness.passes.trace:TracePass",
    "torch_profile": "harness.passes.torch_profile:TorchProfilePass",
    "nsys": "harness.passes.nsys:NsysPass",
    "ablation": "harness.passes.ablation:AblationPass",
})

__all__ = ["DEFAULT_PASSES", "PASSES", "check_passes", "describe"]


def check_passes(names: Sequence[str], run: Any = None) -> tuple[str, ...]:
    """`names` (run.passes) as the tuple the runner runs, or ValueError in one line: a name no
    pass has, a pass listed twice, a pass without one it `needs` listed before it, one listed
    after a pass it must follow, or (given the run's config) a flag that asks for a default pass
    the list leaves out."""
    names = tuple(str(n) for n in names)
    given = f"got run.passes=[{','.join(names)}]"
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ValueError(f"run.passes: {name} is listed twice (a pass runs once per job); {given}")
        try:
            cls = PASSES.get(name)
        except UnknownPluginError:
            raise ValueError(f"run.passes: unknown pass {name!r}; allowed: {', '.join(PASSES.names())} "
                             f"(third-party passes register in the entry-point group 'moebench.passes'); "
                             f"{given}") from None
        for dep in cls.needs:
            if dep not in names[:i]:
                raise ValueError(f"run.passes: {name} needs {dep} listed before it (it reads what {dep} "
                                 f"measured); {given}")
        for dep in cls.after:
            if dep in names[i + 1:]:
                raise ValueError(f"run.passes: {name} reads {dep}'s rows, so {dep} comes before it; {given}")
    if run is not None:
        for name in DEFAULT_PASSES:
            flag = PASSES.get(name).asked_by(run) if name not in names else None
            if flag:
                raise ValueError(f"run.passes: {flag} asks for the {name} pass, which the list leaves out; add "
                                 f"{name} to run.passes or drop {flag}; {given}")
    return names


def describe() -> str:
    """The pass list for `moebench --help`: the default order, one line per pass."""
    width = max(map(len, DEFAULT_PASSES)) + 2
    lines = [f"== Passes (run.passes; default: [{','.join(DEFAULT_PASSES)}]) ==",
             "Each job runs its passes in the order listed; a pass its flags leave off is skipped, with its",
             "reason in the job's manifest. run.passes=[speed] is a lean run (load and speed rows only).", ""]
    for name in DEFAULT_PASSES:
        lines.append(f"  {name:<{width}}{PASSES.get(name).summary}")
    return "\n".join(lines)
