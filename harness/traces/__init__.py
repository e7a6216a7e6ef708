"""Routing traces from other engines: import what vLLM, SGLang and transformers record as a
DESIGN §3 routing trace, so the simulator, the cache policies and the cost model work on models
moebench cannot run here.

Owns: the table of formats (name -> reader and a one-line description; a reader module per
engine) and `import_trace`, which runs a reader and checks its result against the model. Does
not own: the trace file (engine.trace), replays (harness.sim), the command line (`moebench
trace import`, harness.traces.cli).

    from harness.traces import import_trace, Shape
    from engine.config import preset
    tr = import_trace("vllm", [Path("responses.jsonl")], Shape(cfg=preset("qwen3-30b-a3b"), dtype_bytes=2))
    tr = import_trace("sglang-stat", [Path("expert_distribution_rank0_timestamp1.csv")],
                      Shape(n_experts=8, expert_bytes=1 << 20))        # count-only: tr.count_only

An ordered import replays like a recorded trace; a count-only one (SGLang `stat`) serves
popularity analyses only, and everything that needs an order refuses it (engine.trace).
"""
from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.trace import RoutingTrace
from harness.traces.base import ImportFailure, Shape, finish

__all__ = ["FORMATS", "import_trace", "ImportFailure", "Shape"]

# name -> (reader "module:function", what it reads)
FORMATS: dict[str, tuple[str, str]] = {
    "vllm": ("harness.traces.vllm:read",
             "vLLM --enable-return-routed-experts: responses (.json/.jsonl) with prompt_routed_experts and "
             "choices[].routed_experts, or an .npz of those arrays"),
    "sglang-stat": ("harness.traces.sglang:read_stat",
                    "SGLang expert-distribution recorder, stat mode: the CSV layer_id,expert_id,count or the .pt "
                    "logical_count dump -- counts only (a count-only trace)"),
    "sglang-per-token": ("harness.traces.sglang:read_per_token",
                         "SGLang expert-distribution recorder, per_token mode: the .pt dump of per-pass "
                         "topk_ids_of_layer records"),
    "transformers": ("harness.traces.transformers:read",
                     "transformers output_router_logits=True: torch.save(out.router_logits) per forward pass "
                     "(.pt), or .npy [layers, tokens, experts]; top-k of each row"),
    "moebench": ("harness.traces.moebench:read",
                 "moebench routing traces (routing.npz, TraceRecorder, moebench-sim --save-trace), merged"),
}


def import_trace(fmt: str, paths: Sequence[Path], shape: Shape = Shape(), **options: Any) -> RoutingTrace:
    """Read `paths` (in order) as format `fmt` and return the validated trace. `options` go to the
    reader (vllm: prefill_chunk; transformers: batch). ImportFailure (a ValueError) names the file,
    what was wrong, what is allowed and what was given."""
    if fmt not in FORMATS:
        raise ImportFailure(f"unknown trace format {fmt!r}; allowed: {', '.join(FORMATS)}")
    if not paths:
        raise ImportFailure("no input file; allowed: one or more files of the format, in the order recorded")
    for p in paths:
        if not p.is_file():
            raise ImportFailure(f"{p}: no such file")
    module, _, fn = FORMATS[fmt][0].partition(":")
    reader = getattr(importlib.import_module(module), fn)
    top_k = shape.top_k if shape.top_k is not None else getattr(shape.cfg, "top_k", None)
    read = reader(list(paths), top_k=top_k, **options)
    return finish(read, shape, fmt, list(paths))
