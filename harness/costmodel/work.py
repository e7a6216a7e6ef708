"""What a scenario asks of the hardware, before any hardware is named: forward passes, FLOPs,
bytes and expert-cache traffic per phase. Hardware-free; `harness.costmodel.timemodel` turns
it into time with a profile.

Owns: the phase structure of `harness.scenario` as forward passes (`scenario_work`), where
routed experts come from (`Routing`: synthetic, or a recorded `RoutingTrace`), the cache
replay that turns them into hits, misses and streamed experts (the engine's own policy
classes through `engine.policies.simulate.simulate`, in the engine's lookup order), and
measured counts or a chosen hit rate in place of the simulated ones (`apply_counts`,
`apply_hit_rate`). Does not own: time, profiles, rows, or the FLOPs, bytes and events of one
pass (harness.costmodel.passcost).

    shape = WorkloadShape(context_tokens=4096, gen_tokens=64)
    work = scenario_work(preset("mixtral-8x7b"), PlacementSpec("fetch", capacity=4), shape)
    work["decode"].passes[0].misses            # per MoE layer, float
    apply_counts(work["decode"], hits=100, misses=24)    # measured totals replace simulated ones

Dimension legend: B=batch, T=new tokens per sequence, S=past+T, N=B*T rows, D=hidden,
H/K=query/kv heads, h=head dim, E=experts, k=top-k, I=expert intermediate, V=vocab,
L=decoder layers, M=MoE layers, U=unique experts a pass invokes in one layer.

Scenario (harness.scenario, one repeat, cache cold at its start):
  prefill_fresh         the context, in ubatch chunks (past 0, ubatch, ...)
  decode                gen_tokens-1 passes of one token per sequence
  prefill_continuation  turn_tokens+1 tokens on top of context+gen-1 (KV on the device)
  prefill_restored      turn_tokens+1 more, after the whole KV was restored from host RAM

Routing assumption when none is given: uniform, independent top-k per token and layer
(`Routing.synthetic()`, zipf=0, reuse=0). Under it LRU's steady-state decode hit rate is
capacity/E; real routers are skewed and reuse experts, so measured hit rates are higher
(tiny-mixtral on chat text: ~0.27/0.57/0.81 at 2/4/6 of 8 slots vs 0.25/0.50/0.75).

Bounded routing (`routed_passes`, `Routing.routed_layers`): what is routed and replayed through
the cache does not grow with the context. A phase of more than SAMPLE_ROWS rows (a long prompt's
prefill) routes its first passes and its last one; each pass between takes the mean counts of its
routed steady passes (after the first: the cache is warm, and every full pass is alike). Under
synthetic routing the MoE layers are independent and alike, so SAMPLE_LAYERS of them are routed and
the others repeat their counts in turn; a recorded trace's layers are all routed. A phase within
the bounds (every phase of a short scenario, the tests' exact replays) is routed whole.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.config import ModelConfig
from engine.placements import PlacementTraits, needs_cache
from engine.placements import traits as placement_traits
from engine.planner import check_capacity
from engine.policies import make_policy
from engine.policies.simulate import simulate
from engine.trace import RoutingTrace, require_order
from harness.contract import MEASURED_PHASES

PHASES = MEASURED_PHASES
SAMPLE_ROWS = 2048        # rows a phase routes and replays at most (its first passes and its last: `routed_passes`)
SAMPLE_LAYERS = 4         # MoE layers synthetic routing draws; the others repeat their counts


@dataclass(frozen=True)
class WorkloadShape:
    """The scenario's sizes (harness.config.WorkloadConf's numeric fields)."""

    context_tokens: int
    gen_tokens: int = 32
    batch: int = 1
    turn_tokens: int = 64
    ubatch: int = 512
    kv_dtype: str = "model"            # how the KV is stored (engine.kvquant): its bytes are what a restore moves

    def __post_init__(self) -> None:
        for name in ("context_tokens", "gen_tokens", "batch", "turn_tokens", "ubatch"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"WorkloadShape.{name} must be an integer >= 1, got {v!r}")


@dataclass(frozen=True)
class PlacementSpec:
    """A placement and its options, as the engine takes them; what it does is asked of the
    plugin (`traits`), never decided here from its name, so a registered third-party placement
    is predicted like a built-in one."""

    name: str = "resident"
    capacity: int | None = None       # device-cache slots per layer (placements that keep a cache)
    policy: str = "lru"
    options: Mapping[str, Any] = field(default_factory=dict)   # the plugin's Options fields

    def __post_init__(self) -> None:
        from engine.registry import PLACEMENTS
        cls = PLACEMENTS.get(self.name)                       # unknown names list the registered ones
        try:
            cls.parse_options(dict(self.options))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"placement {self.name!r}: {exc}") from None
        if self.uses_cache and (self.capacity is None or self.capacity < 1):
            raise ValueError(f"placement {self.name!r} needs a cache capacity (an int >= 1), got {self.capacity!r}")

    @property
    def uses_cache(self) -> bool:
        return needs_cache(self.name, self.options)

    def traits(self, cfg: ModelConfig) -> PlacementTraits:
        return placement_traits(self.name, cfg, self.options)

    @classmethod
    def from_options(cls, name: str, capacity: int | None = None, policy: str | None = None,
                     options: Mapping[str, Any] | None = None) -> "PlacementSpec":
        """From the engine's/Hydra's form: a name, a capacity, a policy and placement options."""
        opts = dict(options or {})
        return cls(name=name, capacity=capacity if needs_cache(name, opts) else None, policy=policy or "lru",
                   options=opts)


# --- routing ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Routing:
    """Where the routed experts of the scenario's tokens come from.

    `synthetic(zipf, reuse, seed)`: harness.sim.synthetic's generator (uniform and
    independent by default). `from_trace(trace)`: a recorded trace's tokens in order,
    wrapping around, re-chunked into the scenario's passes (batch rows of one pass take
    consecutive trace tokens -- an approximation for batch > 1)."""

    kind: str = "synthetic"
    zipf: float = 0.0
    reuse: float = 0.0
    seed: int = 0
    trace: RoutingTrace | None = field(default=None, compare=False, repr=False)

    @classmethod
    def synthetic(cls, zipf: float = 0.0, reuse: float = 0.0, seed: int = 0) -> "Routing":
        return cls("synthetic", zipf, reuse, seed)

    @classmethod
    def from_trace(cls, trace: RoutingTrace) -> "Routing":
        trace.validate()
        require_order(trace, "the cost model (experts per token, in order)")
        if trace.n_tokens == 0:
            raise ValueError("routing trace has no tokens")
        return cls("trace", trace=trace)

    @property
    def label(self) -> str:
        if self.kind == "trace":
            return f"trace:{self.trace.meta.get('model', 'recorded')}"
        return "synthetic-uniform" if self.zipf == 0 and self.reuse == 0 else \
            f"synthetic(zipf={self.zipf},reuse={self.reuse})"

    def routed_layers(self, cfg: ModelConfig) -> int:
        """The MoE layers this routing draws (the first ones): a trace's every layer; synthetic
        routing's layers are independent and alike, so at most SAMPLE_LAYERS of them."""
        return cfg.n_moe_layers if self.kind == "trace" else min(cfg.n_moe_layers, SAMPLE_LAYERS)

    def experts(self, cfg: ModelConfig, n_tokens: int, layers: int | None = None) -> np.ndarray:
        """int32 [n_tokens, M, k]: routed experts of the scenario's tokens, in order (synthetic: of
        the first `layers` MoE layers, default all)."""
        M, E, k = cfg.n_moe_layers, cfg.n_experts, cfg.top_k
        if self.kind == "trace":
            tr = self.trace
            if (tr.n_layers, tr.n_experts, tr.top_k) != (M, E, k):
                raise ValueError(f"routing trace has layers={tr.n_layers}, n_experts={tr.n_experts}, "
                                 f"top_k={tr.top_k}; the model needs {M}, {E}, {k}")
            idx = np.arange(n_tokens) % tr.n_tokens
            return tr.experts[idx]
        return _synthetic(layers or M, E, k, n_tokens, self.zipf, self.reuse, self.seed)


