"""`moebench trace ...`: routing traces from other engines, on the command line.

Owns: argument parsing and everything the command prints. Does not own: reading the formats
or checking them (harness.traces).

    moebench trace import --from vllm responses.jsonl --model qwen3-30b-a3b --out qwen3.npz
    moebench trace import --from sglang-stat expert_distribution_rank0_timestamp1.csv \\
        --model deepseek-v3 --out dsv3_counts.npz          # count-only: popularity analyses only
    moebench trace import --from transformers pass0.pt pass1.pt --model path/to/checkpoint --out t.npz
    moebench-sim qwen3.npz --policy lru,lfru,belady --capacity 16,32

Exit status: 0 when the trace was written; 2 on a bad argument or input (one line on stderr
saying what was wrong, what is allowed and what was given).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from engine.trace import RoutingTrace, save_trace
from harness.traces import FORMATS, ImportFailure, Shape, import_trace

PROG = "moebench trace import"
USAGE = "moebench trace import --from FORMAT FILE... --out TRACE.npz [--model NAME|DIR] [options]"


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line: what was wrong, then where the help is."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    formats = "\n".join(f"  {name:<17} {desc}" for name, (_, desc) in FORMATS.items())
    p = OneLineParser(prog=PROG, usage=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter,
                      description="Import routing recorded by another engine as a moebench routing trace (.npz) "
                                  "that moebench-sim, the cache policies and the cost model read.",
                      epilog=f"formats:\n{formats}\n\nA count-only import (sglang-stat) holds expert counts and no "
                             "token order: it serves popularity analyses\n(moebench-sim --popularity, "
                             "cache.policy=static cache.policy_options.trace=FILE); replays refuse it.")
    p.add_argument("files", nargs="+", type=Path, metavar="FILE", help="input files, in the order recorded")
    p.add_argument("--from", dest="fmt", required=True, choices=list(FORMATS), metavar="FORMAT",
                   help=f"input format: {', '.join(FORMATS)}")
    p.add_argument("--out", type=Path, required=True, help="the routing trace to write (.npz)")
    p.add_argument("--model", metavar="NAME|DIR",
                   help="the model the routing came from: a preset (moebench plan's names) or a checkpoint "
                        "directory; gives experts, MoE layers, top-k and expert bytes, and checks the files "
                        "against them")
    p.add_argument("--dtype", help="weight dtype for the expert bytes from --model (default: the model's own)")
    p.add_argument("--n-experts", type=int, help="routed experts per layer (when there is no --model)")
    p.add_argument("--expert-bytes", type=int, help="bytes one expert moves (overrides --model's, e.g. quantised)")
    p.add_argument("--top-k", type=int, help="experts per token (transformers logits and counts do not say)")
    p.add_argument("--prefill-chunk", type=int, help="vllm: prompt tokens per forward pass (chunked prefill); "
                                                      "default: the whole prompt in one")
    p.add_argument("--batch", type=int, default=1, help="transformers: sequences per file's rows (default 1)")
    return p


def _shape(args: argparse.Namespace) -> Shape:
    for name in ("n_experts", "expert_bytes", "top_k", "prefill_chunk", "batch"):
        value = getattr(args, name)
        low = 0 if name == "expert_bytes" else 1
        if value is not None and value < low:
            raise ImportFailure(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    if args.model is None:
        if args.dtype is not None:
            raise ImportFailure(f"--dtype {args.dtype} sizes the experts of --model, and no --model was given")
        return Shape(n_experts=args.n_experts, expert_bytes=args.expert_bytes, top_k=args.top_k)
    from engine.config import ModelConfig, preset
    from engine.dtypes import dtype_bytes
    path = Path(args.model)
    cfg = ModelConfig.from_hf_dir(path if path.is_dir() else path.parent) if path.is_dir() or path.name == \
        "config.json" else preset(args.model)
    return Shape(cfg=cfg, dtype_bytes=dtype_bytes(args.dtype or cfg.torch_dtype), n_experts=args.n_experts,
                 expert_bytes=args.expert_bytes, top_k=args.top_k)


def _summary(tr: RoutingTrace) -> str:
    if tr.count_only:
        return (f"count-only: {int(tr.counts.sum())} routings over {tr.n_layers} layers of {tr.n_experts} experts, "
                "no token order -- it serves popularity analyses only (moebench-sim --popularity, "
                "cache.policy=static cache.policy_options.trace=FILE); replays refuse it")
    n_seq = 0 if tr.sequence is None else len(set(tr.sequence.tolist()))
    seqs = "" if tr.sequence is None else f", {n_seq} sequence{'' if n_seq == 1 else 's'}"
    return (f"{tr.n_tokens} tokens x {tr.n_layers} layers x top-{tr.top_k} of {tr.n_experts} experts, "
            f"{int(tr.step_ids()[-1]) + 1} steps{seqs}; order: {tr.meta['order']}")


def import_main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    try:
        if args.out.suffix != ".npz":
            raise ImportFailure(f"--out must name an .npz file, got {args.out.name!r}")
        options = {"prefill_chunk": args.prefill_chunk} if args.fmt == "vllm" else \
            {"batch": args.batch} if args.fmt == "transformers" else {}
        tr = import_trace(args.fmt, args.files, _shape(args), **options)
        save_trace(args.out, tr)
    except (ValueError, FileNotFoundError) as exc:       # ImportFailure, an unknown preset, a bad config.json
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{PROG}: error: cannot write {args.out} ({exc.strerror or exc})", file=sys.stderr)
        return 2
    print(f"{args.fmt}: {len(args.files)} file(s) -> {args.out}: {_summary(tr)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["import"]:
        return import_main(argv[1:])
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: moebench trace import --from FORMAT FILE... --out TRACE.npz [options]\n\n"
              "  import   routing recorded by vLLM, SGLang, transformers or moebench -> a routing trace (.npz)\n\n"
              "moebench trace import --help lists the formats and options.")
        return 0 if argv else 2
    print(f"moebench trace: error: unknown sub-command {argv[0]!r}; allowed: import (see moebench trace --help)",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
