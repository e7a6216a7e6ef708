"""The engine adapter interface: the one surface the scenario drives, whatever runs the model
(moebench's engine, Hugging Face transformers, llama.cpp's server).

Owns: the contract between the scenario and an engine -- sessions, a prefill that produces the
first token (`Produced`: ids per row and, when the engine has them, the logits that chose them),
a decode that *yields* one `Produced` per step (so the scenario times each step, and a streaming
server can yield tokens as they arrive), KV displacement, counters (None where an engine cannot
count: never 0), engine-side timings of the last phase (`phase_metrics`, source=engine), and the
knobs that become row columns. Does not own: timing, phases or checks (harness.scenario), building
or caching adapters (harness.engines).

An engine family member is one module with a subclass registered in
`harness.engines.registry.ENGINES` (or the entry-point group `moebench.engines`); its `Options`
dataclass is its Hydra schema under `engine.` (harness.plugins builds it), `check(spec)` is its
own part of validation, `build(spec, options)` makes it, and its class attributes declare what it
can do (capabilities, knob columns, sub-commands): core code asks those, never its name.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from engine.hooks import NULL, Instrument, Progress
from engine.registry import NoOptions
from engine.lazy import lazy_module
from harness.engines.registry import Command  # noqa: F401 -- an adapter declares its sub-commands with it

if TYPE_CHECKING:
    import torch

    from engine.engine import Engine
    from harness.config.schema import RunSpec
else:                  # an adapter's class and options load without torch (moebench --help, plan)
    torch = lazy_module("torch", globals())


@dataclass
class Produced:
    """What one forward pass gave: one id per sequence, its logits [B, V] when the engine has
    them, and per sequence the top-k {id: logprob} when the engine reports only those."""

    tokens: list[int]
    logits: torch.Tensor | None = None
    top_logprobs: list[dict[int, float] | None] | None = None


def refuse_truncation(spec: RunSpec, engine: str) -> None:
    """An engine that runs a checkpoint as saved cannot drop layers: `model.num_layers` with a
    `model.path` would measure a deeper model than ours and the reference (presets are built
    truncated, so they are fine)."""
    if spec.model.path and spec.model.num_layers:
        raise ValueError(f"engine={engine} runs the checkpoint as saved: model.num_layers={spec.model.num_layers} "
                         "with model.path applies to engine=moebench only (a preset model is built truncated "
                         "for every engine)")


class EngineAdapter(ABC):
    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    device_kind: str = "cpu"
    device_name: str = "cpu"
    emulated: bool = False
    serves: ClassVar[bool] = False                # `serve`: requests arriving over time, many in flight
    resolved_capacity: int | None = None
    has_expert_cache: bool = False     # whether phases start from a cold or warm expert cache
    instrument: Instrument = NULL
    # our engine (engine.Engine) where the adapter runs one: what `per_position_logits`, `routing_hooks` and
    # `resident_twin` read; None for an engine that runs elsewhere
    engine: Engine | None = None

    # --- what it can do: capabilities core code asks (harness.config, harness.plan, the passes, the cost
    # model, the results store), never its name
    uses_placement: ClassVar[bool] = True   # moebench's placement/cache/prefetch factors apply to it
    kv_treatments: ClassVar[bool] = False   # it stores its KV as kv.dtype says (a lossy treatment, labelled)
    per_position_logits: ClassVar[bool] = False   # full-vocabulary logits at every position of a micro-batch
                                                  # (`engine.prefill(all_logits=True)`: the quality pass)
    routing_hooks: ClassVar[bool] = False   # its routing is recorded per pass (`engine.model.step_log`: the trace pass)
    resident_twin: ClassVar[bool] = False   # `resident_adapter(spec)`: the same job, every expert resident (ablation)
    memory_plan: ClassVar[bool] = False     # it plans device memory with engine.planner before loading (so a job's
                                            # plan, under its kv.dtype, is checked before any weight is read)
    cost_model: ClassVar[bool] = False      # the cost model and the roofline predict its time (harness.costmodel)
    # the placements whose layout its own knobs express (what `moebench plan` and `predict` list for it when no
    # placement is chosen); None: every registered placement
    placements: ClassVar[tuple[str, ...] | None] = None
    # its knobs' row columns (what `knobs()` returns beside the factors): configuration a results table groups
    # by (harness.results.CONFIG_COLUMNS)
    knob_columns: ClassVar[tuple[str, ...]] = ()
    # config column -> the value its rows held before that column existed (a results file older than the column
    # reads it for this engine's rows: harness.results.reader)
    columns_before: ClassVar[dict[str, str]] = {}
    # `moebench <words>` -> its sub-command (building a server, importing its reports): what runs and its help line
    commands: ClassVar[dict[str, Command]] = {}
    allocates_here: ClassVar[bool] = True    # its device memory is this process's allocator's (not a server's)
    threads_at_load: ClassVar[bool] = False  # its thread count is fixed when it loads (a server's -t): a job
                                             # at another run.threads needs another engine, never this one
    # token ids it is told never to produce (a server's end-of-generation tokens under ignore_eos): where
    # the reference chose one, the check says so instead of calling the other token wrong
    suppressed_tokens: frozenset[int] = frozenset()
    checks_finite: ClassVar[bool] = False    # it refuses NaN/inf outputs itself; else the scenario checks what
                                             # it returns (harness.scenario.check_received)
    # the loader it hands a checkpoint dir to that could run code shipped in it (transformers, a
    # converter), named in the refusal (harness.remote_code); None: it runs no checkpoint code
    checkpoint_loader: ClassVar[str | None] = None
    holds_gguf: ClassVar[bool] = False       # it holds weights in GGUF types, read from a GGUF file or converted
    compute_dtype: str | None = None   # the torch dtype its matmuls run in; None: the engine picks per tensor
    lossy: bool = False                # it runs a lossy treatment (a KV format that loses precision, ...)
    load_s: float | None = None        # its own model load, s (the load row's source=engine time_s): the
                                       # client's time_s also holds one-time setup (imports, a GGUF conversion)

    def alive(self) -> bool:
        """Whether a cached adapter can serve another job (a server process can die between jobs, or be
        killed after a stall); False: it gets no further request, not even a session's close."""
        return True

    def worker_pid(self) -> int:
        """The process whose CPU time is a phase's work (harness.measure: `cpu_time_s`, `starved`):
        by default this one, all its threads; an engine serving from another process names it."""
        return os.getpid()

    def worker_threads(self) -> int:
        """The threads that process was allowed for the work (`cpu_util`'s denominator)."""
        return torch.get_num_threads()

    def budget_gap(self) -> str | None:
        """How this engine falls short of holding `hardware.device_memory` (the runner warns), or None."""
        return None

    @classmethod
    def check(cls, spec: RunSpec) -> None:
        """This engine's own checks of a job, before any weight is read (harness.config.validate
        reports a ValueError's one line as the config error). The default: the model can store its
        KV as kv.dtype says (engine.kvquant: its state kinds and head_dim)."""
        from engine.kvquant import KVFormatError
        try:
            spec.model_config.architecture().state_terms(4, spec.kv_dtype)
        except KVFormatError as exc:
            raise ValueError(f"kv.dtype: {exc}") from None

    @classmethod
    def held_weights(cls, spec: RunSpec) -> tuple[Any, str]:
        """The bytes this engine holds the job's weights in (engine.formats.WeightBytes; None: the
        model's blocks at model.dtype, what engine.planner counts itself) and a note on the format
        for the plan. The default, an engine that loads a Hugging Face checkpoint or a preset: the
        weights in model.dtype, a published format its blocks do not keep (DeepSeek-V3's FP8)
        dequantised at load, one they keep (gpt-oss's MXFP4 experts) as stored; a model.weight_format
        or expert_format other than model.dtype's, or a GGUF file, is refused (ValueError)."""
        from engine.formats import DTYPE_FORMATS, WeightFormat, published
        from harness.engines.registry import engines_with
        m, own = spec.model, DTYPE_FORMATS.get(spec.dtype, spec.dtype)

        def others() -> str:          # asked on the error paths only: it loads every adapter's declaration
            return " | ".join(engines_with("holds_gguf")) or "none registered"
        if m.gguf:
            raise ValueError(f"model.gguf: engine={cls.name} loads a Hugging Face checkpoint or a preset, not a GGUF "
                             f"file; allowed with engine={cls.name}: model.gguf=null (a GGUF file: engine={others()})")
        asked = WeightFormat(m.weight_format or own, m.expert_format) if (m.weight_format or m.expert_format) else None
        if asked is not None and not asked.keeps_dtype(spec.dtype):
            raise ValueError(f"model.weight_format={m.weight_format} model.expert_format={m.expert_format}: engine="
                             f"{cls.name} holds the weights in model.dtype ({spec.dtype}); allowed: {own} or null "
                             f"(other formats: engine={others()})")
        pub = published(spec.model_config)
        if pub.weights == own:
            return None, f"{pub.label} (published)"
        kept = f"; experts kept in {pub.experts} as published" if pub.experts else ""
        return None, f"published {pub.weights}, held in {own} (dequantised at load){kept}"

    @classmethod
    def transient_rule(cls, spec: RunSpec) -> Any:
        """How this engine's transient memory (activations, attention workspace) is planned
        (engine.planner.TransientRule); None: the planner's own, for this engine's forward pass."""
        return None

    @classmethod
    @abstractmethod
    def build(cls, spec: RunSpec, options: Any, **kw: Any) -> "EngineAdapter":
        """The adapter for a validated RunSpec and this engine's parsed Options."""

    def resident_adapter(self, spec: RunSpec) -> "EngineAdapter":
        """Where `resident_twin`: the same job on the same device with every expert resident (the
        ablation's other side)."""
        raise NotImplementedError(f"engine={self.name} has no resident twin")

    @abstractmethod
    def new_session(self, batch: int) -> Any: ...

    @abstractmethod
    def prefill(self, sess: Any, rows: list[list[int]]) -> Produced:
        """Append `rows` [B][T] to the session; the next token per row."""

    @abstractmethod
    def decode(self, sess: Any, tokens: list[int], steps: int) -> Iterator[Produced]:
        """Feed `tokens` (one per row), then each produced token, `steps` times; yield each step's output."""

    @abstractmethod
    def offload(self, sess: Any) -> None: ...

    @abstractmethod
    def restore(self, sess: Any) -> None: ...

    @abstractmethod
    def close_session(self, sess: Any) -> None: ...

    def counters(self) -> dict[str, int] | None:
        """Cumulative engine counters, or None when this engine cannot measure them."""
        return None

    def phase_metrics(self) -> dict[str, float | None]:
        """Engine-side measurements of the requests since the last call (e.g. a server's own timings)."""
        return {}

    def serve(self, requests: list[Any], max_concurrency: int | None, prefix_cache: str = "isolated",
              prefix: list[int] | None = None) -> Any:
        """Serve `requests` (harness.serving.drive.Request) arriving over time, measured from the
        client side; a `harness.serving.drive.Driven`. `prefix_cache` (harness.serving.load's
        modes): isolated -- no request reuses another's KV; cold -- a request may reuse what an
        earlier one computed of the shared `prefix`; primed -- and `prefix` is computed before the
        first request. Where `serves`: the serve pass."""
        raise NotImplementedError(f"engine={self.name} does not serve requests")

    def knobs(self) -> dict[str, Any]:
        """Engine settings that become row columns (e.g. llama.cpp's -ngl, --n-cpu-moe)."""
        return {}

    def placement_map(self) -> str | None:
        """Where each layer's experts live, one letter per layer (`CCGG`: engine.placements.base,
        PlacementTraits.layer_map): the `placement_map` column. None: this engine has no such map."""
        return None

    @classmethod
    def builds(cls) -> dict[str, str]:
        """What this engine runs that no Python package version names (a server binary's commit),
        by name: a job's manifest records it (`engine_builds`), and `moebench rerun` says where
        what it would run differs. {} when there is nothing beside the packages."""
        return {}

    def set_progress(self, progress: Progress | None) -> None:
        """Report long work (a long prefill) to `progress(what, done, total)`; None: stop."""

    def save_artifacts(self, job_dir: Path) -> None:
        """Write what belongs to the job that just ran into its dir (e.g. a server's log)."""

    def reset(self) -> None:
        """Cold state between repeats (empty expert caches)."""

    def set_instrument(self, instrument: Instrument | None) -> bool:
        """Attach a timeline/NVTX instrument (None detaches); False if this engine has no hook."""
        return False

    def reset_device_peak(self) -> None:
        """Start a new window for `device_peak`."""

    def device_peak(self) -> int | None:
        """Peak bytes the emulated device accounted since `reset_device_peak` (None: not emulated --
        a real device's peak comes from its allocator, harness.measure)."""
        return None

    def close(self) -> None:
        """Free the engine's memory (device and host)."""


def argmax(logits: torch.Tensor) -> list[int]:
    """Greedy ids of logits [B, V]; `.tolist()` synchronises, so the token is on the host."""
    return logits.argmax(-1).tolist()
