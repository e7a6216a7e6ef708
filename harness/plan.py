"""`moebench plan` and `moebench fit`: what fits on the device, answered before any weight is read.

Owns: the memory plan of a composed config (`plan_of`: the engine planner's arithmetic for the
job's model, placement, cache, context the scenario needs, batch, micro-batch, dtype, device
budget and device kind, with room for the quality pass's logits where the job makes one:
RunSpec.all_logits; `job_plan`: the one a job's engine will make, which the runner checks
before anything reads a weight), whether every registered placement would fit, a table over a sweep's
jobs (`-m`), and the searches of `fit` -- the largest context, the largest cache capacity, or the
fewest CPU layers (llama.cpp's --n-cpu-moe) that fit -- each printed with its plan, and, when
nothing fits, what would. Does not own: the arithmetic (engine.planner), composing configs
(Hydra), running anything.

    moebench plan model=mixtral-8x7b model.dtype=bfloat16 hardware.device_memory=24GiB placement=fetch cache.capacity=auto
    moebench plan -m placement=resident,fetch,hybrid workload.context_tokens=4096,32768 hardware.device_memory=2GiB
    moebench fit --search context placement=fetch cache.capacity=2 hardware.device_memory=7MiB
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from engine.devices import fmt_bytes, parse_bytes
from engine.dtypes import dtype_bytes
from engine.planner import MemoryPlan, PlanError, plan_memory
from engine.registry import PLACEMENTS
from harness.config import BAD_CONFIG, ConfigError, RunSpec, config_error_line, validate
from harness.contract import session_tokens
from harness.machine import job_threads

SEARCHES = ("context", "capacity", "n_cpu_layers")


@contextmanager
def composer(hydra: bool = False) -> Iterator[Callable[[Sequence[str]], Any]]:
    """compose(overrides) -> the config the moebench CLI composes for them (with Hydra's own node
    when `hydra`), Hydra initialised once for every call made inside; a `++` plugin option the
    job's plugin lacks is dropped, as a job drops it (harness.plugin_keys)."""
    from hydra import compose, initialize_config_dir

    import harness.cli  # noqa: F401 -- registers the ConfigStore and the resolvers
    from harness.cli import CONF_DIR
    from harness.plugin_keys import drop_not_applicable

    def composed(overrides: Sequence[str]) -> Any:
        cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=hydra)
        drop_not_applicable(cfg, overrides)
        return cfg

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        yield composed


def _compose(overrides: Sequence[str], hydra: bool = False):
    with composer(hydra) as compose:
        return compose(overrides)


def compose_once(overrides: Sequence[str]) -> Any:
    """The config `overrides` compose to, with Hydra's own node."""
    return _compose(overrides, hydra=True)


