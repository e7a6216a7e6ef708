"""Per-layer session state: a full KV's append/offload/restore round trip, bytes equal to the
tensors allocated, the planner's state terms equal to what a session really allocates, and a
state of another kind (fixed, mixed dtypes) displaced and restored by the same Session code."""
from __future__ import annotations

import pytest
import torch

from engine import Engine
from engine.counters import Counters
from engine.devices import Device
from engine.kv import FullKV, LayerState, Session, SlidingKV, StateTerm, nbytes_of
from engine.config import preset
from engine.planner import plan_memory


def full_kv_session(max_tokens: int | None, layers: int = 2, batch: int = 2) -> tuple[Session, Counters]:
    dev, counters = Device.create("cpu"), Counters(layers)
    label = Session.new_label()
    states = [FullKV(dev, label, batch, 2, 4, torch.float32, max_tokens) for _ in range(layers)]
    return Session(dev, counters, batch, states, max_tokens), counters


def append(sess: Session, T: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, st in enumerate(sess.states):
        k, v = torch.randn(sess.batch, 2, T, 4, generator=g), torch.randn(sess.batch, 2, T, 4, generator=g)
        out.append(st.append(k, v, sess.length))
    sess.advance(T)
    return out


def test_full_kv_round_trip_and_bytes():
    sess, counters = full_kv_session(max_tokens=40)
    append(sess, 10, 0)
    k_all, v_all, start = append(sess, 3, 1)[1]
    assert k_all.shape == (2, 2, 13, 4) and start == 0
    before = [(s.k[:, :, :13].clone(), s.v[:, :, :13].clone()) for s in sess.states]
    # planned: the whole context allocated once; bytes are the allocated tensors' bytes
    assert all(s.capacity == 40 for s in sess.states)
    assert sess.nbytes == sum(t.numel() * t.element_size() for s in sess.states for t in s.tensors())
    assert sess.nbytes == 2 * FullKV.term(2, 4, 4).bytes(40, 2)
    used = sess.used_bytes()
    assert used == 2 * 2 * 2 * 2 * 13 * 4 * 4
    sess.offload()
    assert sess.nbytes == 0 and not sess.on_device and sess.used_bytes() == used
    assert counters.totals()["d2h_kv_bytes"] == used
    with pytest.raises(RuntimeError, match="call session.restore"):
        sess.state(0)
    sess.restore()
    assert counters.totals()["h2d_kv_bytes"] == used and sess.nbytes == 2 * FullKV.term(2, 4, 4).bytes(40, 2)
    for s, (k, v) in zip(sess.states, before):
        assert torch.equal(s.k[:, :, :13], k) and torch.equal(s.v[:, :, :13], v)
    append(sess, 2, 2)                       # continues after the restored tokens
    assert sess.length == 15
    with pytest.raises(ValueError, match="planned for max_context=40"):
        append(sess, 26, 3)
    sess.close()
    assert sess.nbytes == 0


def test_unplanned_full_kv_grows_by_doubling_and_keeps_what_it_holds():
    sess, _ = full_kv_session(max_tokens=None, layers=1)
    first = append(sess, 200, 0)[0][0].clone()
    assert sess.states[0].capacity == 256
    append(sess, 100, 1)
    assert sess.states[0].capacity == 512 and torch.equal(sess.states[0].k[:, :, :200], first)


class Recurrent(LayerState):
    """A fixed-size state of two dtypes (the shape of a gated-DeltaNet layer's conv + recurrent state)."""

    def __init__(self, device: Device, label: str, batch: int) -> None:
        super().__init__(device, label)
        self.batch, self.conv, self.rec = batch, None, None

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.conv is None else [self.conv, self.rec]

    def reserve(self, tokens: int, filled: int) -> None:
        if self.conv is None:
            self.conv = self.device.empty((self.batch, 6, 3), torch.bfloat16, self.label)
            self.rec = self.device.empty((self.batch, 2, 4, 4), torch.float32, self.label)

    def snapshot(self, length: int) -> list[torch.Tensor]:
        return self.tensors()

    def _forget(self) -> None:
        self.conv = self.rec = None


def test_a_fixed_state_of_mixed_dtypes_is_displaced_and_restored():
    dev, counters = Device.create("cpu"), Counters(2)
    label = Session.new_label()
    states = [Recurrent(dev, label, 3), FullKV(dev, label, 3, 1, 4, torch.float32, 8)]
    sess = Session(dev, counters, 3, states, 8)
    states[0].reserve(1, 0)
    states[0].conv.copy_(torch.randn(3, 6, 3))
    states[0].rec.copy_(torch.randn(3, 2, 4, 4))
    states[1].append(torch.randn(3, 1, 5, 4), torch.randn(3, 1, 5, 4), 0)
    sess.advance(5)
    term = StateTerm("recurrent state", fixed=(6 * 3 * 2 + 2 * 4 * 4 * 4))
    assert states[0].nbytes == term.bytes(context=10_000, batch=3)         # fixed: whatever the context
    kept = [t.clone() for s in states for t in s.snapshot(5)]
    sess.offload()
    assert [h.dtype for h in states[0].host] == [torch.bfloat16, torch.float32]
    assert counters.totals()["d2h_kv_bytes"] == nbytes_of(kept)
    sess.restore()
    assert all(torch.equal(a, b) for a, b in zip(kept, [t for s in states for t in s.snapshot(5)]))
    assert counters.totals()["h2d_kv_bytes"] == nbytes_of(kept)


@pytest.mark.parametrize("batch,context", [(1, 64), (3, 200)])
def test_planned_state_terms_equal_the_allocated_tensors(batch, context):
    eng = Engine.from_pretrained("tiny-mixtral", device="cpu", batch=batch, max_context=context)
    sess = eng.new_session(batch)
    eng.prefill(sess, [[1, 2, 3]] * batch)
    terms = eng.model.arch.state_terms(4)
    assert [s.nbytes for s in sess.states] == [t.bytes(context, batch) for t in terms]
    assert sess.nbytes == eng.plan.kv == sum(b for _, b in eng.plan.states)
    plan = plan_memory(eng.cfg, "resident", None, None, context, batch, 512, 4)
    assert plan.states == ((f"KV cache (4 layers, {batch} x {context} tokens)", sess.nbytes),)
    assert str(plan).count("KV cache") == 1


def test_sliding_window_kv_is_bounded_and_keeps_the_last_window():
    dev, counters = Device.create("cpu"), Counters(1)
    st = SlidingKV(dev, Session.new_label(), 1, 1, 2, torch.float32, max_tokens=100, window=5)
    sess = Session(dev, counters, 1, [st], 100)
    keys = torch.arange(30, dtype=torch.float32).view(1, 1, 15, 2)       # position t holds (2t, 2t+1)
    seen = []
    for a, b in ((0, 6), (6, 7), (7, 15)):                              # a prefill chunk longer than the window, decode, another chunk
        k_all, _, first = st.append(keys[:, :, a:b], keys[:, :, a:b], a)
        seen.append((first, k_all.shape[2]))
        sess.advance(b - a)
    assert seen == [(0, 6), (2, 5), (3, 12)]                             # held window - 1 = 4, then the new tokens
    assert torch.equal(st.k[0, 0], keys[0, 0, 11:15]) and st.nbytes == SlidingKV.term(1, 2, 4, 5).bytes(100, 1)
    sess.offload()
    assert counters.totals()["d2h_kv_bytes"] == 2 * 4 * 2 * 4
    sess.restore()
    assert torch.equal(st.k[0, 0], keys[0, 0, 11:15])
    short = SlidingKV(dev, Session.new_label(), 2, 1, 2, torch.float32, max_tokens=3, window=5)
    short.reserve(1, 0)
    assert short.nbytes == SlidingKV.term(1, 2, 4, 5).bytes(3, 2)         # planned context below the window


def test_windowed_model_plans_its_bounded_state():
    eng = Engine.from_pretrained("tiny-mixtral", device="cpu", max_context=300, model_overrides={"sliding_window": 64})
    sess = eng.new_session(1)
    eng.prefill(sess, [list(range(100))])
    assert sess.nbytes == eng.plan.kv == 4 * 63 * 2 * 2 * 16 * 4
    assert eng.plan.states[0][0] == "sliding-window KV (64-token window) (4 layers, 1 x 63 tokens)"


def test_bounded_and_fixed_terms():
    window = StateTerm("sliding-window KV", per_token=10, max_tokens=100)
    assert window.bytes(50, 2) == 1000 and window.bytes(1000, 2) == 2000
    assert StateTerm("recurrent state", fixed=7).bytes(1 << 20, 3) == 21


RECURRENT = "recurrent state, fixed per sequence (conv + delta rule)"


@pytest.mark.parametrize("model,kinds", [
    ("tiny-gpt-oss", ["sliding-window KV (8-token window)", "KV cache"]),
    ("tiny-qwen3-next", [RECURRENT, "KV cache"]),
    ("tiny-gemma4", ["sliding-window KV (8-token window)", "KV cache"]),
])
@pytest.mark.parametrize("batch,context", [(1, 64), (3, 300)])
def test_second_wave_planned_states_equal_the_allocated_tensors(model, kinds, batch, context):
    """Each architecture's own state: the bytes every layer's state really allocates are its plan
    term (a window's bound, a recurrent layer's fixed tensors, full KV for the planned context),
    and the plan has one line per kind."""
    eng = Engine.from_pretrained(model, device="cpu", batch=batch, max_context=context)
    sess = eng.new_session(batch)
    eng.prefill(sess, [[1, 2, 3]] * batch)
    terms = eng.model.arch.state_terms(4)
    assert [s.nbytes for s in sess.states] == [t.bytes(context, batch) for t in terms]
    assert sess.nbytes == eng.plan.kv == eng.cfg.state_bytes(context, batch, 4)
    assert [line.split(" (")[0] for line, _ in eng.plan.states] == [k.split(" (")[0] for k in kinds]
    assert all(k in str(eng.plan) for k in kinds)
    sess.close()


def test_real_shapes_state_terms():
    """The plan's state lines at the presets' real shapes, by hand (bf16): bounded sliding windows,
    fixed recurrent state, KV per token only where the layer keeps the whole context."""
    def states(name: str, context: int) -> dict[str, int]:
        return dict(plan_memory(preset(name), "resident", None, None, context, 1, 512, 2).states)

    # gpt-oss-20b: 12 sliding layers hold the last 127 tokens, 12 full ones all; K=8, h=64 -> 2048 B per token
    got = states("gpt-oss-20b", 131072)
    assert got == {"sliding-window KV (128-token window) (12 layers, 1 x 127 tokens)": 12 * 127 * 2048,
                   "KV cache (12 layers, 1 x 131072 tokens)": 12 * 131072 * 2048}
    assert preset("gpt-oss-20b").kv_bytes_per_token(2) == 12 * 2048
    # qwen3-next-80b-a3b: 36 DeltaNet layers, each conv inputs 3 x (2*16*128 + 32*128) bf16 + a 32x128x128 fp32 state
    fixed = 3 * 8192 * 2 + 32 * 128 * 128 * 4
    got = states("qwen3-next-80b-a3b", 262144)
    assert got == {f"{RECURRENT} (36 layers, 1 sequence)": 36 * fixed,
                   "KV cache (12 layers, 1 x 262144 tokens)": 12 * 262144 * 2 * 2 * 256 * 2}
    assert states("qwen3-next-80b-a3b", 1024)[f"{RECURRENT} (36 layers, 1 sequence)"] == 36 * fixed
    assert preset("qwen3-next-80b-a3b").kv_bytes_per_token(2) == 12 * 2048
    # gemma-4-26b-a4b: 25 sliding layers (K=8, h=256) hold 1023 tokens, 5 global ones (K=2, h=512) all
    got = states("gemma-4-26b-a4b", 262144)
    assert got == {"sliding-window KV (1024-token window) (25 layers, 1 x 1023 tokens)": 25 * 1023 * 2 * 8 * 256 * 2,
                   "KV cache (5 layers, 1 x 262144 tokens)": 5 * 262144 * 2 * 2 * 512 * 2}
