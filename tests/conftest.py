"""Shared fixtures: tiny real Hugging Face checkpoints built with transformers' own config
classes and `save_pretrained` (no hub access), one per family and format."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "glm4_moe", "gpt_oss", "qwen3_next",
            "qwen3_5_moe", "gemma4")
SIGMOID_ROUTED = ("deepseek_v3", "glm4_moe")
ROUTERS = ("mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.router.weight", "router.proj.weight")
COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, max_position_embeddings=512, tie_word_embeddings=False)


def hf_model(family: str, seed: int = 0, **options):
    """A tiny random transformers model of `family` (config `options` on top), router weights
    scaled up so that near-ties never decide the top-k set."""
    import transformers as tf

    torch.manual_seed(seed)
    if family == "mixtral":
        cfg = tf.MixtralConfig(**COMMON, num_local_experts=8, intermediate_size=96, rope_theta=1e6, **options)
        model = tf.MixtralForCausalLM(cfg)
    elif family == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**COMMON, num_experts=8, moe_intermediate_size=48, intermediate_size=80,
                                shared_expert_intermediate_size=72, norm_topk_prob=False, mlp_only_layers=[1],
                                **options)
        model = tf.Qwen2MoeForCausalLM(cfg)
    elif family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**COMMON, num_experts=8, moe_intermediate_size=48, intermediate_size=80,
                                head_dim=24, norm_topk_prob=True, decoder_sparse_step=1, **options)
        model = tf.Qwen3MoeForCausalLM(cfg)
    elif family == "olmoe":
        cfg = tf.OlmoeConfig(**COMMON, num_experts=8, intermediate_size=48, clip_qkv=0.15, norm_topk_prob=False,
                             **options)
        model = tf.OlmoeForCausalLM(cfg)
    elif family == "deepseek_v3":   # MLA with a q bottleneck, YaRN, 2 of 4 groups, a dense layer, a shared expert
        kw = dict(n_routed_experts=16, n_group=4, topk_group=2, moe_intermediate_size=32, intermediate_size=96,
                  n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, q_lora_rank=24,
                  kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1,
                                   "mscale": 1.0, "mscale_all_dim": 1.0})
        cfg = tf.DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4, **kw, **options})
        model = tf.DeepseekV3ForCausalLM(cfg)
    elif family == "glm4_moe":      # partial rotary, q/k norm, biases, 2 of 4 groups, a dense layer, a shared expert
        kw = dict(head_dim=24, n_routed_experts=16, n_group=4, topk_group=2, moe_intermediate_size=32,
                  intermediate_size=96, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                  use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5)
        cfg = tf.Glm4MoeConfig(**{**COMMON, **kw, **options})
        model = tf.Glm4MoeForCausalLM(cfg)
    elif family == "gpt_oss":   # alternating sliding (a 4-token window, shorter than the prompts) and full layers
        cfg = tf.GptOssConfig(**{**COMMON, "num_hidden_layers": 4}, num_local_experts=8, intermediate_size=64,
                              head_dim=16, **{"sliding_window": 4, **options})
        model = tf.GptOssForCausalLM(cfg)
    elif family in ("qwen3_next", "qwen3_5_moe"):   # three gated-DeltaNet layers, then a full one
        hybrid = dict(num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48, head_dim=16,
                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12)
        if family == "qwen3_next":
            cfg = tf.Qwen3NextConfig(**{**COMMON, "num_hidden_layers": 4}, **hybrid, intermediate_size=80,
                                     mlp_only_layers=[1], **options)
            model = tf.Qwen3NextForCausalLM(cfg)
        else:
            cfg = tf.Qwen3_5MoeTextConfig(**{**COMMON, "num_hidden_layers": 4}, **hybrid, **options)
            model = tf.Qwen3_5MoeForCausalLM(cfg)
    elif family == "gemma4":   # the MoE text model; per-layer inputs on; global layers with their own head shape
        cfg = tf.Gemma4TextConfig(**{**COMMON, "num_hidden_layers": 4}, head_dim=16, global_head_dim=32,
                                  num_global_key_value_heads=1, attention_k_eq_v=True, intermediate_size=48,
                                  enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=24,
                                  sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2,
                                  final_logit_softcapping=30.0, hidden_size_per_layer_input=8,
                                  vocab_size_per_layer_input=128, **options)
        model = tf.Gemma4ForCausalLM(cfg)
    else:
        raise ValueError(family)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(ROUTERS):
                p.normal_(0.0, 2.0)
            elif "norm" in name or name.endswith("scale"):  # non-trivial so a misplaced norm or scale shows up
                p.uniform_(0.5, 1.5)
            elif name.endswith(("bias", "sinks")) and family == "gpt_oss":   # zero-initialised there
                p.normal_(0.0, 0.5)
        if family in SIGMOID_ROUTED:   # sigmoid scores spread over (0, 1), never saturated into ties at 1.0,
            for layer in model.model.layers:      # and a correction bias that really changes the choice
                gate = getattr(layer.mlp, "gate", None)
                if gate is not None and hasattr(gate, "e_score_correction_bias"):
                    gate.weight.normal_(0.0, 0.4)
                    gate.e_score_correction_bias.normal_(0.0, 0.3)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
    return model.eval()


def install_entry_point(tmp_path: Path, monkeypatch, module: str, source: str, group: str, name: str,
                        target: str) -> None:
    """An installed-looking distribution: `module` (with `source`) on sys.path and a dist-info
    declaring the entry point `name = target` in `group` (what `pip install` of a plugin leaves)."""
    (tmp_path / f"{module}.py").write_text(source)
    dist = tmp_path / f"{module}-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{group}]\n{name} = {target}\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def save(model, path: Path, **kw) -> Path:
    model.save_pretrained(path, **kw)
    return path


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict[str, tuple[object, Path]]:
    """family -> (transformers model in fp32, checkpoint dir saved in fp32)."""
    out = {}
    for fam in FAMILIES:
        m = hf_model(fam)
        out[fam] = (m, save(m, tmp_path_factory.mktemp(fam)))
    return out


@pytest.fixture(scope="session")
def tiny_mixtral_dir(hf_checkpoints) -> Path:
    return hf_checkpoints["mixtral"][1]


def rewrite_config_old_hub_form(path: Path) -> None:
    """Turn a current-form config.json into the older Hub form (rope_theta at top level,
    rope_scaling, torch_dtype instead of dtype)."""
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.pop("rope_parameters", None) or {}
    cfg["rope_theta"] = rope.get("rope_theta", 10000.0)
    cfg["rope_scaling"] = None
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


def pytest_collection_modifyitems(config, items):
    """Tests marked `slow` (the CLI in subprocesses, notebooks, multi-second runs) first, each group
    in its collection order: pytest-xdist hands tests out in this order, so the long ones start at
    once and the short ones fill the end, instead of a long one running alone after every other
    test is done."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    if workers > 1:
        alone = pytest.mark.skip(reason=f"needs the machine to itself, not {workers} pytest workers: `make test` "
                                        "runs it after the rest (pytest -m alone)")
        for item in items:
            if item.get_closest_marker("alone"):
                item.add_marker(alone)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Every test skipped for a missing llama.cpp build reports the skip at tests/llamacpp/conftest.py,
    so `-ra` folds them into one summary line that says how to include them (pytest would name
    each test's own line: one summary line per test)."""
    try:
        from tests.llamacpp import conftest as llamacpp
    except ImportError:             # llama.cpp's plugin package and its tests removed: nothing to fold
        llamacpp = None

    report = yield
    if llamacpp is not None and report.skipped and isinstance(report.longrepr, tuple) \
            and llamacpp.SKIP_REASON in report.longrepr[2]:
        report.longrepr = (llamacpp.__file__, None, report.longrepr[2])
    return report


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """Tiny models are faster on one thread, and a shared 2-core box stays responsive;
    subprocess tests (the CLI) keep torch's default."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
