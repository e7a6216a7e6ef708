"""kv_dtype, the engine side: the planner counts the stored bytes (payload + scales) of each
treatment, auto capacity grows when the KV shrinks, offload/restore move exactly the stored
tensors' bytes, the fast read path equals the slow reference path, exact stays bitwise
exact, and state kinds that cannot be quantised refuse by name."""
from __future__ import annotations

import pytest
import torch

from engine import Engine
from engine.config import preset
from engine.kv import FullKV, SlidingKV, nbytes_of
from engine.kvquant import KVFormatError
from engine.planner import plan_memory

# tiny-mixtral: 4 layers, 2 KV heads of head_dim 16 (one 16-value block per head), float32
PER_TOKEN_PER_LAYER = {
    "model": 2 * 2 * 16 * 4,             # K and V, 2 heads, 16 fp32 values
    "f16": 2 * 2 * 16 * 2,
    "bf16": 2 * 2 * 16 * 2,
    "q8": 2 * 2 * (16 + 2),              # 16 int8 codes + one float16 scale
    "fp8": 2 * 2 * (16 + 2),
    "q4": 2 * 2 * (8 + 2),               # 16 codes packed two per byte + one float16 scale
}


@pytest.mark.parametrize("kv_dtype", list(PER_TOKEN_PER_LAYER))
def test_planner_counts_stored_bytes(kv_dtype):
    cfg = preset("tiny-mixtral")
    plan = plan_memory(cfg, "resident", None, None, context=1000, batch=3, ubatch=64, dtype_bytes=4,
                       device_kind="cpu", kv_dtype=kv_dtype)
    assert plan.kv == 4 * 3 * 1000 * PER_TOKEN_PER_LAYER[kv_dtype]
    assert cfg.kv_bytes_per_token(4, kv_dtype) == 4 * PER_TOKEN_PER_LAYER[kv_dtype]
    assert (kv_dtype in plan.lines()[1]) == (kv_dtype != "model")      # the printout names the format


def test_auto_capacity_grows_when_kv_shrinks():
    # 16 layers, so the whole KV (every layer) outweighs one layer's dequantised read-back
    cfg = preset("tiny-mixtral").replace(num_layers=16, moe_layers=tuple(range(16)))
    caps, plans = {}, {}
    for kv in ("model", "f16", "q8", "q4"):
        plans[kv] = plan_memory(cfg, "fetch", "auto", 24 << 20, context=4096, batch=1, ubatch=64, dtype_bytes=4,
                                device_kind="cpu", kv_dtype=kv)
        caps[kv] = plans[kv].capacity
    assert caps["model"] < caps["f16"] < caps["q8"] <= caps["q4"] == cfg.n_experts, caps
    assert plans["q8"].kv < plans["f16"].kv < plans["model"].kv
    assert plans["q8"].attention > plans["model"].attention          # the read-back transient is planned


@pytest.mark.parametrize("kv_dtype", ["q8", "q4", "f16"])
def test_offload_restore_bytes_are_the_stored_tensors(kv_dtype):
    eng = Engine.from_pretrained("tiny-mixtral", device="cpu", max_context=64, kv_dtype=kv_dtype)
    sess = eng.new_session(1)
    eng.generate([list(range(1, 20))], 4, session=sess)
    stored = sum(nbytes_of(st.snapshot(sess.length)) for st in sess.states)
    assert stored == sess.length * 4 * PER_TOKEN_PER_LAYER[kv_dtype]
    assert sess.nbytes == eng.plan.kv                          # allocated = planned
    eng.reset_counters()
    sess.offload()
    assert eng.counters["d2h_kv_bytes"] == stored
    sess.restore()
    assert eng.counters["h2d_kv_bytes"] == stored
    sess.close()
    eng.close()


def _logits(eng: Engine, prompt: list[int], reference: bool) -> list[torch.Tensor]:
    sess = eng.new_session(1)
    for st in sess.states:
        st.reference = reference
    res = eng.generate([prompt], 5, session=sess)
    sess.close()
    return res.logits


@pytest.mark.parametrize("model", ["tiny-mixtral", "tiny-gpt-oss"])    # FullKV; SlidingKV (window 8) beside FullKV
@pytest.mark.parametrize("kv_dtype", ["q8", "q4", "fp8"])
def test_fast_read_equals_reference_read(model, kv_dtype):
    eng = Engine.from_pretrained(model, device="cpu", max_context=64, ubatch=7, kv_dtype=kv_dtype)
    assert any(isinstance(s, SlidingKV) for s in eng.new_session(1).states) == (model == "tiny-gpt-oss")
    prompt = [(7 * i + 3) % 500 for i in range(23)]
    fast, ref = _logits(eng, prompt, False), _logits(eng, prompt, True)
    assert all(torch.equal(a, b) for a, b in zip(fast, ref))
    exact = Engine.from_pretrained(model, device="cpu", max_context=64, ubatch=7)
    assert max((a - b).abs().max().item() for a, b in zip(fast, _logits(exact, prompt, False))) > 0   # it is lossy
    eng.close(), exact.close()


