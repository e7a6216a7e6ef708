"""Checkpoints that ship with moebench: trained weights, named like presets.

Owns: the name -> directory table of the checkpoints under `engine/checkpoints/` (each a plain
Hugging Face checkpoint: config.json + model.safetensors, with a model card and the log of the
run that trained it), and `shipped_checkpoint(name)`. A shipped name is looked up before the
presets (engine.config.PRESETS, seeded random weights of real shapes), so
`Engine.from_pretrained("tiny-moe-trained")` loads trained weights, and the harness's
`model=tiny-moe-trained` is `model.path=<that directory>`.
Does not own: reading a checkpoint (engine.checkpoint), how one was trained
(scripts/train_tiny_moe.py).

    from engine.shipped import shipped_checkpoint
    shipped_checkpoint("tiny-moe-trained")     # Path(.../engine/checkpoints/tiny-moe-trained)
    shipped_checkpoint("tiny-mixtral")         # None: a preset, not a shipped checkpoint
"""
from __future__ import annotations

from pathlib import Path

CHECKPOINTS_DIR = Path(__file__).resolve().parent / "checkpoints"

#: name -> directory under CHECKPOINTS_DIR. `tiny-moe-trained`: 4 layers, 8 experts, top-2, trained on
#: the Python standard library's source (its README.md, the model card, says how and what it routes like).
SHIPPED: dict[str, str] = {"tiny-moe-trained": "tiny-moe-trained"}


def shipped_checkpoint(name: str) -> Path | None:
    """The directory of the shipped checkpoint `name`; None when `name` names none."""
    sub = SHIPPED.get(str(name))
    return None if sub is None else CHECKPOINTS_DIR / sub
