"""moebench's offloading MoE inference engine (plain PyTorch).

    from engine import Engine
    eng = Engine.from_pretrained("tiny-mixtral", placement="fetch", cache_capacity=4)
    # or: Engine.from_pretrained("tiny-mixtral", EngineOptions(placement="fetch", cache_capacity=4))
    res = eng.generate([[1, 2, 3]], max_new_tokens=8)
    res.tokens, eng.counters

See engine.options for the options, engine.placements and engine.policies for plugins,
engine.families (and engine/families/README.md) for model families and how to add one.

Model shapes, presets, `EngineOptions`, the registries and the memory planner (engine.planner)
import without torch; `Engine`, `GenerateResult` and `NonFiniteError` load it on first use (engine.lazy).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.kernels.openmp import quiet_spinning

quiet_spinning()                         # before anything loads torch (libgomp reads it once)

from engine.config import PRESETS, ModelConfig, preset  # noqa: E402
from engine.options import EngineOptions  # noqa: E402
from engine.registry import FAMILIES, PLACEMENTS, POLICIES  # noqa: E402

if TYPE_CHECKING:
    from engine.engine import Engine, GenerateResult
    from engine.finite import NonFiniteError

_LAZY = {"Engine": "engine.engine", "GenerateResult": "engine.engine", "NonFiniteError": "engine.finite"}

__all__ = ["Engine", "EngineOptions", "GenerateResult", "NonFiniteError", "ModelConfig", "PRESETS", "preset", "FAMILIES", "PLACEMENTS",
           "POLICIES"]


def __getattr__(name: str) -> Any:
    """The engine itself, imported when first asked for (it brings torch)."""
    if name not in _LAZY:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
