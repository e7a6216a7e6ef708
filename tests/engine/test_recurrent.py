"""Linear attention with a recurrent state (Qwen3-Next, Qwen3.5-MoE) against transformers' torch
path (`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`, `causal_conv1d_*`: the
fallbacks it runs without fla / causal-conv1d): the two forms of the recurrence, the conv, the
gated norm, prompts spanning several chunks and micro-batches, and sessions continued and restored
across turns as transformers' own cache continues them."""
from __future__ import annotations

import pytest
import torch

from engine import Engine
from engine.blocks.delta_rule import causal_conv, chunked_delta_rule, recurrent_delta_rule
from engine.blocks.deltanet import RecurrentState, gated_rms_norm
from engine.counters import Counters
from engine.devices import Device
from engine.kv import Session
from tests.conftest import hf_model, save
from tests.engine.test_hf_match import check_against_hf

TOL = 1e-4


def delta_inputs(T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, H, dk, dv = 2, 4, 8, 12
    return (torch.randn(B, T, H, dk, generator=g), torch.randn(B, T, H, dk, generator=g),
            torch.randn(B, T, H, dv, generator=g), -2 * torch.rand(B, T, H, generator=g),
            torch.rand(B, T, H, generator=g), torch.randn(B, H, dk, dv, generator=g))


@pytest.mark.parametrize("T", [1, 5, 64, 150])
def test_both_forms_match_transformers(T):
    """The step form is transformers' recurrent fallback bit for bit; the chunked form (chunks of
    64, the last one partial, not padded) its chunked fallback to fp32 rounding; the two agree."""
    from transformers.models.qwen3_next import modeling_qwen3_next as ref

    q, k, v, g, beta, s0 = delta_inputs(T)
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, s_ref = ref.torch_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    o, s = recurrent_delta_rule(q, k, v, g, beta, s0)
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)
    o_ref, s_ref = ref.torch_chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    o, s = chunked_delta_rule(q, k, v, g, beta, s0)
    assert (o - o_ref).abs().max() <= 1e-5 and (s - s_ref).abs().max() <= 1e-5
    o_step, s_step = recurrent_delta_rule(q, k, v, g, beta, s0)
    assert (o - o_step).abs().max() <= 1e-5 and (s - s_step).abs().max() <= 1e-5


def test_conv_continues_from_the_held_inputs_as_transformers_does():
    from transformers.models.qwen3_next import modeling_qwen3_next as ref

    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 10, 9, generator=g), torch.randn(10, 4, generator=g)
    out, held = causal_conv(x[..., :7], torch.zeros(2, 10, 3), w)              # a prefill from nothing
    assert torch.equal(out, ref.causal_conv1d_fn(x[..., :7], w))
    state = torch.cat((x[..., 3:4], held), dim=-1)                              # transformers keeps K inputs
    step, held = causal_conv(x[..., 7:8], held, w)                              # a decode step
    assert torch.equal(step, ref.causal_conv1d_update(x[..., 7:8], state, w))
    whole, _ = causal_conv(x, torch.zeros(2, 10, 3), w)
    assert torch.equal(torch.cat((out, step), dim=-1), whole[..., :8])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_norm_matches_transformers(dtype):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    g = torch.Generator().manual_seed(2)
    x, z, w = (torch.randn(6, 12, generator=g) * 3).to(dtype), torch.randn(6, 12, generator=g).to(dtype), \
        torch.randn(12, generator=g).to(dtype)
    ref = Qwen3NextRMSNormGated(12, eps=1e-6).to(dtype)
    ref.weight.data = w.clone()
    with torch.no_grad():
        assert torch.equal(gated_rms_norm(x, z, w, 1e-6), ref(x, z))


def test_recurrent_state_is_fixed_and_round_trips_two_dtypes():
    dev, counters = Device.create("cpu"), Counters(1)
    st = RecurrentState(dev, Session.new_label(), 2, channels=10, kernel=4, heads=3, dk=4, dv=5, dtype=torch.bfloat16)
    sess = Session(dev, counters, 2, [st], 100)
    st.reserve(1, 0)
    assert st.conv.abs().sum() == 0 and st.ssm.abs().sum() == 0                # zero: no history yet
    st.conv.copy_(torch.randn(2, 10, 3))
    st.ssm.copy_(torch.randn(2, 3, 4, 5))
    kept = [t.clone() for t in st.snapshot(17)]
    term = RecurrentState.term(10, 4, 3, 4, 5, 2)
    assert st.nbytes == term.bytes(10, 2) == term.bytes(100_000, 2) == 2 * (10 * 3 * 2 + 3 * 4 * 5 * 4)
    sess.offload()
    assert [h.dtype for h in st.host] == [torch.bfloat16, torch.float32]
    sess.restore()
    assert all(torch.equal(a, b) for a, b in zip(kept, st.snapshot(17)))
    assert counters.totals()["d2h_kv_bytes"] == counters.totals()["h2d_kv_bytes"] == st.nbytes


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    model = hf_model("qwen3_next", seed=4)
    return model, save(model, tmp_path_factory.mktemp("qwen3_next"))


@pytest.mark.parametrize("ubatch", [512, 50, 64])
def test_a_prompt_over_several_chunks_and_micro_batches(qwen3_next, ubatch):
    """150 tokens: three chunks of the prefill form; in micro-batches of 50 or 64 each continues
    the conv and delta-rule state the previous one left."""
    model, path = qwen3_next
    prompt = [[(7 * i + 3) % 128 for i in range(150)]]
    check_against_hf(model, path, ubatch=ubatch, prompt=prompt)


def hf_turns(model, turns: list[list[int]], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers continuing its own cache across turns (the last generated token fed first)."""
    from transformers import DynamicCache

    past, pending, toks, logits = DynamicCache(config=model.config), [], [], []
    with torch.no_grad():
        for turn in turns:
            ids = torch.tensor([pending + turn])
            for _ in range(steps):
                out = model(ids, past_key_values=past, use_cache=True).logits[0, -1]
                logits.append(out)
                toks.append(int(out.argmax()))
                ids = torch.tensor([[toks[-1]]])
            pending = [toks[-1]]
    return toks, logits


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_continued_and_restored_sessions_match_transformers(family, tmp_path):
    """Three turns in one session, the state displaced to host RAM and restored before the third:
    the tokens and logits of transformers continuing its cache; the restore moves the fixed state."""
    model = hf_model(family, seed=5)
    path = save(model, tmp_path / family)
    turns = [[(11 * i + 1) % 128 for i in range(20)], [5, 9, 77, 3, 12, 40, 8], [100, 2, 33]]
    ref_toks, ref_logits = hf_turns(model, turns, 4)
    eng = Engine.from_pretrained(path, device="cpu", ubatch=8)
    sess = eng.new_session(1)
    toks, logits = [], []
    for i, turn in enumerate(turns):
        if i == 2:
            eng.reset_counters()
            held = sess.used_bytes()
            sess.offload()
            sess.restore()
            assert eng.counters["d2h_kv_bytes"] == eng.counters["h2d_kv_bytes"] == held
        r = eng.generate([turn], 4, session=sess)
        toks += r.tokens[0]
        logits += [x[0] for x in r.logits]
    assert toks == ref_toks
    assert max((a - b).abs().max().item() for a, b in zip(logits, ref_logits)) <= TOL
    recurrent = [s for s in sess.states if isinstance(s, RecurrentState)]
    assert len(recurrent) == 3 and all(s.nbytes == recurrent[0].nbytes for s in recurrent)
