"""NaN and inf are refused, and named: a checkpoint written by transformers with one tensor poisoned
(one expert's w1, one attention projection, one lm_head row) is refused at load, naming the tensor,
its file and its count, on every placement; finite weights that overflow at run time (experts
scaled to 1e25 in float32: their products pass 3.4e38) raise NonFiniteError naming the pass and
the first layer that went non-finite, in prefill and in decode, on every placement and in the
fixed-shape decode step (resident_grouped, cuda_graph=true: eager on the CPU)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import Engine, NonFiniteError
from engine.checkpoint import scan_nonfinite
from engine.finite import nonfinite_count, read_with_check, refuse_bad_tensors
from engine.hooks import RouteCallback

PLACEMENTS = {"resident": {}, "fetch": {"cache_capacity": 2}, "cpu": {}, "hybrid": {"n_cpu_layers": 1},
              "stream": {"stream_threshold": 1, "cache_capacity": 2},
              "resident_grouped": {"cuda_graph": True}}
EXPERT_W1 = "model.layers.1.block_sparse_moe.experts.3.w1.weight"
ATTENTION = "model.layers.0.self_attn.q_proj.weight"
HEAD = "lm_head.weight"
FILE = "model.safetensors"


def rewritten(src: Path, dst: Path, change) -> Path:
    """A copy of checkpoint `src` at `dst` whose tensors `change(tensors)` edits in place (as
    safetensors writes them: the same file, the same names)."""
    shutil.copytree(src, dst)
    f = dst / FILE
    tensors = load_file(f)
    change(tensors)
    save_file(tensors, f, metadata={"format": "pt"})
    return dst


def poison(name: str, how: str = "row"):
    """NaN and inf into tensor `name`: the first row's first 5 values (`row`), or a whole row 7."""
    def change(t: dict[str, torch.Tensor]) -> None:
        if how == "row":
            t[name][0, :3] = float("nan")
            t[name][0, 3:5] = float("inf")
        else:
            t[name][7] = float("nan")
    return change


KINDS = {"expert w1": (EXPERT_W1, "row", 5), "attention projection": (ATTENTION, "row", 5),
         "lm_head row": (HEAD, "whole", 64)}


def load(path: Path, placement: str, **kw) -> Engine:
    return Engine.from_pretrained(str(path), placement=placement, device="cpu", max_context=256,
                                  **PLACEMENTS[placement], **kw)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_poisoned_tensor_is_refused_at_load_by_name(tiny_mixtral_dir, tmp_path, kind, placement):
    name, how, count = KINDS[kind]
    ckpt = rewritten(tiny_mixtral_dir, tmp_path / "ckpt", poison(name, how))
    numel = load_file(ckpt / FILE)[name].numel()
    with pytest.raises(NonFiniteError) as err:
        load(ckpt, placement)
    msg = str(err.value)
    assert "\n" not in msg
    assert f"tensor {name!r} in {FILE}: {count} of {numel} values are NaN or inf" in msg, msg
    assert "1 tensor in all" in msg and str(ckpt) in msg


def test_the_first_bad_tensor_is_named_with_how_many_are_bad(tiny_mixtral_dir, tmp_path):
    def change(t):
        for name in (HEAD, ATTENTION, EXPERT_W1):
            poison(name)(t)
    ckpt = rewritten(tiny_mixtral_dir, tmp_path / "ckpt", change)
    with pytest.raises(NonFiniteError) as err:
        load(ckpt, "fetch")
    msg = str(err.value)
    assert f"tensor {HEAD!r}" in msg and "3 tensors in all hold NaN or inf" in msg, msg   # first by file, then name
    # the same verdict without a model: each tensor read once (what engine=llamacpp asks before converting)
    bad = scan_nonfinite(ckpt)
    assert sorted(b.name for b in bad) == sorted([HEAD, ATTENTION, EXPERT_W1]) and all(b.count == 5 for b in bad)
    with pytest.raises(NonFiniteError) as scanned:
        refuse_bad_tensors(str(ckpt), bad)
    assert str(scanned.value) == msg


