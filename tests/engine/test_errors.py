"""Bad input gets a clear error, before anything is allocated, and nothing half-built stays."""
from __future__ import annotations

import gc
import json
import re
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import Engine
from engine.checkpoint import MissingTensorError
from engine.model import MoEModel
from engine.planner import PlanError, plan_memory
from engine.config import UnsupportedModelError, preset
from engine.registry import UnknownPluginError


def live_models() -> int:
    gc.collect()
    # type(o), not isinstance: isinstance reads o.__class__, which on some lazy module proxies
    # among gc's objects (torch.distributed.reduce_op) raises a FutureWarning
    return sum(issubclass(type(o), MoEModel) for o in gc.get_objects())


def test_unknown_architecture_names_supported(tmp_path, tiny_mixtral_dir):
    d = shutil.copytree(tiny_mixtral_dir, tmp_path / "llama")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["LlamaForCausalLM"], "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM.*MixtralForCausalLM.*OlmoeForCausalLM"):
        Engine.from_pretrained(d, device="cpu")


def test_missing_tensor_is_named_and_nothing_left(tmp_path, tiny_mixtral_dir):
    d = shutil.copytree(tiny_mixtral_dir, tmp_path / "missing")
    sd = load_file(d / "model.safetensors")
    del sd["model.layers.2.block_sparse_moe.experts.5.w2.weight"]
    save_file(sd, d / "model.safetensors")
    before = live_models()
    with pytest.raises(MissingTensorError, match=r"model\.layers\.2\.block_sparse_moe\.experts\.5\.w2\.weight"):
        Engine.from_pretrained(d, device="cpu", placement="fetch", cache_capacity=4)
    assert live_models() == before


def test_missing_attention_tensor(tmp_path, tiny_mixtral_dir):
    d = shutil.copytree(tiny_mixtral_dir, tmp_path / "missing_attn")
    sd = load_file(d / "model.safetensors")
    del sd["model.layers.1.self_attn.k_proj.weight"]
    save_file(sd, d / "model.safetensors")
    with pytest.raises(MissingTensorError, match="model.layers.1.self_attn.k_proj.weight"):
        Engine.from_pretrained(d, device="cpu")


@pytest.mark.parametrize("capacity", [0, 1, 9])
def test_capacity_out_of_range(capacity):
    with pytest.raises(ValueError, match=r"cache_capacity must be in \[top_k=2, n_experts=8\].*got " + str(capacity)):
        Engine.from_pretrained("tiny-mixtral", device="cpu", placement="fetch", cache_capacity=capacity)


def test_fetch_without_capacity():
    with pytest.raises(ValueError, match="needs cache_capacity"):
        Engine.from_pretrained("tiny-mixtral", device="cpu", placement="fetch")


def test_unknown_placement_lists_known():
    with pytest.raises(UnknownPluginError, match="unknown placement 'fetcher'; known: cpu, fetch, hybrid, resident, resident_grouped, stream"):
        Engine.from_pretrained("tiny-mixtral", device="cpu", placement="fetcher")


def test_unknown_policy_lists_known():
    with pytest.raises(UnknownPluginError, match="unknown cache policy 'mru'.*belady, fifo, lfru, lfu, lru, static"):
        Engine.from_pretrained("tiny-mixtral", device="cpu", placement="fetch", cache_capacity=2, cache_policy="mru")


def test_unknown_placement_option():
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['n_cpu_layer'\]; allowed: \['n_cpu_layers', 'cpu_layers', 'working_set_trace'\]"):
        Engine.from_pretrained("tiny-mixtral", device="cpu", placement="hybrid", n_cpu_layer=2)


def test_unknown_source_lists_presets():
    with pytest.raises(ValueError, match="neither a checkpoint directory.*tiny-mixtral"):
        Engine.from_pretrained("tiny-mixtrel", device="cpu")


def test_plan_over_budget_shows_arithmetic():
    before = live_models()
    with pytest.raises(PlanError) as err:
        Engine.from_pretrained("tiny-mixtral", device="cpu", placement="resident", device_memory="6MiB")
    msg = str(err.value)
    for part in ("non-expert weights", "KV cache (4 layers, 1 x 4096 tokens)", "experts [resident]", "= total", "budget",
                 "6.00 MiB"):
        assert part in msg
    assert live_models() == before


def test_a_session_above_the_planned_batch_is_refused_under_a_budget():
    """Its KV and activations scale with the batch: a budgeted engine planned for batch 1 would run
    two sequences on room for one (the ledger refuses only once it runs out, mid-pass)."""
    eng = Engine.from_pretrained("tiny-mixtral", device="cpu", placement="resident", device_memory="64MiB",
                                 max_context=600)
    with pytest.raises(ValueError, match="a session of batch 2 but the engine was planned for batch=1"):
        eng.new_session(2)
    with pytest.raises(ValueError, match="planned for batch=1"):
        eng.generate([[1, 2, 3], [4, 5, 6]], 2)
    eng.new_session(1).close()
    planned = Engine.from_pretrained("tiny-mixtral", device="cpu", placement="resident", device_memory="64MiB",
                                     max_context=600, batch=2)
    planned.generate([[1, 2, 3], [4, 5, 6]], 2)                  # planned for it: runs


