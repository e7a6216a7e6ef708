"""Files written to each engine's documented routing format, from known routing, so an import can be
checked against the routing that went in. Each writer names where its format is defined.

N=tokens, L=MoE layers, k=top-k, E=experts.
"""
from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import torch


def routing(rng: np.random.Generator, n: int, layers: int, k: int, n_experts: int) -> np.ndarray:
    """int [n, L, k]: k distinct experts per token and layer."""
    return np.stack([np.stack([rng.choice(n_experts, size=k, replace=False) for _ in range(layers)])
                     for _ in range(n)]).astype(np.int64).reshape(n, layers, k)


# --- vLLM ---------------------------------------------------------------------------------------
def b64_npy(arr: np.ndarray) -> str:
    """A newer vLLM server's encoding of routed experts: base64 of `np.save`'s bytes (vllm
    entrypoints' serving code; decoded as np.load(io.BytesIO(base64.b64decode(s))))."""
    buf = io.BytesIO()
    np.save(buf, arr)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def vllm_response(prompt: np.ndarray | None, gens: list[np.ndarray], encode: str = "lists",
                  combined: bool = False) -> dict:
    """A /v1/completions response of a server run with --enable-return-routed-experts, as vLLM's
    docs/training/routed_experts_replay.md describes it: `prompt_routed_experts` [prompt_len,
    num_moe_layers, top_k] at the response level, `choices[i].routed_experts` [gen_len, layers,
    top_k] per completion (vllm/outputs.py: RequestOutput.prompt_routed_experts,
    CompletionOutput.routed_experts); int16 ids in the docs. `combined`: the older single-array
    form, prompt rows first in each choice's routed_experts, no prompt_routed_experts."""
    def enc(a: np.ndarray):
        a = a.astype(np.int16)
        return a.tolist() if encode == "lists" else b64_npy(a)

    choices = []
    for i, g in enumerate(gens):
        rows = np.concatenate([prompt, g]) if combined else g
        choices.append({"index": i, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None,
                        "routed_experts": enc(rows)})
    n_prompt = 0 if prompt is None else len(prompt)
    return {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "m", "choices": choices,
            "usage": {"prompt_tokens": n_prompt, "total_tokens": n_prompt + sum(map(len, gens)),
                      "completion_tokens": sum(map(len, gens))},
            "prompt_routed_experts": None if combined or prompt is None else enc(prompt)}


def write_jsonl(path: Path, responses: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in responses))
    return path


# --- SGLang ---------------------------------------------------------------------------------------
def sglang_stat_csv(path: Path, counts: np.ndarray, layers: list[int]) -> Path:
    """The older recorder's stat dump (python/sglang/srt/managers/expert_distribution.py,
    ExpertDistributionRecorder.dump_record): header layer_id,expert_id,count, then one line per
    (layer, expert) with a count > 0. counts: [len(layers), E]."""
    lines = ["layer_id,expert_id,count"]
    for row, layer in zip(counts, layers):
        lines += [f"{layer},{e},{int(c)}" for e, c in enumerate(row) if c > 0]
    path.write_text("\n".join(lines) + "\n")
    return path


def sglang_stat_pt(path: Path, per_pass: np.ndarray) -> Path:
    """The newer recorder's stat dump (python/sglang/srt/eplb/expert_distribution.py,
    _StatAccumulator.dump): torch.save of {rank, logical_count [passes, num_layers,
    num_logical_experts], average_utilization_rate_over_window}."""
    torch.save({"rank": 0, "logical_count": torch.from_numpy(per_pass.astype(np.int32)),
                "average_utilization_rate_over_window": None}, path)
    return path


def sglang_per_token_pt(path: Path, passes: list[np.ndarray], num_layers: int, moe_layers: list[int],
                        physical_to_logical: np.ndarray) -> Path:
    """The per_token recorder's dump (python/sglang/srt/eplb/expert_distribution.py,
    _DetailAccumulator.dump and _DetailSinglePassGatherer.collect): torch.save of {records: one
    dict per forward pass (forward_pass_id, rank, gatherer_key, input_ids, positions,
    extend_seq_lens, forward_mode, topk_ids_of_layer int32 [num_layers, tokens, 8] of physical
    ids, -1 where nothing was routed, misc_objects, global_physical_count), and
    last_physical_to_logical_map [num_layers, num_physical]}. passes: logical ids [n, L, k] per pass."""
    logical_to_physical = {(l, int(e)): int(p) for l in range(num_layers)
                           for p, e in enumerate(physical_to_logical[l])}
    records = []
    for i, ids in enumerate(passes):
        n = len(ids)
        topk = np.full((num_layers, n, 8), -1, np.int32)            # the gatherer's fixed 8 columns
        for j, layer in enumerate(moe_layers):
            for t in range(n):
                topk[layer, t, :ids.shape[2]] = [logical_to_physical[layer, int(e)] for e in ids[t, j]]
        count = np.zeros((num_layers, physical_to_logical.shape[1]), np.int32)
        for layer in range(num_layers):
            valid = topk[layer][topk[layer] >= 0]
            np.add.at(count[layer], valid, 1)
        records.append({"forward_pass_id": i, "rank": 0, "gatherer_key": "primary",
                        "input_ids": list(range(n)), "positions": list(range(n)),
                        "extend_seq_lens": [n] if i == 0 else None, "forward_mode": 1 if i == 0 else 2,
                        "topk_ids_of_layer": torch.from_numpy(topk), "misc_objects": [],
                        "global_physical_count": torch.from_numpy(count)})
    torch.save({"records": records, "last_physical_to_logical_map": torch.from_numpy(physical_to_logical)}, path)
    return path
