"""vLLM's returned routed experts (`--enable-return-routed-experts`) as a routing trace.

Owns: reading what vLLM returns and turning it into ordered passes. Does not own: the checks
against the model and the trace file (harness.traces.base).

The format, as vLLM defines it (docs/training/routed_experts_replay.md; `RequestOutput.
prompt_routed_experts` and `CompletionOutput.routed_experts` in vllm/outputs.py; the OpenAI
server's response fields in vllm/entrypoints/openai/*/protocol.py):

* `prompt_routed_experts` -- at the response (request) level, shared by every choice:
  expert ids `[prompt_len, num_moe_layers, top_k]`;
* `choices[i].routed_experts` -- per completion: `[gen_len, num_moe_layers, top_k]`, one row
  per generated token that went through a forward pass.

Each value is an expert id in [0, num_experts). A response carries them as nested JSON lists,
or -- newer servers -- as a string holding a base64-encoded `.npy` file (`np.save` output).
Files read here: `.json` (one response object or a list of them), `.jsonl` (one response per
line), or `.npz` with arrays `prompt_routed_experts` and `routed_experts` (what
`np.savez(f, prompt_routed_experts=out.prompt_routed_experts,
routed_experts=out.outputs[0].routed_experts)` writes from an offline `LLM.generate` output).
A response without `prompt_routed_experts` whose `routed_experts` also covers the prompt (the
older single-array form) is split at `usage.prompt_tokens` / `len(prompt_token_ids)`.

Order (meta `order`): requests one after another in file order; a request's prompt is one
forward pass (or `prefill_chunk` tokens per pass, vLLM's chunked prefill), then one pass per
generated position holding that position's token of every choice (parallel sampling decodes
the choices together). Each choice is a sequence; the prompt belongs to the first choice's.
"""
from __future__ import annotations

import base64
import binascii
import io
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from harness.traces.base import ImportFailure, Passes, Read, check_ids

ORDER = ("requests in file order; per request the prompt in {prefill}, then one pass per generated position "
         "across the request's choices")


def read(paths: Sequence[Path], prefill_chunk: int | None = None, **_: Any) -> Read:
    passes = Passes()
    for path in paths:
        for where, resp in _responses(path):
            _add_request(passes, where, resp, prefill_chunk)
    prefill = "one forward pass" if prefill_chunk is None else f"forward passes of {prefill_chunk} tokens"
    return Read(passes, order=ORDER.format(prefill=prefill))


def _responses(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, response) of every response in `path`."""
    if path.suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        except (OSError, ValueError) as exc:
            raise ImportFailure(f"{path}: not a readable .npz ({exc}); allowed: arrays prompt_routed_experts "
                                "and routed_experts") from None
        known = {"prompt_routed_experts", "routed_experts"}
        if not known & set(arrays):
            raise ImportFailure(f"{path}: holds arrays {sorted(arrays)}; allowed: prompt_routed_experts and/or "
                                "routed_experts (vLLM's RequestOutput / CompletionOutput fields)")
        resp = {"prompt_routed_experts": arrays.get("prompt_routed_experts"),
                "choices": [{"routed_experts": arrays["routed_experts"]}] if "routed_experts" in arrays else []}
        yield str(path), resp
        return
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ImportFailure(f"{path}: cannot read it ({exc}); allowed: a .json/.jsonl vLLM response file or .npz")
    if path.suffix == ".jsonl":
        docs = [(f"{path}:{i + 1}", line) for i, line in enumerate(text.splitlines()) if line.strip()]
    elif path.suffix == ".json":
        docs = [(str(path), text)]
    else:
        raise ImportFailure(f"{path}: unknown file type {path.suffix!r}; allowed: .json (a response or a list), "
                            ".jsonl (one response per line), .npz (prompt_routed_experts, routed_experts)")
    for where, doc in docs:
        try:
            obj = json.loads(doc)
        except json.JSONDecodeError as exc:
            raise ImportFailure(f"{where}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
                                "allowed: a vLLM completion or chat completion response") from None
        for i, resp in enumerate(obj if isinstance(obj, list) else [obj]):
            here = where if not isinstance(obj, list) else f"{where}[{i}]"
            if not isinstance(resp, dict):
                raise ImportFailure(f"{here}: a {type(resp).__name__}, not a response object; allowed: a vLLM "
                                    "response with prompt_routed_experts / choices[].routed_experts")
            yield here, resp


def _add_request(passes: Passes, where: str, resp: dict[str, Any], prefill_chunk: int | None) -> None:
    choices = resp.get("choices") or []
    gens = [_ids(c.get("routed_experts"), f"{where}: choices[{i}].routed_experts") if isinstance(c, dict) else None
            for i, c in enumerate(choices)]
    prompt = _ids(resp.get("prompt_routed_experts"), f"{where}: prompt_routed_experts")
    if prompt is None and gens and gens[0] is not None:          # the single-array form: prompt rows first
        n = _prompt_len(resp)
        if n is None or n > len(gens[0]):
            raise ImportFailure(f"{where}: no prompt_routed_experts, and routed_experts ({len(gens[0])} rows) cannot "
                                f"be split into prompt and generated rows (prompt length {n}); allowed: a response "
                                "with prompt_routed_experts, or usage.prompt_tokens / prompt_token_ids")
        prompt, gens = gens[0][:n], [g[n:] if g is not None else None for g in gens]
    if prompt is None and all(g is None for g in gens):
        raise ImportFailure(f"{where}: no routed experts (prompt_routed_experts and choices[].routed_experts are "
                            "missing or null); vLLM returns them when served with --enable-return-routed-experts")
    gens = [g for g in gens if g is not None and len(g)]
    seqs = passes.new_sequences(max(len(gens), 1))
    if prompt is not None and len(prompt):
        chunk = prefill_chunk or len(prompt)
        for start in range(0, len(prompt), chunk):
            part = prompt[start:start + chunk]
            passes.add(part, [seqs[0]] * len(part))
    for pos in range(max((len(g) for g in gens), default=0)):
        rows = [(s, g[pos]) for s, g in zip(seqs, gens) if pos < len(g)]
        passes.add(np.stack([r for _, r in rows]), [s for s, _ in rows])


def _ids(value: Any, where: str) -> np.ndarray | None:
    """Expert ids [n, L, k] from nested lists, a base64 `.npy` string or an array; None for null."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = np.load(io.BytesIO(base64.b64decode(value, validate=True)), allow_pickle=False)
        except (binascii.Error, ValueError, OSError, EOFError) as exc:
            raise ImportFailure(f"{where}: a string that is not a base64-encoded .npy array ({exc}); allowed: "
                                "nested lists [tokens][layers][top_k] or base64(np.save(array))") from None
    elif isinstance(value, list):
        if not value:
            return None
        try:
            value = np.asarray(value)
        except ValueError:
            raise ImportFailure(f"{where}: ragged nested lists; allowed: [tokens][layers][top_k] with one "
                                "layer count and one top_k") from None
    return check_ids(value, where)


def _prompt_len(resp: dict[str, Any]) -> int | None:
    ids = resp.get("prompt_token_ids")
    if isinstance(ids, list):
        return len(ids)
    usage = resp.get("usage")
    n = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) else None