def test_every_positions_logits_are_refused_under_a_budget_unless_planned():
    """prefill(all_logits=True) keeps [B, T, V] logits on the device, far above the last position's
    [B, V] the plan otherwise holds: a budgeted engine runs it only when planned for it
    (all_logits=True), one micro-batch per call; without a budget nothing is promised."""
    kw = dict(device="cpu", placement="resident", max_context=64, ubatch=8, model_overrides={"vocab_size": 8192})
    eng = Engine.from_pretrained("tiny-mixtral", device_memory="64MiB", **kw)
    sess = eng.new_session(1)
    with pytest.raises(ValueError, match="no room for them; build it with .*all_logits=True"):
        eng.prefill(sess, [[1] * 8], all_logits=True)
    assert sess.length == 0                                       # refused before anything ran
    planned = Engine.from_pretrained("tiny-mixtral", device_memory="64MiB", all_logits=True, **kw)
    assert planned.plan.activations > eng.plan.activations and planned.plan.all_logits
    assert "activations (micro-batch, all logits)" in str(planned.plan)
    sess = planned.new_session(1)
    assert planned.prefill(sess, [list(range(1, 9))], all_logits=True).shape == (1, 8, planned.cfg.vocab_size)
    with pytest.raises(ValueError, match=r"of 9 tokens .* one micro-batch's \(ubatch=8\): call it once per 8"):
        planned.prefill(sess, [[1] * 9], all_logits=True)
    free = Engine.from_pretrained("tiny-mixtral", **kw)            # no budget: the whole prompt's, in one call
    whole = free.prefill(free.new_session(1), [list(range(1, 20))], all_logits=True)
    assert whole.shape == (1, 19, free.cfg.vocab_size)


def test_auto_capacity_shrinks_with_context():
    """A longer context leaves fewer expert slots: KV (and the attention workspace over it)
    versus residency."""
    caps = []
    for ctx in (512, 2048, 4096):
        eng = Engine.from_pretrained("tiny-mixtral", device="cpu", placement="fetch", cache_capacity="auto",
                                     device_memory="20MiB", max_context=ctx)
        caps.append(eng.plan.capacity)
    assert caps == sorted(caps, reverse=True) and caps[0] > caps[-1] >= 2
    with pytest.raises(PlanError, match="fewer than top_k=2"):
        Engine.from_pretrained("tiny-mixtral", device="cpu", placement="fetch", cache_capacity="auto",
                               device_memory="20MiB", max_context=6144)


def test_presets_plan_at_real_shapes():
    plan = plan_memory(preset("mixtral-8x7b"), "fetch", "auto", 40 << 30, 4096, 1, 512, 2)
    assert 2 <= plan.capacity < 8
    assert plan.non_expert < plan.total <= 40 << 30
    for name in ("qwen3-30b-a3b", "olmoe-1b-7b", "qwen1.5-moe-a2.7b"):
        assert plan_memory(preset(name), "resident", None, None, 4096, 1, 512, 2).experts > 0


