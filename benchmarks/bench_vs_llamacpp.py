"""Our engine (`resident`, CPU) against llama.cpp (the pinned build, llama-server) on the same
mid-size Mixtral-shaped checkpoint: prefill tok/s on 512 tokens, decode tok/s over 64 tokens,
and greedy token agreement between the two on the same prompt.

llama.cpp runs the f32 GGUF converted from the very checkpoint our engine loads, in the exact
configuration (f32 KV cache, flash attention off), one slot, prompt cache off per request;
its figures are its own timings (`prompt_ms`, `predicted_ms` over predicted_n - 1 decode
steps), ours are wall time around `prefill` / the decode loop (both engine-internal, §7.6).
Repeats alternate the two engines so machine noise hits both alike; each thread count gets
its own server and `torch.set_num_threads`. Reported: medians with min-max, ratio ours/llama.cpp,
and each median's frac_of_roofline (benchmarks/bench_roofline.py: rates measured in this process
at that thread count).
Not a test: `python benchmarks/bench_vs_llamacpp.py [--repeats N] [--threads 1,2]` (needs `make llamacpp`).
"""
from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_roofline  # noqa: E402
from bench_vs_transformers import SHAPE, build_checkpoint, parser, summary, time_ours  # noqa: E402
from engine import Engine  # noqa: E402
from harness.llamacpp.build import cache_root, find_binaries  # noqa: E402
from harness.llamacpp.convert import convert  # noqa: E402
from harness.llamacpp.flags import EXACT  # noqa: E402
from harness.llamacpp.server import LlamaServer  # noqa: E402


def checkpoint(shape: dict = SHAPE) -> Path:
    """The benchmark checkpoint (or another `shape` of it), saved once into the cache (so its
    GGUF is converted once)."""
    key = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:12]
    path = cache_root() / "checkpoints" / f"bench-mixtral-{key}"
    if not (path / "config.json").is_file():
        tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent if path.parent.exists() else None))
        build_checkpoint(tmp, shape)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, path)
    return path


def time_llamacpp(srv: LlamaServer, prompt: list[int], n_decode: int) -> tuple[float, float, list[int]]:
    r = srv.complete(prompt, n_decode + 1, cache_prompt=False)
    t = r.timings
    assert t.cache_n == 0 and t.prompt_n == len(prompt) and t.decode_steps == n_decode, t.raw
    return t.prompt_ms / 1e3, t.predicted_ms / 1e3, r.tokens


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    bins = find_binaries()
    path = checkpoint()
    gguf = convert(path, "f32")
    ours = Engine.from_pretrained(str(path), placement="resident", device="cpu",
                                  max_context=args.prefill + args.decode + 1)
    torch.manual_seed(0)
    prompt = torch.randint(0, SHAPE["vocab_size"], (args.prefill,)).tolist()
    info = bins.info
    print(f"torch {torch.__version__}; llama.cpp {info.llama_cpp_commit if info else '?'} "
          f"({info.backend if info else bins.origin}), {args.repeats} repeats (median; min-max)")
    print(f"model: Mixtral-shaped, hidden {SHAPE['hidden_size']}, {SHAPE['num_hidden_layers']} layers, "
          f"{SHAPE['num_local_experts']} experts, top-{SHAPE['num_experts_per_tok']}, fp32 "
          f"(GGUF f32, {gguf.size_bytes / 2**30:.2f} GiB); llama.cpp flags {' '.join(EXACT.server_argv())}")
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        log = Path(tempfile.gettempdir()) / f"bench_vs_llamacpp-t{threads}.log"
        flags = EXACT.replace(threads=threads, ctx=args.prefill + args.decode + 8, cache_ram=0)
        with LlamaServer(gguf.path, flags, log_path=log, binaries=bins) as srv:
            time_ours(ours, [prompt[:32]], 2)                   # warm-up, excluded
            time_llamacpp(srv, prompt[:32], 2)
            rates_before = bench_roofline.measured_rates(eng=ours, prefill_tokens=args.prefill)
            s: dict[str, list[float]] = {k: [] for k in ("ours_prefill", "ours_decode", "ll_prefill", "ll_decode")}
            for r in range(args.repeats):
                for name in (("ours", "ll") if r % 2 == 0 else ("ll", "ours")):
                    if name == "ours":
                        p, d = time_ours(ours, [prompt], args.decode)
                    else:
                        p, d, _ = time_llamacpp(srv, prompt, args.decode)
                    s[f"{name}_prefill"].append(args.prefill / p)
                    s[f"{name}_decode"].append(args.decode / d)
            ref = ours.generate([prompt], args.decode + 1).tokens[0]
            got = srv.complete(prompt, args.decode + 1, cache_prompt=False).tokens
            agree = sum(a == b for a, b in zip(ref, got)) / len(ref)
            peak = srv.peak_rss_bytes()
        load = os.getloadavg()
        print(f"-- {threads} thread(s); load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
              f"llama-server peak RSS {peak / 2**30:.2f} GiB")
        print(summary("prefill", s["ours_prefill"], s["ll_prefill"], "llama.cpp", f"tok/s on {args.prefill} tokens"))
        print(summary("decode", s["ours_decode"], s["ll_decode"], "llama.cpp", f"tok/s over {args.decode} tokens"))
        rates = bench_roofline.measured_rates(rates_before, ours, args.prefill)
        bound = bench_roofline.bound(ours, args.prefill, args.prefill + args.decode // 2, rates)
        print(bench_roofline.line(threads, bound, rates, {
            (name, phase): statistics.median(s[f"{key}_{phase}"])
            for name, key in (("ours", "ours"), ("llama.cpp", "ll")) for phase in ("prefill", "decode")}))
        print(bench_roofline.expert_shape_line(ours, args.prefill, bound, rates, {
            name: statistics.median(s[f"{key}_prefill"]) for name, key in (("ours", "ours"), ("llama.cpp", "ll"))}))
        print(f"token agreement (greedy, {len(ref)} tokens after the same {args.prefill}-token prompt): {agree:.3f}")


if __name__ == "__main__":
    main()
