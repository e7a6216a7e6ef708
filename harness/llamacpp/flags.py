"""llama.cpp's offload and runtime knobs: one dataclass, turned into argv, checked against the build.

Owns: the knobs moebench sweeps (`-ngl`, `--cpu-moe`, `--n-cpu-moe`, `-ot`, `-ub`, `-b`, `-c`,
`-ctk/-ctv`, `-fa`, `-t`, `-np`), the two named configurations (`EXACT`: reproduces the
fp32 reference token for token; `DEFAULTS`: what llama.cpp picks when given nothing), and
validating a knob set against what *this* binary accepts, by parsing its `--help` once per
binary (cached by path, size and mtime; a binary whose --help fails raises build.BinaryFailed).
Does not own: starting the server (`server`), or which knob values a sweep tries (Hydra config).

    flags = LlamaFlags(threads=2, n_gpu_layers=0, cache_type_k="f32", cache_type_v="f32", flash_attn="off")
    argv = flags.server_argv(bins.server)       # validated: ['-t', '2', '-ngl', '0', ...]
    argv = flags.bench_argv(bins.bench)         # llama-bench spelling of the same knobs

Why EXACT is f32 KV with flash attention off: on f32 weights llama.cpp's CPU flash-attention
path and an f16 KV cache are lossy (greedy tokens drift from transformers' after a few dozen
steps); with `-ctk f32 -ctv f32 -fa off` they match. llama-bench does not accept `-ctk f32`, so
EXACT cannot be benchmarked by llama-bench; `bench_argv` says so instead of passing it.
"""
from __future__ import annotations

import dataclasses
import logging
import re
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path

from harness.llamacpp.build import run_binary

log = logging.getLogger(__name__)

FLASH_ATTN = ("on", "off", "auto")

# knob -> tidy-row column. `batch`, `threads` and `ctx` are renamed because the row schema
# already has `batch` (sequences per step) and `context_tokens`; llama.cpp's -b is tokens.
KNOB_COLUMNS = {"n_gpu_layers": "n_gpu_layers", "cpu_moe": "cpu_moe", "n_cpu_moe": "n_cpu_moe",
                "override_tensor": "override_tensor", "ubatch": "ubatch", "batch": "n_batch", "ctx": "n_ctx",
                "cache_type_k": "cache_type_k", "cache_type_v": "cache_type_v", "flash_attn": "flash_attn",
                "threads": "threads", "parallel": "n_parallel", "cache_ram": "cache_ram_mib"}

# llama-bench's other knobs (no server flag of ours), as rows of an import carry them: under
# llama-bench's own names (harness.llamacpp.bench_import)
BENCH_ONLY_KNOBS = ("cpu_mask", "cpu_strict", "poll", "split_mode", "main_gpu", "no_kv_offload", "devices",
                    "tensor_split", "load_mode", "lazy_mode", "use_mmap", "use_direct_io", "embeddings",
                    "no_op_offload", "no_host", "repack", "fit_target", "fit_min_ctx")


class FlagError(ValueError):
    """A knob value this llama.cpp build does not accept."""


