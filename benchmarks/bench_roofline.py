"""The hardware bound beside the two engine-vs-engine benchmarks (bench_vs_llamacpp,
bench_vs_transformers): what decode and prefill could reach on this machine at the thread
count being measured, so each tok/s comes with its `frac_of_roofline` (DESIGN.md §5).

Owns: the bytes one decode step must read and the FLOPs one prefill token must do for a
loaded engine's model (from its blocks' tensor specs, its expert layout and its KV), and the
bound at rates measured in this process at the current torch thread count -- the machine's RAM
read bandwidth (harness.read_bandwidth: a STREAM-class read, no engine's kernel; decode reads
every weight it uses once per token) and square-GEMM GFLOP/s (prefill) -- with torch's GEMV
weight-read rate beside it for comparison (what the bound used to be: a kernel's rate, which
llama.cpp beat), and each engine's fraction of the bound, "roofline wrong" where a measurement
beats it by more than harness.roofline.ROOFLINE_SLACK. Does not own: the micro-benchmarks
(harness.costmodel.calibrate, harness.read_bandwidth) or the cost model's full prediction
(harness.roofline does that for harness runs, from `moebench calibrate`).

    before = measured_rates()                      # at torch.get_num_threads()
    ...                                            # the timed repeats
    rates = measured_rates(before)                 # the higher of before and after
    b = bound(eng, prefill_tokens=512, context=576, rates=rates)
    b["decode_tok_per_s"], b["prefill_tok_per_s"]

Decode reads: every non-expert weight except the embedding table (one row of it), top-k
experts per MoE layer (a batch-1 step routes one token: exactly top_k distinct experts), and
the KV of every layer at the given context. Prefill does: 2 FLOPs per weight a token uses
(attention and router projections, its top-k experts; the head on the last token only, as both
benchmarks ask for one position's logits) plus causal attention scores, 2 * 2 * H * h * S/2 per
token per layer. No software overhead, copies none (CPU, resident).
"""
from __future__ import annotations

import engine  # noqa: F401 -- before torch: OpenMP's idle spin, read once (engine.kernels.openmp)
import torch

from harness.costmodel.calibrate import best_time, gemm_rates, gemv_rates
from harness.read_bandwidth import read_bandwidth
from harness.roofline import ROOFLINE_SLACK

GEMV_MIB, GEMM_SIZE, REPEATS = 512, 2048, 3


def measured_rates(earlier: dict[str, float] | None = None, eng=None, prefill_tokens: int = 512) -> dict[str, float]:
    """RAM read GB/s (at the current torch thread count and at all cores), torch's GEMV weight-read
    GB/s and GEMM GFLOP/s (fp32) at the current torch thread count, and with
    `eng` the expert FFN's GFLOP/s at a `prefill_tokens` prefill's mean rows per expert
    (`expert_rows`: top_k / n_experts of them; the engine's kernel on a real expert of its store);
    with `earlier` (the same measured before the engines ran), the higher of each: a bound takes
    the machine at its least disturbed, and on a shared machine one measurement can land in a
    moment another process took the cores (call it before and after the timed repeats)."""
    rb = read_bandwidth(fresh=True)
    now = {"read_gbps": rb.gbps, "read_gbps_all_cores": rb.all_cores_gbps,
           "gemv_gbps": gemv_rates("cpu", ["float32"], GEMV_MIB, REPEATS)["float32"],
           "gemm_gflops": gemm_rates("cpu", ["float32"], (GEMM_SIZE,), REPEATS)[f"float32@{GEMM_SIZE}"]}
    if eng is not None:
        cfg, model = eng.cfg, eng.model
        layout, packed = model.arch.experts, model.store.expert(cfg.moe_layers[0], 0)
        rows = max(1, round(prefill_tokens * cfg.top_k / cfg.n_experts))
        x = torch.randn(rows, cfg.hidden_size).to(model.dtype)
        now["expert_rows"] = rows
        now["expert_gflops"] = 2 * rows * layout.params / best_time(lambda: layout.run(x, packed), 10) / 1e9
    return now if earlier is None else {k: max(v, earlier[k]) for k, v in now.items()}


