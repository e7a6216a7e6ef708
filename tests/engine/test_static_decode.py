"""Decode steps of fixed shape (engine.static_decode; resident_grouped with cuda_graph=true):
what a CUDA graph replays, checked on the CPU where the same step runs eagerly -- two steps at
different positions run the very same ops on the same shapes with the same arguments and read
nothing back to the host, and the engine's output is the eager engine's (tokens equal, logits
to fp32 rounding)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import Engine
from engine.static_decode import MIN_KEYS, keys_bucket
from tests.engine.test_dispatch import HOST_SYNCING_OPS

GRAPH = {"placement": "resident_grouped", "cuda_graph": True}
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [5, 4, 3, 2, 1, 9, 8, 7, 6, 5, 4, 3]]


def describe(x) -> object:
    """An op argument as a graph sees it: a tensor by shape, dtype and device; anything else as is."""
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.dtype, x.device.type)
    if isinstance(x, (list, tuple)):
        return tuple(describe(a) for a in x)
    return x


class OpTrace(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops.append((func.__name__, describe(args), describe(sorted(kwargs.items()))))
        return func(*args, **kwargs)


def traced_step(eng: Engine, sess, tokens: list[int], monkeypatch) -> list[tuple]:
    """Every op of the part of one decode step a CUDA graph captures (`StaticDecoder.run`, after
    `prepare` wrote its inputs), with any `.tolist()` inside it refused (a device->host read on
    CUDA); the session advanced as `step` does."""
    def refuse(self):
        raise AssertionError("a static decode step read a tensor back to the host (.tolist())")

    dec = sess.static_decoder
    trace = OpTrace()
    with monkeypatch.context() as m, torch.inference_mode():
        keys = dec.prepare(torch.tensor([[t] for t in tokens]))
        m.setattr(torch.Tensor, "tolist", refuse)
        with trace:
            logits = dec.run(keys)
    sess.advance(1)
    assert trace.ops and logits.shape == (sess.batch, eng.cfg.vocab_size)
    return trace.ops


@pytest.mark.parametrize("model", ["tiny-mixtral", "tiny-glm"])
def test_two_steps_run_the_same_ops_and_read_nothing_back(model: str, monkeypatch) -> None:
    """Steps at context 14 and 40 (one key bucket) are op for op the same, shapes and arguments
    included (what lets one captured graph replay both), and none syncs with the host."""
    eng = Engine.from_pretrained(model, device="cpu", max_context=512, **GRAPH)
    sess = eng.new_session(2)
    tok = eng.prefill(sess, PROMPTS).argmax(-1).tolist()
    tok = eng.decode_step(sess, tok).argmax(-1).tolist()          # builds the session's decoder
    first = traced_step(eng, sess, tok, monkeypatch)
    for _ in range(25):
        tok = eng.decode_step(sess, tok).argmax(-1).tolist()
    assert sess.length == 39
    second = traced_step(eng, sess, tok, monkeypatch)
    assert len(first) > 100 and first == second
    names = {op[0].split(".")[0] for op in first}
    assert not names & set(HOST_SYNCING_OPS + ("item", "is_nonzero")), names


def test_eager_step_differs_between_positions(monkeypatch) -> None:
    """The check above can fail: the eager step's ops depend on the position (same trace, eager)."""
    eng = Engine.from_pretrained("tiny-mixtral", device="cpu", max_context=512, placement="resident_grouped")
    sess = eng.new_session(2)
    tok = eng.prefill(sess, PROMPTS).argmax(-1).tolist()
    traces = []
    for _ in range(2):
        trace = OpTrace()
        with torch.inference_mode(), trace:
            eng.model.forward(torch.tensor([[t] for t in tok]), sess)
        traces.append(trace.ops)
    assert traces[0] != traces[1]


