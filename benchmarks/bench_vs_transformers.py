"""Our engine (`resident`, CPU) against Hugging Face transformers on the same mid-size
Mixtral-shaped checkpoint: prefill tok/s on 512 tokens and decode tok/s over 64 tokens.

The same work on both sides: transformers computes logits for the last position only
(`logits_to_keep=1`), as our engine does. Both engines run in one process, interleaved,
repeats alternating, at each requested thread count, so machine noise hits both alike; the
figures reported are medians with min-max and their ratio (ours / transformers), with the
load average before and after, and each median's frac_of_roofline (benchmarks/bench_roofline.py).
`--profile N` adds, per thread count, N more prefill passes of each engine under torch.profiler,
interleaved, split into GEMMs (aten::mm), the attention kernel and every other op by self time
(profile_decode's categories), aten::mm per weight shape ([K, N] of x [M, K] @ W [K, N]), and the
ceiling that split puts on the prefill ratio: transformers' median prefill time over our GEMMs and
attention alone -- the ratio ours would reach if all its other ops cost nothing.
Not a test: run `python benchmarks/bench_vs_transformers.py [--repeats N] [--threads 1,2] [--profile N]`.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import engine  # noqa: F401 -- before torch: OpenMP's idle spin, read once (engine.kernels.openmp)
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_roofline  # noqa: E402
from engine import Engine  # noqa: E402

SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=1024, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=4, num_local_experts=16, num_experts_per_tok=2,
             max_position_embeddings=4096, rope_theta=1e6)


def skeleton_of(shape: dict) -> dict:
    """The same architecture (layers, heads, experts, top-k: every op and line of Python a step runs)
    with its matrices shrunk to nothing: a step of it is the per-step cost that is not reading weights.
    Head dim 8, the smallest every kernel path of a CPU decode step takes (engine.layers.fused_decode_ok)."""
    return shape | {"hidden_size": 8 * shape["num_attention_heads"], "intermediate_size": 64, "vocab_size": 512}


def skeleton_words(shape: dict) -> str:
    """The skeleton of `shape` in words, for a report line."""
    skel = skeleton_of(shape)
    return f"hidden {skel['hidden_size']}, vocab {skel['vocab_size']}"


def build_checkpoint(path: Path, shape: dict = SHAPE):
    import transformers as tf
    torch.manual_seed(0)
    model = tf.MixtralForCausalLM(tf.MixtralConfig(**shape)).eval()
    model.save_pretrained(path)
    return model


def time_hf(model, prompt: torch.Tensor, n_decode: int) -> tuple[float, float]:
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(prompt, use_cache=True, logits_to_keep=1)
        t1 = time.perf_counter()
        past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        t2 = time.perf_counter()
        for _ in range(n_decode):
            out = model(tok, past_key_values=past, use_cache=True, logits_to_keep=1)
            past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        t3 = time.perf_counter()
    return t1 - t0, t3 - t2


def time_ours(eng: Engine, prompt: list[list[int]], n_decode: int) -> tuple[float, float]:
    sess = eng.new_session(1)
    t0 = time.perf_counter()
    logits = eng.prefill(sess, prompt)
    t1 = time.perf_counter()
    tok = logits.argmax(-1).tolist()
    t2 = time.perf_counter()
    for _ in range(n_decode):
        tok = eng.decode_step(sess, tok).argmax(-1).tolist()
    t3 = time.perf_counter()
    sess.close()
    return t1 - t0, t3 - t2


GEMV_OPS = ("aten::mm", "aten::addmm")           # the weight-streaming matrix products of a decode step


def category(name: str) -> str:
    """The op category a profiler row's time counts under: GEMV, the attention kernel, or other ops."""
    if name in GEMV_OPS:
        return "GEMV (aten::mm)"
    if "scaled_dot_product" in name:
        return "attention kernel"
    return "other ops"


def prefill_split(runs: dict[str, Callable[[], object]], passes: int) -> dict[str, dict[str, float]]:
    """Per engine, the median ms per prefill pass of each op category by self time (GEMMs,
    attention, other), the aten calls of the two matrix ops per pass, and aten::mm's time and
    calls per weight shape ("mm [K, N]"), from `passes` profiled passes per engine, alternating
    which goes first."""
    from torch.profiler import ProfilerActivity, profile

    samples: dict[str, dict[str, list[float]]] = {k: defaultdict(list) for k in runs}
    for r in range(passes):
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
                runs[name]()
            per: dict[str, float] = defaultdict(float)
            for e in p.key_averages(group_by_input_shape=True):
                per[category(e.key)] += e.self_cpu_time_total / 1e3
                if e.key in ("aten::mm", "aten::_grouped_mm"):
                    per[f"{e.key} calls"] += e.count
                if e.key == "aten::mm" and len(e.input_shapes) > 1 and len(e.input_shapes[1]) == 2:
                    shape = f"mm [{e.input_shapes[1][0]}, {e.input_shapes[1][1]}]"
                    per[shape] += e.self_cpu_time_total / 1e3
                    per[f"{shape} calls"] += e.count
            for k, v in per.items():
                samples[name][k].append(v)
    return {name: {k: statistics.median(v) for k, v in cats.items()} for name, cats in samples.items()}


