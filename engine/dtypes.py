"""The engine's one table of dtypes: config names, torch dtypes, bytes per element.

Owns: which dtypes a model may run in (`DTYPES`), turning a name into a torch dtype
(`torch_dtype`, with an error listing the allowed names) and into bytes (`dtype_bytes`).
Everything else -- checkpoints, the planner, the harness's config and cost model -- reads
this table instead of keeping its own.
"""
from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES: tuple[str, ...] = tuple(DTYPES)


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def dtype_bytes(name: str | torch.dtype) -> int:
    return torch_dtype(name).itemsize


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")
