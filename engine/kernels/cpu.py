"""Small-batch linear layers on the CPU: the engine's own kernel (rows_linear.cpp), built once,
with a decode step's small ops beside it (decode_ops.cpp).

A decode step multiplies each weight matrix by one row (a few at batch > 1). torch's CPU path for
that is the BLAS GEMV/GEMM, which on the machines measured here reads weights on one core only
(MKL's fp32 GEMV does not thread at these sizes, and its GEMM at 2-8 rows reads at a fraction of
the GEMV's rate), so decode did not get faster with threads while the machine had the bandwidth
(docs/cpu_experts.md has the measurements). The kernel splits the weight rows in chunks over as
many threads as `torch.set_num_threads` says (the caller and the kernel's own helper threads, which
spin briefly between calls instead of sleeping; the caller never waits for a helper that another
process keeps off its core; OpenMP's idle workers kept off the helpers' cores:
engine.kernels.openmp) and reads fp32 or bf16 weights directly, and the lossy treatments' int8 /
int4 expert matrices from their packed bytes (integer values converted in registers, a scale applied
once to the row's or the group's sum: the dequantised matrix's product up to fp32 rounding, at a
fraction of the dense kernel's work per weight); each output is one dot product in a fixed order,
the same bits whatever the batch or thread count. Above `MAX_ROWS` rows it is the BLAS GEMM
(`at::mm`, bitwise `F.linear`; for bf16 on a CPU without bf16 arithmetic, fp32 on widened copies,
rounded once: torch's bf16 GEMM there runs at a fraction of the fp32 rate), so one call site serves
prefill and decode. bf16 weights are thus never converted at load (no second copy in memory) and
never run at the emulated rate.

Owns: building the kernel (torch.utils.cpp_extension, into `$MOEBENCH_KERNELS`, else the Python
environment's own `share/moebench-kernels` where it is writable (a virtual environment: the build
goes with the environment that links it, whatever `$MOEBENCH_CACHE` a run points elsewhere), else
`~/.cache/moebench/kernels`; per torch and Python version and per source; `python -m engine.kernels.cpu`
builds it ahead, as `make setup` does), whether it can run here (`available`, `reason`), the
switch that turns it off (`MOEBENCH_CPU_KERNELS=0` or `enabled(False)`: the torch path, for A/B
measurements), and the calls (`small_linear`, `grouped_small_linear`, `linear`: F.linear's drop-in, and
`int8_linear` / `int4_linear` on a quantised expert's packed bytes, and their `*_q8_` forms on
activations rounded to int8; the decode-step ops between the weight reads, each one call where
torch makes several -- `rms_norm`, `rope`, `decode_attention`, `rope_attention`, `softmax_topk`,
`silu_mul`, `swiglu` / `swiglu_add_`, `linears` -- with engine.layers' torch forms their reference;
`wrapped`, to time or count the calls). Does not
own: which layers use it (the experts, engine.blocks.experts; attention's projections and the LM
head, engine.blocks.attention and decoder) or the torch path it falls back to.

    from engine.kernels import cpu
    y = cpu.small_linear(x, w) if cpu.usable(x, w) else F.linear(x, w)    # x [n, K], w [O, K]
    y = cpu.linear(x, w, b)                     # F.linear(x, w, b), the kernel where it applies
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.kernels.openmp import spin_state
from engine.lazy import lazy_module

if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
else:
    torch = lazy_module("torch", globals())
    F = lazy_module("torch.nn.functional", globals())

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(f) for f in ("rows_linear.cpp", "decode_ops.cpp"))
HEADERS = tuple(Path(__file__).with_name(f) for f in ("ops.h", "pool.h", "vec.h"))
NAME = "moebench_cpu_kernels"
MAX_ROWS = 8                  # rows up to which the kernel beats the BLAS GEMM here (docs/cpu_experts.md)
QUANT_MAX_ROWS = 128          # rows up to which the quantised kernels beat dequantise-then-GEMM here (the same)
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off"]   # no contraction: the order written is the order run
DTYPES = ("float32", "bfloat16")

_state = {"enabled": os.environ.get("MOEBENCH_CPU_KERNELS", "1") != "0"}
_fast: dict[str, Any] = {}    # "ops": the loaded namespace or None, "widen": bf16 via fp32 beyond MAX_ROWS


def build_dir() -> Path:
    """Where the kernel is built: one folder per torch and Python version (a build links one torch)
    and per source and flags (two checkouts with different sources -- an A/B of two commits --
    never rebuild each other's library)."""
    root = _kernels_root()
    tag = f"torch{torch.__version__.replace('+', '_')}-py{sys.version_info.major}{sys.version_info.minor}"
    code = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    key = hashlib.sha256(code + " ".join(FLAGS).encode()).hexdigest()[:12]
    return root / tag / key


def _kernels_root() -> Path:
    if os.environ.get("MOEBENCH_KERNELS"):
        return Path(os.environ["MOEBENCH_KERNELS"])
    env = Path(sys.prefix) / "share" / "moebench-kernels"
    if sys.prefix != sys.base_prefix and os.access(sys.prefix, os.W_OK):
        return env
    return Path.home() / ".cache" / "moebench" / "kernels"


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """cpp_extension runs `ninja` from PATH; the `ninja` package (a dependency) puts it in the
    environment's scripts folder, which is not on PATH when the interpreter runs by its full path."""
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), old])
    try:
        yield
    finally:
        os.environ["PATH"] = old


