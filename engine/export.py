"""Write a preset's seeded random weights as a Hugging Face checkpoint directory.

Owns: turning a model's blocks into a checkpoint -- every tensor the family's blocks declare,
under its checkpoint name, and every routed expert under its per-expert Hub names (the
family's ExpertLayout) -- plus the family's config.json (`Family.hf_config`), so
transformers (engine=hf) runs exactly the weights our engine runs for the same preset and
seed. Does not own: any name or config key (the family's), reading checkpoints.

    path = export_preset("tiny-mixtral", seed=0, cfg=preset("tiny-mixtral"), root=Path("results/.checkpoints"))
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.config import ModelConfig
from engine.model import TensorSource


def hf_config(cfg: ModelConfig) -> dict:
    """config.json for cfg in the current transformers form (the family writes it)."""
    return cfg.family_class.hf_config(cfg)


def export_preset(name: str, seed: int, cfg: ModelConfig, root: Path) -> Path:
    """Materialise (once) preset `name` with `seed` as an fp32 checkpoint under root; return its dir."""
    path = Path(root) / f"{name}-L{cfg.num_layers}-seed{seed}"
    if (path / "config.json").is_file():
        return path
    src = TensorSource(cfg, None, seed)
    arch = cfg.architecture()
    tensors = {spec.name: src.get(spec, torch.float32).contiguous() for _, _, spec in arch.walk()}
    layout = arch.experts
    buf = torch.empty(layout.numel, dtype=layout.storage_dtype(torch.float32))

    def drawn(layer: int, e: int) -> torch.Tensor:
        src.expert_into(layout, layer, e, buf)
        return buf

    for i in cfg.moe_layers:
        tensors.update(layout.hub_layer(i, (drawn(i, e) for e in range(cfg.n_experts))))
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, tmp / "model.safetensors")
    (tmp / "config.json").write_text(json.dumps(hf_config(cfg), indent=2))
    tmp.rename(path)
    return path