@dataclass(frozen=True)
class LlamaFlags:
    """None means: do not pass the flag, llama.cpp's own default applies."""
    n_gpu_layers: int | str | None = None      # -ngl N | "auto" | "all"
    cpu_moe: bool = False                       # --cpu-moe: every layer's experts on the CPU
    n_cpu_moe: int | None = None                # --n-cpu-moe N: experts of the first N layers on the CPU
    override_tensor: tuple[str, ...] = ()       # -ot PATTERN=BUFFER, each as given (e.g. "exps=CPU")
    ubatch: int | None = None                   # -ub: physical (micro-)batch
    batch: int | None = None                    # -b: logical batch
    ctx: int | None = None                      # -c: context size (0: the model's)
    cache_type_k: str | None = None             # -ctk
    cache_type_v: str | None = None             # -ctv
    flash_attn: str | None = None               # -fa on|off|auto
    threads: int | None = None                  # -t
    parallel: int | None = 1                    # -np: server slots (1: every request on slot 0)
    cache_ram: int | None = None                # -cram MiB: the server's host-RAM prompt cache (0: off)

    def __post_init__(self) -> None:
        for name in ("ubatch", "batch", "threads", "parallel", "n_cpu_moe"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "n_cpu_moe" else 1)):
                raise FlagError(f"{name} must be a positive integer or None, got {v!r}")
        if self.cache_ram is not None and (not isinstance(self.cache_ram, int) or self.cache_ram < -1):
            raise FlagError(f"cache_ram must be MiB >= 0 (0: off), -1 (no limit) or None, got {self.cache_ram!r}")
        if self.ctx is not None and (not isinstance(self.ctx, int) or self.ctx < 0):
            raise FlagError(f"ctx must be an integer >= 0 (0: the model's context) or None, got {self.ctx!r}")
        if self.n_gpu_layers is not None and not (
                (isinstance(self.n_gpu_layers, int) and self.n_gpu_layers >= 0) or self.n_gpu_layers in ("auto", "all")):
            raise FlagError(f"n_gpu_layers must be an integer >= 0, 'auto' or 'all', got {self.n_gpu_layers!r}")
        if self.flash_attn is not None and self.flash_attn not in FLASH_ATTN:
            raise FlagError(f"flash_attn must be one of {FLASH_ATTN} or None, got {self.flash_attn!r}")
        if self.batch is not None and self.ubatch is not None and self.ubatch > self.batch:
            raise FlagError(f"ubatch {self.ubatch} > batch {self.batch}: llama.cpp would clamp -ub to -b and run "
                            f"micro-batches of {self.batch}; give a batch (engine.batch) of at least the ubatch "
                            "(workload.ubatch)")
        if self.cpu_moe and self.n_cpu_moe is not None:
            raise FlagError(f"cpu_moe=True and n_cpu_moe={self.n_cpu_moe} both given; cpu_moe already puts "
                            "every layer's experts on the CPU")
        if isinstance(self.override_tensor, str):
            object.__setattr__(self, "override_tensor", (self.override_tensor,))
        for ot in self.override_tensor:
            if "=" not in ot:
                raise FlagError(f"override_tensor entries are PATTERN=BUFFER (e.g. 'exps=CPU'), got {ot!r}")

    def replace(self, **changes) -> LlamaFlags:
        return dataclasses.replace(self, **changes)

    def as_factors(self) -> dict[str, object]:
        """The knobs as tidy-row columns, named as `KNOB_COLUMNS` says (None: llama.cpp's default).
        `kv_dtype` is the DESIGN column: the K/V cache type, "K/V" when they differ."""
        out: dict[str, object] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[KNOB_COLUMNS[f.name]] = (",".join(v) or None) if isinstance(v, tuple) else v
        k, v = self.cache_type_k, self.cache_type_v
        out["kv_dtype"] = k if k == v else f"{k or 'default'}/{v or 'default'}"
        return out

    # ------------------------------------------------------------ argv

    def _pairs(self, bench: bool) -> list[tuple[str, str, str | None]]:
        """(knob, flag, value) in argv order; value None for a bare switch."""
        p: list[tuple[str, str, str | None]] = []
        if self.threads is not None:
            p.append(("threads", "-t", str(self.threads)))
        if self.n_gpu_layers is not None:
            p.append(("n_gpu_layers", "-ngl", str(self.n_gpu_layers)))
        if self.cpu_moe and not bench:
            p.append(("cpu_moe", "--cpu-moe", None))
        if self.n_cpu_moe is not None:
            p.append(("n_cpu_moe", "-ncmoe" if bench else "--n-cpu-moe", str(self.n_cpu_moe)))
        if bench and (self.override_tensor or self.cpu_moe):
            # llama-bench has no --cpu-moe; it is the server's expert-tensor override, spelled out.
            # One -ot per test there: overrides joined by ';' (',' would make them separate tests)
            ots = [*self.override_tensor, *([CPU_MOE_OVERRIDE] if self.cpu_moe else [])]
            p.append(("override_tensor" if self.override_tensor else "cpu_moe", "-ot", ";".join(ots)))
        elif not bench:
            p += [("override_tensor", "-ot", ot) for ot in self.override_tensor]
        if self.ubatch is not None:
            p.append(("ubatch", "-ub", str(self.ubatch)))
        if self.batch is not None:
            p.append(("batch", "-b", str(self.batch)))
        if self.ctx is not None and not bench:
            p.append(("ctx", "-c", str(self.ctx)))
        if self.cache_type_k is not None:
            p.append(("cache_type_k", "-ctk", self.cache_type_k))
        if self.cache_type_v is not None:
            p.append(("cache_type_v", "-ctv", self.cache_type_v))
        if self.flash_attn is not None:
            p.append(("flash_attn", "-fa", self.flash_attn))
        if self.parallel is not None and not bench:
            p.append(("parallel", "-np", str(self.parallel)))
        if self.cache_ram is not None and not bench:
            p.append(("cache_ram", "-cram", str(self.cache_ram)))
        return p

    def server_argv(self, server: Path | None = None) -> list[str]:
        """argv for llama-server; checked against `server --help` when a binary is given."""
        pairs = self._pairs(bench=False)
        if server is not None:
            validate(pairs, help_spec(Path(server)), Path(server).name)
        return [x for _, f, v in pairs for x in ((f,) if v is None else (f, v))]

    def bench_argv(self, bench: Path | None = None) -> list[str]:
        """argv for llama-bench (its own spelling); `ctx`, `parallel`, `cache_ram` do not apply there."""
        pairs = self._pairs(bench=True)
        if bench is not None:
            validate(pairs, help_spec(Path(bench)), Path(bench).name)
        return [x for _, f, v in pairs for x in (f, v if v is not None else "1")]