def test_a_weight_that_overflows_the_run_dtype_is_refused_as_such(tiny_mixtral_dir, tmp_path):
    def change(t):
        t[ATTENTION][2, :4] = 1e6                 # finite in float32, inf in float16
    ckpt = rewritten(tiny_mixtral_dir, tmp_path / "ckpt", change)
    with pytest.raises(NonFiniteError, match=rf"{ATTENTION}' in {FILE}: 4 of \d+ values overflow float16 "
                                             r"\(finite in the checkpoint\)"):
        load(ckpt, "resident", dtype="float16")
    load(ckpt, "resident").close()                # float32 holds it: nothing to refuse
    assert scan_nonfinite(ckpt) == []


def scaled_experts(experts: range | list[int], layer: int = 1, factor: float = 1e25):
    """Experts of `layer` with w1 and w3 scaled by `factor`: finite float32 weights (a checkpoint the
    loader accepts) whose gate x up product overflows for any token routed to them."""
    def change(t):
        for e in experts:
            for w in ("w1", "w3"):
                name = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight"
                t[name] = t[name] * factor
    return change


@pytest.fixture(scope="module")
def overflowing(tiny_mixtral_dir, tmp_path_factory) -> Path:
    return rewritten(tiny_mixtral_dir, tmp_path_factory.mktemp("overflow") / "ckpt", scaled_experts(range(8)))


PROMPT = [[11, 52, 7, 99, 23, 64, 5, 31, 88, 17, 40, 2]]


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_an_overflow_in_prefill_names_the_first_bad_layer(overflowing, placement):
    eng = load(overflowing, placement)
    assert scan_nonfinite(overflowing) == []      # the weights are finite: this is the run time's check
    with pytest.raises(NonFiniteError) as err:
        eng.generate(PROMPT, 4)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("prefill of session positions 0-11 went non-finite"), msg
    assert ("the first non-finite output is layer 1 of 3 (model.layers.1), from its routed experts (finite input, "
            "non-finite output)") in msg, msg
    assert "pass 1 of the 1 since the session began" in msg
    eng.close()


def experts_at_layer(eng: Engine, layer: int, feed) -> set[int]:
    """The experts `layer` routes to while `feed(eng)` runs."""
    seen: set[int] = set()
    hook = RouteCallback(lambda l, ids, w: seen.update(ids.flatten().tolist()) if l == layer else None)
    eng.model.add_routing_hook(hook)
    try:
        feed(eng)
    finally:
        eng.model.remove_routing_hook(hook)
    return seen


@pytest.fixture(scope="module")
def decode_overflow(tiny_mixtral_dir, tmp_path_factory) -> tuple[Path, list[int], int]:
    """A checkpoint where one expert of layer 1 overflows, a 3-token prompt that layer 1 never
    routes to it, and a token whose decode step it does: the prefill is finite, that step is not."""
    eng = Engine.from_pretrained(str(tiny_mixtral_dir), device="cpu", max_context=256)
    prompt = [11, 52, 7]
    unused = sorted(set(range(8)) - experts_at_layer(eng, 1, lambda e: e.generate([prompt], 1)))
    assert unused, "a 3-token prompt routes to at most 6 of the 8 experts"

    def step(token: int):
        def feed(e: Engine) -> None:
            sess = e.new_session()
            e.prefill(sess, [prompt])
            e.decode_step(sess, [token])
            sess.close()
        return feed
    for expert in unused:
        token = next((t for t in range(128) if expert in experts_at_layer(eng, 1, step(t))), None)
        if token is not None:
            break
    assert token is not None
    eng.close()
    ckpt = rewritten(tiny_mixtral_dir, tmp_path_factory.mktemp("decode-overflow") / "ckpt", scaled_experts([expert]))
    return ckpt, prompt, token


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_an_overflow_in_a_decode_step_names_the_step_and_the_layer(decode_overflow, placement):
    ckpt, prompt, token = decode_overflow
    eng = load(ckpt, placement)
    sess = eng.new_session()
    first = eng.greedy(sess, eng.prefill(sess, [prompt]))       # finite: the prompt never reaches the expert
    assert len(first) == 1
    with pytest.raises(NonFiniteError) as err:
        eng.greedy(sess, eng.decode_step(sess, [token]))
    msg = str(err.value)
    assert msg.startswith("decode at session position 3 went non-finite"), msg
    assert "layer 1 of 3 (model.layers.1), from its routed experts" in msg and "pass 2 of the 2" in msg, msg
    assert sess.length == 0                                      # emptied: its state holds NaN
    eng.close()


