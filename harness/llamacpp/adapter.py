"""`engine=llamacpp`: llama.cpp's server driving the same scenario as our engine, on the same
weights and the same token ids, so one sweep compares llama.cpp's offload knobs with each other
and with our placements.

Owns: turning the job into llama.cpp's world -- the model converted to GGUF at
`engine.weights` (harness.llamacpp.convert, cached; refused first, in our loader's words, when
its weights hold NaN or inf: `refuse_nonfinite_weights`), the knobs (`Options`: -ngl, --cpu-moe,
--n-cpu-moe, -ot, -b, -ctk/-ctv, -fa, the server's host prompt cache; -ub from
`workload.ubatch`, -c from the session length, -t from the run's threads) checked against this
build before launch, one server per model and knob set (reused across repeats and jobs, always
stopped; one that stalled is killed and never reused: `engine.stall_timeout_s`,
`engine.request_timeout_s`, `engine.startup_timeout_s`), the server process as the one whose CPU
time a phase measures -- and each phase as llama.cpp requests:

  prefill_fresh         the slot erased, then the context as one request (n_predict=1, streamed
                        with prompt-progress events); the server must report 0 cached tokens
  decode                the pending token and gen-1 steps, streamed: each step timed as it
                        arrives (client) and by the server's own clock (engine)
  prefill_continuation  the whole history plus the turn, the slot's KV reused (`reused_tokens`
                        from the server's cached-token count)
  kv_offload            the slot saved to a file and erased (`saved_state_bytes`)
  prefill_restored      the slot restored from that file, then continued

Engine-side figures are llama.cpp's own per-request timings (source=engine) and its server
process's peak RSS; counters it cannot give (bytes over the link, expert-cache hits) are
null, never 0. Greedy tokens are checked against our exact reference like every engine's, and
where the server returns top-k logprobs, those against the reference's (`max_abs_logprob_diff`).
Declares what it can do (`kv_treatments`: kv.dtype as -ctk/-ctv), its own checks (`check`: the
knobs against kv.dtype, a GGUF type for the model dtype), its knob columns and its sub-commands
(`moebench setup llamacpp`, `moebench import llama-bench`); no module outside this package names it.
Does not own: building llama.cpp, converting, the server or its HTTP client (the sibling modules).
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.placements.base import PlacementTraits
from engine.placements.hybrid import HybridOptions, cpu_layer_set
from harness.engines.base import Command, EngineAdapter, Produced, refuse_truncation
from harness.llamacpp.convert import LOADER as CONVERTER
from harness.llamacpp.flags import BENCH_ONLY_KNOBS, KNOB_COLUMNS, OWN_TYPES, cpu_expert_layers
from harness.llamacpp.responses import logprob_of
from harness.machine import job_threads

if TYPE_CHECKING:
    from engine.config import ModelConfig
    from harness.config.schema import RunSpec

log = logging.getLogger(__name__)
CONFIGS = ("exact", "defaults")      # exact: KV in the model's dtype, flash attention off (reproduces the reference)
TOP_LOGPROBS = 5


@dataclass(frozen=True)
class LlamaCppOptions:
    config: str = "exact"                  # exact | defaults: llama.cpp's own choices for -ctk/-ctv/-fa
    weights: str | None = None             # GGUF type: f32 f16 bf16 q8_0 q4_k_m ... (the converter's or llama-quantize's);
                                           # None: the model dtype's own (float32 f32, bfloat16 bf16, float16 f16)
    n_gpu_layers: str | None = None        # -ngl N | auto | all (None: llama.cpp's default)
    cpu_moe: bool = False                  # --cpu-moe: every layer's experts on the CPU
    n_cpu_moe: int | None = None           # --n-cpu-moe N: the experts of the first N layers on the CPU
    override_tensor: str | None = None     # -ot PATTERN=BUFFER[,PATTERN=BUFFER...]
    # which n_cpu_moe layers: first_n (--n-cpu-moe), last_n or by_working_set (a routing trace's layers
    # with the fewest distinct experts per prefill pass), the latter two as `-ot` entries: the same
    # map as placement=hybrid placement.cpu_layers=... (engine.placements.hybrid.cpu_layer_set)
    cpu_layers: str = "first_n"
    working_set_trace: str | None = None
    batch: int | None = None               # -b: logical batch (tokens)
    cache_type_k: str | None = None        # -ctk: overrides the config's
    cache_type_v: str | None = None        # -ctv
    flash_attn: str | None = None          # -fa on|off|auto: overrides the config's
    cache_ram: int = 0                     # --cache-ram MiB: the server's host-RAM prompt cache (0: off, so a
                                           # fresh prefill is fresh; set it to sweep what it buys)
    top_logprobs: bool = True              # ask for the top-5 logprobs of each token (checked against ours)
    # limits, s (harness.llamacpp.server): launch -> /health ok; no byte from the server while a request
    # is in flight (the server is killed, the job fails); one request start to end
    startup_timeout_s: float = 180.0
    stall_timeout_s: float = 300.0
    request_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        from harness.llamacpp.convert import GGUF_TYPES
        for name in ("startup_timeout_s", "stall_timeout_s", "request_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name}: allowed a positive number of seconds, got {value!r}")
        if self.config not in CONFIGS:
            raise ValueError(f"config: allowed {list(CONFIGS)}, got {self.config!r}")
        if self.weights is not None and self.weights not in GGUF_TYPES:
            raise ValueError(f"weights: allowed {sorted(GGUF_TYPES)}, got {self.weights!r}")
        if self.n_gpu_layers is not None and not (str(self.n_gpu_layers).isdigit()
                                                  or self.n_gpu_layers in ("auto", "all")):
            raise ValueError(f"n_gpu_layers: allowed an integer >= 0, 'auto' or 'all', got {self.n_gpu_layers!r}")
        if self.cpu_layers != "first_n" and self.n_cpu_moe is None:
            raise ValueError(f"cpu_layers={self.cpu_layers}: says which layers, n_cpu_moe how many; give "
                             "engine.n_cpu_moe=N (or cpu_layers=first_n)")
        HybridOptions(self.n_cpu_moe or 0, self.cpu_layers, self.working_set_trace)   # its checks, one wording
        self.flags(ubatch=None, ctx=None, threads=None)        # the knob checks of LlamaFlags, before any launch

    def mapped(self, cfg: ModelConfig) -> LlamaCppOptions:
        """These options with a last_n / by_working_set map spelled as llama.cpp runs it: the chosen
        layers' `-ot` entries (flags.cpu_layers_override) in place of --n-cpu-moe."""
        if self.cpu_layers == "first_n":
            return self
        from harness.llamacpp.flags import cpu_layers_override
        layers = cpu_layer_set(cfg, HybridOptions(self.n_cpu_moe, self.cpu_layers, self.working_set_trace))
        ot = [p for p in (self.override_tensor or "").split(",") if p] + list(cpu_layers_override(layers))
        return replace(self, n_cpu_moe=None, cpu_layers="first_n", working_set_trace=None,
                                   override_tensor=",".join(ot) or None)

    def weights_for(self, dtype: str) -> str:
        """The GGUF type the job runs: `weights`, or the model dtype's own."""
        if self.weights is not None:
            return self.weights
        if dtype not in OWN_TYPES:
            raise ValueError(f"engine=llamacpp: model.dtype={dtype} has no GGUF type; allowed: {', '.join(OWN_TYPES)}")
        return OWN_TYPES[dtype]

    def flags(self, ubatch: int | None, ctx: int | None, threads: int | None, kv_dtype: str = "model",
              dtype: str = "float32"):
        """The knobs as LlamaFlags, with the job's kv.dtype treatment as -ctk/-ctv (`kv_treatment`);
        `config=exact` keeps the KV in the model's `dtype`, as ours does."""
        from harness.llamacpp.flags import DEFAULTS, EXACT, kv_treatment
        own = OWN_TYPES.get(dtype, "f32")
        base = EXACT.replace(cache_type_k=own, cache_type_v=own) if self.config == "exact" else DEFAULTS
        ngl = int(self.n_gpu_layers) if self.n_gpu_layers is not None and str(self.n_gpu_layers).isdigit() \
            else self.n_gpu_layers
        changes = {"n_gpu_layers": ngl, "cpu_moe": self.cpu_moe, "n_cpu_moe": self.n_cpu_moe,
                   "override_tensor": tuple(p for p in (self.override_tensor or "").split(",") if p),
                   "batch": self.batch, "ubatch": ubatch, "ctx": ctx, "threads": threads, "cache_ram": self.cache_ram}
        for knob in ("cache_type_k", "cache_type_v", "flash_attn"):
            if getattr(self, knob) is not None:
                changes[knob] = getattr(self, knob)
        explicit = {k: getattr(self, k) for k in ("cache_type_k", "cache_type_v", "flash_attn")}
        return kv_treatment(base.replace(**changes), kv_dtype, explicit)