# What llama-server's --cpu-moe does: the routed experts' tensors of every layer in host memory
EXPERT_TENSORS = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"     # llama.cpp's LLM_FFN_EXPS_REGEX
CPU_MOE_OVERRIDE = EXPERT_TENSORS + "=CPU"


# The configuration that reproduces the fp32 reference (see module docstring), and llama.cpp's own.
EXACT = LlamaFlags(cache_type_k="f32", cache_type_v="f32", flash_attn="off")
OWN_TYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}   # model.dtype -> its GGUF / KV cache type
DEFAULTS = LlamaFlags()

# kv.dtype (engine.kvquant) -> llama.cpp's -ctk/-ctv cache type. Its q8_0/q4_0 are the formats
# ours follow (one float16 scale per 32 values); llama.cpp has no fp8 cache type.
KV_CACHE_TYPES = {"f16": "f16", "bf16": "bf16", "q8": "q8_0", "q4": "q4_0"}
QUANTISED_CACHE_TYPES = ("q8_0", "q4_0")


def kv_treatment(flags: LlamaFlags, kv_dtype: str, explicit: dict[str, str | None]) -> LlamaFlags:
    """`flags` with the kv.dtype treatment applied as -ctk/-ctv ("model": unchanged). `explicit`:
    the cache_type_k / cache_type_v / flash_attn the user set under engine.*, which a treatment may
    not silently override. llama.cpp quantises the V cache only with flash attention, so a
    quantised treatment turns it on, and refuses an explicit flash_attn=off."""
    if kv_dtype == "model":
        return flags
    if kv_dtype not in KV_CACHE_TYPES:
        raise FlagError(f"kv.dtype={kv_dtype}: llama.cpp has no such KV cache type; allowed with engine=llamacpp: "
                        f"kv.dtype=model | {' | '.join(KV_CACHE_TYPES)}")
    ctype = KV_CACHE_TYPES[kv_dtype]
    for knob in ("cache_type_k", "cache_type_v"):
        if explicit.get(knob) is not None and explicit[knob] != ctype:
            raise FlagError(f"kv.dtype={kv_dtype} sets {knob}={ctype}, but engine.{knob}={explicit[knob]} was given; "
                            f"set one of them")
    fa = flags.flash_attn
    if ctype in QUANTISED_CACHE_TYPES:
        if explicit.get("flash_attn") == "off":
            raise FlagError(f"kv.dtype={kv_dtype}: llama.cpp quantises the V cache ({ctype}) only with flash attention; "
                            "engine.flash_attn=off was given; allowed: engine.flash_attn=on | auto")
        fa = explicit.get("flash_attn") or "on"
    return flags.replace(cache_type_k=ctype, cache_type_v=ctype, flash_attn=fa)


# ---------------------------------------------------------------- what the build accepts


@dataclass(frozen=True)
class HelpSpec:
    """What one binary's --help says it accepts: every flag spelling, and for the flags whose
    values are a closed list, that list."""
    flags: frozenset[str]
    choices: dict[str, tuple[str, ...]]


_VALUE_KNOBS = {"-ctk": "cache_type_k", "-ctv": "cache_type_v", "-fa": "flash_attn"}


# ggml type names a KV cache may take; which ones a binary accepts is asked of the binary
KV_TYPE_CANDIDATES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


