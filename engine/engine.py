"""The public engine: build from a checkpoint or preset, generate greedily, expose counters.

Owns: turning user options into a validated, planned, loaded model with its placement;
prefill in micro-batches of `ubatch` tokens; greedy decode; sessions; counters; the finiteness
check of every pass, read with its greedy token (`greedy`: a NaN or inf raises NonFiniteError
naming the pass and the first layer that produced it; engine.finite).
Does not own: tokenization (the engine sees token ids only), timing and phases (the
harness), what a model computes (its family: engine.families, engine.blocks, engine.model).

    from engine import Engine
    eng = Engine.from_pretrained("tiny-mixtral", placement="fetch", cache_capacity=4, cache_policy="lru")
    res = eng.generate([[1, 2, 3, 4]], max_new_tokens=8)
    res.tokens, eng.counters["h2d_bytes"]

Continuing a conversation keeps the KV on the device:

    sess = eng.new_session(batch=1)
    eng.generate([turn1], 8, session=sess)
    eng.generate([turn2], 8, session=sess)       # only turn2 (and the last reply token) is prefilled
"""
from __future__ import annotations

import logging
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from engine.checkpoint import Checkpoint, torch_dtype
from engine.config import ModelConfig, preset, PRESETS
from engine.counters import Counters
from engine.devices import Device, fmt_bytes, parse_bytes
from engine.finite import FiniteWatch, NonFiniteError, check_sum, combined, describe_decode, describe_prefill
from engine.hostmem import host_alloc_bytes
from engine.hooks import NULL, Instrument, Progress
from engine.kv import Session, check_planned
from engine.kvquant import is_lossy, kv_format
from engine.model import MoEModel, TensorSource
from engine.options import EngineOptions
from engine.placements.base import Placement, PlacementContext
from engine.planner import MemoryPlan, plan_memory
from engine.policies import make_policy
from engine.prefetch.base import PrefetchContext, Prefetcher
from engine.registry import PLACEMENTS, POLICIES, PREFETCHERS
from engine.shipped import SHIPPED, shipped_checkpoint
from engine.static_decode import StaticDecoder

log = logging.getLogger(__name__)
DEFAULT_CONTEXT = 4096


@dataclass
class GenerateResult:
    tokens: list[list[int]]          # generated ids per prompt (greedy)
    logits: list[torch.Tensor]       # [B, V] per generated token: the logits that chose it
    session: Session | None          # the session, when the caller passed one


