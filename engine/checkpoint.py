"""Lazy tensor access to a Hugging Face safetensors checkpoint, single file or sharded.

Owns: finding tensors by name across shards (`model.safetensors.index.json` or every
`*.safetensors` file), reading one row of a stacked tensor, dtype conversion (a block-wise FP8
tensor is dequantised with its `_scale_inv` as it is read, when config.json declares that
format: engine.quant), and clear errors for missing tensors -- and the reverse: which tensors
were read, so that after a load the checkpoint's tensors nothing read are named in one warning
(`warn_unread`; transformers' "Some weights of the model checkpoint were not used"). Does not
own: which names a model has (each block declares its tensors, each family's expert layout its
expert names: engine.blocks; each family the tensors it skips on purpose: `Family.skipped`) or
where tensors end up (engine.model).

Non-finite weights: every weight is tested as it is read (one reduction, engine.finite), after
its conversion to the run's dtype where the caller asks for one, and after a load
`refuse_nonfinite` refuses a checkpoint with any NaN or inf in one line naming the first bad
tensor, its file, its count and how many tensors are bad; `scan_nonfinite` gives the same verdict
without a model, reading each tensor once (for an engine that runs the checkpoint itself).

Tensors are read one at a time through `safe_open` (memory-mapped), so loading never
holds a second full copy of the weights: each tensor is copied straight into its
destination and dropped.
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open

from engine.dtypes import DTYPES, torch_dtype  # noqa: F401 -- re-exported: callers import them from here
from engine.finite import BadTensor, nonfinite_count, refuse_bad_tensors
from engine.lazy import lazy_module
from engine.quant import SCALE_SUFFIX, BlockFP8, block_fp8, is_float8

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

log = logging.getLogger(__name__)


class MissingTensorError(KeyError):
    """A tensor the model needs is not in the checkpoint."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