def split_lines(split: dict[str, dict[str, float]], hf_prefill_ms: float) -> list[str]:
    """The printed op split and the ceiling it puts on ours / transformers in prefill."""
    gemm, attn = "GEMV (aten::mm)", "attention kernel"
    out = [f"   {name:<12} GEMMs {c[gemm]:7.1f}  attention {c[attn]:6.1f}  other ops {c['other ops']:6.1f} ms; "
           f"aten::mm calls {c.get('aten::mm calls', 0):.0f}, aten::_grouped_mm calls "
           f"{c.get('aten::_grouped_mm calls', 0):.0f}" for name, c in split.items()]
    ours, theirs = split["ours"], split["transformers"]
    for shape in sorted(k for k in ours if k.startswith("mm [") and not k.endswith("calls")):
        out.append(f"   {shape:<16} ours {ours[shape]:7.1f} ms in {ours[shape + ' calls']:.0f} calls, transformers "
                   f"{theirs.get(shape, 0.0):7.1f} ms in {theirs.get(shape + ' calls', 0):.0f}")
    out.append(f"   ceiling: transformers' median prefill {hf_prefill_ms:.1f} ms / our GEMMs + attention "
               f"{ours[gemm] + ours[attn]:.1f} ms = {hf_prefill_ms / (ours[gemm] + ours[attn]):.2f}x "
               "(ours with every other op free)")
    return out


def parser(description: str) -> argparse.ArgumentParser:
    """The arguments every engine-vs-engine benchmark takes (the same work on both sides)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    return ap


def summary(name: str, ours: list[float], other: list[float], other_name: str, unit: str) -> str:
    """One phase's line: each side's median (min-max) and the ratio of the medians, ours / theirs."""
    mo, mt = statistics.median(ours), statistics.median(other)
    return (f"{name:<8} ours {mo:8.1f} ({min(ours):.1f}-{max(ours):.1f})  {other_name} {mt:8.1f} "
            f"({min(other):.1f}-{max(other):.1f}) {unit}  ratio {mo / mt:.2f}x")


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="N profiled prefill passes per engine: the op split and the ratio's ceiling")
    args = ap.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        hf = build_checkpoint(Path(d))
        ours = Engine.from_pretrained(d, placement="resident", device="cpu", max_context=args.prefill + args.decode + 1)
    prompt = torch.randint(0, SHAPE["vocab_size"], (1, args.prefill))
    print(f"torch {torch.__version__}, {args.repeats} repeats per thread count (median; min-max); "
          f"load average before {os.getloadavg()[0]:.2f}")
    print(f"model: Mixtral-shaped, hidden {SHAPE['hidden_size']}, {SHAPE['num_hidden_layers']} layers, "
          f"{SHAPE['num_local_experts']} experts, top-{SHAPE['num_experts_per_tok']}, fp32; transformers with "
          "logits_to_keep=1")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        samples: dict[str, list[float]] = {k: [] for k in ("hf_prefill", "hf_decode", "ours_prefill", "ours_decode")}
        time_hf(hf, prompt[:, :32], 2)                          # warm-up, excluded
        time_ours(ours, prompt[:, :32].tolist(), 2)
        rates_before = bench_roofline.measured_rates(eng=ours, prefill_tokens=args.prefill)
        for r in range(args.repeats):
            for name in (("hf", "ours") if r % 2 == 0 else ("ours", "hf")):
                p, dcd = (time_hf(hf, prompt, args.decode) if name == "hf"
                          else time_ours(ours, prompt.tolist(), args.decode))
                samples[f"{name}_prefill"].append(args.prefill / p)
                samples[f"{name}_decode"].append(args.decode / dcd)
        med = {k: statistics.median(v) for k, v in samples.items()}
        for phase, unit in (("prefill", f"tok/s on {args.prefill} tokens"),
                            ("decode", f"tok/s over {args.decode} tokens")):
            print(f"{threads} thread(s) "
                  + summary(phase, samples[f"ours_{phase}"], samples[f"hf_{phase}"], "transformers", unit))
        rates = bench_roofline.measured_rates(rates_before, ours, args.prefill)
        bound = bench_roofline.bound(ours, args.prefill, args.prefill + args.decode // 2, rates)
        print(bench_roofline.line(threads, bound, rates, {(name, phase): med[f"{key}_{phase}"]
                                                          for name, key in (("ours", "ours"), ("transformers", "hf"))
                                                          for phase in ("prefill", "decode")}))
        print(bench_roofline.expert_shape_line(ours, args.prefill, bound, rates,
                                               {"ours": med["ours_prefill"], "transformers": med["hf_prefill"]}))
        if args.profile:
            split = prefill_split({"ours": lambda: time_ours(ours, prompt.tolist(), 0),
                                   "transformers": lambda: time_hf(hf, prompt, 0)}, args.profile)
            print(f"prefill op split at {threads} thread(s), self time per pass, median of {args.profile} "
                  "profiled passes each, interleaved:")
            print("\n".join(split_lines(split, args.prefill / med["hf_prefill"] * 1e3)))
    print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