@dataclass
class _Session:
    history: list[int]                     # token ids whose KV the slot holds (the pending token not included)
    saved: str | None = None               # the slot file of a displaced session


class LlamaCppAdapter(EngineAdapter):
    name = "llamacpp"
    serves = True                     # `serve`: streamed requests to the server's -np slots
    Options = LlamaCppOptions
    uses_placement = False            # its offload knobs are engine.*; moebench's placement/cache do not apply
    # the layouts those knobs express: -ngl 99 (resident), --cpu-moe (cpu), --n-cpu-moe N / -ot (hybrid); no
    # expert cache, no streaming
    placements = ("resident", "cpu", "hybrid")
    threads_at_load = True            # the server's -t
    allocates_here = False            # the server holds its device memory: this process's peaks are not its
    checkpoint_loader = CONVERTER
    kv_treatments = True              # kv.dtype as -ctk/-ctv
    holds_gguf = True                 # GGUF types: converted to, or a GGUF file's (model.gguf, plans only)
    # its configuration, GGUF type and knobs as row columns, and the knobs a llama-bench import keeps
    knob_columns = ("llamacpp_config", "gguf_type", *KNOB_COLUMNS.values(), *BENCH_ONLY_KNOBS)
    commands = {"setup llamacpp": Command("harness.llamacpp.build:main", "",
                                          "engine=llamacpp: build the pinned llama.cpp once (cached)"),
                "import llama-bench": Command("harness.llamacpp.bench_import:main", "FILE.jsonl",
                                              "llama-bench's own results as tidy rows")}

    @classmethod
    def check(cls, spec: RunSpec) -> None:
        """kv.dtype as -ctk/-ctv, checked with the engine.* knobs; a GGUF type for the model's dtype."""
        spec.engine_options.mapped(spec.model_config).flags(None, None, None, spec.kv_dtype)   # FlagError: ValueError
        spec.engine_options.weights_for(spec.dtype)

    @classmethod
    def held_weights(cls, spec: RunSpec) -> tuple[Any, str]:
        from harness.llamacpp.memory import held_weights
        return held_weights(spec)

    @classmethod
    def transient_rule(cls, spec: RunSpec) -> Any:
        from harness.llamacpp.memory import transient_rule
        return transient_rule(spec)

    def __init__(self, spec: RunSpec, options: LlamaCppOptions) -> None:
        from harness.llamacpp.build import find_binaries, server_backend
        from harness.llamacpp.convert import convert, convert_preset
        from harness.llamacpp.server import LlamaServer

        if spec.workload.batch != 1:
            raise ValueError(f"engine=llamacpp: workload.batch={spec.workload.batch}; this adapter drives one "
                             "server slot per job, so allowed: workload.batch=1")
        refuse_truncation(spec, self.name)
        self.options = options = options.mapped(spec.model_config)
        self.cfg = spec.model_config
        self.binaries = find_binaries()        # a clear error saying how to build when missing
        threads = job_threads(spec)
        self.weights = _run_type(spec, options)
        # a load's concurrent requests get a slot each (-np), each slot the job's whole context (llama-server
        # splits -c among its slots)
        self.parallel = spec.planned_batch
        self.flags = options.flags(spec.workload.ubatch, (spec.session_tokens + 1) * self.parallel, threads,
                                   spec.kv_dtype, spec.dtype).replace(parallel=self.parallel)
        # lossy: weights or a KV cache type other than the model dtype's own, or flash attention
        # not off (its CPU path drifts from the reference: harness.llamacpp.flags)
        own = OWN_TYPES.get(spec.dtype)
        self.lossy = spec.lossy or self.flags.flash_attn != "off" or not (
            self.weights == self.flags.cache_type_k == self.flags.cache_type_v == own)
        self.flags.server_argv(self.binaries.server)           # validated against this build before launch
        if spec.model.path:                    # NaN or inf weights convert without a word: refused as our loader does
            refuse_nonfinite_weights(spec.model.path)
        self.gguf = (convert(spec.model.path, self.weights, trust_remote_code=spec.model.trust_remote_code)
                     if spec.model.path else
                     convert_preset(spec.model.name, spec.model.seed, self.weights, cfg=spec.model_config))
        # ignore_eos masks the tokenizer's end-of-generation tokens (the pass-through vocabulary has none)
        self.suppressed_tokens = frozenset() if self.gguf.passthrough_vocab else end_of_generation_ids(spec.model.path)
        self.workdir = Path(tempfile.mkdtemp(prefix="moebench-llamacpp-"))
        try:
            self.server = LlamaServer(self.gguf.path, self.flags, log_path=self.workdir / "llama-server.log",
                                      binaries=self.binaries, slot_save_path=self.workdir / "slots",
                                      startup_timeout_s=options.startup_timeout_s,
                                      request_timeout_s=options.request_timeout_s,
                                      stall_timeout_s=options.stall_timeout_s).start()
        except BaseException:                  # the failure carries the log's tail; the dir goes
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise
        self.load_s = self.server.load_s       # start -> /health ok: the model load, no conversion or probe
        props = self.server.props()
        # what the server runs: -c padded up to a multiple of 256, and its own build (LLAMA_CPP_BIN's too)
        self.n_ctx = (props.get("default_generation_settings") or {}).get("n_ctx")     # None: not reported
        self.server_commit = str(props.get("build_info") or "").rpartition("-")[2] or "unknown"
        backend = server_backend(self.binaries.server)
        self.device_kind = "cuda" if backend == "cuda" else "cpu"
        self.device_name = f"llama.cpp {backend}"
        self.emulated = False
        self._metrics: dict[str, float | None] = {}
        self._log_offset = 0

    @classmethod
    def build(cls, spec: RunSpec, options: Any, **kw: Any) -> "LlamaCppAdapter":
        return cls(spec, options)

    def alive(self) -> bool:
        srv = self.server
        return srv is not None and srv.broken is None and srv.proc is not None and srv.proc.poll() is None

    def worker_pid(self) -> int:
        """The server does the work: its CPU time is the phase's (harness.measure reads /proc)."""
        return self.server.pid

    def worker_threads(self) -> int:
        """The server's -t (llama.cpp's default, every core, when unset)."""
        return self.flags.threads or os.cpu_count() or 1

    def budget_gap(self) -> str | None:
        return ("llama.cpp puts on the device what its knobs say (engine.n_gpu_layers, engine.n_cpu_moe, ...), "
                "whatever the budget" if self.device_kind == "cuda" else
                "this llama.cpp build runs on the CPU: nothing is on a device to hold to it")

    # --- rows ---------------------------------------------------------------------------------
    def placement_map(self) -> str | None:
        """Where its flags put each layer's routed experts (flags.cpu_expert_layers), in the letters of
        engine.placements.base.PlacementTraits.layer_map; None under -ngl auto (decided at load)."""
        cpu = cpu_expert_layers(self.flags, self.cfg.num_layers)
        return None if cpu is None else PlacementTraits(cpu_layers=cpu).layer_map(self.cfg)

    def knobs(self) -> dict[str, Any]:
        """llama.cpp's knobs under their row names (harness.llamacpp.flags.KNOB_COLUMNS; `threads` and
        `ubatch` are the run's own columns too, with the same values), the configuration and weights;
        `n_ctx` and `llamacpp_commit` as the running server reports them (/props), the converter's
        commit beside."""
        out = dict(self.flags.as_factors())
        out.update(llamacpp_config=self.options.config, gguf_type=self.weights, n_ctx=self.n_ctx,
                   llamacpp_commit=self.server_commit, gguf_converter_commit=self.gguf.llama_cpp_commit)
        return out

    @classmethod
    def builds(cls) -> dict[str, str]:
        """`llamacpp_commit`: the commit of the llama-server a job would run now, as it says itself."""
        from harness.llamacpp.build import find_binaries
        server = find_binaries().server
        out = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=60)
        found = re.search(r"commit ([0-9a-f]+)", out.stdout + out.stderr)
        return {"llamacpp_commit": found.group(1) if found else "unknown"}

    def phase_metrics(self) -> dict[str, float | None]:
        out, self._metrics = self._metrics, {}
        out["peak_host_rss_bytes"] = self.server.peak_rss_bytes()     # the server process, not the harness
        if self.device_kind == "cuda":                                 # NVML: what the server holds now, not a peak
            out["device_used_bytes"] = _nvml_process_bytes(self.server.pid)
        return out

    def reset_device_peak(self) -> None:
        self.server.reset_peak_rss()

    def save_artifacts(self, job_dir: Path) -> None:
        """This job's part of the server log, into the job dir."""
        log_path = self.server.log_path
        if log_path.is_file():
            with open(log_path, "rb") as f:
                f.seek(self._log_offset)
                data = f.read()
            self._log_offset += len(data)
            job_dir.mkdir(parents=True, exist_ok=True)
            (job_dir / "llama-server.log").write_bytes(data)

    # --- the scenario ---------------------------------------------------------------------------
    def new_session(self, batch: int) -> _Session:
        self.server.slot_erase(0)
        return _Session([])

    def serve(self, requests, max_concurrency: int | None, prefix_cache: str = "isolated",
              prefix: list[int] | None = None):
        """Over HTTP, as a serving client: each request streamed to any free slot (`-np` slots, one
        per request in flight), greedy, the planned output length enforced (ignore_eos). Isolated:
        cache_prompt off, no request reuses a slot's KV; cold: on, a request reuses what its slot
        holds of its prompt; primed: and every slot is given `prefix` first. The server's
        `timings.cache_n` is a request's cached prompt tokens."""
        from harness.serving.drive import drive_requests
        reuse = prefix_cache != "isolated"
        for slot in range(self.parallel) if prefix_cache == "primed" and prefix else ():
            self.server.complete(prefix, 1, slot=slot, cache_prompt=True, ignore_eos=True)

        def exchange(r):                                 # each request's bytes are built before the run
            return self.server.exchange(r.prompt, r.output_len, slot=-1, cache_prompt=reuse, ignore_eos=True)
        try:
            return drive_requests(exchange, requests, max_concurrency)
        finally:
            for slot in range(self.parallel):          # the next job's phases start from empty slots
                self.server.slot_erase(slot)

    def _probs(self) -> int:
        return TOP_LOGPROBS if self.options.top_logprobs else 0

    def prefill(self, sess: _Session, rows: list[list[int]]) -> Produced:
        fresh = not sess.history
        prompt = [*sess.history, *rows[0]]
        # streamed: its prompt-progress events are what the stall watchdog sees of a long prefill
        r = self.server.complete(prompt, 1, cache_prompt=True, n_probs=self._probs(), ignore_eos=True, stream=True)
        t = r.timings
        if fresh and t.cache_n:
            raise RuntimeError(f"llama-server reused {t.cache_n} cached tokens for a fresh prefill (its prompt cache "
                               "is on? engine.cache_ram=0 turns it off)")
        if not fresh and t.cache_n is not None and t.cache_n != len(sess.history):
            raise RuntimeError(f"llama-server reused {t.cache_n} cached tokens of the session's {len(sess.history)}: "
                               "this turn would not be the prefix-cache hit it is measured as")
        self._metrics.update(time_s=t.prompt_ms / 1e3, tokens=float(t.prompt_n), tok_per_s=t.prefill_tok_per_s,
                             reused_tokens=None if t.cache_n is None else float(t.cache_n))
        sess.history = prompt
        return Produced([r.tokens[0]], top_logprobs=[_top(r.top_logprobs, 0)] if self._probs() else None)

    def decode(self, sess: _Session, tokens: list[int], steps: int) -> Iterator[Produced]:
        prompt = [*sess.history, tokens[0]]
        made: list[int] = []
        # ignore_eos: every engine generates the same number of tokens (llama.cpp would stop at an
        # end-of-generation token, which ours never does); it masks those tokens, so where the exact
        # greedy token is one, its continuation differs from ours from there (token_agreement says so)
        chunks = self.server.stream(prompt, steps, cache_prompt=True, n_probs=self._probs(), timings_per_token=True,
                                    ignore_eos=True)
        final = None
        for chunk in chunks:
            for i, tok in enumerate(chunk.tokens):
                made.append(tok)
                probs = chunk.probs[i] if i < len(chunk.probs) else None
                yield Produced([tok], top_logprobs=[_top_one(probs)] if self._probs() else None)
            final = chunk.final or final
        if final is None:
            raise RuntimeError("llama-server's stream ended without its timings")
        if len(made) != steps:
            raise RuntimeError(f"llama-server generated {len(made)} of the {steps} decode tokens asked for: the "
                               "phase would not be the work the other engines do")
        t = final.timings
        per_step = _diffs(final.token_server_ms)
        self._metrics.update(time_s=(t.prompt_ms + t.predicted_ms) / 1e3, tokens=float(len(made)),
                             tok_per_s=len(made) / ((t.prompt_ms + t.predicted_ms) / 1e3)
                             if t.prompt_ms + t.predicted_ms > 0 else None)
        if per_step:
            from harness.measure import percentile
            self._metrics.update({f"tpot_s_p{q}": percentile(per_step, q) for q in (50, 90, 99)})
        sess.history = [*prompt, *made[:-1]]

    def offload(self, sess: _Session) -> None:
        name = f"slot-{id(sess)}.bin"
        r = self.server.slot_save(0, name)
        self.server.slot_erase(0)
        sess.saved = name
        self._metrics.update(time_s=None if r.ms is None else r.ms / 1e3,
                             saved_state_bytes=None if r.bytes is None else float(r.bytes))

    def restore(self, sess: _Session) -> None:
        if sess.saved is None:
            raise RuntimeError("restore() of a session that was not offloaded")
        r = self.server.slot_restore(0, sess.saved)
        if r.tokens != len(sess.history):
            raise RuntimeError(f"llama-server restored {r.tokens} tokens of a {len(sess.history)}-token session")
        self._metrics["restore_s"] = None if r.ms is None else r.ms / 1e3

    def close_session(self, sess: _Session) -> None:
        if sess.saved is not None:
            (self.workdir / "slots" / sess.saved).unlink(missing_ok=True)
        if self.alive():                       # a server killed after a stall gets no request
            self.server.slot_erase(0)

    def reset(self) -> None:
        self.server.slot_erase(0)

    def close(self) -> None:
        if getattr(self, "server", None) is not None:
            self.server.stop()
            self.server = None
        shutil.rmtree(getattr(self, "workdir", ""), ignore_errors=True)


