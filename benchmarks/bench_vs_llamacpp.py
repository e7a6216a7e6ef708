"""Our engine (CPU) against llama.cpp (the pinned build, llama-server) on the same Mixtral-shaped
checkpoint: prefill tok/s, decode tok/s, and greedy token agreement between the two on the same
prompt, per thread count, at one of two shapes (`--shape`): `small` (hidden 1024, 8 layers, the
engine-speed benchmark's) or `wide` (hidden and expert intermediate 2048, 6 layers: ~1.1 GB read
per decode token, where the weight reads, not per-op dispatch, set the pace).

llama.cpp runs the f32 GGUF converted from the very checkpoint our engine loads (both built once
into the cache), in the exact configuration (f32 KV cache, flash attention off), one slot,
prompt cache off per request; its figures are its own timings (`prompt_ms`, `predicted_ms` over
predicted_n - 1 decode steps), ours are wall time around `prefill` / the decode loop (both
engine-internal, §7.6). Repeats alternate the engines so machine noise hits them alike; each
thread count gets its own server and `torch.set_num_threads`. Reported: medians with min-max,
ratio ours/llama.cpp, the load average around each thread count, and each median's
frac_of_roofline against the machine's RAM read bandwidth (benchmarks/bench_roofline.py; "roofline
wrong" where a figure beats the bound by more than the slack). `--ab` times ours a second way in
the same rounds, with the engine's CPU kernels off (engine.kernels.cpu: torch's path), and prints
the ratio kernels on / off. Each round also times both engines' decode on the shape's skeleton
(bench_vs_transformers.skeleton_of: the same architecture with its matrices shrunk to nothing),
the per-step cost that is not reading weights (dispatch, Python, the graph), in ms per step.
Not a test: `python benchmarks/bench_vs_llamacpp.py [--shape small|wide] [--repeats N] [--threads 1,2] [--ab]`
(needs `make llamacpp`).
"""
from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import engine  # noqa: F401 -- before torch: OpenMP's idle spin, read once (engine.kernels.openmp)
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_roofline  # noqa: E402
from bench_vs_transformers import SHAPE, build_checkpoint, parser, skeleton_of, summary, time_ours  # noqa: E402
from engine import Engine  # noqa: E402
from engine.kernels import cpu as cpu_kernels  # noqa: E402
from engine.kernels.openmp import as_given, spin_state  # noqa: E402
from harness.llamacpp.build import cache_root, find_binaries  # noqa: E402
from harness.llamacpp.convert import convert  # noqa: E402
from harness.llamacpp.flags import EXACT  # noqa: E402
from harness.llamacpp.server import LlamaServer  # noqa: E402