@functools.lru_cache(maxsize=8)
def _synthetic(layers: int, n_experts: int, top_k: int, tokens: int, zipf: float, reuse: float,
               seed: int) -> np.ndarray:
    """harness.sim.synthetic's routing, drawn once for every placement predicted on the same shape."""
    from harness.sim.synthetic import generate
    out = generate(layers, n_experts, top_k, tokens, zipf, reuse, seed).experts
    out.flags.writeable = False              # cached: shared by every caller
    return out


# --- the scenario as passes -----------------------------------------------------------------------
@dataclass
class PassWork:
    """One forward pass: B sequences x T new tokens on top of `past`; per MoE layer [M] counts."""

    phase: str
    batch: int
    new: int
    past: int
    unique: np.ndarray                 # float [M]: experts invoked (U)
    hits: np.ndarray                   # float [M]: device-cache hits
    misses: np.ndarray                 # float [M]: device-cache misses (one expert copy each)
    streamed: np.ndarray               # float [M]: experts streamed through stream buffers
    on_cpu: np.ndarray                 # bool  [M]: layer's experts run on the CPU

    @property
    def rows(self) -> int:
        return self.batch * self.new


@dataclass
class PhaseWork:
    phase: str
    passes: list[PassWork]
    tokens: int                        # as harness.scenario counts them
    reused_tokens: int
    restore_tokens: int = 0            # KV tokens per sequence restored host->device before the phase
    kv_dtype: str = "model"            # their storage format (engine.kvquant)

    def total(self, attr: str) -> float:
        return float(sum(getattr(p, attr).sum() for p in self.passes))