@lru_cache(maxsize=16)
def _help_cached(path: str, size: int, mtime_ns: int) -> HelpSpec:
    # a binary that fails is reported as failing (BinaryFailed: its exit status and output), never as
    # a build that lacks the flags a failed --help did not list
    out = run_binary(Path(path), ["--help"])
    text = out.stdout + out.stderr
    if not text.strip():
        raise FlagError(f"{path} --help printed nothing (exit {out.returncode}); cannot validate flags")
    spec = parse_help(text)
    # llama-bench's help lists no cache types; ask it: it parses argv in order and exits 0 at
    # --list-devices only if every earlier value was accepted
    missing = [f for f in ("-ctk", "-ctv") if f in spec.flags and f not in spec.choices]
    if missing and "--list-devices" in spec.flags:
        for f in missing:
            spec.choices[f] = tuple(t for t in KV_TYPE_CANDIDATES if subprocess.run(
                [path, f, t, "--list-devices"], capture_output=True, timeout=60).returncode == 0)
    return spec


def help_spec(binary: Path) -> HelpSpec:
    """Parse `binary --help` (once per binary version)."""
    st = Path(binary).stat()
    return _help_cached(str(binary), st.st_size, st.st_mtime_ns)


_FLAG = re.compile(r"-{1,2}[a-zA-Z][\w-]*")
_CLOSED = re.compile(r"[\[<{]((?:[\w.]+\|)+[\w.]+)[\]>}]")


def parse_help(text: str) -> HelpSpec:
    """Flags: the `-x, --xx METAVAR` spellings that open an option line. Choices: for -ctk/-ctv
    the `allowed values:` list under them, for -fa its `[on|off|auto]`-style list."""
    flags: set[str] = set()
    choices: dict[str, tuple[str, ...]] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        s = line.strip()
        if not s.startswith("-"):
            continue
        names = []
        for tok in s.split():
            t = tok.rstrip(",")
            if _FLAG.fullmatch(t):
                names.append(t)
            elif not (t.isupper() or t[:1] in "<[{"):
                break                                  # the description starts
        flags.update(names)
        below = " ".join(l.strip() for l in lines[i + 1:i + 4] if not l.strip().startswith("-"))
        for n in names:
            if n in _VALUE_KNOBS and n not in choices:
                m = re.search(r"allowed values:\s*([\w\s,]+?)(?:\(|$)", s + " " + below)
                c = _CLOSED.search(s)
                if m:
                    choices[n] = tuple(v.strip() for v in m.group(1).split(",") if v.strip())
                elif c:
                    choices[n] = tuple(c.group(1).split("|"))
    return HelpSpec(frozenset(flags), choices)


def validate(pairs: list[tuple[str, str, str | None]], spec: HelpSpec, binary: str) -> None:
    """Raise FlagError naming the knob, its value and what this build accepts."""
    for knob, flag, value in pairs:
        if flag not in spec.flags:
            raise FlagError(f"knob {knob}={value!r}: this {binary} has no {flag} option "
                            f"(its --help lists {len(spec.flags)} flags)")
        allowed = spec.choices.get(flag)
        if allowed and value is not None and value not in allowed:
            raise FlagError(f"knob {knob}={value!r}: this {binary} accepts {flag} {'|'.join(allowed)}")


def cpu_layers_override(layers: Iterable[int]) -> tuple[str, ...]:
    """-ot entries putting these layers' routed experts on the CPU: the pattern --n-cpu-moe adds per
    layer (common.h's llm_ffn_block_regex), so any set of layers is a map llama.cpp runs."""
    return tuple(rf"blk\.{i}{EXPERT_TENSORS}=CPU" for i in sorted(layers))


def cpu_expert_layers(flags: LlamaFlags, n_layers: int) -> frozenset[int] | None:
    """The layers whose routed experts these flags leave on the CPU: --cpu-moe, --n-cpu-moe N (the
    first N), each `-ot PATTERN=CPU` matching a layer's expert tensors (searched as llama.cpp does),
    and the layers -ngl N does not offload (llama.cpp offloads the last N). None where it is not
    decided before launch (-ngl auto, the pinned llama.cpp's default: it fits at load)."""
    ngl = flags.n_gpu_layers
    if ngl in (None, "auto"):
        return None
    below = n_layers - min(ngl, n_layers) if isinstance(ngl, int) else 0          # "all": every layer offloaded
    cpu = set(range(below))
    if flags.cpu_moe:
        cpu.update(range(n_layers))
    cpu.update(range(min(flags.n_cpu_moe or 0, n_layers)))
    for ot in flags.override_tensor:
        pattern, _, buffer = ot.rpartition("=")
        if buffer.upper() == "CPU":
            rx = re.compile(pattern)
            cpu.update(i for i in range(n_layers) if any(rx.search(f"blk.{i}.ffn_{p}_exps.weight")
                                                         for p in ("up", "down", "gate", "gate_up")))
    return frozenset(cpu)