def test_prompt_validation():
    eng = Engine.from_pretrained("tiny-mixtral", device="cpu")
    with pytest.raises(ValueError, match="equal lengths"):
        eng.generate([[1, 2], [3]], 2)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 512\)"):
        eng.generate([[1, 600]], 2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.generate([[1]], 0)


@pytest.mark.parametrize("placement, kw", [("resident", {}), ("fetch", {"cache_capacity": 4})])
def test_an_engine_that_ran_frees_its_store_and_cache_when_dropped(placement, kw):
    """The memoised row and matrix aliases (engine.layers.memo) hold no reference cycle through
    C++: once an engine that ran forward passes is closed and dropped, its expert store and cache
    slots are freed (they were kept alive for the life of the process)."""
    import weakref
    eng = Engine.from_pretrained("tiny-mixtral", device="cpu", max_context=64, placement=placement, **kw)
    held = [weakref.ref(t) for t in eng.model.store.rows.values()]
    if eng.placement.cache is not None:
        held += [weakref.ref(t) for t in eng.placement.cache.slots.values()]
    assert held
    eng.generate([[1, 2, 3]], 3)
    eng.close()
    del eng
    gc.collect()
    assert [r() is None for r in held] == [True] * len(held)


@pytest.mark.parametrize("name, ubatch", [("tiny-mixtral", 8), ("tiny-gpt-oss", 64), ("tiny-qwen3-next", 64)])
def test_context_past_the_plan_is_refused_before_any_state_changes(name, ubatch):
    """A prefill, a decode step or a generate turn that would pass max_context is refused up front:
    no micro-batch appended (several chunks), no sliding-window KV or recurrent state advanced (one
    chunk, gpt-oss and qwen3-next), no decoded tokens kept; the next turn is exactly a clean one's."""
    eng = Engine.from_pretrained(name, device="cpu", max_context=32, ubatch=ubatch)
    V = eng.cfg.vocab_size
    p1, p2 = [[(i * 7 + 3) % V for i in range(10)]], [[(i * 5 + 1) % V for i in range(6)]]
    clean = eng.new_session(1)
    eng.prefill(clean, p1)
    ref = eng.prefill(clean, p2)
    sess = eng.new_session(1)
    eng.prefill(sess, p1)
    with pytest.raises(ValueError, match="planned for max_context=32"):
        eng.prefill(sess, [[1] * 30])
    with pytest.raises(ValueError, match="planned for max_context=32"):
        eng.generate([[1] * 4], 30, session=sess)
    assert sess.length == 10 and sess.pending is None
    assert torch.equal(eng.prefill(sess, p2), ref)
    full = eng.new_session(1)
    eng.prefill(full, [[1] * 32])
    with pytest.raises(ValueError, match="planned for max_context=32"):
        eng.decode_step(full, [1])
    assert full.length == 32


def test_bad_arguments_are_refused_with_their_name():
    eng = Engine.from_pretrained("tiny-mixtral", device="cpu", max_context=64)
    for bad in ([[3.7, 9.2]], [[True, False]], [[[1, 2]]], [["1"]]):
        with pytest.raises(ValueError, match="token ids must be integers"):
            eng.generate(bad, 2)
    assert eng.generate([[int(np.int64(3)), np.int64(9)]], 2).tokens == eng.generate([[3, 9]], 2).tokens
    for batch in (0, -1, 1.5):
        with pytest.raises(ValueError, match="batch must be an integer >= 1"):
            eng.new_session(batch)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer"):
        eng.generate([[1]], 2.5)
    for kw, name in (({"max_context": 0}, "max_context"), ({"max_context": -8}, "max_context"),
                     ({"ubatch": 2.5}, "ubatch"), ({"batch": 0}, "batch")):
        with pytest.raises(ValueError, match=f"{name} must be an integer >= 1"):
            Engine.from_pretrained("tiny-mixtral", device="cpu", **kw)
    eng.close()
    eng.close()                                   # a second close does nothing
    for call in (lambda: eng.generate([[1, 2]], 2), eng.reset, lambda: eng.new_session(1)):
        with pytest.raises(RuntimeError, match="engine is closed"):
            call()


@pytest.mark.parametrize("name, change, match", [
    ("model.layers.2.block_sparse_moe.experts.5.w1.weight", lambda t: t[:1], r"has shape \(1, \d+\), config implies"),
    ("model.layers.2.block_sparse_moe.experts.5.w1.weight", lambda t: t.t().contiguous(), "config implies"),
    ("model.layers.2.block_sparse_moe.experts.5.w2.weight", lambda t: t.to(torch.int32), "stored as torch.int32"),
    ("model.layers.1.self_attn.q_proj.weight", lambda t: t.to(torch.int64), "stored as torch.int64"),
])
def test_a_wrong_weight_is_named_not_broadcast_or_cast(tmp_path, tiny_mixtral_dir, name, change, match):
    """An expert matrix of the wrong shape used to load broadcast (one row copied over all of them)
    or fail unnamed; integer weights were cast to floats. Each is now refused, by name and file."""
    d = shutil.copytree(tiny_mixtral_dir, tmp_path / "bad")
    sd = load_file(d / "model.safetensors")
    sd[name] = change(sd[name])
    save_file(sd, d / "model.safetensors")
    with pytest.raises(ValueError, match=re.escape(repr(name)) + " in model.safetensors .*" + match):
        Engine.from_pretrained(d, device="cpu", placement="fetch", cache_capacity=4)


def test_a_sharded_index_without_its_map_is_named(tmp_path, tiny_mixtral_dir):
    d = shutil.copytree(tiny_mixtral_dir, tmp_path / "idx")
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="no 'weight_map'"):
        Engine.from_pretrained(d, device="cpu")


def test_a_pass_on_an_offloaded_session_is_refused_before_anything_counts():
    eng = Engine.from_pretrained("tiny-mixtral", device="cpu", placement="fetch", cache_capacity=4,
                                 prefetch="next_layer_gate", max_context=64)
    clean, sess = eng.new_session(1), eng.new_session(1)
    for s in (clean, sess):
        eng.prefill(s, [[1, 2, 3, 4]])
    sess.offload()
    before, step = eng.counters, eng.model.prefetcher.step
    for call in (lambda: eng.prefill(sess, [[5, 6]]), lambda: eng.decode_step(sess, [5])):
        with pytest.raises(RuntimeError, match=r"restore\(\) first"):
            call()
    assert eng.counters == before and sess.length == 4
    assert eng.model.prefetcher.step == step        # a trace_oracle's replay stays in step with the passes
    sess.restore()
    assert torch.equal(eng.prefill(sess, [[5, 6]]), eng.prefill(clean, [[5, 6]]))
