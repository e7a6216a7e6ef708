"""Placement maps: which layers' experts `hybrid` puts on the CPU (first_n, last_n, by a routing
trace's per-layer working set), the per-layer letters every row carries, and the same output as
resident whichever layers go (the invariant; tests/engine/test_invariant.py runs first_n and last_n
through every session shape)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import Engine
from engine.config import preset
from engine.placements.hybrid import HybridOptions, cpu_layer_set, working_set_ranking
from engine.registry import PLACEMENTS
from engine.trace import distinct_per_pass, load_trace, save_trace
from engine.trace_recorder import TraceRecorder

MODEL = "tiny-mixtral"          # 4 MoE layers, 8 experts, top-2


def layer_map(model: str, placement: str, **options) -> str:
    cfg = preset(model)
    return PLACEMENTS.get(placement).traits(cfg, options).layer_map(cfg)


def test_first_n_and_last_n_letters():
    assert layer_map(MODEL, "hybrid", n_cpu_layers=1) == "CGGG"
    assert layer_map(MODEL, "hybrid", n_cpu_layers=1, cpu_layers="last_n") == "GGGC"
    assert layer_map(MODEL, "hybrid", n_cpu_layers=0) == "GGGG"
    assert layer_map(MODEL, "resident") == "GGGG"
    assert layer_map(MODEL, "cpu") == "CCCC"
    assert layer_map(MODEL, "fetch") == "FFFF"


def test_a_dense_layer_is_a_dash():
    """DeepSeek-V3's first dense layers have no experts; first_n counts them as llama.cpp does."""
    cfg = preset("tiny-deepseek")
    dense = [i for i in range(cfg.num_layers) if i not in cfg.moe_layers]
    assert dense, "the tiny DeepSeek preset keeps a dense first layer"
    got = PLACEMENTS.get("hybrid").traits(cfg, {"n_cpu_layers": 1, "cpu_layers": "last_n"}).layer_map(cfg)
    assert all(got[i] == "-" for i in dense) and got.endswith("C") and got.count("C") == 1


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    eng = Engine.from_pretrained(MODEL, device="cpu")
    rec = TraceRecorder(eng)
    eng.generate([list(range(3, 40))], 4)
    return save_trace(tmp_path_factory.mktemp("trace") / "routing.npz", rec.trace())


def test_by_working_set_picks_the_layers_with_fewest_distinct_experts(trace_path):
    cfg = preset(MODEL)
    _, prefill = distinct_per_pass(load_trace(trace_path))
    want = [layer for _, layer in sorted(zip(prefill.tolist(), cfg.moe_layers))]
    assert working_set_ranking(cfg, str(trace_path)) == want
    got = cpu_layer_set(cfg, HybridOptions(2, "by_working_set", str(trace_path)))
    assert got == frozenset(want[:2])


def test_by_working_set_gives_resident_output(trace_path):
    prompt = [list(range(5, 30))]
    ref = Engine.from_pretrained(MODEL, device="cpu").generate(prompt, 4)
    eng = Engine.from_pretrained(MODEL, device="cpu", placement="hybrid", n_cpu_layers=2,
                                 cpu_layers="by_working_set", working_set_trace=str(trace_path))
    out = eng.generate(prompt, 4)
    assert out.tokens == ref.tokens
    assert all(torch.allclose(a, b, atol=1e-5, rtol=0) for a, b in zip(out.logits, ref.logits))


def test_bad_maps_are_refused(trace_path, tmp_path):
    with pytest.raises(ValueError, match="needs working_set_trace"):
        HybridOptions(1, "by_working_set")
    with pytest.raises(ValueError, match="allowed first_n, last_n, by_working_set"):
        HybridOptions(1, "middle")
    other = load_trace(trace_path)
    foreign = save_trace(tmp_path / "other.npz", type(other)(other.experts, {**other.meta, "n_experts": 16},
                                                            step=other.step, sequence=other.sequence))
    with pytest.raises(ValueError, match="not the model's"):
        working_set_ranking(preset(MODEL), str(foreign))


def test_distinct_per_pass_splits_decode_from_prefill(trace_path):
    decode, prefill = distinct_per_pass(load_trace(trace_path))
    assert np.all((decode >= 1) & (decode <= 2))          # one token: at most top-k experts
    assert np.all((prefill > 2) & (prefill <= 8))          # 37 tokens over 8 experts
