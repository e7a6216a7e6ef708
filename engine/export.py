"""Write a preset's seeded random weights as a Hugging Face checkpoint directory.

Owns: the reverse naming (our tensors -> Hub names, per-expert layout) and a config.json
in the current transformers form, so transformers (engine=hf) runs exactly the weights our
engine runs for the same preset and seed. Does not own: reading checkpoints.

    path = export_preset("tiny-mixtral", seed=0, cfg=preset("tiny-mixtral"), root=Path("results/.checkpoints"))
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.checkpoint import expert_names, moe_prefix
from engine.config import ModelConfig
from engine.model import TensorSource

ARCH = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
        "olmoe": "OlmoeForCausalLM"}


def hf_config(cfg: ModelConfig) -> dict:
    d = {
        "architectures": [ARCH[cfg.family]], "model_type": cfg.family, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "num_experts_per_tok": cfg.top_k,
        "intermediate_size": cfg.intermediate_size, "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": cfg.hidden_act, "tie_word_embeddings": cfg.tie_word_embeddings,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"}, "dtype": "float32",
    }
    if cfg.family == "mixtral":
        d["num_local_experts"] = cfg.n_experts
        d["intermediate_size"] = cfg.moe_intermediate_size
        d["sliding_window"] = cfg.sliding_window
    else:
        d.update(num_experts=cfg.n_experts, moe_intermediate_size=cfg.moe_intermediate_size,
                 norm_topk_prob=cfg.norm_topk_prob)
    if cfg.family == "qwen2_moe":
        d.update(qkv_bias=cfg.qkv_bias, shared_expert_intermediate_size=cfg.shared_expert_intermediate_size)
    if cfg.family in ("qwen2_moe", "qwen3_moe"):
        dense = [l for l in range(cfg.num_layers) if not cfg.is_moe_layer(l)]
        d.update(mlp_only_layers=dense, decoder_sparse_step=1, use_sliding_window=False)
    if cfg.family in ("qwen3_moe", "olmoe"):
        d["attention_bias"] = cfg.o_bias
    if cfg.family == "olmoe":
        d["clip_qkv"] = cfg.clip_qkv
    return d


def export_preset(name: str, seed: int, cfg: ModelConfig, root: Path) -> Path:
    """Materialise (once) preset `name` with `seed` as an fp32 checkpoint under root; return its dir."""
    path = Path(root) / f"{name}-L{cfg.num_layers}-seed{seed}"
    if (path / "config.json").is_file():
        return path
    src = TensorSource(cfg, None, seed)
    D, H, K, hd, V, I = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size,
                         cfg.moe_intermediate_size)
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for i in range(cfg.num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        shapes.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                       a + "q_proj.weight": (H * hd, D), a + "k_proj.weight": (K * hd, D),
                       a + "v_proj.weight": (K * hd, D), a + "o_proj.weight": (D, H * hd)})
        if cfg.qkv_bias:
            shapes.update({a + "q_proj.bias": (H * hd,), a + "k_proj.bias": (K * hd,), a + "v_proj.bias": (K * hd,)})
        if cfg.o_bias:
            shapes[a + "o_proj.bias"] = (D,)
        if cfg.qk_norm != "none":
            full = cfg.qk_norm == "full"
            shapes.update({a + "q_norm.weight": (H * hd if full else hd,), a + "k_norm.weight": (K * hd if full else hd,)})
        if cfg.is_moe_layer(i):
            shapes[f"{moe_prefix(cfg, i)}.gate.weight"] = (cfg.n_experts, D)
            if cfg.shared_expert_intermediate_size:
                S, m = cfg.shared_expert_intermediate_size, p + "mlp.shared_expert."
                shapes.update({m + "gate_proj.weight": (S, D), m + "up_proj.weight": (S, D),
                               m + "down_proj.weight": (D, S), p + "mlp.shared_expert_gate.weight": (1, D)})
        else:
            m = p + "mlp."
            II = cfg.intermediate_size
            shapes.update({m + "gate_proj.weight": (II, D), m + "up_proj.weight": (II, D), m + "down_proj.weight": (D, II)})
    if cfg.tie_word_embeddings:
        del shapes["lm_head.weight"]
    tensors = {n: src.get(n, s, torch.float32).contiguous() for n, s in shapes.items()}
    buf = torch.empty(cfg.expert_params)
    for i in cfg.moe_layers:
        for e in range(cfg.n_experts):
            src.expert_into(i, e, buf)
            gate, up, down = expert_names(cfg, i, e)
            tensors[gate] = buf[: I * D].view(I, D).clone()
            tensors[up] = buf[I * D: 2 * I * D].view(I, D).clone()
            tensors[down] = buf[2 * I * D:].view(D, I).clone()
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, tmp / "model.safetensors")
    (tmp / "config.json").write_text(json.dumps(hf_config(cfg), indent=2))
    tmp.rename(path)
    return path