class Engine:
    def __init__(self, cfg: ModelConfig, model: MoEModel, placement: Placement, device: Device, plan: MemoryPlan,
                 counters: Counters, ubatch: int, options: dict[str, Any]) -> None:
        self.cfg, self.model, self.placement, self.device = cfg, model, placement, device
        self.plan, self._counters, self.ubatch, self.options = plan, counters, ubatch, options
        self._watch = FiniteWatch(model)      # every pass's finiteness check, read with its token

    # --- construction ----------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, source: str | Path, options: EngineOptions | None = None, **kw: Any) -> "Engine":
        """Validate, plan, then load. Raises before allocating anything when the input is wrong.

        source: a Hugging Face checkpoint directory (config.json + *.safetensors) or a preset
        name (engine.config.PRESETS). options: an `EngineOptions` (engine.options says what each
        means); keyword arguments replace its fields, and a keyword that names no field is a
        placement option (e.g. issue_ahead for fetch; n_cpu_layers for hybrid; stream_threshold,
        stream_fallback, stream_buffers for stream), so both of these build the same engine:

            Engine.from_pretrained("tiny-mixtral", EngineOptions(placement="fetch", cache_capacity=4))
            Engine.from_pretrained("tiny-mixtral", placement="fetch", cache_capacity=4)
        """
        o = options or EngineOptions()
        if kw:
            o = o.replace(**kw)
        cfg, ckpt_dir = _model_of(source, o)
        # options, all checked before any allocation
        placement_cls = PLACEMENTS.get(o.placement)
        placement_cls.parse_options(o.placement_options)
        POLICIES.get(o.cache_policy)
        prefetch_cls = PREFETCHERS.get(o.prefetch)
        uses_cache = placement_cls.uses_cache(o.placement_options)
        if o.prefetch != "none" and not uses_cache:
            raise ValueError(f"prefetch {o.prefetch!r} needs a placement with a device expert cache "
                             f"(fetch, or stream with stream_fallback='fetch'); got placement {o.placement!r}")
        dt = cfg_dtype(cfg, o.dtype)
        kv_format(o.kv_dtype)                                 # a bad name is refused before anything else
        _positive_int("ubatch", o.ubatch)
        _positive_int("batch", o.batch)
        if o.max_context is not None:
            _positive_int("max_context", o.max_context, " or None")
        context = o.max_context or min(DEFAULT_CONTEXT, cfg.max_position_embeddings)
        if context > cfg.max_position_embeddings:
            raise ValueError(f"max_context {context} exceeds the model's max_position_embeddings "
                             f"{cfg.max_position_embeddings}")
        dev = Device.create(o.device, o.device_memory)
        try:
            plan = plan_memory(cfg, o.placement, o.cache_capacity if uses_cache else None, dev.ledger.budget, context,
                               o.batch, o.ubatch, dt.itemsize, o.placement_options, o.reserve_bytes,
                               device_kind=dev.kind, capacity_bytes=parse_bytes(o.cache_capacity_bytes),
                               kv_dtype=o.kv_dtype, all_logits=bool(o.all_logits))
            kv_format(o.kv_dtype).check_device(dev.torch_device)
        except BaseException:
            dev.close()
            raise
        log.debug("%s", plan)
        model, strategy, counters = _load(cfg, ckpt_dir, o, dev, dt, plan, placement_cls, prefetch_cls)
        built = dict(placement=o.placement, prefetch=o.prefetch, cache_capacity=plan.capacity,
                     requested_capacity=o.cache_capacity,
                     cache_policy=o.cache_policy if plan.capacity is not None else None, dtype=str(dt).split(".")[-1],
                     device=dev.kind, emulated=dev.emulated, ubatch=o.ubatch, max_context=context, batch=o.batch,
                     expert_quant=cfg.expert_quant.mode if cfg.expert_quant is not None else "none",
                     kv_dtype=o.kv_dtype, all_logits=bool(o.all_logits), **o.placement_options)
        counters.reset()
        return cls(cfg, model, strategy, dev, plan, counters, o.ubatch, built)

    # --- counters ----------------------------------------------------------------------------
    @property
    def counters(self) -> dict[str, int]:
        """Metric name -> cumulative value since the last reset_counters()."""
        return self._counters.totals()

    @property
    def counters_by_layer(self) -> dict[int, dict[str, int]]:
        return self._counters.by_layer()

    def reset_counters(self) -> None:
        self._counters.reset()

    def reset(self) -> None:
        """Cold state: empty expert caches and zero counters (weights stay loaded)."""
        self._open()
        self.placement.reset()
        if self.model.prefetcher is not None:
            self.model.prefetcher.reset()
        self._counters.reset()

    progress: Progress | None = None      # hears ("prefill", chunk, chunks) per micro-batch when set

    def set_instrument(self, instrument: Instrument | None) -> None:
        """Switch instrumentation (timeline, NVTX) on or off; None restores the no-op default."""
        self._open()
        instrument = instrument or NULL
        self.model.instrument = self.device.instrument = self.placement.ctx.instrument = instrument

    @property
    def step_log(self) -> dict[int, list[list[int]]] | None:
        """Per MoE layer, the sorted experts each forward pass used (record_lookups=True);
        the `steps` a trace_oracle prefetcher replays."""
        return self.model.step_log

    @property
    def lookup_log(self) -> dict[int, list[int]] | None:
        """Per layer, the expert ids looked up in the device cache, in order (record_lookups=True)."""
        cache = self.placement.cache
        return None if cache is None else cache.lookup_log

    # --- sessions and generation -----------------------------------------------------------
    def new_session(self, batch: int = 1) -> Session:
        """A session of `batch` sequences (under a device budget at most the planned batch: its KV and
        activations are what the plan holds room for); each layer's state is allocated for the
        planned context."""
        self._open()
        _positive_int("batch", batch)
        if batch > self.plan.batch and self.device.ledger.budget is not None:
            raise ValueError(f"a session of batch {batch} but the engine was planned for batch={self.plan.batch} "
                             "(its KV and activations scale with it); pass batch= to Engine.from_pretrained")
        return self.model.new_session(self._counters, batch, max_tokens=self.plan.context,
                                      kv_dtype=self.options["kv_dtype"])

    @property
    def kv_dtype(self) -> str:
        """How sessions store their KV (engine.kvquant)."""
        return self.options["kv_dtype"]

    @property
    def lossy(self) -> bool:
        """Whether this engine runs a lossy treatment (quantised experts, or a KV format that loses
        precision for the model's dtype): its outputs differ from the exact model's by design, and
        are labelled."""
        return is_lossy(self.kv_dtype, self.model.dtype, self.cfg.expert_quant)

    def _open(self) -> None:
        if self.model is None:
            raise RuntimeError("this engine is closed (Engine.close()); load another with Engine.from_pretrained")

    def _room(self, sess: Session, tokens: int) -> None:
        """Refuse `tokens` more tokens for `sess` before any state changes: past the model's
        positions, or past the context the engine was planned for (which no state grows beyond); and
        for a session offloaded to host RAM (a pass refused half-way would already have counted in
        the prefetcher's and placement's bookkeeping)."""
        if not sess.on_device:
            raise RuntimeError("session state is offloaded to host RAM; call session.restore() first")
        need = sess.length + tokens
        if need > self.cfg.max_position_embeddings:
            raise ValueError(f"context {need} exceeds max_position_embeddings {self.cfg.max_position_embeddings}")
        check_planned(need, self.plan.context)

    def _ids(self, rows: list[list[int]], sess: Session) -> torch.Tensor:
        self._open()
        if not rows or any(not isinstance(r, (list, tuple)) for r in rows):
            raise ValueError("prompts must be a non-empty list of token-id lists (one per sequence)")
        bad = next((t for r in rows for t in r if not isinstance(t, numbers.Integral) or isinstance(t, bool)), None)
        if bad is not None:
            raise ValueError(f"token ids must be integers, got {bad!r} ({type(bad).__name__})")
        if len(rows) != sess.batch:
            raise ValueError(f"got {len(rows)} prompts for a session of batch {sess.batch}")
        lengths = {len(r) for r in rows}
        if len(lengths) != 1:
            raise ValueError(f"prompts in one batch must have equal lengths, got {sorted(lengths)}")
        ids = torch.tensor(rows, dtype=torch.long)
        if ids.numel():   # checked on the host lists: on the tensor it is six ops of dispatch per decode step
            lo, hi = min(map(min, rows)), max(map(max, rows))     # every row has the same, nonzero length
            if lo < 0 or hi >= self.cfg.vocab_size:
                raise ValueError(f"token ids must be in [0, {self.cfg.vocab_size}), got range [{lo}, {hi}]")
        return ids.to(self.device.torch_device)

    @torch.inference_mode()
    def prefill(self, sess: Session, prompts: list[list[int]], all_logits: bool = False) -> torch.Tensor:
        """Append prompts [B][T] to the session in micro-batches of `ubatch` tokens.

        Returns last-position logits [B, V] (all positions [B, T, V] with all_logits: on a budgeted
        device only where the plan made room for them, at most `ubatch` tokens per call); `greedy`
        reads the token and this prefill's check (its logits, every position's final hidden state)."""
        ids = self._ids(prompts, sess)
        T = ids.shape[1]
        if T == 0:
            raise ValueError("empty prompt")
        if all_logits and self.device.ledger.budget is not None:
            self._check_all_logits(T)
        self._room(sess, T)
        self._watch.begin(sess)
        start, outs, sums = sess.length, [], []
        chunks = -(-T // self.ubatch)
        for n, s in enumerate(range(0, T, self.ubatch)):
            with self.model.instrument.span("step", phase="prefill", tokens=min(self.ubatch, T - s) * sess.batch):
                outs.append(self.model.forward(ids[:, s:s + self.ubatch], sess, all_logits, sums=sums))
            self._watch.record(sess, [r[s:s + self.ubatch] for r in prompts], all_logits)
            if self.progress is not None and chunks > 1:
                self.progress("prefill", n + 1, chunks)
        out = torch.cat(outs, dim=1) if all_logits and len(outs) > 1 else outs[-1]
        sums.append(check_sum(out))          # every position's final hidden state, and the logits returned
        self._watch.pending(sess, combined(sums), describe_prefill(start, T, chunks))
        return out

    def _check_all_logits(self, tokens: int) -> None:
        """Every position's logits, [B, T, V] on the device, fit the budget only as planned: room for
        one micro-batch's (Engine.from_pretrained(all_logits=True)), so one micro-batch per call."""
        if not self.plan.all_logits:
            raise ValueError("prefill(all_logits=True) keeps every position's logits on the device, and this "
                             "engine's memory plan has no room for them; build it with "
                             "Engine.from_pretrained(..., all_logits=True)")
        if tokens > self.ubatch:
            raise ValueError(f"prefill(all_logits=True) of {tokens} tokens would keep {tokens} positions' logits on "
                             f"the device; the plan has room for one micro-batch's (ubatch={self.ubatch}): call it "
                             f"once per {self.ubatch} tokens, as harness.quality does")

    @torch.inference_mode()
    def decode_step(self, sess: Session, tokens: list[int]) -> torch.Tensor:
        """Feed one token per sequence; returns logits [B, V] (`greedy` reads the token and the step's check)."""
        rows = [[t] for t in tokens]
        ids = self._ids(rows, sess)
        self._room(sess, 1)
        self._watch.begin(sess)
        position = sess.length
        with self.model.instrument.span("step", phase="decode", tokens=sess.batch):
            if self.placement.static_decode:
                if sess.static_decoder is None:
                    sess.static_decoder = StaticDecoder(self.model, sess)
                logits = sess.static_decoder.step(ids)
            else:
                logits = self.model.forward(ids, sess)
        self._watch.record(sess, rows, False)
        self._watch.pending(sess, check_sum(logits), describe_decode(position, sess.batch))
        return logits

    @torch.inference_mode()
    def step(self, items: list[tuple[Session, list[int]]]) -> torch.Tensor:
        """One ragged step: each item a session of one sequence and its next tokens -- a prompt
        chunk, or the one token it decodes -- of any length, at the session's own position; returns
        the last position's logits of each item [n, V] (`greedy_step` reads the ids). The layers'
        attention runs per sequence, the rest over the step's rows together (MoEModel.forward_ragged):
        each sequence's logits are what it alone would give, up to the rounding of row counts."""
        self._open()
        if not items:
            raise ValueError("a step needs at least one (session, tokens) item")
        if len({id(sess) for sess, _ in items}) != len(items):
            raise ValueError("a session appears twice in one step; give each sequence's tokens once")
        ids = []
        for sess, toks in items:
            if sess.batch != 1:
                raise ValueError(f"a ragged step takes sessions of one sequence (new_session(1)), got batch {sess.batch}")
            if not toks:
                raise ValueError("an item of a step has no tokens")
            self._room(sess, len(toks))
            self._watch.begin(sess)          # an unread check of the session's previous pass is read first
            ids.append(self._ids([list(toks)], sess).view(-1))
        n = sum(len(t) for _, t in items)
        with self.model.instrument.span("step", phase="ragged", tokens=n):
            return self.model.forward_ragged([(i, sess) for i, (sess, _) in zip(ids, items)])

    def greedy_step(self, logits: torch.Tensor) -> list[int]:
        """The greedy id per row of a ragged step's logits [n, V], read to the host in one read with
        their finiteness; raises NonFiniteError when any is NaN or inf."""
        top = torch.cat([logits.argmax(-1), check_sum(logits).isfinite().view(1).long()]).tolist()
        if not top[-1]:
            raise NonFiniteError(f"a ragged step of {logits.shape[0]} sequences gave non-finite logits")
        return top[:-1]

    def greedy(self, sess: Session, logits: torch.Tensor) -> list[int]:
        """The greedy id per row of `logits` [B, V] -- what prefill or decode_step just returned for
        `sess` -- read to the host in one read together with that pass's finiteness check (its
        logits and, for a prefill, every position's final hidden state: engine.finite). Raises
        NonFiniteError naming the pass and the first layer whose output went NaN or inf (found by
        replaying the session's passes; the session is then left empty)."""
        self._open()
        return self._watch.read(sess, logits)

    def check_finite(self, sess: Session, logits: torch.Tensor | None = None) -> None:
        """The finiteness check of `sess`'s last pass, for a caller that reads its logits itself (a
        host read; `greedy` does it for free). Raises as `greedy` does. A pass left unchecked is
        checked before the session's next one anyway."""
        self._open()
        self._watch.settle(sess, logits)

    def generate(self, prompts: list[list[int]], max_new_tokens: int = 16,
                 session: Session | None = None) -> GenerateResult:
        """Greedy generation. With `session`, prompts continue it (its KV is reused) and the
        session keeps everything but the final generated token, which is fed first next turn."""
        _positive_int("max_new_tokens", max_new_tokens)
        sess = session or self.new_session(len(prompts))
        try:
            rows = [list(r) for r in prompts]
            if sess.pending is not None:
                rows = [[p, *r] for p, r in zip(sess.pending, rows)]
            if rows and rows[0]:                   # the whole turn, before any of it changes the session
                self._room(sess, len(rows[0]) + max_new_tokens - 1)
            logits = self.prefill(sess, rows)
            out_logits, generated = [logits], []
            tok = self.greedy(sess, logits)
            generated.append(tok)
            for _ in range(max_new_tokens - 1):
                logits = self.decode_step(sess, tok)
                out_logits.append(logits)
                tok = self.greedy(sess, logits)
                generated.append(tok)
            sess.pending = tok
        finally:
            if session is None:
                sess.close()
        return GenerateResult(tokens=[list(col) for col in zip(*generated)], logits=out_logits, session=session)

    def close(self) -> None:
        """Drop weights and caches (device memory is returned to the allocator) and lift the
        allocator cap this engine's budget set (engine.devices). Waits for the device first: a
        prefetch copy still in flight on the copy stream writes into a slot and reads a host row
        that this frees. Closing a closed engine does nothing."""
        if self.model is None:
            return
        self.device.synchronize()
        self.model = self.placement = self._watch = None
        self.device.ledger.held.clear()
        self.device.close()
        if self.device.kind == "cuda":
            torch.cuda.empty_cache()


def _model_of(source: str | Path, o: EngineOptions) -> tuple[ModelConfig, Path | None]:
    """The model's config -- from a checkpoint dir (a shipped one by its name) or a preset, overrides
    and the experts' treatment applied -- and the checkpoint dir (None for a preset: seeded random
    weights)."""
    ckpt_dir: Path | None = shipped_checkpoint(str(source)) or Path(source)
    if (ckpt_dir / "config.json").is_file():
        cfg = ModelConfig.from_hf_dir(ckpt_dir)
    elif str(source) in PRESETS:
        cfg, ckpt_dir = preset(str(source)), None
    else:
        raise ValueError(f"{str(source)!r} is neither a checkpoint directory with config.json nor a preset; "
                         f"presets: {', '.join(sorted(PRESETS))}; shipped checkpoints: {', '.join(sorted(SHIPPED))}")
    if o.model_overrides:
        cfg = cfg.replace(**o.model_overrides)
    expert_quant = o.expert_quant
    if isinstance(expert_quant, str):
        from engine.blocks.quant_experts import resolve_expert_quant
        expert_quant = resolve_expert_quant(cfg, expert_quant, **(o.quant_options or {}))
    elif o.quant_options:
        raise ValueError("quant_options apply to expert_quant given by name ('int8', 'int4', 'mixed')")
    if expert_quant is not None:
        cfg = cfg.replace(expert_quant=expert_quant)
        cfg.architecture()               # a layout that cannot be quantised says so before anything loads
    return cfg, ckpt_dir


def _load(cfg: ModelConfig, ckpt_dir: Path | None, o: EngineOptions, dev: Device, dt: torch.dtype, plan: MemoryPlan,
          placement_cls: type[Placement], prefetch_cls: type[Prefetcher]) -> tuple[MoEModel, Placement, Counters]:
    """The model loaded with its placement set up (and its prefetcher); on any failure what was
    taken is freed, so nothing half-built stays accounted."""
    counters = Counters(cfg.num_layers)
    instrument = o.instrument or NULL
    ckpt = model = strategy = None
    try:
        model = MoEModel(cfg, dev, dt, instrument)
        ctx = PlacementContext(cfg, dev, model.store, counters, instrument, plan.capacity,
                               (lambda layer: make_policy(o.cache_policy, plan.capacity, cfg.n_experts, layer,
                                                          **(o.policy_options or {})))
                               if plan.capacity is not None else None)
        strategy = placement_cls(ctx, **o.placement_options)
        _check_host_ram(cfg, dt, ckpt_dir, host_ram_needed(cfg, dt, strategy, dev, plan))
        ckpt = Checkpoint(ckpt_dir) if ckpt_dir is not None else None
        model.load(TensorSource(cfg, ckpt, o.seed), strategy.expert_on_device, pin_host=strategy.copies_experts,
                   progress=o.progress)
        strategy.setup()
        if o.prefetch != "none":
            model.prefetcher = prefetch_cls(PrefetchContext(cfg, strategy.cache, model.routers),
                                            **(o.prefetch_options or {}))
        if o.record_lookups:
            model.step_log = {}
            if strategy.cache is not None:
                strategy.cache.lookup_log = {}
    except BaseException:
        model = strategy = None   # drop the half-built weights before the error propagates
        dev.ledger.held.clear()
        dev.close()
        if dev.kind == "cuda":
            torch.cuda.empty_cache()
        raise
    finally:
        if ckpt is not None:
            ckpt.close()
    model.placement = strategy
    dev.instrument = instrument
    return model, strategy, counters


def _positive_int(name: str, value: Any, alternative: str = "") -> None:
    """Refuse `value` for argument `name` unless it is an integer >= 1 (never a bool or a float)."""
    if not (isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1):
        raise ValueError(f"{name} must be an integer >= 1{alternative}, got {value!r}")


def cfg_dtype(cfg: ModelConfig, dtype: str) -> torch.dtype:
    return torch_dtype(cfg.torch_dtype if dtype == "auto" else dtype)


def host_ram_needed(cfg: ModelConfig, dt: torch.dtype, strategy: Placement, dev: Device,
                    plan: MemoryPlan) -> list[tuple[str, int]]:
    """The host RAM a load takes, as (what, bytes) rows: non-expert weights (they pass through
    host RAM on CUDA and live there on the emulated device), one host expert store allocation
    per offloaded layer at the bytes its pinning method really takes (engine.hostmem), and on
    the emulated device the "device" expert bytes, which are host allocations too."""
    layer_bytes = cfg.n_experts * plan.expert_bytes
    host_layers = [l for l in cfg.moe_layers if not strategy.expert_on_device(l)]
    method = dev.pin_method(strategy.copies_experts)
    rows = [("non-expert weights", cfg.architecture().non_expert_bytes(dt.itemsize)),
            (f"host expert store ({len(host_layers)} layers x {fmt_bytes(layer_bytes)}, {method})",
             len(host_layers) * host_alloc_bytes(layer_bytes, method))]
    if dev.emulated:
        rows.append(("device experts (emulated: in host RAM)", plan.experts))
    return rows


def _check_host_ram(cfg: ModelConfig, dt: torch.dtype, ckpt_dir: Path | None, needed: list[tuple[str, int]],
                    available: int | None = None) -> None:
    """Refuse, with the arithmetic, to materialise a model that cannot fit in host RAM."""
    need = sum(n for _, n in needed)
    avail = psutil.virtual_memory().available if available is None else available
    if need > avail:
        what = "checkpoint" if ckpt_dir else f"preset {cfg.name!r} (seeded random weights)"
        lines = "\n".join(f"  {name:<56} {fmt_bytes(n):>12}" for name, n in needed)
        raise MemoryError(f"{what} needs {fmt_bytes(need)} of host RAM at {str(dt).split('.')[-1]}, "
                          f"but only {fmt_bytes(avail)} is available:\n{lines}\n"
                          "use engine.planner.plan_memory for sizing without weights, or model_overrides "
                          "(e.g. num_layers) for a truncated run")


__all__ = ["Engine", "EngineOptions", "GenerateResult", "NonFiniteError", "parse_bytes"]