def expand(overrides: Sequence[str]) -> list[list[str]]:
    """The jobs a basic-sweeper multirun makes of `overrides` (and of an experiment's
    `hydra.sweeper.params`): the cartesian product of every key's values."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    cfg = _compose([o.input_line for o in parsed if not o.is_sweep_override()], hydra=True)
    params = dict(cfg.hydra.sweeper.params or {})
    extra = [f"{k}={v}" for k, v in params.items() if not any(o.key_or_group == k for o in parsed)]
    parsed += OverridesParser.create().parse_overrides(extra)
    axes = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override()
            else [o.input_line] for o in parsed]
    return [list(combo) for combo in itertools.product(*axes)]


def spec_of(overrides: Sequence[str]) -> RunSpec:
    return validate(_compose(overrides))


def _device_kind(spec: RunSpec) -> str:
    d = spec.hardware.device
    if d != "auto":
        return d
    if spec.hardware.device_memory_gib is not None:   # a hardware profile's card: plan for that card
        return "cuda"
    if not gpu_driver_present():          # torch would find no device: a plan needs no torch to say so
        return "cpu"
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


# device nodes a GPU driver makes (NVIDIA, AMD ROCm, WSL): without one, torch.cuda.is_available() is false
_GPU_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def gpu_driver_present() -> bool:
    return any(os.path.exists(p) for p in _GPU_NODES)


def budget_of(spec: RunSpec) -> int | None:
    """hardware.device_memory; else the card of the hardware profile (hardware.device_memory_gib:
    a profile says how much memory its device has, so a plan for it is a plan for that card); else
    the free memory of a real card; else none (the emulated device)."""
    if spec.hardware.device_memory is not None:
        return parse_bytes(spec.hardware.device_memory)
    if spec.hardware.device_memory_gib is not None:
        return int(spec.hardware.device_memory_gib * (1 << 30))
    if _device_kind(spec) == "cuda":
        import torch
        return torch.cuda.mem_get_info()[0]
    return None


def plan_of(spec: RunSpec, placement: str | None = None, options: dict[str, Any] | None = None,
            capacity: int | str | None = None) -> MemoryPlan:
    """The planner's plan for this job (or for another placement of it); raises PlanError."""
    name = placement or spec.placement
    opts = spec.placement_options if placement is None else (options or {})
    uses = PLACEMENTS.get(name).uses_cache(opts)
    cap = (spec.capacity if placement is None else capacity) if uses else None
    cap_bytes = spec.capacity_bytes if uses and placement is None and cap is None else None
    if uses and cap is None and cap_bytes is None:
        cap = "auto"
    w, m = spec.workload, spec.planned_config
    dt = m.torch_dtype if spec.model.dtype == "auto" else spec.model.dtype
    return plan_memory(m, name, cap, budget_of(spec), spec.session_tokens, spec.planned_batch, w.ubatch,
                       dtype_bytes(dt), opts, device_kind=_device_kind(spec), capacity_bytes=cap_bytes, kv_dtype=spec.kv_dtype if _plans_memory(spec) else None,
                       all_logits=spec.all_logits, cpu_threads=job_threads(spec), transient=_engine().get(
                           spec.engine).transient_rule(spec))


def _engine():
    """The engine registry, imported when asked: `moebench plan` loads no adapter it does not use."""
    from harness.engines.registry import ENGINES
    return ENGINES


def _plans_memory(spec: RunSpec) -> bool:
    """The job's engine plans device memory with engine.planner (under the job's kv.dtype)."""
    return _engine().get(spec.engine).memory_plan


def job_plan(spec: RunSpec) -> MemoryPlan | None:
    """The memory plan the job's engine will make when it loads (engine.Engine.from_pretrained),
    made first, from the config alone: the runner asks for it right after `validate`, so a budget
    that cannot hold the job fails it with the plan's arithmetic before the reference or the
    engine reads a weight. None when there is nothing to refuse: an engine that does not plan with
    engine.planner (its adapter declares no `memory_plan`) or no hardware.device_memory (the engine
    plans without a budget then). Raises PlanError, or ValueError for an impossible cache."""
    if spec.hardware.device_memory is None or not _plans_memory(spec):
        return None
    return plan_of(spec)


@dataclass(frozen=True)
class HostPlan:
    """What stays in host RAM for a job (`terms`: printout line, bytes) against the host's RAM
    (hardware.host_memory_gib; None: not given, so no verdict). Weights that do not fit are paged
    in from disk as they are touched (an mmap'd checkpoint), which the prediction bounds by
    hardware.disk_read_gbps."""

    terms: tuple[tuple[str, int], ...]
    budget: int | None
    expert_bytes: int               # the routed experts' share of the terms (what a decode step pages)

    @property
    def total(self) -> int:
        return sum(b for _, b in self.terms)

    @property
    def fits(self) -> bool | None:
        return None if self.budget is None else self.total <= self.budget

    @property
    def paged_fraction(self) -> float:
        """The share of the host-held experts that RAM cannot hold (0 when it fits or is unknown)."""
        if not self.fits and self.budget is not None and self.expert_bytes:
            return min(1.0, (self.total - self.budget) / self.expert_bytes)
        return 0.0

    def lines(self) -> list[str]:
        w = max(40, *(len(name) for name, _ in self.terms)) if self.terms else 40
        out = [f"  {name:<{w}} {fmt_bytes(b):>12}" for name, b in self.terms]
        out.append(f"  {'= total':<{w}} {fmt_bytes(self.total):>12}")
        if self.budget is None:
            out.append(f"  {'host RAM':<{w}} {'unknown':>12}  (hardware.host_memory_gib: no host verdict)")
        else:
            out.append(f"  {'host RAM':<{w}} {fmt_bytes(self.budget):>12}")
            if not self.fits:
                out.append(f"  does not fit the host RAM: {fmt_bytes(self.total - self.budget)} over; "
                           f"{self.paged_fraction:.0%} of the host-held experts page in from disk as they are "
                           "touched (predict bounds decode by hardware.disk_read_gbps)")
        return out


