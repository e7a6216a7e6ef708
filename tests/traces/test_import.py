"""Importers on files written to each engine's documented format (tests/traces/fixtures.py): the
routing that went in comes out, in the documented order, checked against the model; what a
count-only import supports and what refuses it; one-line errors."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.config import preset
from engine.policies.static import Static, StaticOptions
from engine.trace import expert_counts, load_trace, lookup_arrays, save_trace
from harness.sim.replay import replay
from harness.sim.stats import popularity, trace_stats
from harness.traces import ImportFailure, Shape, import_trace
from tests.traces import fixtures as fx

MIXTRAL = preset("tiny-mixtral")          # 4 MoE layers, 8 experts, top-2, fp32
DEEPSEEK = preset("tiny-deepseek")        # layer 0 dense, MoE layers 1..3, 8 experts, top-2
SHAPE = Shape(cfg=MIXTRAL, dtype_bytes=4)


@pytest.fixture()
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


# --- vLLM -----------------------------------------------------------------------------------------
def test_vllm_requests_prompt_then_parallel_choices(tmp_path: Path, rng) -> None:
    p1, g1 = fx.routing(rng, 5, 4, 2, 8), fx.routing(rng, 3, 4, 2, 8)
    p2, g2a, g2b = fx.routing(rng, 4, 4, 2, 8), fx.routing(rng, 2, 4, 2, 8), fx.routing(rng, 3, 4, 2, 8)
    path = fx.write_jsonl(tmp_path / "r.jsonl", [fx.vllm_response(p1, [g1]),
                                                 fx.vllm_response(p2, [g2a, g2b], encode="base64")])
    tr = import_trace("vllm", [path], SHAPE)
    # request 1: prompt (1 pass), 3 decode passes; request 2: prompt, then the two choices
    # decode together: positions 0 and 1 hold both, position 2 only choice b
    want = np.concatenate([p1, g1, p2, g2a[:1], g2b[:1], g2a[1:2], g2b[1:2], g2b[2:]])
    assert np.array_equal(tr.experts, want)
    assert tr.step.tolist() == [0] * 5 + [1, 2, 3] + [4] * 4 + [5, 5, 6, 6, 7]
    assert tr.sequence.tolist() == [0] * 8 + [1] * 4 + [1, 2, 1, 2, 2]
    assert tr.meta["moe_layers"] == [0, 1, 2, 3] and tr.meta["model"] == "tiny-mixtral"
    assert tr.expert_bytes == MIXTRAL.expert_bytes(4) and tr.meta["format"] == "vllm"
    assert "prompt in one forward pass" in tr.meta["order"]


def test_vllm_prefill_chunks_combined_form_and_offline_npz(tmp_path: Path, rng) -> None:
    p, g = fx.routing(rng, 7, 4, 2, 8), fx.routing(rng, 2, 4, 2, 8)
    resp = tmp_path / "one.json"
    resp.write_text(__import__("json").dumps(fx.vllm_response(p, [g], combined=True)))
    npz = tmp_path / "offline.npz"
    np.savez(npz, prompt_routed_experts=p.astype(np.int16), routed_experts=g.astype(np.int16))
    tr = import_trace("vllm", [resp, npz], SHAPE, prefill_chunk=3)
    assert np.array_equal(tr.experts, np.concatenate([p, g, p, g]))
    assert tr.step.tolist() == [0, 0, 0, 1, 1, 1, 2, 3, 4] + [5, 5, 5, 6, 6, 6, 7, 8, 9]
    assert "the prompt in forward passes of 3 tokens" in tr.meta["order"]


@pytest.mark.parametrize("case, match", [
    ("layers", r"layer count mismatch: the vllm routing has 3 MoE layers, model tiny-mixtral has 4 \(\[0, 1, 2, 3\]\)"),
    ("null", r"no routed experts .*--enable-return-routed-experts"),
    ("range", r"expert id 9 at \[0, 0, 0\] is out of range \[0, 8\)"),
    ("ragged", r"ragged nested lists"),
    ("topk", r"top_k mismatch: the vllm file says 3, --model tiny-mixtral says 2"),
])
def test_vllm_errors_say_what_is_allowed(tmp_path: Path, rng, case: str, match: str) -> None:
    p = fx.routing(rng, 3, 3 if case == "layers" else 4, 3 if case == "topk" else 2, 8)
    resp = fx.vllm_response(p, [])
    if case == "null":
        resp["prompt_routed_experts"] = None
    if case == "range":
        resp["prompt_routed_experts"][0][0][0] = 9
    if case == "ragged":
        resp["prompt_routed_experts"][1] = resp["prompt_routed_experts"][1][:2]
    with pytest.raises(ImportFailure, match=match) as err:
        import_trace("vllm", [fx.write_jsonl(tmp_path / "r.jsonl", [resp])], SHAPE)
    assert "\n" not in str(err.value)


def test_without_a_model_the_numbers_come_from_flags(tmp_path: Path, rng) -> None:
    path = fx.write_jsonl(tmp_path / "r.jsonl", [fx.vllm_response(fx.routing(rng, 3, 2, 2, 6), [])])
    with pytest.raises(ImportFailure, match=r"does not say how many experts.*--model NAME\|DIR.*--n-experts N"):
        import_trace("vllm", [path], Shape())
    with pytest.raises(ImportFailure, match=r"expert_bytes is unknown.*--expert-bytes B"):
        import_trace("vllm", [path], Shape(n_experts=6))
    tr = import_trace("vllm", [path], Shape(n_experts=6, expert_bytes=100))
    assert (tr.n_experts, tr.expert_bytes, tr.moe_layers, "model" in tr.meta) == (6, 100, [0, 1], False)


# --- SGLang stat: count-only -----------------------------------------------------------------------
def test_sglang_stat_csv_is_count_only(tmp_path: Path, rng) -> None:
    counts = rng.integers(0, 50, size=(3, 8))
    counts[0, 7] = 0                                       # a zero count is not in the CSV at all
    path = fx.sglang_stat_csv(tmp_path / "expert_distribution_rank0_timestamp1.csv", counts, [1, 2, 3])
    tr = import_trace("sglang-stat", [path], Shape(cfg=DEEPSEEK, dtype_bytes=4))
    assert tr.count_only and tr.n_tokens == 0 and tr.meta["count_only"] is True
    assert np.array_equal(expert_counts(tr), counts) and tr.moe_layers == [1, 2, 3]
    back = load_trace(save_trace(tmp_path / "c.npz", tr))            # the file marks it count-only
    assert back.count_only and np.array_equal(back.counts, counts)
    # popularity analyses accept it: static's profile and the hot-expert table
    opts = Static.prepare(StaticOptions(trace=str(tmp_path / "c.npz")), DEEPSEEK)
    assert opts["popularity"][2] == counts[1].tolist()
    pop = popularity(back, [2])
    top2 = np.sort(counts, axis=1)[:, -2:].sum(axis=1) / counts.sum(axis=1)
    assert np.allclose(pop[pop.layer != "all"].top_c_share, top2)
    # what needs an order refuses it, in one line, saying so
    from engine.policies.belady import Belady, BeladyOptions
    belady = lambda: Belady.prepare(BeladyOptions(trace=str(tmp_path / "c.npz")), DEEPSEEK)   # noqa: E731
    for call in (lambda: replay(back, ["lru"], [2]), lambda: lookup_arrays(back), lambda: trace_stats(back), belady):
        with pytest.raises(ValueError, match=r"count-only trace .*no token order.*cannot drive") as err:
            call()
        assert "\n" not in str(err.value)


def test_sglang_stat_pt_sums_passes_and_files(tmp_path: Path, rng) -> None:
    per_pass = rng.integers(0, 5, size=(6, 4, 8))          # [passes, num_layers, experts]
    per_pass[:, 0] = 0                                      # the dense layer records nothing
    a = fx.sglang_stat_pt(tmp_path / "a.pt", per_pass[:4])
    b = fx.sglang_stat_pt(tmp_path / "b.pt", per_pass[4:])
    tr = import_trace("sglang-stat", [a, b], Shape(cfg=DEEPSEEK, dtype_bytes=4))
    assert np.array_equal(tr.counts, per_pass.sum(axis=0)[1:]) and tr.moe_layers == [1, 2, 3]
    with pytest.raises(ImportFailure, match=r"layer count mismatch: the sglang-stat dump spans 4 layers, model "
                                            r"tiny-moonlight has 5"):
        import_trace("sglang-stat", [a], Shape(cfg=preset("tiny-moonlight"), dtype_bytes=4))


def test_sglang_stat_csv_needs_the_expert_count(tmp_path: Path) -> None:
    path = fx.sglang_stat_csv(tmp_path / "s.csv", np.array([[3, 1, 0]]), [0])
    with pytest.raises(ImportFailure, match="--n-experts N"):
        import_trace("sglang-stat", [path], Shape(expert_bytes=1))
    tr = import_trace("sglang-stat", [path], Shape(n_experts=4, expert_bytes=1))
    assert tr.counts.tolist() == [[3, 1, 0, 0]]
    bad = tmp_path / "bad.csv"
    bad.write_text("layer,expert,n\n0,1,2\n")
    with pytest.raises(ImportFailure, match=r"header \['layer', 'expert', 'n'\]; allowed: layer_id,expert_id,count"):
        import_trace("sglang-stat", [bad], Shape(n_experts=4, expert_bytes=1))


# --- SGLang per_token ------------------------------------------------------------------------------
def test_sglang_per_token_maps_physical_ids_and_keeps_pass_order(tmp_path: Path, rng) -> None:
    passes = [fx.routing(rng, n, 3, 2, 8) for n in (6, 2, 2, 1)]   # a prefill of 6, then decode passes
    p2l = np.array([list(range(8)) + [3, 5]] * 4)                  # 10 physical slots: 3 and 5 replicated
    p2l[2] = np.roll(p2l[2], 3)                                    # a layer whose slots are permuted
    path = fx.sglang_per_token_pt(tmp_path / "expert_distribution_recorder_1_0.pt", passes, 4, [1, 2, 3], p2l)
    tr = import_trace("sglang-per-token", [path], Shape(cfg=DEEPSEEK, dtype_bytes=4))
    assert np.array_equal(tr.experts, np.concatenate(passes))
    assert tr.step.tolist() == [0] * 6 + [1, 1, 2, 2, 3] and tr.sequence is None
    assert tr.moe_layers == [1, 2, 3] and tr.top_k == 2
    with pytest.raises(ImportFailure, match=r"a per_token/per_pass dump .*--from sglang-per-token"):
        import_trace("sglang-stat", [path], Shape(cfg=DEEPSEEK, dtype_bytes=4))


# --- moebench's own --------------------------------------------------------------------------------
def test_moebench_traces_merge_with_steps_and_sequences_renumbered(tmp_path: Path, rng) -> None:
    from engine.trace import RoutingTrace
    meta = {"n_experts": 8, "expert_bytes": 10, "moe_layers": [0, 1, 2, 3], "top_k": 2}
    a = RoutingTrace(experts=fx.routing(rng, 4, 4, 2, 8).astype(np.int32), meta=dict(meta),
                     step=np.array([0, 0, 1, 1], np.int32), sequence=np.array([0, 1, 0, 1], np.int32))
    b = RoutingTrace(experts=fx.routing(rng, 3, 4, 2, 8).astype(np.int32), meta=dict(meta),
                     step=np.array([5, 5, 6], np.int32), sequence=np.array([0, 0, 0], np.int32))
    pa, pb = save_trace(tmp_path / "a.npz", a), save_trace(tmp_path / "b.npz", b)
    tr = import_trace("moebench", [pa, pb], SHAPE)
    assert np.array_equal(tr.experts, np.concatenate([a.experts, b.experts]))
    assert tr.step.tolist() == [0, 0, 1, 1, 2, 2, 3] and tr.sequence.tolist() == [0, 1, 0, 1, 2, 2, 2]
    assert tr.expert_bytes == 10                            # the traces' own size, not the model's
    other = save_trace(tmp_path / "o.npz", RoutingTrace(experts=a.experts, meta={**meta, "n_experts": 9}))
    with pytest.raises(ImportFailure, match=r"n_experts=9, .*a.npz has 8; allowed: traces of one model"):
        import_trace("moebench", [pa, other], SHAPE)


def test_unknown_format_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ImportFailure, match=r"unknown trace format 'vlm'; allowed: vllm, sglang-stat"):
        import_trace("vlm", [tmp_path], SHAPE)
    with pytest.raises(ImportFailure, match=r"nope.json: no such file"):
        import_trace("vllm", [tmp_path / "nope.json"], SHAPE)
