"""Synthetic routing traces: popularity skew plus temporal reuse, with calibrated presets.

Owns: the generative model (`generate`), the presets (`PRESETS`, `generate_preset`) and the
calibration of a preset's reuse parameter against a published statistic
(`calibrate_reuse`). Does not own: measuring statistics (`harness.sim.stats`, whose
definitions the calibration targets) or the trace format (`engine.trace`).

Model, per layer independently (N=tokens, L=layers, E=experts, k=top-k):
* popularity: Zipf over a per-layer random permutation of the experts,
  p[perm[r]] ∝ 1 / (r + 1) ** zipf (zipf=0: uniform);
* token 0 draws k distinct experts from p; each later token keeps, per slot j, the
  previous token's slot-j expert with probability `reuse` and fills the other slots by
  sampling without replacement from p restricted to the experts not kept (Gumbel top-k,
  i.e. sequential draws), so a token's experts are always distinct;
* weights: k sorted, normalised exponentials (slot 0 heaviest), so slot 0 is the first
  choice and a kept first choice stays first.
No `step`: every token is its own forward pass (decode-like replay).

Presets (documented sources; see PRESETS for the numbers):
* "mixtral-like": 32 layers, 8 experts, top-2, Mixtral-8x7B expert size (bf16). Reuse is
  calibrated per layer so that the Mixtral paper's "first choice" repetition rate (Jiang et
  al. 2024, §5 "Routing analysis", Table 5: the expert assigned to a token is the same as
  the previous token's) is met: ~14% at layer 0 (random: 12.5%), ~26% at layer 15 (the
  paper's middle-layer values span ~24-28%) and ~22% at layer 31, linearly interpolated in
  between. Popularity is mild (zipf 0.2): the paper reports no dominant expert per domain;
  that exponent is a choice, not a fit.
* "olmoe-like": 16 layers, 64 experts, top-8, OLMoE-1B-7B expert size (bf16). Noticeable
  skew: the zipf exponent is calibrated so the most popular expert of a layer is chosen by
  about twice the uniform rate k/E (25% of tokens vs 12.5%), an assumption in the range of
  OLMoE's expert-specialisation plots (Muennighoff et al. 2024), not a published number.
  Reuse 0.1 per slot: an uncalibrated assumption.
* "uniform-64x8": no skew, no reuse; a labelled baseline.

    tr = generate(layers=4, n_experts=8, top_k=2, tokens=1000, zipf=0.5, reuse=0.2, seed=0)
    tr = generate_preset("mixtral-like", tokens=10_000, seed=0)
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.config import preset as model_preset
from engine.trace import RoutingTrace

__all__ = ["generate", "generate_preset", "calibrate_reuse", "Preset", "PRESETS", "zipf_popularity",
           "interpolate_targets"]


def zipf_popularity(n_experts: int, zipf: float, rng: np.random.Generator) -> np.ndarray:
    """float64 [E]: Zipf(zipf) probabilities over a random permutation of the experts."""
    ranks = np.arange(1, n_experts + 1, dtype=np.float64)
    p_rank = ranks ** -float(zipf)
    p = np.empty(n_experts)
    p[rng.permutation(n_experts)] = p_rank / p_rank.sum()
    return p


def _per_layer(value: float | Sequence[float], layers: int, name: str, lo: float, hi: float) -> np.ndarray:
    arr = np.full(layers, float(value)) if np.isscalar(value) else np.asarray(value, dtype=np.float64)
    if arr.shape != (layers,):
        raise ValueError(f"{name} must be a number or one value per layer ({layers}), got {len(arr)} values")
    if not np.all((arr >= lo) & (arr <= hi)):
        raise ValueError(f"{name} values must be in [{lo}, {hi}], got {arr[(arr < lo) | (arr > hi)].tolist()}")
    return arr


def generate(layers: int, n_experts: int, top_k: int, tokens: int, zipf: float | Sequence[float] = 0.0,
             reuse: float | Sequence[float] = 0.0, seed: int = 0, expert_bytes: int = 1, *,
             meta: dict[str, Any] | None = None, chunk: int = 1024) -> RoutingTrace:
    """A synthetic trace from the model in the module docstring (deterministic per seed).

    `zipf` >= 0 and `reuse` in [0, 1] are one value for all layers or a list per layer."""
    if layers < 1 or tokens < 0 or not 1 <= top_k <= n_experts:
        raise ValueError(f"need layers >= 1, tokens >= 0 and 1 <= top_k <= n_experts; got layers={layers}, "
                         f"tokens={tokens}, top_k={top_k}, n_experts={n_experts}")
    L, E, k, N = layers, n_experts, top_k, tokens
    z = _per_layer(zipf, L, "zipf", 0.0, np.inf)
    r = _per_layer(reuse, L, "reuse", 0.0, 1.0)
    rng = np.random.default_rng(seed)
    logp = np.log(np.stack([zipf_popularity(E, z[l], rng) for l in range(L)]))     # [L, E]
    keep_all = rng.random((N, L, k)) < r[None, :, None]                             # [N, L, k]
    experts = np.empty((N, L, k), dtype=np.int32)
    prev = None
    for t0 in range(0, N, chunk):
        t1 = min(N, t0 + chunk)
        scores_chunk = logp[None] + rng.gumbel(size=(t1 - t0, L, E))               # [t, L, E]
        for i in range(t1 - t0):
            scores = scores_chunk[i]                                                # [L, E]
            if prev is None:
                experts[t0 + i] = np.argsort(-scores, axis=1)[:, :k]
            else:
                keep = keep_all[t0 + i]                                             # [L, k]
                rows, slots = np.nonzero(keep)
                scores[rows, prev[rows, slots]] = -np.inf                            # kept: not drawn again
                order = np.argsort(-scores, axis=1)                                 # [L, E] draws in order
                fresh_rank = np.cumsum(~keep, axis=1) - 1                            # [L, k] j-th fresh slot
                drawn = np.take_along_axis(order, np.maximum(fresh_rank, 0), axis=1)   # [L, k]
                experts[t0 + i] = np.where(keep, prev, drawn)
            prev = experts[t0 + i]
    w = -np.sort(-rng.exponential(size=(N, L, k)), axis=2)                         # [N, L, k] descending
    w /= w.sum(axis=2, keepdims=True)
    info = {"n_experts": E, "expert_bytes": int(expert_bytes), "moe_layers": list(range(L)), "top_k": k,
            "source": "synthetic", "seed": int(seed), "zipf": z.tolist(), "reuse": r.tolist()}
    info.update(meta or {})
    return RoutingTrace(experts=experts, weights=w.astype(np.float32), meta=info).validate()


# --- presets ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Preset:
    """A named synthetic configuration and the published statistic it was calibrated to."""

    layers: int
    n_experts: int
    top_k: int
    zipf: float | tuple[float, ...]
    reuse: float | tuple[float, ...]
    expert_bytes: int
    model: str                                   # the engine preset whose shapes it imitates
    source: str                                  # where the targets come from
    targets: dict[str, Any] = field(default_factory=dict)   # stat name -> {layer: value}; see tests/sim

    def generate(self, tokens: int, seed: int = 0) -> RoutingTrace:
        return generate(self.layers, self.n_experts, self.top_k, tokens, self.zipf, self.reuse, seed,
                        self.expert_bytes, meta={"model": self.model, "preset": self.source})


def interpolate_targets(anchors: dict[int, float], layers: int) -> tuple[float, ...]:
    """Piecewise-linear per-layer values through {layer: value} anchors (flat beyond the ends)."""
    xs = sorted(anchors)
    return tuple(float(v) for v in np.interp(np.arange(layers), xs, [anchors[x] for x in xs]))


def _bf16_expert_bytes(name: str) -> int:
    return model_preset(name).expert_params * 2


MIXTRAL_FIRST_SAME = {0: 0.14, 15: 0.26, 31: 0.22}       # Jiang et al. 2024, Table 5 ("first choice")
MIXTRAL_ZIPF = 0.2
# Per-slot reuse for each of the 32 layers: calibrate_reuse(interpolate_targets(MIXTRAL_FIRST_SAME, 32),
# n_experts=8, top_k=2, zipf=MIXTRAL_ZIPF, tokens=100_000, seed=1) (seed=2 agrees within 0.001);
# verified against the targets in tests/sim/test_synthetic.py.
MIXTRAL_REUSE: tuple[float, ...] = (
    0.0132, 0.0223, 0.0315, 0.0406, 0.0497, 0.0588, 0.0679, 0.077,
    0.0861, 0.0952, 0.1043, 0.1134, 0.1225, 0.1316, 0.1407, 0.1498,
    0.147, 0.1441, 0.1413, 0.1385, 0.1356, 0.1328, 0.1299, 0.1271,
    0.1243, 0.1214, 0.1186, 0.1157, 0.1129, 0.11, 0.1072, 0.1043,
)
OLMOE_ZIPF = 0.25     # bisection on zipf: the top expert's token rate is ~2.0x k/E (tests/sim/test_synthetic.py)
OLMOE_REUSE = 0.1

PRESETS: dict[str, Preset] = {}


def _build_presets() -> None:
    PRESETS["mixtral-like"] = Preset(
        layers=32, n_experts=8, top_k=2, zipf=MIXTRAL_ZIPF, reuse=MIXTRAL_REUSE,
        expert_bytes=_bf16_expert_bytes("mixtral-8x7b"), model="mixtral-8x7b",
        source="Mixtral of Experts (Jiang et al. 2024), §5 routing analysis, Table 5",
        targets={"first_same": dict(MIXTRAL_FIRST_SAME)})
    PRESETS["olmoe-like"] = Preset(
        layers=16, n_experts=64, top_k=8, zipf=OLMOE_ZIPF, reuse=OLMOE_REUSE,
        expert_bytes=_bf16_expert_bytes("olmoe-1b-7b"), model="olmoe-1b-7b",
        source="OLMoE (Muennighoff et al. 2024) expert specialisation; skew level assumed, not fitted",
        targets={"top_rate_over_uniform": 2.0})
    PRESETS["uniform-64x8"] = Preset(
        layers=16, n_experts=64, top_k=8, zipf=0.0, reuse=0.0, expert_bytes=_bf16_expert_bytes("olmoe-1b-7b"),
        model="olmoe-1b-7b", source="baseline: uniform, independent routing", targets={})


_build_presets()


def generate_preset(name: str, tokens: int, seed: int = 0) -> RoutingTrace:
    """`PRESETS[name].generate(tokens, seed)`; an unknown name lists the presets."""
    if name not in PRESETS:
        raise ValueError(f"unknown synthetic preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name].generate(tokens, seed)


def calibrate_reuse(targets: Sequence[float], *, n_experts: int, top_k: int, zipf: float,
                    tokens: int = 100_000, seed: int = 1, stat: str = "first_same",
                    grid: Sequence[float] = tuple(np.linspace(0.0, 0.4, 17))) -> tuple[float, ...]:
    """Per-layer reuse values whose `stat` (a harness.sim.stats column) meets each target.

    Measures `stat` at every reuse value of `grid` (one trace, one layer per grid point, all
    with popularity `zipf`), fits a quadratic in reuse by least squares -- exact in the limit
    for first_same, which is q0 + r(1 - 2 q0 + q1) + r^2 (q0 - q1) with q0/q1 the chance that
    a fresh first choice repeats -- and inverts it per target. The fit removes the sampling
    noise a per-layer search would leave. Raises ValueError for a target outside the range
    the grid reaches."""
    from harness.sim.stats import trace_stats

    g = np.asarray(grid, dtype=np.float64)
    got = trace_stats(generate(len(g), n_experts, top_k, tokens, zipf, g, seed))[stat].to_numpy()
    coef = np.polyfit(g, got, 2)                                       # stat ~ c2 r^2 + c1 r + c0
    fine = np.linspace(g[0], g[-1], 4001)
    curve = np.polyval(coef, fine)
    if np.any(np.diff(curve) <= 0):
        raise ValueError(f"{stat} is not increasing in reuse over {g[0]}..{g[-1]} (fit {coef}); use a narrower grid")
    tgt = np.asarray(targets, dtype=np.float64)
    out = (tgt < curve[0]) | (tgt > curve[-1])
    if out.any():
        raise ValueError(f"targets {tgt[out].round(4).tolist()} are outside the {stat} range "
                         f"[{curve[0]:.4f}, {curve[-1]:.4f}] that reuse in [{g[0]}, {g[-1]}] gives at zipf={zipf}")
    return tuple(round(float(v), 4) for v in np.interp(tgt, curve, fine))