def host_plan(spec: RunSpec, placement: str | None = None, options: dict[str, Any] | None = None,
              device_plan: MemoryPlan | None = None) -> HostPlan:
    """What the job keeps in host RAM: the routed experts its placement leaves on the host (the
    CPU layers', or every layer's store a device cache copies from), the session's KV offloaded
    for the restored turn, and the reference model when run.check_reference loads one."""
    name = placement or spec.placement
    opts = spec.placement_options if placement is None else (options or {})
    cfg = spec.planned_config
    dt = dtype_bytes(cfg.torch_dtype if spec.model.dtype == "auto" else spec.model.dtype)
    tr = PLACEMENTS.get(name).traits(cfg, opts)
    held = [layer for layer in cfg.moe_layers if tr.copies_experts or layer in tr.cpu_layers]
    per_layer = cfg.n_experts * cfg.expert_bytes(dt)
    terms = [(f"experts on the host [{name}] ({len(held)} of {cfg.n_moe_layers} MoE layers)", len(held) * per_layer)]
    if device_plan is not None:
        terms.append(("KV offloaded (the restored turn)", device_plan.kv))
    if spec.run.check_reference:
        arch = cfg.architecture()
        non_expert = arch.non_expert_bytes(dt) if cfg.weight_bytes is None else cfg.weight_bytes.non_expert
        terms.append(("reference model (run.check_reference)", non_expert + cfg.n_moe_layers * per_layer))
    gib = spec.hardware.host_memory_gib
    return HostPlan(tuple(terms), None if gib is None else int(gib * (1 << 30)), len(held) * per_layer)


@dataclass
class Verdict:
    fits: bool
    plan: MemoryPlan | None
    message: str            # the plan, or the refusal with its arithmetic


def verdict(spec: RunSpec, **kw: Any) -> Verdict:
    try:
        p = plan_of(spec, **kw)
        return Verdict(True, p, str(p))
    except PlanError as exc:
        return Verdict(False, None, str(exc))
    except (ValueError, TypeError) as exc:      # e.g. a capacity outside [top_k, n_experts]
        return Verdict(False, None, f"{type(exc).__name__}: {exc}")


def registered_verdicts(spec: RunSpec) -> list[tuple[str, Verdict]]:
    """Every registered placement the job's engine can lay out (its adapter's `placements`), with
    its verdict at this job's context and budget, default options and the job's cache capacity
    (else auto): what `moebench plan` lists under a job's plan."""
    capacity = spec.capacity if spec.capacity is not None else "auto"
    return [(name, verdict(spec, placement=name, capacity=capacity)) for name in engine_placements(spec)]


def engine_placements(spec: RunSpec) -> list[str]:
    """The registered placements the job's engine lays out, in registry order."""
    own = _engine().get(spec.engine).placements
    return [name for name in PLACEMENTS.names() if own is None or name in own]


def _header(spec: RunSpec) -> str:
    w, m, b = spec.workload, spec.model_config, budget_of(spec)
    threads = f" ({job_threads(spec)} torch threads)" if _device_kind(spec) == "cpu" else ""
    return (f"{spec.model_label} ({m.family}, {m.n_moe_layers} MoE layers x {m.n_experts} experts, top-{m.top_k}), "
            f"dtype {spec.model.dtype}, {spec.placement}, context {w.context_tokens} (+{w.gen_tokens} generated, "
            f"+2 turns of {w.turn_tokens}) x batch {spec.planned_batch}, ubatch {w.ubatch}, device {_device_kind(spec)}"
            f"{threads}, budget {fmt_bytes(b) if b is not None else 'unlimited'}{_budget_source(spec)}\n"
            f"engine={spec.engine}: weights {spec.weights_note}")