def bound(eng, prefill_tokens: int, context: int, rates: dict[str, float]) -> dict[str, float]:
    """Decode tok/s at `context` held tokens and prefill tok/s over `prefill_tokens` fresh ones."""
    cfg, model = eng.cfg, eng.model
    db = model.dtype.itemsize
    arch = model.arch
    embed = arch.embedding.w["weight"]
    non_expert = arch.non_expert_bytes(db) - (0 if arch.head.tied else embed.numel() * db)
    experts = cfg.n_moe_layers * cfg.top_k * arch.experts.nbytes(db)
    kv = cfg.kv_bytes_per_token(db) * context
    decode_bytes = non_expert + experts + kv + embed.shape[1] * db
    head_params = arch.head.w["weight"].numel()
    weight_params = (non_expert // db - head_params) + cfg.n_moe_layers * cfg.top_k * arch.experts.params
    attn = sum(2 * 2 * layer.attention.H * layer.attention.hd * prefill_tokens / 2
               for layer in arch.layers if hasattr(layer.attention, "H"))
    flops_per_token = 2 * weight_params + attn + 2 * head_params / prefill_tokens
    return {"decode_tok_per_s": rates["read_gbps"] * 1e9 / decode_bytes, "decode_bytes": decode_bytes,
            "prefill_tok_per_s": rates["gemm_gflops"] * 1e9 / flops_per_token, "prefill_flops": flops_per_token}


def fraction(measured: float, bound: float) -> str:
    """A measurement's fraction of its bound as printed: "roofline wrong (x)" above the slack."""
    f = measured / bound
    return f"roofline wrong ({f:.2f})" if f > ROOFLINE_SLACK else f"{f:.2f}"


def line(threads: int, b: dict[str, float], rates: dict[str, float], measured: dict[str, float]) -> str:
    """One printed line: the bound, its basis and each engine's fraction of it."""
    fr = "  ".join(f"{name} {phase} {fraction(v, b[f'{phase}_tok_per_s'])}" for (name, phase), v in measured.items())
    return (f"roofline at {threads} thread(s): decode {b['decode_tok_per_s']:.1f} tok/s "
            f"({b['decode_bytes'] / 2**20:.0f} MiB/token at the RAM read {rates['read_gbps']:.1f} GB/s; all cores "
            f"{rates['read_gbps_all_cores']:.1f}; torch GEMV {rates['gemv_gbps']:.1f}), prefill "
            f"{b['prefill_tok_per_s']:.0f} tok/s ({b['prefill_flops'] / 1e6:.0f} MFLOP/token at GEMM "
            f"{rates['gemm_gflops']:.0f} GFLOP/s); frac_of_roofline: {fr}")


def expert_shape_line(eng, prefill_tokens: int, b: dict[str, float], rates: dict[str, float],
                      measured: dict[str, float]) -> str:
    """What the model's own shapes allow: the expert FFN's rate at a prefill's mean rows per
    expert (`measured_rates(..., eng)`) against the square GEMM's, the prefill bound if expert
    FLOPs ran at that rate, and each engine's fraction of it -- the per-expert GEMM's size, not
    software, is what bounds a MoE prefill below the square-GEMM roofline."""
    cfg, layout = eng.cfg, eng.model.arch.experts
    expert_flops = 2 * cfg.n_moe_layers * cfg.top_k * layout.params
    per_token = (expert_flops / (rates["expert_gflops"] * 1e9)
                 + (b["prefill_flops"] - expert_flops) / (rates["gemm_gflops"] * 1e9))
    fr = "  ".join(f"{name} {fraction(v, 1 / per_token)}" for name, v in measured.items())
    return (f"expert FFN at {rates['expert_rows']:.0f} rows (a {prefill_tokens}-token prefill's mean per expert): "
            f"{rates['expert_gflops']:.0f} GFLOP/s, {rates['expert_gflops'] / rates['gemm_gflops']:.2f} of the "
            f"{GEMM_SIZE}^3 GEMM; prefill bound at that rate {1 / per_token:.0f} tok/s; fraction of it: {fr}")


__all__ = ["bound", "expert_shape_line", "fraction", "line", "measured_rates"]