@pytest.mark.parametrize("model", ["tiny-mixtral", "tiny-glm"])
def test_graph_decode_gives_the_eager_engines_output(model: str) -> None:
    """Across a key bucket's edge (context 250 -> 262 crosses MIN_KEYS = 256): the same greedy
    tokens, logits to fp32 rounding (the attention kernel sums over the masked bucket)."""
    prompt = [[(7 * i) % 400 + 1 for i in range(250)]]
    ref = Engine.from_pretrained(model, device="cpu", max_context=600).generate(prompt, 12)
    got = Engine.from_pretrained(model, device="cpu", max_context=600, **GRAPH).generate(prompt, 12)
    assert got.tokens == ref.tokens
    diff = max(float((a - b).abs().max()) for a, b in zip(got.logits, ref.logits))
    assert diff < 1e-5, diff


def test_garbage_past_the_context_does_not_reach_the_output() -> None:
    """Buffers come from torch.empty: whatever the allocator left past the context (NaN here) is
    cleared before the first static step, since a masked key weighs 0 and 0 * NaN is NaN."""
    def run(options: dict) -> list[list[int]]:
        eng = Engine.from_pretrained("tiny-mixtral", device="cpu", max_context=300, **options)
        sess = eng.new_session(2)
        tok = eng.prefill(sess, PROMPTS).argmax(-1).tolist()
        with torch.inference_mode():
            for state in sess.states:
                for t in state.tensors():
                    t[:, :, sess.length:].fill_(float("nan"))
        out = [tok]
        for _ in range(6):
            logits = eng.decode_step(sess, out[-1])
            assert torch.isfinite(logits).all()
            out.append(logits.argmax(-1).tolist())
        return out

    assert run(GRAPH) == run({})


def test_session_offloaded_mid_decode_continues_as_eager() -> None:
    """The decoder is dropped with the buffers it wrote into; the restored session decodes on."""
    def run(options: dict) -> list[list[int]]:
        eng = Engine.from_pretrained("tiny-mixtral", device="cpu", max_context=300, **options)
        sess = eng.new_session(2)
        first = eng.generate(PROMPTS, 5, session=sess).tokens
        sess.offload()
        sess.restore()
        return first + eng.generate([[3], [4]], 5, session=sess).tokens

    assert run(GRAPH) == run({})


def test_keys_bucket() -> None:
    assert keys_bucket(1, 4096) == MIN_KEYS == 256
    assert keys_bucket(256, 4096) == 256 and keys_bucket(257, 4096) == 512
    assert keys_bucket(3000, 3000) == 3000 and keys_bucket(100, 128) == 128
    with pytest.raises(ValueError, match="needs 129 key positions; the session holds 128"):
        keys_bucket(129, 128)


@pytest.mark.parametrize("model,kind", [("tiny-deepseek", "an MLA latent"),
                                        ("tiny-qwen3-next", "a recurrent DeltaNet state"),
                                        ("tiny-gemma4", "a sliding-window KV")])
def test_refused_for_states_written_at_host_positions(model: str, kind: str) -> None:
    with pytest.raises(ValueError, match=f"cuda_graph: .*keep .*{kind}.*allowed for this model: cuda_graph=false"):
        Engine.from_pretrained(model, device="cpu", **GRAPH)


def test_refuses_routing_listeners() -> None:
    eng = Engine.from_pretrained("tiny-mixtral", device="cpu", record_lookups=True, **GRAPH)
    with pytest.raises(ValueError, match="cannot feed routing hooks, record_lookups or a prefetcher"):
        eng.generate(PROMPTS, 3)


def test_option_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="cuda_graph must be true or false, got 'yes'"):
        Engine.from_pretrained("tiny-mixtral", device="cpu", placement="resident_grouped", cuda_graph="yes")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_gives_the_eager_engines_tokens() -> None:
    prompt = [[(7 * i) % 400 + 1 for i in range(250)]]
    opts = dict(device="cuda", dtype="bfloat16", max_context=600)
    ref = Engine.from_pretrained("tiny-mixtral", placement="resident_grouped", **opts).generate(prompt, 12)
    eng = Engine.from_pretrained("tiny-mixtral", placement="resident_grouped", cuda_graph=True, **opts)
    sess = eng.new_session(1)
    got = eng.generate(prompt, 12, session=sess)
    assert got.tokens == ref.tokens
    assert set(sess.static_decoder.graphs) == {256, 512}
