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
`--quant int8|int4` runs our engine with that lossy expert treatment (experts.quant; int4 in
groups of 32; `--activations int8`: the experts' inputs rounded to int8 per block of 32 first, as
llama.cpp's Q8_0 / Q4_0 dot products round theirs) against llama.cpp on the same checkpoint quantised to Q8_0 / Q4_0 -- which
quantises attention and the LM head too (llama-quantize's own choice of type per tensor), so it
reads fewer bytes per token than ours, whose treatment quantises the experts only -- and against
llama.cpp on a GGUF whose experts alone are Q8_0 / Q4_0, the rest f32 as ours (llama-quantize
--tensor-type): the like-for-like comparison of the expert kernels. The bytes each reads per
decode token are printed, and each llama.cpp's frac_of_roofline is against its own bytes.
Not a test: `python benchmarks/bench_vs_llamacpp.py [--shape small|wide] [--repeats N] [--threads 1,2] [--ab]
[--quant int8|int4 [--activations int8]]` (needs `make llamacpp`).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import engine  # noqa: F401 -- before torch: OpenMP's idle spin, read once (engine.kernels.openmp)
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_roofline  # noqa: E402
from bench_vs_transformers import (SHAPE, build_checkpoint, parser, skeleton_of, skeleton_words, summary,  # noqa: E402
                                   time_ours)
from engine import Engine  # noqa: E402
from engine.kernels import cpu as cpu_kernels  # noqa: E402
from engine.kernels.openmp import as_given, spin_state  # noqa: E402
from harness.llamacpp.build import cache_root, find_binaries  # noqa: E402
from harness.llamacpp.convert import GGUFModel, convert  # noqa: E402
from harness.llamacpp.flags import EXACT  # noqa: E402
from harness.llamacpp.server import LlamaServer  # noqa: E402
from harness.llamacpp.source import gguf_module  # noqa: E402


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


QUANT_GGUF = {"int8": "q8_0", "int4": "q4_0"}           # our treatment -> the llama.cpp type it is set against
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def experts_only_gguf(f32: GGUFModel, gtype: str) -> Path:
    """The f32 GGUF with its expert tensors alone quantised to `gtype` (llama-quantize, the rest
    kept f32 by --tensor-type and the output / embedding types: what our expert treatment does),
    made once beside it. gguf_decode_bytes' types per tensor show what it holds."""
    out = f32.path.with_name(f"model-f32-experts-{gtype}.gguf")
    if not out.is_file():
        quantize = find_binaries().quantize
        if quantize is None:
            raise SystemExit("--quant needs llama-quantize, which the llama.cpp build at hand lacks (make llamacpp)")
        tmp = out.with_suffix(".tmp")
        # the type is gtype and every tensor but the experts' is set back to f32 (overrides of an F32
        # target are ignored by this llama-quantize)
        cmd = [str(quantize), "--tensor-type", "attn_.*=f32", "--tensor-type", "ffn_gate_inp=f32",
               "--output-tensor-type", "f32", "--token-embedding-type", "f32", str(f32.path), str(tmp), gtype.upper()]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["no output"]
            raise SystemExit(f"llama-quantize failed (exit {proc.returncode}) making {out.name}: {tail[0]}")
        os.replace(tmp, out)
    return out


def gguf_decode_bytes(path: Path, top_k: int, n_experts: int) -> tuple[int, dict[str, int]]:
    """Weight bytes a decode token reads from GGUF `path` (KV excluded): every tensor, the expert
    tensors' top_k / n_experts share, one row of the token embedding; and the bytes by tensor type."""
    total, by_type = 0, {}
    for t in gguf_module().GGUFReader(str(path)).tensors:
        n = int(t.n_bytes)
        if any(e in t.name for e in EXPERT_TENSORS):
            n = n * top_k // n_experts
        elif t.name.startswith("token_embd"):
            n = n // int(t.shape[-1])                  # one row of [n_embd, n_vocab] (GGUF lists dims inner first)
        total += n
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + n
    return total, by_type


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
    ap.add_argument("--quant", choices=("none", *QUANT_GGUF), default="none",
                    help="our experts.quant treatment, against llama.cpp's Q8_0 (int8) / Q4_0 (int4): see above")
    ap.add_argument("--activations", choices=("fp32", "int8"), default="fp32",
                    help="with --quant, our experts.activations: int8 rounds the experts' inputs per block of 32 "
                         "as llama.cpp's Q8_0 / Q4_0 dot products do")
    args = ap.parse_args()
    if args.activations != "fp32" and args.quant == "none":
        ap.error("--activations int8 applies to quantised experts: give --quant int8 or --quant int4")
    shape = SHAPES[args.shape]
    bins = find_binaries()
    path = checkpoint(shape)
    gguf = convert(path, "f32")
    ours = Engine.from_pretrained(str(path), placement=args.placement, device="cpu",
                                  max_context=args.prefill + args.decode + 1, expert_quant=args.quant,
                                  quant_options={"activations": args.activations})
    ggufs = {"ll": gguf.path}                     # llama.cpp's engines: name -> the GGUF it serves
    if args.quant != "none":
        gtype = QUANT_GGUF[args.quant]
        ggufs = {"ll": convert(path, gtype).path, "lle": experts_only_gguf(gguf, gtype)}
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
    labels = {"ll": "llama.cpp", "lle": "llama.cpp experts-only", "off": "kernels off"}
    if args.quant != "none":
        gtype = QUANT_GGUF[args.quant].upper()
        labels["ll"] = f"llama.cpp {gtype}"
        labels["lle"] = f"llama.cpp experts-only {gtype}"
        print(f"lossy: ours experts.quant={args.quant} experts.activations={args.activations} (experts only; "
              f"attention, norms and the LM head fp32); "
              f"'{labels['ll']}' is llama-quantize's {gtype} model, which quantises attention and the LM head "
              f"too; '{labels['lle']}' quantises the expert tensors alone, the rest f32 as ours")
    ll_bytes = {k: gguf_decode_bytes(p, shape["num_experts_per_tok"], shape["num_local_experts"])
                for k, p in ggufs.items()}
    names = ("ours", *ggufs) + (("off",) if args.ab else ())
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        log = Path(tempfile.gettempdir()) / f"bench_vs_llamacpp-t{threads}.log"
        flags = EXACT.replace(threads=threads, ctx=args.prefill + args.decode + 8, cache_ram=0)
        load_before = os.getloadavg()
        skel_log = Path(tempfile.gettempdir()) / f"bench_vs_llamacpp-skeleton-t{threads}.log"
        with contextlib.ExitStack() as stack:
            srvs = {k: stack.enter_context(LlamaServer(p, flags, log_path=log.with_name(f"{log.stem}-{k}.log"),
                                                       binaries=bins)) for k, p in ggufs.items()}
            skel_srv = stack.enter_context(LlamaServer(skel_gguf.path, flags, log_path=skel_log, binaries=bins))
            time_ours(ours, [prompt[:32]], 2)                   # warm-up, excluded
            for srv in srvs.values():
                time_llamacpp(srv, prompt[:32], 2)
            time_ours(skel, [skel_prompt[:32]], 2)
            time_llamacpp(skel_srv, skel_prompt[:32], 2)
            rates_before = bench_roofline.measured_rates(eng=ours, prefill_tokens=args.prefill)
            s: dict[str, list[float]] = {f"{n}_{ph}": [] for n in names for ph in ("prefill", "decode")}
            step_ms: dict[str, list[float]] = {"ours": [], "ll": []}         # the skeletons' decode, ms per step
            for r in range(args.repeats):
                for name in names[r % len(names):] + names[: r % len(names)]:     # each first in turn
                    if name in srvs:
                        p, d, _ = time_llamacpp(srvs[name], prompt, args.decode)
                    else:
                        with cpu_kernels.enabled(name == "ours"):
                            p, d = time_ours(ours, [prompt], args.decode)
                    s[f"{name}_prefill"].append(args.prefill / p)
                    s[f"{name}_decode"].append(args.decode / d)
                step_ms["ours"].append(time_ours(skel, [skel_prompt], args.decode)[1] / args.decode * 1e3)
                step_ms["ll"].append(time_llamacpp(skel_srv, skel_prompt, args.decode)[1] / args.decode * 1e3)
            ref = ours.generate([prompt], args.decode + 1).tokens[0]
            agree = {k: sum(a == b for a, b in zip(ref, srv.complete(prompt, args.decode + 1, cache_prompt=False).tokens))
                     / len(ref) for k, srv in srvs.items()}
            peak = {k: srv.peak_rss_bytes() for k, srv in srvs.items()}
        load = os.getloadavg()
        print(f"-- {threads} thread(s); load average before {load_before[0]:.2f}, after {load[0]:.2f} {load[1]:.2f} "
              f"{load[2]:.2f}; llama-server peak RSS "
              + ", ".join(f"{labels[k]} {v / 2**30:.2f} GiB" for k, v in peak.items()))
        for k in srvs:
            print(summary("prefill", s["ours_prefill"], s[f"{k}_prefill"], labels[k], f"tok/s on {args.prefill} tokens"))
            print(summary("decode", s["ours_decode"], s[f"{k}_decode"], labels[k], f"tok/s over {args.decode} tokens"))
        if args.ab:
            for phase in ("prefill", "decode"):
                print(summary(phase, s[f"ours_{phase}"], s[f"off_{phase}"], "kernels off", "tok/s"))
        print(f"dispatch (a decode step of the same architecture, {skeleton_words(shape)}: no weights to speak of): "
              + "  ".join(f"{label} {statistics.median(step_ms[key]):.2f} ({min(step_ms[key]):.2f}-"
                          f"{max(step_ms[key]):.2f}) ms/step" for label, key in (("ours", "ours"), ("llama.cpp", "ll"))))
        rates = bench_roofline.measured_rates(rates_before, ours, args.prefill)
        bound = bench_roofline.bound(ours, args.prefill, args.prefill + args.decode // 2, rates)
        engines = (("ours", "ours"),) + ((("llama.cpp", "ll"),) if args.quant == "none" else ()) + \
            ((("ours kernels off", "off"),) if args.ab else ())
        if args.quant != "none":                # llama.cpp reads other bytes than ours: each against its own
            ours_w = bench_roofline.bound(ours, args.prefill, 0, rates)["decode_bytes"]
            print(f"weight bytes read per decode token (KV excluded): ours {ours_w / 2**20:.0f} MiB; " + "; ".join(
                f"{labels[k]} {b / 2**20:.0f} MiB ("
                + ", ".join(f"{t} {n / 2**20:.0f}" for t, n in sorted(by.items(), key=lambda i: -i[1])) + ")"
                for k, (b, by) in ll_bytes.items()))
            print(f"llama.cpp decode frac_of_roofline at its own bytes (+ the same KV as ours) and the RAM read "
                  f"{rates['read_gbps']:.1f} GB/s: " + "  ".join(
                      f"{labels[k]} " + bench_roofline.fraction(
                          statistics.median(s[f"{k}_decode"]),
                          rates["read_gbps"] * 1e9 / (b + bound["decode_bytes"] - ours_w))
                      for k, (b, _) in ll_bytes.items()))
        print(bench_roofline.line(threads, bound, rates, {
            (name, phase): statistics.median(s[f"{key}_{phase}"]) for name, key in engines
            for phase in ("prefill", "decode")}))
        print(bench_roofline.expert_shape_line(ours, args.prefill, bound, rates, {
            name: statistics.median(s[f"{key}_prefill"]) for name, key in engines}))
        print(f"token agreement (greedy, {len(ref)} tokens after the same {args.prefill}-token prompt): "
              + "  ".join(f"{labels[k]} {a:.3f}" for k, a in agree.items())
              + ("  (different quantisers: agreement is not expected to be 1)" if args.quant != "none" else ""))


if __name__ == "__main__":
    main()
