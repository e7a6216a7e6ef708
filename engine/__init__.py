"""moebench's offloading MoE inference engine (plain PyTorch).

    from engine import Engine
    eng = Engine.from_pretrained("tiny-mixtral", placement="fetch", cache_capacity=4)
    res = eng.generate([[1, 2, 3]], max_new_tokens=8)
    res.tokens, eng.counters

See engine.engine for the options, engine.placements and engine.policies for plugins.
"""
from engine.config import PRESETS, ModelConfig, preset
from engine.engine import Engine, GenerateResult
from engine.registry import PLACEMENTS, POLICIES

__all__ = ["Engine", "GenerateResult", "ModelConfig", "PRESETS", "preset", "PLACEMENTS", "POLICIES"]
