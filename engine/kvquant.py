"""Storage formats of the KV cache (`kv_dtype`): how keys and values are kept between passes.

Owns: the formats a KV state may store its keys/values in (`KV_DTYPES`), what one row of
`head_dim` values costs in bytes (payload + scales: what the planner, the session's
offload/restore counters and the cost model count), quantising on write and dequantising on
read -- each fast, vectorised quantiser beside a slow, obvious per-block reference
(`quantise_reference` / `dequantise_reference`, tests/engine/test_kvquant.py holds them equal).
Does not own: where the state lives or how it grows (engine.kv), attention (engine.blocks).

| name    | stored as                                                          | bytes per 32 values |
|---------|--------------------------------------------------------------------|---------------------|
| `model` | the model's dtype: exact, the default                               | 32 x dtype bytes    |
| `f16`   | float16                                                             | 64                  |
| `bf16`  | bfloat16                                                            | 64                  |
| `q8`    | int8 + one float16 scale per block (llama.cpp q8_0: x = q * d)      | 34                  |
| `q4`    | 4-bit codes, two per uint8, + one float16 scale per block (q4_0)    | 18                  |
| `fp8`   | float8_e4m3fn + one float16 scale per block (x = q * d, amax -> 448)| 34                  |

Blocks run along head_dim: 32 values, or the whole head when head_dim is below 32 and
divides it (a tiny test model's 16); any other head_dim is refused for the block formats.
q4 follows llama.cpp's q4_0: d = m / -8 where m is the block's value of largest magnitude
(sign kept), code = clamp(floor(x / d + 8.5), 0, 15), x = (code - 8) * d; codes are packed
in pairs along head_dim (element 2j in the low nibble, 2j+1 in the high one).

    fmt = kv_format("q8")
    parts = fmt.quantise(k)                          # k [B, K, T, h] -> [int8 [B, K, T, h], f16 [B, K, T, h/32]]
    k_hat = fmt.dequantise(parts, torch.float32)     # [B, K, T, h]
    fmt.row_bytes(128, dtype_bytes=2)                # 136: 128 codes + 4 scales of 2 bytes
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())


KV_DTYPES = ("model", "f16", "bf16", "q8", "q4", "fp8")
DEFAULT_KV_DTYPE = "model"
BLOCK = 32
SCALE_DTYPE = "float16"                           # names, not torch dtypes: sizing a format needs no torch
ITEMSIZE = {"float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1, "float8_e4m3fn": 1}   # bytes per stored element
FP8_MAX = 448.0                                   # float8_e4m3fn's largest finite value


class KVFormatError(ValueError):
    """A kv_dtype this model, state kind or device cannot store (the message says which and why)."""


def block_size(head_dim: int) -> int:
    """Values per scale along head_dim: 32, or the whole head when it is shorter and divides 32."""
    if head_dim % BLOCK == 0:
        return BLOCK
    if head_dim < BLOCK and BLOCK % head_dim == 0:
        return head_dim
    raise KVFormatError(f"block-quantised kv_dtype needs head_dim a multiple of {BLOCK} (or a divisor of it), "
                        f"got head_dim={head_dim}; allowed kv_dtype for this model: model, f16, bf16")


@dataclass(frozen=True)
class KVFormat:
    """One storage format. `cast`: a plain dtype (None: the model's own); `code`: the block
    quantiser's code dtype, None for the cast formats. Both are torch's names for them, so that
    sizing a format (`row_bytes`, the planner's) needs no torch."""

    name: str
    cast: str | None = None
    code: str | None = None

    @property
    def blocked(self) -> bool:
        return self.code is not None

    @property
    def n_parts(self) -> int:
        """Tensors per key (or value) buffer: payload, and a scale for the block formats."""
        return 2 if self.blocked else 1

    def exact_for(self, dtype: torch.dtype | str) -> bool:
        """Whether storing in this format loses nothing for a model computing in `dtype` (a torch
        dtype or its name)."""
        return not self.blocked and (self.cast is None or self.cast == str(dtype).removeprefix("torch."))

    def _layout(self, head_dim: int) -> list[tuple[str, int]]:
        """(dtype name, last-dim size) of each stored tensor of a block format's buffer."""
        nb = head_dim // block_size(head_dim)
        payload = head_dim // 2 if self.name == "q4" else head_dim
        return [(self.code, payload), (SCALE_DTYPE, nb)]

    def parts(self, head_dim: int, dtype: torch.dtype) -> list[tuple[torch.dtype, int]]:
        """(dtype, last-dim size) of each stored tensor of one key or value buffer."""
        if not self.blocked:
            return [(dtype if self.cast is None else _dtype(self.cast), head_dim)]
        return [(_dtype(name), n) for name, n in self._layout(head_dim)]

    def row_bytes(self, head_dim: int, dtype_bytes: int) -> int:
        """Stored bytes of one row of head_dim values (payload + scales) at `dtype_bytes` per model element."""
        if not self.blocked:
            return head_dim * (ITEMSIZE[self.cast] if self.cast is not None else dtype_bytes)
        return sum(ITEMSIZE[name] * n for name, n in self._layout(head_dim))

    def check(self, head_dim: int, device: torch.device | str = "cpu") -> None:
        """Refuse, before anything is allocated, a head_dim or device this format cannot serve."""
        if self.blocked:
            block_size(head_dim)
        self.check_device(device)

    def check_device(self, device: torch.device | str = "cpu") -> None:
        """Refuse a device on which torch cannot store this format (fp8 where float8 is missing)."""
        if self.name == "fp8":
            if not hasattr(torch, "float8_e4m3fn"):
                raise KVFormatError(f"kv_dtype=fp8 needs torch.float8_e4m3fn, which torch {torch.__version__} "
                                    f"lacks; allowed: {', '.join(n for n in KV_DTYPES if n != 'fp8')}")
            try:
                torch.ones(4, device=device).to(torch.float8_e4m3fn).to(torch.float32)
            except (RuntimeError, TypeError) as exc:
                raise KVFormatError(f"kv_dtype=fp8: torch {torch.__version__} cannot store float8_e4m3fn on "
                                    f"{device} ({exc}); allowed: {', '.join(n for n in KV_DTYPES if n != 'fp8')}") \
                    from None

    # --- the fast path ----------------------------------------------------------------------------
    def quantise(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [..., h] -> the stored parts (module docstring)."""
        if not self.blocked:
            return [x if self.cast is None else x.to(_dtype(self.cast))]
        h = x.shape[-1]
        bs = block_size(h)
        xb = x.float().reshape(*x.shape[:-1], h // bs, bs)                       # [..., nb, bs]
        if self.name == "q4":
            idx = xb.abs().argmax(dim=-1, keepdim=True)
            d = (xb.gather(-1, idx) / -8.0).to(_dtype(SCALE_DTYPE))              # [..., nb, 1]
            inv = _inverse(d.float())
            codes = (xb * inv + 8.5).floor().clamp(0, 15).to(torch.uint8).reshape(*x.shape[:-1], h)
            packed = codes[..., 0::2] | (codes[..., 1::2] << 4)                   # [..., h/2]
            return [packed, d.squeeze(-1)]
        top = 127.0 if self.name == "q8" else FP8_MAX
        d = (xb.abs().amax(dim=-1, keepdim=True) / top).to(_dtype(SCALE_DTYPE))  # [..., nb, 1]
        scaled = xb * _inverse(d.float())
        if self.name == "q8":
            q = scaled.round().clamp(-127, 127).to(torch.int8)
        else:                                # clamped: a value past 448 would become NaN, not saturate
            q = scaled.clamp(-FP8_MAX, FP8_MAX).to(_dtype(self.code))
        return [q.reshape(*x.shape[:-1], h), d.squeeze(-1)]

    def dequantise(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The stored parts -> values [..., h] in the compute dtype."""
        if not self.blocked:
            return parts[0].to(dtype)
        payload, d = parts
        if self.name == "q4":
            codes = torch.stack((payload & 0x0F, payload >> 4), dim=-1).flatten(-2)   # [..., h]
            values = codes.float() - 8.0
        else:
            values = payload.float()
        h = values.shape[-1]
        nb = d.shape[-1]
        out = values.reshape(*values.shape[:-1], nb, h // nb) * d.float().unsqueeze(-1)   # [..., nb, bs]
        return out.reshape(values.shape).to(dtype)


def _dtype(name: str) -> torch.dtype:
    """torch's dtype of a stored name; float8_e4m3fn where this torch lacks it reads as uint8
    (`check_device` refuses fp8 there before anything is stored)."""
    return getattr(torch, name, torch.uint8)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """1/d, 0 where the block is all zeros (its codes are then 0, or 8 for q4: both decode to 0)."""
    return torch.where(d != 0, 1.0 / d, torch.zeros_like(d))


FORMATS: dict[str, KVFormat] = {
    "model": KVFormat("model"),
    "f16": KVFormat("f16", cast="float16"),
    "bf16": KVFormat("bf16", cast="bfloat16"),
    "q8": KVFormat("q8", code="int8"),
    "q4": KVFormat("q4", code="uint8"),
    "fp8": KVFormat("fp8", code="float8_e4m3fn"),
}


def kv_format(name: str | KVFormat | None) -> KVFormat:
    """The format of a kv_dtype name (None: the default, exact)."""
    if isinstance(name, KVFormat):
        return name
    name = DEFAULT_KV_DTYPE if name is None else name
    if name not in FORMATS:
        raise KVFormatError(f"kv_dtype must be one of {list(KV_DTYPES)}, got {name!r}")
    return FORMATS[name]


def is_lossy(name: str | KVFormat | None, dtype: torch.dtype | str, expert_quant: Any = None) -> bool:
    """Whether a model computing in `dtype` runs a lossy treatment: its experts quantised
    (`expert_quant`, an engine.blocks.quant_experts.ExpertQuant, with a mode other than none) or
    its KV stored in `name`, a format that loses precision for `dtype`."""
    from engine.dtypes import checked_name

    if expert_quant is not None and expert_quant.mode != "none":
        return True
    if isinstance(dtype, str):
        checked_name(dtype)                  # an unknown name is refused, listing the allowed ones
    return not kv_format(name).exact_for(dtype)


# --- the slow reference: one block at a time, scalar arithmetic per value ------------------------------
def quantise_reference(fmt: KVFormat, x: torch.Tensor) -> list[torch.Tensor]:
    """What `fmt.quantise` computes, block by block over rows of x [R, h] (2-D only)."""
    if not fmt.blocked:
        return fmt.quantise(x)
    R, h = x.shape
    bs = block_size(h)
    nb = h // bs
    codes = torch.zeros(R, h, dtype=torch.int64)
    scale_dtype, code_dtype = _dtype(SCALE_DTYPE), _dtype(fmt.code)
    scales = torch.zeros(R, nb, dtype=scale_dtype)
    fp8 = torch.zeros(R, h, dtype=code_dtype) if fmt.name == "fp8" else None
    for r in range(R):
        for b in range(nb):
            blk = [float(v) for v in x[r, b * bs:(b + 1) * bs].float()]
            if fmt.name == "q4":
                m = max(blk, key=abs)                       # the first value of largest magnitude
                d = float(torch.tensor(m / -8.0, dtype=torch.float32).to(scale_dtype))
            else:
                top = 127.0 if fmt.name == "q8" else FP8_MAX
                d = float(torch.tensor(max(abs(v) for v in blk) / top, dtype=torch.float32).to(scale_dtype))
            scales[r, b] = d
            inv = float(torch.tensor(1.0, dtype=torch.float32) / d) if d != 0 else 0.0
            for j, v in enumerate(blk):
                s = float(torch.tensor(v, dtype=torch.float32) * inv)      # fp32 product, as the fast path
                if fmt.name == "q4":
                    codes[r, b * bs + j] = min(15, max(0, int(torch.floor(torch.tensor(s + 8.5, dtype=torch.float32)))))
                elif fmt.name == "q8":
                    codes[r, b * bs + j] = min(127, max(-127, int(torch.round(torch.tensor(s)))))
                else:
                    fp8[r, b * bs + j] = torch.tensor(min(FP8_MAX, max(-FP8_MAX, s)), dtype=torch.float32).to(code_dtype)
    if fmt.name == "q4":
        c = codes.to(torch.uint8)
        packed = torch.zeros(R, h // 2, dtype=torch.uint8)
        for j in range(h // 2):
            packed[:, j] = c[:, 2 * j] + 16 * c[:, 2 * j + 1]
        return [packed, scales]
    return [codes.to(torch.int8) if fmt.name == "q8" else fp8, scales]


def dequantise_reference(fmt: KVFormat, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """What `fmt.dequantise` computes, one value at a time, for parts of any leading shape."""
    if not fmt.blocked:
        return parts[0].to(dtype)
    payload, d = parts
    lead = payload.shape[:-1]
    h = payload.shape[-1] * (2 if fmt.name == "q4" else 1)
    nb = d.shape[-1]
    bs = h // nb
    flat_p, flat_d = payload.reshape(-1, payload.shape[-1]), d.reshape(-1, nb).float()
    out = torch.empty(flat_p.shape[0], h, dtype=torch.float32)
    for r in range(flat_p.shape[0]):
        for j in range(h):
            if fmt.name == "q4":
                byte = int(flat_p[r, j // 2])
                q = float((byte & 0x0F) if j % 2 == 0 else (byte >> 4)) - 8.0
            else:
                q = float(flat_p[r, j].float())
            out[r, j] = torch.tensor(q, dtype=torch.float32) * flat_d[r, j // bs]
    return out.reshape(*lead, h).to(dtype)
