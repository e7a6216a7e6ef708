"""Lazy tensor access to a Hugging Face safetensors checkpoint, single file or sharded.

Owns: finding tensors by name across shards (`model.safetensors.index.json` or every
`*.safetensors` file), reading one row of a stacked tensor, dtype conversion, and clear
errors for missing tensors. Does not own: which names a model has (each block declares its
tensors, each family's expert layout its expert names: engine.blocks) or where tensors end
up (engine.model).

Tensors are read one at a time through `safe_open` (memory-mapped), so loading never
holds a second full copy of the weights: each tensor is copied straight into its
destination and dropped.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine.dtypes import DTYPES, torch_dtype  # noqa: F401 -- re-exported: callers import them from here


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
            weight_map = json.loads(index.read_text())["weight_map"]
            self._where = {name: self.path / f for name, f in weight_map.items()}
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {self.path}")
            self._where = {}
            for f in files:
                with safe_open(f, framework="pt") as h:
                    for name in h.keys():
                        self._where[name] = f
        self._handles: dict[Path, object] = {}

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
        t = self._handle(self._where[name]).get_tensor(name)
        return t if dtype is None else t.to(dtype)

    def get_row(self, name: str, row: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """`tensor[row]` of a stacked tensor without reading the other rows."""
        if name not in self._where:
            raise MissingTensorError(f"tensor {name!r} is missing from checkpoint {self.path}")
        t = self._handle(self._where[name]).get_slice(name)[row]
        return t if dtype is None else t.to(dtype)

    def close(self) -> None:
        self._handles.clear()