class Checkpoint:
    """Name -> tensor for one checkpoint directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index}: no 'weight_map' object (tensor name -> shard file), as "
                                 "save_pretrained writes it")
            self._where = {name: self.path / f for name, f in weight_map.items()}
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {self.path}")
            self._where = {}
            for f in files:
                try:
                    with safe_open(f, framework="pt") as h:
                        for name in h.keys():
                            self._where[name] = f
                except SafetensorError as e:
                    raise ValueError(f"{f}: not a readable safetensors file ({e})") from None
        self._handles: dict[Path, object] = {}
        self._read_names: set[str] = set()      # every tensor read so far, FP8 scales and MXFP4 parts included
        self._bad: dict[str, BadTensor] = {}     # weights read with non-finite values, by name (rows summed)
        config = self.path / "config.json"
        self.fp8: BlockFP8 | None = block_fp8(json.loads(config.read_text())) if config.is_file() else None
        if self.fp8 is not None:
            log.warning("%s: block-wise FP8 checkpoint (quant_method fp8, weight_block_size %s): each FP8 weight is "
                     "dequantised at load (w * weight_scale_inv per block) to the engine's dtype, which it then "
                     "runs and counts in (not FP8)", self.path, list(self.fp8.block))

    def names(self) -> set[str]:
        return set(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def _handle(self, f: Path):
        if f not in self._handles:
            if not f.is_file():
                raise FileNotFoundError(f"shard {f.name} named in the index is missing from {self.path}")
            self._handles[f] = safe_open(f, framework="pt")
        return self._handles[f]

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        if name not in self._where:
            raise MissingTensorError(f"tensor {name!r} is missing from checkpoint {self.path}")
        t = self._read(name, lambda h: h.get_tensor(name))
        if is_float8(t.dtype):
            t = self._dequantize(name, t, lambda scale: self.get(scale))
        return t if dtype is None else t.to(dtype)

    def weight(self, name: str, shape: tuple[int, ...], row: int | None = None,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        """A floating-point weight that must have `shape` (with `row`: that row of a stacked
        tensor). Anything else is a ValueError naming the tensor, its file and both shapes --
        never a row broadcast over a matrix, nor integers cast to floats."""
        t = self.get(name) if row is None else self.get_row(name, row)
        where = f"tensor {name!r}{'' if row is None else f' (row {row})'} in {self._where[name].name}"
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{where} has shape {tuple(t.shape)}, config implies {tuple(shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{where} is stored as {t.dtype}; a weight must be floating point")
        out = t if dtype is None else t.to(dtype)
        if n := nonfinite_count(out):         # as the model holds it; finite as stored: the cast overflowed
            raw = nonfinite_count(t) if out is not t else n
            self._note_bad(name, raw or n, out.numel(), None if raw else str(out.dtype).split(".")[-1])
        return out

    def _note_bad(self, name: str, count: int, numel: int, cast_to: str | None) -> None:
        """A weight (or one row of a stacked one) read with `count` non-finite values."""
        old = self._bad.get(name)
        if old is not None:
            count, numel = count + old.count, numel + old.numel
        self._bad[name] = BadTensor(self._where[name].name, name, count, numel, cast_to)

    def refuse_nonfinite(self) -> None:
        """After a load: NonFiniteError naming the first weight read with NaN or inf (its file, its
        count) and how many were; nothing when every weight was finite."""
        refuse_bad_tensors(str(self.path), list(self._bad.values()))

    def _read(self, name: str, read: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        f = self._where[name]
        self._read_names.add(name)
        try:
            return read(self._handle(f))
        except SafetensorError as e:
            raise MissingTensorError(f"tensor {name!r} cannot be read from {f.name}, the shard that names it "
                                     f"({e})") from None

    def get_row(self, name: str, row: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """`tensor[row]` of a stacked tensor without reading the other rows."""
        if name not in self._where:
            raise MissingTensorError(f"tensor {name!r} is missing from checkpoint {self.path}")
        t = self._read(name, lambda h: h.get_slice(name)[row])
        if is_float8(t.dtype):
            t = self._dequantize(name, t, lambda scale: self.get_row(scale, row))
        return t if dtype is None else t.to(dtype)

    def _dequantize(self, name: str, t: torch.Tensor, scale_of: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """An FP8 tensor as fp32, through its block scales (never a bare cast of FP8 codes)."""
        scale = name + SCALE_SUFFIX
        if self.fp8 is None:
            raise ValueError(f"tensor {name!r} in {self.path} is stored as {t.dtype}, but config.json declares no "
                             "block-wise FP8 quantization_config (quant_method 'fp8', weight_block_size) to read it by")
        if scale not in self._where:
            raise MissingTensorError(f"FP8 tensor {name!r} has no {scale!r} in checkpoint {self.path}")
        return self.fp8.dequantize(t, scale_of(scale))

    def unread(self, skipped: Iterable[str] = ()) -> list[str]:
        """Sorted names of the tensors never read, except those matching a `skipped` regex (re.search)."""
        skip = [re.compile(p) for p in skipped]
        return sorted(n for n in self._where.keys() - self._read_names if not any(p.search(n) for p in skip))

    def warn_unread(self, model: str, skipped: Iterable[str] = (), shown: int = 5) -> list[str]:
        """After a load: one warning naming the tensors nothing read (the first `shown`, sorted),
        which the model then runs without; returns them all."""
        names = self.unread(skipped)
        if names:
            one = len(names) == 1
            more = f", ... ({len(names) - shown} more)" if len(names) > shown else ""
            log.warning("%s: %d checkpoint %s not used by the %s model and %s not loaded: %s%s (a family that should "
                        "read %s would compute something else)", self.path, len(names),
                        "tensor is" if one else "tensors are", model, "was" if one else "were",
                        ", ".join(names[:shown]), more, "it" if one else "them")
        return names

    def close(self) -> None:
        self._handles.clear()


def scan_nonfinite(path: str | Path) -> list[BadTensor]:
    """Every floating-point tensor of checkpoint dir `path` with NaN or inf values, each read once
    through safetensors (memory-mapped, one tensor at a time): the loader's verdict without a model,
    for an engine that runs the checkpoint itself. `refuse_bad_tensors(path, bad)` words it as a
    load does."""
    ckpt = Checkpoint(path)
    bad = []
    try:
        for name in sorted(ckpt.names(), key=lambda n: (ckpt._where[n].name, n)):     # file by file
            t = ckpt._read(name, lambda h, name=name: h.get_tensor(name))
            if count := nonfinite_count(t):
                bad.append(BadTensor(ckpt._where[name].name, name, count, t.numel()))
            del t
    finally:
        ckpt.close()
    return bad
