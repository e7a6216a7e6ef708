"""Hugging Face transformers' router logits (`output_router_logits=True`) as a routing trace.

Owns: reading saved router logits and taking each token's top-k. Does not own: the checks
against the model and the trace file (harness.traces.base).

The format: a forward pass of a transformers MoE model called with `output_router_logits=True`
returns `router_logits`, a tuple with one float tensor per MoE layer, `[batch * seq_len,
num_experts]` (rows row-major over [batch, seq]; `MoeModelOutputWithPast.router_logits` in
transformers' modeling_outputs.py, filled by Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GPT-OSS).
Save it as it is -- `torch.save(out.router_logits, "pass0.pt")` -- one file per forward pass
(a prefill, then one per decode step if you record those), or as a `.npy` array `[layers,
tokens, num_experts]`. Files are passes in the order given; `batch` splits each pass's rows
into that many sequences.

The routed experts are each row's `top_k` largest logits (top-k of the logits is top-k of their
softmax), highest first: the routing of a softmax top-k router. A router that adds a score bias
or limits expert groups (DeepSeek-V3, GLM-4.5) chooses differently, and transformers does not
return logits for those models. top_k is not in the logits: give --model or --top-k.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from harness.traces.base import ImportFailure, Passes, Read


def read(paths: Sequence[Path], top_k: int | None = None, batch: int = 1, **_: Any) -> Read:
    if top_k is None:
        raise ImportFailure("router logits do not say how many experts a token routes to; give --model NAME|DIR "
                            "or --top-k K")
    passes = Passes()
    n_experts: int | None = None
    for path in paths:
        logits = _logits(path)                                                   # [L, n, E]
        L, n, E = logits.shape
        if n_experts is not None and E != n_experts:
            raise ImportFailure(f"{path}: logits over {E} experts, earlier files {n_experts}; allowed: one model")
        n_experts = E
        if not 1 <= top_k <= E:
            raise ImportFailure(f"top_k={top_k} is outside [1, {E}] (the logits' experts)")
        if n % batch:
            raise ImportFailure(f"{path}: {n} rows do not split into --batch {batch} sequences of equal length; "
                                f"allowed: a batch that divides the rows (rows are row-major over [batch, seq])")
        ids = np.argsort(-logits, axis=2, kind="stable")[:, :, :top_k]          # [L, n, k], highest first
        rows = passes.new_sequences(batch)
        passes.add(ids.transpose(1, 0, 2), np.repeat(rows, n // batch))           # [n, L, k]
    order = f"one forward pass per file, in the order given; rows row-major over [batch={batch}, seq]"
    return Read(passes, order=order, n_experts=n_experts)


def _logits(path: Path) -> np.ndarray:
    """float [L, n, E] from a .pt (tuple/list of per-layer tensors, or one stacked tensor) or a .npy."""
    allowed = ("allowed: torch.save(out.router_logits) -- a tuple of per-layer [tokens, experts] tensors -- "
               "or a .npy [layers, tokens, experts]")
    if path.suffix == ".npy":
        try:
            arr = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise ImportFailure(f"{path}: not a readable .npy ({exc}); {allowed}") from None
    elif path.suffix == ".pt":
        import pickle

        import torch
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, ValueError) as exc:
            raise ImportFailure(f"{path}: not a readable torch.save file ({type(exc).__name__}); {allowed}") from None
        if isinstance(obj, (tuple, list)) and obj and all(isinstance(t, torch.Tensor) and t.ndim >= 2 for t in obj):
            shapes = {(t.numel() // max(t.shape[-1], 1), t.shape[-1]) for t in obj}          # (tokens, experts)
            if len(shapes) != 1:
                raise ImportFailure(f"{path}: per-layer tensors of different shapes "
                                    f"{[tuple(t.shape) for t in obj]}; {allowed}")
            arr = np.stack([t.detach().float().reshape(-1, t.shape[-1]).numpy() for t in obj])
        elif isinstance(obj, torch.Tensor):
            arr = obj.detach().float().numpy()
        else:
            raise ImportFailure(f"{path}: holds a {type(obj).__name__}; {allowed}")
    else:
        raise ImportFailure(f"{path}: unknown file type {path.suffix!r}; {allowed}")
    if arr.ndim != 3 or arr.dtype.kind != "f" or 0 in arr.shape:
        raise ImportFailure(f"{path}: router logits of dtype {arr.dtype}, shape {arr.shape}; {allowed}")
    if not np.isfinite(arr).all():
        raise ImportFailure(f"{path}: router logits hold NaN or inf; allowed: finite logits")
    return arr