def phase_passes(shape: WorkloadShape) -> dict[str, list[tuple[int, int]]]:
    """Per phase, the (T, past) of each forward pass (harness.scenario + Engine.prefill chunking)."""
    ctx, gen, turn, ub = shape.context_tokens, shape.gen_tokens, shape.turn_tokens, shape.ubatch

    def chunks(T: int, past: int) -> list[tuple[int, int]]:
        return [(min(ub, T - s), past + s) for s in range(0, T, ub)]

    after_decode = ctx + gen - 1
    return {"prefill_fresh": chunks(ctx, 0),
            "decode": [(1, ctx + i) for i in range(gen - 1)],
            "prefill_continuation": chunks(turn + 1, after_decode),
            "prefill_restored": chunks(turn + 1, after_decode + turn + 1)}


def routed_passes(rows: list[int]) -> list[int]:
    """Which passes of a phase (`rows`: each pass's B*T) are routed: all of them, or -- beyond
    SAMPLE_ROWS rows and three passes -- its first passes and its last (the module docstring)."""
    n = len(rows)
    if n <= 3 or sum(rows) <= SAMPLE_ROWS:
        return list(range(n))
    first = min(n - 1, max(2, SAMPLE_ROWS // rows[0] - 1))      # the cold pass and at least one steady one
    return [*range(first), n - 1]


def scenario_work(cfg: ModelConfig, placement: PlacementSpec, shape: WorkloadShape,
                  routing: Routing | None = None) -> dict[str, PhaseWork]:
    """Every phase's passes with expert counts from `routing` replayed through the cache (bounded:
    the module docstring's "Bounded routing")."""
    routing = routing or Routing.synthetic()
    if placement.uses_cache:
        check_capacity(placement.capacity, cfg.top_k, cfg.n_experts)
    B, M, E = shape.batch, cfg.n_moe_layers, cfg.n_experts
    R = routing.routed_layers(cfg)
    layout = phase_passes(shape)
    routed = {phase: routed_passes([B * T for T, _ in plist]) for phase, plist in layout.items()}
    n_tokens = sum(B * layout[phase][i][0] for phase, idx in routed.items() for i in idx)
    experts = routing.experts(cfg, n_tokens, R)                               # [n, R, k]
    tr = placement.traits(cfg)
    passes: list[PassWork] = []                                               # the routed ones, in order
    present_all: list[np.ndarray] = []                                        # per routed pass [R, E] bool
    start = 0
    for phase, plist in layout.items():
        for T, past in (plist[i] for i in routed[phase]):
            rows = experts[start:start + B * T]                               # [N, R, k]
            start += B * T
            present = np.zeros((R, E), dtype=bool)
            present[np.arange(R)[None, :, None], rows] = True                 # [R, E]
            unique = present.sum(axis=1).astype(np.float64)                   # [R]
            zero = np.zeros(R)
            passes.append(PassWork(phase, B, T, past, unique, zero.copy(), zero.copy(),
                                   unique.copy() if tr.streams(B * T) else zero.copy(), _on_cpu(cfg, tr, B * T)))
            present_all.append(present)
    if placement.uses_cache:
        _replay_cache(passes, present_all, placement, E, list(cfg.moe_layers)[:R])
    layer_of = np.arange(M) % R                                               # [M]: the routed layer each repeats
    for p in passes:
        p.unique, p.hits, p.misses, p.streamed = (a[layer_of] for a in (p.unique, p.hits, p.misses, p.streamed))
    out: dict[str, PhaseWork] = {}
    ctx, gen, turn = shape.context_tokens, shape.gen_tokens, shape.turn_tokens
    reused = {"prefill_fresh": 0, "decode": 0, "prefill_continuation": ctx + gen - 1,
              "prefill_restored": ctx + gen - 1 + turn + 1}
    tokens = {"prefill_fresh": B * ctx, "decode": B * (gen - 1), "prefill_continuation": B * (turn + 1),
              "prefill_restored": B * (turn + 1)}
    for phase in PHASES:
        ps = _fill(layout[phase], routed[phase], [p for p in passes if p.phase == phase], cfg, tr)
        if phase == "decode" and not ps:
            continue
        out[phase] = PhaseWork(phase, ps, tokens[phase], reused[phase],
                               restore_tokens=reused[phase] if phase == "prefill_restored" else 0,
                               kv_dtype=shape.kv_dtype)
    return out


def _on_cpu(cfg: ModelConfig, tr: PlacementTraits, rows: int) -> np.ndarray:
    return np.array([tr.on_cpu(layer, rows) for layer in cfg.moe_layers], dtype=bool)   # [M]


def _fill(plist: list[tuple[int, int]], routed: list[int], done: list[PassWork], cfg: ModelConfig,
          tr: PlacementTraits) -> list[PassWork]:
    """A phase's every pass: its routed ones (`done`, in the order of `routed`), and between them
    passes with the mean counts of its routed steady passes (all but its first and its last)."""
    if len(routed) == len(plist):
        return done
    steady = done[1:-1]
    mean = {a: np.mean([getattr(p, a) for p in steady], axis=0) for a in ("unique", "hits", "misses", "streamed")}
    by_index = dict(zip(routed, done))
    out = []
    for i, (T, past) in enumerate(plist):
        p = by_index.get(i)
        if p is None:
            p = PassWork(done[0].phase, done[0].batch, T, past, *(mean[a].copy() for a in
                         ("unique", "hits", "misses", "streamed")), _on_cpu(cfg, tr, done[0].batch * T))
        out.append(p)
    return out


def _replay_cache(passes: list[PassWork], present: list[np.ndarray], placement: PlacementSpec, E: int,
                  model_layers: list[int]) -> None:
    """Fill hits/misses of the passes that go through the device cache, per layer, in the
    engine's lookup order (per pass: the sorted unique experts) and protection rule."""
    cached = [i for i, p in enumerate(passes) if not p.streamed.any() and not p.on_cpu.any()]
    for m, layer in enumerate(model_layers):
        refs: list[int] = []
        owner: list[int] = []
        for i in cached:
            ids = np.flatnonzero(present[i][m])
            refs.extend(ids.tolist())
            owner.extend([i] * len(ids))
        opts: dict[str, Any] = {}
        if placement.policy == "belady":
            opts["future"] = refs
        elif placement.policy == "static":
            opts["popularity"] = np.bincount(np.asarray(refs, dtype=np.int64), minlength=E).tolist()
        policy = make_policy(placement.policy, placement.capacity, E, layer, **opts)
        flags = np.asarray(simulate(policy, refs, steps=owner), dtype=bool)   # a pass is a step: its protection rule
        own = np.asarray(owner, dtype=np.int64)
        hits = np.bincount(own, weights=flags, minlength=len(passes))
        misses = np.bincount(own, weights=~flags, minlength=len(passes))
        for i in cached:
            passes[i].hits[m], passes[i].misses[m] = hits[i], misses[i]


def apply_counts(work: PhaseWork, hits: float | None = None, misses: float | None = None,
                 streamed: float | None = None) -> PhaseWork:
    """Replace the simulated totals of a phase with measured ones (e.g. from result rows),
    keeping how they spread over passes and layers. For fetch, lookups = hits + misses are
    the experts invoked, so `unique` is rescaled with them."""
    def scale(attr: str, target: float | None) -> None:
        if target is None:
            return
        cur = work.total(attr)
        for p in work.passes:
            arr = getattr(p, attr)
            if cur > 0:
                setattr(p, attr, arr * (target / cur))
            elif target > 0:                       # nothing simulated: spread evenly
                setattr(p, attr, np.full_like(arr, target / (len(work.passes) * arr.size)))
    if hits is not None or misses is not None:
        scale("hits", hits)
        scale("misses", misses)
        for p in work.passes:
            cached = (p.hits + p.misses) > 0
            p.unique = np.where(cached, p.hits + p.misses, p.unique)
    if streamed is not None:
        scale("streamed", streamed)
        for p in work.passes:
            p.unique = np.where(p.streamed > 0, p.streamed, p.unique)
    return work


def apply_hit_rate(work: PhaseWork, hit_rate: float) -> PhaseWork:
    """Keep the simulated lookups of a phase but split them at `hit_rate` (a what-if knob)."""
    if not 0.0 <= hit_rate <= 1.0:
        raise ValueError(f"hit_rate must be in [0, 1], got {hit_rate!r}")
    for p in work.passes:
        lookups = p.hits + p.misses
        p.hits, p.misses = lookups * hit_rate, lookups * (1.0 - hit_rate)
    return work
