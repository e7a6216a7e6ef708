"""moebench's offloading MoE inference engine (plain PyTorch).

    from engine import Engine
    eng = Engine.from_pretrained("tiny-mixtral", placement="fetch", cache_capacity=4)
    res = eng.generate([[1, 2, 3]], max_new_tokens=8)
    res.tokens, eng.counters

See engine.engine for the options, engine.placements and engine.policies for plugins,
engine.families (and engine/families/README.md) for model families and how to add one.
"""
from engine.config import PRESETS, ModelConfig, preset
from engine.engine import Engine, GenerateResult
from engine.finite import NonFiniteError
from engine.registry import FAMILIES, PLACEMENTS, POLICIES

__all__ = ["Engine", "GenerateResult", "NonFiniteError", "ModelConfig", "PRESETS", "preset", "FAMILIES", "PLACEMENTS",
           "POLICIES"]