def test_a_step_whose_logits_the_caller_read_itself_is_checked_before_the_next(decode_overflow):
    ckpt, prompt, token = decode_overflow
    eng = load(ckpt, "fetch")
    sess = eng.new_session()
    eng.prefill(sess, [prompt]).argmax(-1).tolist()
    eng.decode_step(sess, [token]).argmax(-1).tolist()           # NaN read as a token, unchecked so far
    with pytest.raises(NonFiniteError, match=r"^decode at session position 3 went non-finite"):
        eng.decode_step(sess, [token])
    eng.close()


def test_a_healthy_session_goes_on_and_greedy_is_argmax(tiny_mixtral_dir):
    eng = load(tiny_mixtral_dir, "fetch")
    sess = eng.new_session()
    logits = eng.prefill(sess, PROMPT)
    assert eng.greedy(sess, logits) == logits.argmax(-1).tolist()
    for _ in range(3):
        logits = eng.decode_step(sess, logits.argmax(-1).tolist())
        eng.check_finite(sess, logits)
    assert sess.length == len(PROMPT[0]) + 3
    eng.close()


@pytest.mark.parametrize("one_read", [True, False])
def test_the_token_and_the_check_are_read_together(one_read):
    ids = torch.tensor([4, 0, 151_935])
    for total, finite in ((3.5, True), (float("nan"), False), (float("inf"), False), (float("-inf"), False)):
        assert read_with_check(ids, torch.tensor(total), one_read) == ([4, 0, 151_935], finite)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_count_is_exact_and_a_sum_that_overflows_is_no_false_alarm(dtype):
    x = torch.ones(4096, dtype=dtype) * (6e4 if dtype == torch.float16 else 1e38)   # the sum overflows
    assert nonfinite_count(x) == 0
    x[5], x[9], x[11] = float("nan"), float("inf"), float("-inf")
    assert nonfinite_count(x) == 3
    assert nonfinite_count(torch.arange(4)) == 0                  # not floating point: nothing to count


def test_a_check_that_fires_on_finite_values_is_confirmed_not_refused(tiny_mixtral_dir, tmp_path, caplog):
    """Embeddings at 3e37: finite, and every norm brings them back to 0, so the model computes finite
    values throughout -- but a prompt's hidden states sum past float32's 3.4e38, so the cheap check
    fires. The replay finds every output finite: the session stands, with a warning."""
    def change(t):
        t["model.embed_tokens.weight"] = torch.full_like(t["model.embed_tokens.weight"], 3e37)
    ckpt = rewritten(tiny_mixtral_dir, tmp_path / "ckpt", change)
    eng = load(ckpt, "resident")
    sess = eng.new_session()
    with caplog.at_level("WARNING", logger="engine.finite"):
        tokens = eng.greedy(sess, eng.prefill(sess, PROMPT))
    assert len(tokens) == 1 and sess.length == len(PROMPT[0])
    assert "a finiteness check fired but every value is finite" in caplog.text
    eng.greedy(sess, eng.decode_step(sess, tokens))                # the session goes on
    eng.close()