def _run_type(spec: RunSpec, options: LlamaCppOptions) -> str:
    """The GGUF type a run converts to: engine.weights, else model.weight_format, else the dtype's own."""
    from harness.llamacpp.convert import GGUF_TYPES
    if spec.model.gguf:
        raise ValueError("model.gguf: a GGUF file's header sizes plans and predictions; a run converts the "
                         "checkpoint (engine.weights); allowed for a run: model.gguf=null")
    if options.weights is None and spec.model.weight_format:
        from engine.formats import canonical
        if canonical(spec.model.weight_format) not in GGUF_TYPES or spec.model.expert_format:
            raise ValueError(f"model.weight_format={spec.model.weight_format}: a run converts to one of "
                             f"{', '.join(GGUF_TYPES)} (no separate expert_format); plans and predictions take more")
        return canonical(spec.model.weight_format)
    return options.weights_for(spec.dtype)


def refuse_nonfinite_weights(model_dir: str | Path) -> None:
    """Our loader's verdict on a checkpoint's weights (engine.checkpoint.scan_nonfinite: NaN or inf,
    by file, tensor and count) before llama.cpp gets it, in the loader's words; kept beside the
    checkpoint's GGUFs (`nonfinite.json`), so the weights are read once per checkpoint identity."""
    from engine.checkpoint import scan_nonfinite
    from engine.finite import BadTensor, refuse_bad_tensors
    from harness.llamacpp.convert import cache_dir, checkpoint_identity
    from harness.results import atomic_write_bytes

    model_dir = Path(model_dir)
    identity = checkpoint_identity(model_dir)
    verdict = cache_dir(identity) / "nonfinite.json"
    try:
        data = json.loads(verdict.read_text())
        bad = [BadTensor(**b) for b in data["bad"]] if data["identity"] == identity else None
    except (OSError, ValueError, KeyError, TypeError):      # none yet, or unreadable: read the weights
        bad = None
    if bad is None:
        bad = scan_nonfinite(model_dir)
        verdict.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(verdict, json.dumps({"identity": identity, "bad": [asdict(b) for b in bad]}).encode())
    refuse_bad_tensors(str(model_dir), bad)


