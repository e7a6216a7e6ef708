"""The engine's one table of dtypes: config names, torch dtypes, bytes per element.

Owns: which dtypes a model may run in (`DTYPE_NAMES`; `DTYPES`, name -> torch dtype), turning a
name into a torch dtype (`torch_dtype`, with an error listing the allowed names) and into bytes
(`dtype_bytes`). Everything else -- checkpoints, the planner, the harness's config and cost
model -- reads this table instead of keeping its own. Names and bytes need no torch (planning a
model never imports it: engine.lazy); a torch dtype is looked up when asked for.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from engine.lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())

ITEMSIZE: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
DTYPE_NAMES: tuple[str, ...] = tuple(ITEMSIZE)


class _TorchDtypes(Mapping[str, "torch.dtype"]):
    """DTYPE_NAMES -> torch's dtype of that name, looked up on read."""

    def __getitem__(self, name: str) -> torch.dtype:
        if name not in ITEMSIZE:
            raise KeyError(name)
        return getattr(torch, name)

    def __iter__(self) -> Iterator[str]:
        return iter(DTYPE_NAMES)

    def __len__(self) -> int:
        return len(DTYPE_NAMES)


DTYPES: Mapping[str, torch.dtype] = _TorchDtypes()


def checked_name(name: str | torch.dtype) -> str:
    """The name of an allowed dtype, given as a name or a torch dtype (ValueError listing the allowed)."""
    text = name if isinstance(name, str) else dtype_name(name)
    if text not in ITEMSIZE:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_NAMES)}, got {name!r}")
    return text


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if not isinstance(name, str) and isinstance(name, torch.dtype):
        return name
    return DTYPES[checked_name(name)]


def dtype_bytes(name: str | torch.dtype) -> int:
    if isinstance(name, str):
        return ITEMSIZE[checked_name(name)]
    return torch_dtype(name).itemsize


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")