SHAPES = {"small": SHAPE,
          "wide": {**SHAPE, "hidden_size": 2048, "intermediate_size": 2048, "num_hidden_layers": 6}}


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
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small", help="the checkpoint's shape (see above)")
    ap.add_argument("--placement", default="resident", help="our engine's placement (the CPU runs every expert)")
    ap.add_argument("--ab", action="store_true", help="also time ours with the CPU kernels off, interleaved")
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    bins = find_binaries()
    path = checkpoint(shape)
    gguf = convert(path, "f32")
    ours = Engine.from_pretrained(str(path), placement=args.placement, device="cpu",
                                  max_context=args.prefill + args.decode + 1)
    skel_shape = skeleton_of(shape)               # the per-step cost that is not reading weights, both engines
    skel_path = checkpoint(skel_shape)
    skel_gguf = convert(skel_path, "f32")
    skel = Engine.from_pretrained(str(skel_path), placement=args.placement, device="cpu",
                                  max_context=args.prefill + args.decode + 1)
    torch.manual_seed(0)
    prompt = torch.randint(0, shape["vocab_size"], (args.prefill,)).tolist()
    skel_prompt = torch.randint(0, skel_shape["vocab_size"], (args.prefill,)).tolist()
    info = bins.info
    print(f"torch {torch.__version__}; llama.cpp {info.llama_cpp_commit if info else '?'} "
          f"({info.backend if info else bins.origin}), {args.repeats} repeats (median; min-max); CPU kernels "
          f"{'on' if cpu_kernels.available() else 'unavailable: ' + str(cpu_kernels.reason())}; ours' idle OpenMP "
          f"workers: {spin_state()}; llama-server's: {as_given().get('GOMP_SPINCOUNT', 'libgomp default')}")
    print(f"model ({args.shape}): Mixtral-shaped, hidden {shape['hidden_size']}, expert intermediate "
          f"{shape['intermediate_size']}, {shape['num_hidden_layers']} layers, {shape['num_local_experts']} experts, "
          f"top-{shape['num_experts_per_tok']}, fp32 (GGUF f32, {gguf.size_bytes / 2**30:.2f} GiB); ours "
          f"placement={args.placement}; llama.cpp flags {' '.join(EXACT.server_argv())}")
    names = ("ours", "ll", "off") if args.ab else ("ours", "ll")
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        log = Path(tempfile.gettempdir()) / f"bench_vs_llamacpp-t{threads}.log"
        flags = EXACT.replace(threads=threads, ctx=args.prefill + args.decode + 8, cache_ram=0)
        load_before = os.getloadavg()
        skel_log = Path(tempfile.gettempdir()) / f"bench_vs_llamacpp-skeleton-t{threads}.log"
        with LlamaServer(gguf.path, flags, log_path=log, binaries=bins) as srv, \
                LlamaServer(skel_gguf.path, flags, log_path=skel_log, binaries=bins) as skel_srv:
            time_ours(ours, [prompt[:32]], 2)                   # warm-up, excluded
            time_llamacpp(srv, prompt[:32], 2)
            time_ours(skel, [skel_prompt[:32]], 2)
            time_llamacpp(skel_srv, skel_prompt[:32], 2)
            rates_before = bench_roofline.measured_rates(eng=ours, prefill_tokens=args.prefill)
            s: dict[str, list[float]] = {f"{n}_{ph}": [] for n in names for ph in ("prefill", "decode")}
            step_ms: dict[str, list[float]] = {"ours": [], "ll": []}         # the skeletons' decode, ms per step
            for r in range(args.repeats):
                for name in names[r % len(names):] + names[: r % len(names)]:     # each first in turn
                    if name == "ll":
                        p, d, _ = time_llamacpp(srv, prompt, args.decode)
                    else:
                        with cpu_kernels.enabled(name == "ours"):
                            p, d = time_ours(ours, [prompt], args.decode)
                    s[f"{name}_prefill"].append(args.prefill / p)
                    s[f"{name}_decode"].append(args.decode / d)
                step_ms["ours"].append(time_ours(skel, [skel_prompt], args.decode)[1] / args.decode * 1e3)
                step_ms["ll"].append(time_llamacpp(skel_srv, skel_prompt, args.decode)[1] / args.decode * 1e3)
            ref = ours.generate([prompt], args.decode + 1).tokens[0]
            got = srv.complete(prompt, args.decode + 1, cache_prompt=False).tokens
            agree = sum(a == b for a, b in zip(ref, got)) / len(ref)
            peak = srv.peak_rss_bytes()
        load = os.getloadavg()
        print(f"-- {threads} thread(s); load average before {load_before[0]:.2f}, after {load[0]:.2f} {load[1]:.2f} "
              f"{load[2]:.2f}; llama-server peak RSS {peak / 2**30:.2f} GiB")
        print(summary("prefill", s["ours_prefill"], s["ll_prefill"], "llama.cpp", f"tok/s on {args.prefill} tokens"))
        print(summary("decode", s["ours_decode"], s["ll_decode"], "llama.cpp", f"tok/s over {args.decode} tokens"))
        if args.ab:
            for phase in ("prefill", "decode"):
                print(summary(phase, s[f"ours_{phase}"], s[f"off_{phase}"], "kernels off", "tok/s"))
        print("dispatch (a decode step of the same architecture, hidden 64, vocab 512: no weights to speak of): "
              + "  ".join(f"{label} {statistics.median(step_ms[key]):.2f} ({min(step_ms[key]):.2f}-"
                          f"{max(step_ms[key]):.2f}) ms/step" for label, key in (("ours", "ours"), ("llama.cpp", "ll"))))
        rates = bench_roofline.measured_rates(rates_before, ours, args.prefill)
        bound = bench_roofline.bound(ours, args.prefill, args.prefill + args.decode // 2, rates)
        engines = (("ours", "ours"), ("llama.cpp", "ll")) + ((("ours kernels off", "off"),) if args.ab else ())
        print(bench_roofline.line(threads, bound, rates, {
            (name, phase): statistics.median(s[f"{key}_{phase}"]) for name, key in engines
            for phase in ("prefill", "decode")}))
        print(bench_roofline.expert_shape_line(ours, args.prefill, bound, rates, {
            name: statistics.median(s[f"{key}_prefill"]) for name, key in engines}))
        print(f"token agreement (greedy, {len(ref)} tokens after the same {args.prefill}-token prompt): {agree:.3f}")


if __name__ == "__main__":
    main()
