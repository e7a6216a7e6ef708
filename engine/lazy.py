"""torch, imported at its first use: planning a model never loads it.

Owns: `lazy_module`, the name a module binds torch (or `torch.nn.functional`) to when the module
is on the planning path. Does not own: which modules are on that path (tests/engine/
test_import_light.py lists them and holds them free of torch).

Blocks, placements and KV formats declare (tensors, state terms, bytes: what the planner, the
cost model and `moebench plan` ask) and compute (forward passes) in one class each. Declaring
needs no torch, and importing torch costs seconds, so such a module binds it as

    if TYPE_CHECKING:
        import torch
    else:
        torch = lazy_module("torch", globals())

and reads it only inside functions. The first attribute read (`torch.empty(...)` in a function
that computes) imports torch and rebinds the module's global to the real module: from then on the
module reads torch itself, with no indirection on the forward path, and a test's monkeypatch of
torch is seen as with a plain `import torch`. Reading an attribute at module level (a table of
torch dtypes, a default argument) would import torch at import time: keep names there and turn
them into torch objects in the function that needs them.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class _LazyModule:
    """Stands in a module's namespace for module `name` until its first attribute read."""

    __slots__ = ("_name", "_namespace")

    def __init__(self, name: str, namespace: dict[str, Any]) -> None:
        self._name, self._namespace = name, namespace

    def __getattr__(self, attr: str) -> Any:
        module = importlib.import_module(self._name)
        for key, value in list(self._namespace.items()):     # once: later reads go straight to the module
            if value is self:
                self._namespace[key] = module
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<module {self._name!r}, imported at its first use>"


def lazy_module(name: str, namespace: dict[str, Any]) -> ModuleType:
    """A stand-in for module `name`, to be bound in `namespace` (a module's `globals()`), that
    imports the module at its first attribute read and puts it in the stand-in's place there."""
    return _LazyModule(name, namespace)  # type: ignore[return-value]