def _budget_source(spec: RunSpec) -> str:
    hw = spec.hardware
    if hw.device_memory is None and hw.device_memory_gib is not None:
        return f" (hardware={hw.name}'s {hw.device_memory_gib:g} GiB card)"
    return ""


def report(spec: RunSpec) -> tuple[bool, str]:
    """Whether the job's plan fits, and the text `moebench plan` prints for one job."""
    v = verdict(spec)
    lines = [_header(spec), v.message]
    if v.plan is not None and spec.capacity == "auto":
        lines.append(f"cache.capacity=auto -> {v.plan.capacity} expert slots per MoE layer")
    if v.plan is not None:
        lines += ["host memory plan:", *host_plan(spec, device_plan=v.plan).lines()]
    which = ("every registered placement" if _engine().get(spec.engine).placements is None
             else f"every placement engine={spec.engine} lays out")
    lines.append(f"{which} at this context and budget (its default options):")
    width = max(map(len, PLACEMENTS.names()))
    for name, other in registered_verdicts(spec):
        total = fmt_bytes(other.plan.total) if other.plan else other.message.splitlines()[0]
        cap = f" ({other.plan.capacity} slots/layer)" if other.plan and other.plan.capacity is not None else ""
        lines.append(f"  {name:<{width}} {'fits' if other.fits else 'does not fit'}: {total}{cap}")
    return v.fits, "\n".join(lines)


def sweep_report(jobs: list[list[str]]) -> tuple[bool, str]:
    """One line per job of a sweep: its overrides, the plan total, and whether it fits."""
    rows, ok, cpu_threads = [], True, set()
    for job in jobs:
        try:
            spec = spec_of(job)
            if _device_kind(spec) == "cpu":
                cpu_threads.add(job_threads(spec))
        except ConfigError as exc:
            rows.append((" ".join(job), "invalid", str(exc)))
            ok = False
            continue
        v = verdict(spec)
        ok &= v.fits
        detail = (f"{fmt_bytes(v.plan.total)}" + (f", {v.plan.capacity} slots/layer" if v.plan.capacity else "")
                  if v.plan else v.message.splitlines()[0])
        rows.append((" ".join(job), "fits" if v.fits else "does not fit", detail))
    width = max(len(r[0]) for r in rows)
    note = f"planned for {' or '.join(map(str, sorted(cpu_threads)))} torch thread(s) (run.threads; CPU attention " \
        "keeps a buffer per thread)\n" if cpu_threads else ""
    return ok, note + "\n".join(f"{a:<{width}}  {b:<12}  {c}" for a, b, c in rows)


# --- fit: the largest setting that fits -------------------------------------------------------------
def _largest(lo: int, hi: int, fits) -> int | None:
    """The largest n in [lo, hi] with fits(n), for fits monotone (true up to some n); None if none."""
    if not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def fit_context(spec: RunSpec) -> tuple[int | None, str]:
    w, m = spec.workload, spec.model_config
    most = m.max_position_embeddings - session_tokens(0, w.gen_tokens, w.turn_tokens)
    with_ctx = lambda n: replace(spec, workload=replace(w, context_tokens=n))  # noqa: E731
    best = _largest(1, most, lambda n: verdict(with_ctx(n)).fits)
    if best is None:
        return None, (f"nothing fits: even a 1-token context is refused --\n{verdict(with_ctx(1)).message}\n"
                      + _what_would(with_ctx(1)))
    return best, f"largest context_tokens that fits: {best} (the model allows {most})\n{verdict(with_ctx(best)).message}"


def fit_capacity(spec: RunSpec) -> tuple[int | None, str]:
    m = spec.model_config
    if not PLACEMENTS.get(spec.placement).uses_cache(spec.placement_options):
        raise ConfigError(f"fit --search capacity: placement={spec.placement} keeps no expert cache; use a placement "
                          "with one (fetch, or stream with stream_fallback=fetch)")
    with_cap = lambda n: replace(spec, capacity=n)  # noqa: E731
    best = _largest(m.top_k, m.n_experts, lambda n: verdict(with_cap(n)).fits)
    if best is None:
        return None, (f"nothing fits: even top_k={m.top_k} slots per layer are refused --\n"
                      f"{verdict(with_cap(m.top_k)).message}\n" + _what_would(with_cap(m.top_k)))
    return best, f"largest cache.capacity that fits: {best} of {m.n_experts}\n{verdict(with_cap(best)).message}"


