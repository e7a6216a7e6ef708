"""The routing-trace simulator (DESIGN.md §8): replay eviction policies and cache sizes over a
trace, the full LRU curve in one pass, Belady's optimum as the bound, routing statistics and
calibrated synthetic traces.

Owns: analysis of traces (pandas allowed here, unlike engine/). Does not own: the trace
format and recording (`engine.trace`), the policies (`engine.policies`, used as they are),
or the cost model.

    from engine.trace import load_trace
    from harness.sim import replay, lru_curve, trace_stats, generate_preset
    df = replay(load_trace("run.npz"), ["lru", "belady"], [4, 8])

Command line: `moebench-sim` (harness.sim.cli).
"""
from harness.sim.replay import lru_curve, replay
from harness.sim.stats import format_stats, trace_stats
from harness.sim.synthetic import PRESETS, generate, generate_preset

__all__ = ["replay", "lru_curve", "trace_stats", "format_stats", "generate", "generate_preset", "PRESETS"]
