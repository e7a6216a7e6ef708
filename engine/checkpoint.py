"""Lazy tensor access to a Hugging Face safetensors checkpoint, single file or sharded.

Owns: finding tensors by name across shards, the per-family naming of experts
(per-expert `experts.{e}.w1` / `gate_proj` files and fused `experts.gate_up_proj`
tensors), dtype conversion, and clear errors for missing tensors.
Does not own: where tensors end up (engine.loader decides host vs device).

Tensors are read one at a time through `safe_open` (memory-mapped), so loading never
holds a second full copy of the weights: each tensor is copied straight into its
destination and dropped.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
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


# --- family naming -------------------------------------------------------------------
def moe_prefix(cfg: ModelConfig, layer: int) -> str:
    return f"model.layers.{layer}." + ("block_sparse_moe" if cfg.family == "mixtral" else "mlp")


def router_name(cfg: ModelConfig, layer: int) -> str:
    return f"{moe_prefix(cfg, layer)}.gate.weight"


def expert_names(cfg: ModelConfig, layer: int, e: int) -> tuple[str, str, str]:
    """(gate, up, down) per-expert tensor names as stored on the Hub."""
    p = f"{moe_prefix(cfg, layer)}.experts.{e}."
    if cfg.family == "mixtral":
        return p + "w1.weight", p + "w3.weight", p + "w2.weight"
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def read_expert_into(ckpt: Checkpoint, cfg: ModelConfig, layer: int, e: int, out: torch.Tensor) -> None:
    """Write expert (layer, e) packed as [gate (I*D) | up (I*D) | down (D*I)] into the 1-D `out`.

    Accepts the per-expert Hub layout and the fused layout (`experts.gate_up_proj` [E, 2I, D],
    `experts.down_proj` [E, D, I]) under either `mlp.` or `block_sparse_moe.`.
    """
    D, I = cfg.hidden_size, cfg.moe_intermediate_size
    gate, up, down = expert_names(cfg, layer, e)
    gu, dn = out[: 2 * I * D].view(2 * I, D), out[2 * I * D:].view(D, I)
    if ckpt.has(gate):
        gu[:I].copy_(ckpt.get(gate))
        gu[I:].copy_(ckpt.get(up))
        dn.copy_(ckpt.get(down))
        return
    for prefix in (moe_prefix(cfg, layer), f"model.layers.{layer}.mlp"):
        fused = f"{prefix}.experts.gate_up_proj"
        if ckpt.has(fused):
            gu.copy_(ckpt.get_row(fused, e))
            dn.copy_(ckpt.get_row(f"{prefix}.experts.down_proj", e))
            return
    raise MissingTensorError(
        f"tensor {gate!r} is missing from checkpoint {ckpt.path} "
        f"(no fused {moe_prefix(cfg, layer)}.experts.gate_up_proj either)")
