"""`engine=hf`: Hugging Face transformers' own model on the same weights, the numerical and speed
reference beside ours; on CUDA, accelerate's `device_map` offload within the device budget.

Owns: loading the checkpoint (a preset is exported with engine.export first, so both engines run
the same seeded weights), the same work as ours per pass (logits of the last position only,
`logits_to_keep=1`; a prefill in micro-batches of `workload.ubatch` tokens), its KV cache as a session, and moving that cache to host RAM and back.
Counters it cannot give stay None (never 0). MXFP4 checkpoints (GPT-OSS) load through
transformers' own dequantisation (`Mxfp4Config(dequantize=True)`: bf16 expert weights, exact),
cast to the run's dtype off CUDA so an fp32 run is fp32 throughout; recurrent layers' states
(Qwen3-Next's conv and delta-rule states) move to host RAM and back with the KV. Code shipped in
the checkpoint (an `auto_map`) runs only under `model.trust_remote_code=true`; otherwise such a
checkpoint is refused (harness.remote_code).
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.dtypes import DTYPES, dtype_name
from engine.lazy import lazy_module
from harness.engines.base import EngineAdapter, Produced, argmax, refuse_truncation
from harness.remote_code import refuse_checkpoint_code

if TYPE_CHECKING:
    import torch

    from harness.config.schema import RunSpec
else:                  # its declarations (capabilities, options) load without torch; building it loads torch
    torch = lazy_module("torch", globals())


class HFAdapter(EngineAdapter):
    name = "hf"
    uses_placement = False            # transformers runs its own way; moebench's placement/cache do not apply
    checkpoint_loader = "transformers' from_pretrained"

    def __init__(self, spec: RunSpec) -> None:
        import transformers

        from engine.export import export_preset

        refuse_truncation(spec, self.name)
        self.ubatch = spec.workload.ubatch
        path = spec.model.path or str(export_preset(spec.model.name, spec.model.seed, spec.model_config,
                                                    Path(spec.run.out) / ".checkpoints"))
        dtype = "auto" if spec.model.dtype == "auto" else DTYPES[spec.model.dtype]
        cuda = spec.hardware.device == "cuda" or (spec.hardware.device == "auto" and torch.cuda.is_available())
        trusted = bool(spec.model.trust_remote_code)
        refuse_checkpoint_code(path, trusted, self.checkpoint_loader)     # validate() did; a direct build too
        # explicit either way: transformers' own default (None) would ask on a terminal
        kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": trusted}
        if cuda:
            kwargs["device_map"] = "auto"
            if spec.hardware.device_memory:
                kwargs["max_memory"] = {0: spec.hardware.device_memory, "cpu": "1000GiB"}
        mxfp4 = (json.loads((Path(path) / "config.json").read_text()).get("quantization_config") or {}
                 ).get("quant_method") == "mxfp4"
        if mxfp4:
            kwargs["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
        t0 = time.perf_counter()
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
        self.load_s = time.perf_counter() - t0
        if mxfp4 and not cuda and dtype != "auto":
            self.model = self.model.to(dtype)       # dequantised experts come back bf16 whatever `dtype` asked
        self.device = torch.device("cuda") if cuda else torch.device("cpu")
        self.device_kind = "cuda" if cuda else "cpu"
        self.device_name = torch.cuda.get_device_name() if cuda else "cpu"
        self.emulated = False     # transformers runs on the CPU for real here: no device is emulated
        self.compute_dtype = dtype_name(self.model.dtype)

    @classmethod
    def build(cls, spec: RunSpec, options: Any, **kw: Any) -> "HFAdapter":   # progress etc. do not apply
        return cls(spec)

    def budget_gap(self) -> str | None:
        if self.device_kind == "cpu":
            return "transformers runs on the CPU here: nothing is on a device to hold to it"
        return "accelerate's max_memory holds transformers' weights to it; its KV and activations come on top"

    def new_session(self, batch: int):
        from transformers import DynamicCache
        return {"past": DynamicCache(config=self.model.config)}

    def _forward(self, sess, ids: torch.Tensor) -> torch.Tensor:
        # the same work as ours: logits of the last position only, never [B, T, V]
        with torch.inference_mode():
            out = self.model(ids.to(self.device), past_key_values=sess["past"], use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]

    def prefill(self, sess, rows) -> Produced:
        """In micro-batches of `workload.ubatch` tokens, as ours and llama.cpp's -ub prefill."""
        ids = torch.tensor(rows)
        for start in range(0, ids.shape[1], self.ubatch):
            out = self._forward(sess, ids[:, start:start + self.ubatch])
        return Produced(argmax(out), out)

    def decode(self, sess, tokens: list[int], steps: int) -> Iterator[Produced]:
        for _ in range(steps):
            out = self._forward(sess, torch.tensor(tokens)[:, None])
            tokens = argmax(out)
            yield Produced(tokens, out)

    def offload(self, sess) -> None:
        for layer in sess["past"].layers:
            _move_cache_layer(layer, torch.device("cpu"))

    def restore(self, sess) -> None:
        for layer in sess["past"].layers:
            _move_cache_layer(layer, self.device)

    def close_session(self, sess) -> None:
        sess["past"] = None

    def close(self) -> None:
        self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _move_cache_layer(layer: Any, device: torch.device) -> None:
    """Copy one transformers cache layer's tensors to `device`: keys/values of an attention layer,
    the conv and recurrent state dicts of a linear-attention layer (or both)."""
    for name in ("keys", "values"):
        t = getattr(layer, name, None)
        if isinstance(t, torch.Tensor):
            setattr(layer, name, t.to(device, copy=True))
    for name in ("conv_states", "recurrent_states"):
        states = getattr(layer, name, None)
        if isinstance(states, dict):
            for key, t in states.items():
                if isinstance(t, torch.Tensor):
                    states[key] = t.to(device, copy=True)