@functools.cache
def _load() -> tuple[Any | None, str | None]:
    """(the op namespace, None) once built and loaded, or (None, why not)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"the kernel is x86-64 AVX2 code; this CPU is {platform.machine()}"
    cap = torch.backends.cpu.get_cpu_capability()
    if cap not in ("AVX2", "AVX512"):
        return None, f"the kernel needs AVX2 and FMA; torch reports CPU capability {cap}"
    try:
        from torch.utils.cpp_extension import load

        out = build_dir()
        out.mkdir(parents=True, exist_ok=True)
        with _ninja_on_path():
            load(NAME, [str(p) for p in SOURCES], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], build_directory=str(out),
                 is_python_module=False, verbose=False)
    except Exception as exc:  # noqa: BLE001 -- any build failure means the torch path, said once
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return None, f"building {', '.join(p.name for p in SOURCES)} failed ({type(exc).__name__}: {first})"
    return torch.ops.moebench_cpu, None


def available() -> bool:
    """Whether the kernel is built and loaded (building it on the first call)."""
    ops, why = _load()
    if ops is None and why and not getattr(_load, "_warned", False):
        _load._warned = True          # type: ignore[attr-defined]
        log.warning("CPU kernels unavailable, small-batch linear layers use torch's path: %s", why)
    if ops is not None and spin_state().startswith("libgomp's default") and not getattr(_load, "_spin_said", False):
        _load._spin_said = True       # type: ignore[attr-defined]
        log.warning("CPU kernels: OpenMP's idle workers spin as %s", spin_state())
    _fast["ops"] = ops
    _fast["widen"] = ops is not None and not native_bf16()
    return ops is not None


def reason() -> str | None:
    """Why the kernel cannot run here; None when it can."""
    return _load()[1]


def is_enabled() -> bool:
    return _state["enabled"]


@contextlib.contextmanager
def enabled(on: bool) -> Iterator[None]:
    """Within the block the kernel is used (True, where available) or not (False: torch's path)."""
    before = _state["enabled"]
    _state["enabled"] = bool(on)
    try:
        yield
    finally:
        _state["enabled"] = before


class _Wrapped:
    """The kernels' op namespace with each op passed through `wrap(name, op)` (see `wrapped`)."""

    def __init__(self, ops: Any, wrap: Callable[[str, Callable[..., Any]], Callable[..., Any]]) -> None:
        self._ops, self._wrap = ops, wrap

    def __getattr__(self, name: str) -> Callable[..., Any]:
        return self._wrap(name, getattr(self._ops, name))


@contextlib.contextmanager
def wrapped(wrap: Callable[[str, Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """Within the block every kernel op is called as `wrap(name, op)(*args)`: to time or count the
    calls a real step makes (benchmarks/profile_decode.py --gaps). The kernels must be available."""
    ops = _ops()
    if ops is None:
        raise RuntimeError(f"the CPU kernels cannot run here: {reason()}")
    _fast["ops"] = _Wrapped(ops, wrap)
    try:
        yield
    finally:
        _fast["ops"] = ops


def _ops() -> Any | None:
    """The loaded op namespace, or None where the kernel cannot run (found once: a decode step asks
    dozens of times, so the answer is kept)."""
    if "ops" not in _fast:
        available()
    return _fast["ops"]


@functools.cache
def _dtypes() -> frozenset[torch.dtype]:
    return frozenset(getattr(torch, d) for d in DTYPES)


def takes(x: torch.Tensor) -> bool:
    """Whether the kernels run on x: on the CPU, a dtype of DTYPES, the kernels enabled and available."""
    return _state["enabled"] and x.device.type == "cpu" and x.dtype in _dtypes() and _ops() is not None


def usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `small_linear(x, w)` runs the kernel for these tensors: both on the CPU, one dtype of
    DTYPES, the kernel enabled and available."""
    return w.device.type == "cpu" and x.dtype == w.dtype and takes(x)


@functools.cache
def native_bf16() -> bool:
    """Whether this CPU does bf16 arithmetic (AVX512-BF16 or AMX): else torch's bf16 GEMM emulates
    it at a fraction of the fp32 rate, and the kernel's BLAS side widens bf16 to fp32 instead."""
    caps = torch._C._cpu._get_cpu_capability() if hasattr(torch._C, "_cpu") else {}
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def small_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [n, K] @ w [O, K]^T -> [n, O] in x's dtype: the kernel up to MAX_ROWS rows, BLAS above."""
    return _ops().small_linear(x, w, MAX_ROWS, _fast["widen"])


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w, b)` (x [..., K]): the kernel where it runs these tensors and x has at most
    MAX_ROWS rows, else F.linear's own op, so a prefill's numerics are torch's, unchanged."""
    if usable(x, w) and (b is None or b.dtype == x.dtype):
        return _fast["ops"].linear(x, w, b, MAX_ROWS, _fast["widen"])
    return F.linear(x, w, b)


def linears(x: torch.Tensor, ws: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """`[linear(x, w) for w in ws]`, bit for bit, with the kernel's rows of every weight in one
    parallel job where it runs them all (one start and one wait instead of one per weight)."""
    if all(usable(x, w) for w in ws):
        return _fast["ops"].linears(x, list(ws), MAX_ROWS, _fast["widen"])
    return [linear(x, w) for w in ws]


def grouped_small_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per expert group, `small_linear`: x [M, K] sorted by expert, w [E, O, K], offs [E] int32 end
    of each group -> [M, O]; each group bitwise `small_linear` on it."""
    return _ops().grouped_small_linear(x, w, offs, MAX_ROWS, _fast["widen"])


def quant_usable(x: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether `int8_linear` / `int4_linear` run the kernel for rows x on packed expert bytes: x
    float32 and at most QUANT_MAX_ROWS rows (a prefill's rows per expert, mostly: the dequantised
    copy the GEMM needs costs more than the kernel's reads up to there), both on the CPU, packed
    uint8, the kernel enabled and available (else the caller dequantises and runs the dense path)."""
    return (_state["enabled"] and x.device.type == "cpu" and packed.device.type == "cpu" and x.dtype == torch.float32
            and packed.dtype == torch.uint8 and x.dim() == 2 and x.shape[0] <= QUANT_MAX_ROWS and _ops() is not None)


def int4_group_ok(group: int) -> bool:
    """Whether the kernel reads int4 groups of this size (a power of two >= 8: each 32-bit lane of
    8 weights then lies in one group, and a block of lanes spans whole groups or part of one)."""
    return group >= 8 and group & (group - 1) == 0


def int4_q8_group_ok(group: int) -> bool:
    """Whether the int8-activation kernel reads int4 groups of this size (a power of two >= 32:
    each 32-input block of x lies in one group)."""
    return int4_group_ok(group) and group >= 32


def int8_linear(x: torch.Tensor, packed: torch.Tensor, q_at: int, scale_at: int, O: int, K: int) -> torch.Tensor:
    """x [n, K] fp32 @ dequant(w)^T -> [n, O] fp32 for the int8 matrix w [O, K] in the uint8 buffer
    `packed` (its values from byte q_at, its fp32 per-row scales from byte scale_at): scale x the
    fixed-order dot product of q and x -- engine.blocks.intquant.dequantize_int8's matrix times x up
    to fp32 rounding, the same bits at any batch and thread count."""
    return _ops().int8_linear(x, packed, q_at, scale_at, O, K)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, q_at: int, scale_at: int, zero_at: int, O: int, K: int,
                group: int, lanes: int = 0) -> torch.Tensor:
    """As `int8_linear` for the int4 matrix w [O, K]: two values a byte (low nibble first) from
    q_at, fp32 scales [O, K/group] from scale_at, uint8 zero points [O, K/group] from zero_at;
    the sum over groups of scale x (the dot product of q and x - zero x the group's sum of x).
    `group`: see int4_group_ok. `lanes`: 0 runs the widest blocks this CPU has (16 lanes with
    AVX-512, else 8); 8 or 16 asks for one (rows_linear.cpp's int4 section: each width's own bits)."""
    return _ops().int4_linear(x, packed, q_at, scale_at, zero_at, O, K, group, lanes)


def int8_q8_linear(x: torch.Tensor, packed: torch.Tensor, q_at: int, scale_at: int, O: int, K: int) -> torch.Tensor:
    """`int8_linear` with x rounded to int8 per block of 32 inputs first (engine.blocks.intquant.
    quantize_activations, bit for bit) and each block's product an integer dot product: the
    dequantised matrix times the rounded x up to fp32 rounding (experts.activations=int8). K a
    multiple of 32."""
    return _ops().int8_q8_linear(x, packed, q_at, scale_at, O, K)


def int4_q8_linear(x: torch.Tensor, packed: torch.Tensor, q_at: int, scale_at: int, zero_at: int, O: int, K: int,
                   group: int) -> torch.Tensor:
    """`int4_linear` on x rounded as `int8_q8_linear` does: per block, scale x d x (the integer dot
    product - zero x the block's sum of rounded values). `group`: see int4_q8_group_ok."""
    return _ops().int4_q8_linear(x, packed, q_at, scale_at, zero_at, O, K, group)


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float, offset: float = 0.0,
             scale_fp32: bool = False) -> torch.Tensor:
    """RMSNorm of x [..., D] (`takes(x)`; w [D] in x's dtype) in one op: w * T(x r), or with
    scale_fp32 T(x r (offset + w)) (w None: T(x r)), r = 1/sqrt(mean(x^2) + eps) in fp32 --
    engine.layers.rms_norm / rms_norm_fp32 up to fp32 rounding (the mean's sum in its own order)."""
    return _fast["ops"].rms_norm(x, w, eps, offset, scale_fp32)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """engine.layers.apply_rope in one op, bit for bit: x [B, H, T, h] contiguous (`takes(x)`),
    cos and the signed sin [T, r] contiguous in x's dtype."""
    return _fast["ops"].rope(x, cos, signed_sin)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """engine.layers.decode_attention in one op (up to fp32 rounding): q [B, H, 1, h], k [B, K, S, h],
    v [B, K, S, hv], fp32, each head's rows contiguous -> [B, H, 1, hv]; the (sequence, key head)
    pairs shared over the kernels' threads."""
    return _fast["ops"].decode_attention(q, k, v, scale)


def rope_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                   k_buf: torch.Tensor, v_buf: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """`rope` on q [B, H, 1, h] and k [B, K, 1, h], k and v written at position `start` of the KV
    buffers [B, K, capacity, h], `decode_attention` over positions 0..start -> [B, H, 1, hv]: one op
    (fp32, `takes(q)`)."""
    return _fast["ops"].rope_attention(q, k, v, cos, signed_sin, k_buf, v_buf, start, scale)


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """A SwiGLU expert in one op: `small_linear(silu_mul(gate, up), down)` on `small_linear(x, gate_up)`'s
    halves -- engine.layers.expert_ffn with the kernel's linear and SiLU, bit for bit. x [n, D]
    (`usable(x, gate_up)`), gate_up [2I, D], down [D, I]."""
    return _fast["ops"].swiglu(x, gate_up, down, MAX_ROWS, _fast["widen"])


def swiglu_add_(out: torch.Tensor, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                gate: torch.Tensor) -> None:
    """`out.add_(swiglu(x, gate_up, down) * gate)` in one op, rounded as those ops round it: out
    [n, D] contiguous and gate [n, 1] in x's dtype."""
    _fast["ops"].swiglu_add_(out, x, gate_up, down, gate, MAX_ROWS, _fast["widen"])


def softmax_topk(h: torch.Tensor, w: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A softmax top-k router in one op: (ids int64 [N, k], weights fp32 [N, k]) for h [N, D]
    (`usable(h, w)`) and w [E, D] -- the logits by `small_linear`, their fp32 softmax, the k
    largest in descending order (ties: the lower id), over their sum when `norm`: engine.layers.
    route's ops up to fp32 rounding."""
    return _fast["ops"].softmax_topk(h, w, k, norm, MAX_ROWS, _fast["widen"])


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`F.silu(gate) * up` in one op (up to fp32 rounding: silu's exp is the kernel's): gate, up
    [n, I] with rows contiguous (`takes(gate)`, up in gate's dtype)."""
    return _fast["ops"].silu_mul(gate, up)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ok = available()
    print(f"CPU kernels: {'built and loaded from ' + str(build_dir()) if ok else 'unavailable: ' + str(reason())}")