def fit_cpu_layers(spec: RunSpec) -> tuple[int | None, str]:
    m = spec.model_config
    hybrid = lambda n: replace(spec, placement="hybrid", placement_options={"n_cpu_layers": n}, capacity=None)  # noqa: E731
    for n in range(m.n_moe_layers + 1):           # fewest first; monotone, but the range is small
        if verdict(hybrid(n)).fits:
            return n, (f"fewest CPU layers that fit for engine={spec.engine} ({_rule_label(spec)}): {n} of "
                       f"{m.n_moe_layers} (placement=hybrid placement.n_cpu_layers={n}; llama.cpp --n-cpu-moe {n})\n"
                       f"{verdict(hybrid(n)).message}")
    last = hybrid(m.n_moe_layers)
    return None, (f"nothing fits: even every MoE layer's experts on the CPU is refused --\n{verdict(last).message}\n"
                  + _what_would(last))


def _rule_label(spec: RunSpec) -> str:
    """Whose memory rule a search answers with: the engine's transient rule, its weights' format."""
    rule = _engine().get(spec.engine).transient_rule(spec)
    return f"{rule.label if rule is not None else 'its own forward pass'}; weights {spec.weights_note}"


def _what_would(spec: RunSpec) -> str:
    """When nothing fits: the largest context that would (if any), and the fixed weights alone."""
    w = spec.workload
    shrunk = None
    if w.context_tokens > 1:
        shrunk = _largest(1, w.context_tokens - 1,
                          lambda n: verdict(replace(spec, workload=replace(w, context_tokens=n))).fits)
    if shrunk is not None:
        return f"what would fit: the same setting with workload.context_tokens={shrunk}"
    return ("what would fit: nothing at any context -- the weights this placement keeps on the device exceed the "
            "budget; offload more (placement=fetch with a small cache.capacity, or placement=cpu), a smaller "
            "model.dtype, or a larger hardware.device_memory")


FITS = {"context": fit_context, "capacity": fit_capacity, "n_cpu_layers": fit_cpu_layers}


def plan_main(argv: Sequence[str]) -> int:
    """`moebench plan [-m] [overrides]`: exit 0 when (every job's) plan fits, 1 when not, 2 on bad input."""
    p = argparse.ArgumentParser(prog="moebench plan", description="The memory plan of a config (or of each job "
                                "of a sweep, -m), from the config alone: no weight is read, nothing runs. Exit 0: "
                                "it fits, 1: it does not, 2: bad input.",
                                epilog="e.g. moebench plan model=mixtral-8x7b model.dtype=bfloat16 "
                                       "hardware.device_memory=24GiB placement=fetch cache.capacity=auto")
    p.add_argument("-m", "--multirun", action="store_true", help="one line per job of the sweep the overrides make")
    p.add_argument("overrides", nargs="*", help="the run's overrides (key=value, group=option), as `moebench` takes")
    args = p.parse_intermixed_args(argv)
    multirun = args.multirun
    try:
        from harness.plugin_keys import scope_options
        overrides = scope_options(args.overrides, multirun, compose_once)
        if multirun:
            ok, text = sweep_report(expand(overrides))
        else:
            ok, text = report(spec_of(overrides))
    except BAD_CONFIG as exc:
        print(f"moebench plan: {config_error_line(exc)}", file=sys.stderr)
        return 2
    print(text)
    return 0 if ok else 1


def fit_main(argv: Sequence[str]) -> int:
    """`moebench fit --search context|capacity|n_cpu_layers [overrides]`."""
    p = argparse.ArgumentParser(prog="moebench fit", description="The largest setting that fits the device budget.")
    p.add_argument("--search", choices=SEARCHES, default="context")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    try:
        best, text = FITS[args.search](spec_of(args.overrides))
    except BAD_CONFIG as exc:
        print(f"moebench fit: {config_error_line(exc)}", file=sys.stderr)
        return 2
    print(text)
    return 0 if best is not None else 1