def end_of_generation_ids(model_dir: str | Path) -> frozenset[int]:
    """The end-of-generation ids a checkpoint declares (`eos_token_id`, an int or a list, in
    config.json and generation_config.json), which llama-server masks under ignore_eos."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        try:
            value = json.loads((Path(model_dir) / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        ids.update(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))
    return frozenset(ids)


def _top_one(prob: dict[str, Any] | None) -> dict[int, float] | None:
    if not prob:
        return None
    return {int(c["id"]): logprob_of(c.get("logprob")) for c in prob.get("top_logprobs", [])}


def _top(top: list | None, i: int) -> dict[int, float] | None:
    if not top or i >= len(top):
        return None
    return {c.id: c.logprob for c in top[i]}


def _diffs(cumulative_ms: list[float] | None) -> list[float]:
    """Per-step seconds from the server's cumulative decode clock (one value per token)."""
    if not cumulative_ms or len(cumulative_ms) < 2:
        return []
    return [(b - a) / 1e3 for a, b in zip(cumulative_ms, cumulative_ms[1:])]


def _nvml_process_bytes(pid: int) -> float | None:
    """GPU memory process `pid` holds, from NVML (None without NVML or when it is not listed).
    Unverified: written to NVML's API, never run on a GPU in this project yet."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            total = 0
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    if p.pid == pid and p.usedGpuMemory is not None:
                        total += int(p.usedGpuMemory)
            return float(total) if total else None
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None