def test_exact_kv_dtype_is_bitwise_the_default():
    prompt = list(range(5, 30))
    default = Engine.from_pretrained("tiny-mixtral", device="cpu", max_context=64)
    same = Engine.from_pretrained("tiny-mixtral", device="cpu", max_context=64, kv_dtype="model")
    assert all(torch.equal(a, b) for a, b in zip(_logits(default, prompt, False), _logits(same, prompt, False)))
    assert not same.lossy and Engine.from_pretrained("tiny-mixtral", device="cpu", max_context=64,
                                                     kv_dtype="f16").lossy
    f16 = Engine.from_pretrained("tiny-mixtral", device="cpu", max_context=64, dtype="float16", kv_dtype="f16")
    assert not f16.lossy and isinstance(f16.new_session(1).states[0], FullKV)


@pytest.mark.parametrize("model,kind", [("tiny-deepseek", "MLA latent"), ("tiny-qwen3-next", "recurrent DeltaNet")])
def test_other_state_kinds_refuse_by_name(model, kind):
    with pytest.raises(KVFormatError, match=f"kv_dtype='q8'.*{kind}.*allowed for this model: kv_dtype='model'"):
        Engine.from_pretrained(model, device="cpu", max_context=64, kv_dtype="q8")


def test_bad_kv_dtype_is_refused_before_loading():
    with pytest.raises(KVFormatError, match=r"kv_dtype must be one of \['model', 'f16', 'bf16', 'q8', 'q4', 'fp8'\], "
                                            r"got 'q2'"):
        Engine.from_pretrained("tiny-mixtral", device="cpu", kv_dtype="q2")


@pytest.mark.parametrize("tokens,batch,dtype,kv_dtype,overrides", [
    (1, 2, "float32", "q8", None),                               # a decode step
    (256, 1, "float32", "q4", None),
    (256, 2, "bfloat16", "q8", None),
    (128, 1, "float32", "f16", None),
    (256, 2, "float32", "fp8", {"sliding_window": 32}),           # bounded state: parts concatenated, then read
])
def test_planned_transient_bounds_the_dequantised_read(tokens, batch, dtype, kv_dtype, overrides):
    from tests.engine.test_planner_memory import measured_and_planned

    peak, planned = measured_and_planned("cpu", tokens, batch, dtype, {"kv_dtype": kv_dtype}, overrides)
    assert 0 < peak <= planned <= 3 * peak, (peak, planned)


@pytest.mark.parametrize("kv_dtype", ["q8", "q4", "f16"])
def test_planned_transient_bounds_a_decode_step_reading_a_long_quantised_kv(kv_dtype):
    """A decode step at 2048 tokens: its transient is mostly the dequantised keys and values,
    which only `kv_read_bytes` plans for (the step's own tensors are a few KiB)."""
    from harness.measure import transient_peak

    S = 2048
    eng = Engine.from_pretrained("tiny-mixtral", device="cpu", ubatch=512, max_context=S + 1, kv_dtype=kv_dtype)
    sess = eng.new_session(1)
    eng.prefill(sess, [[(5 * i) % 512 for i in range(S)]])
    peak = transient_peak("cpu", lambda: eng.decode_step(sess, [7]))
    # the engine's plan is for ubatch-token chunks; the planner for a one-token pass
    plan = plan_memory(eng.cfg, "resident", None, None, S + 1, 1, 1, 4, device_kind="cpu", kv_dtype=kv_dtype)
    dequantised = 2 * 2 * S * 16 * 4                            # K and V, 2 heads x 16 dims, fp32
    assert peak >= dequantised
    assert peak <= plan.transient <= 3 * peak, (peak, plan.transient)


@pytest.mark.parametrize("model", ["tiny-mixtral", "tiny-gpt-oss"])
def test_displacement_of_a_quantised_kv_changes_nothing(model):
    """Offload and restore move the stored codes and scales as they are: the next turn's logits
    equal those of a session that never left the device."""
    eng = Engine.from_pretrained(model, device="cpu", max_context=96, ubatch=16, kv_dtype="q4")
    turn1, turn2 = [list(range(3, 40))], [list(range(50, 70))]
    out = []
    for displace in (False, True):
        sess = eng.new_session(1)
        eng.generate(turn1, 3, session=sess)
        if displace:
            sess.offload()
            sess.restore()
        out.append(eng.generate(turn2, 4, session=sess).logits)
        sess.close()
    assert all(torch.equal(a, b) for a, b in zip(*out))
    eng.close()
