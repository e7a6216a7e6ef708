"""Trace file format: round trip, validation errors that name what is wrong, lookup order."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.trace import (RoutingTrace, expert_counts, load_trace, lookup_arrays, lookup_sequences,
                          save_trace)


def small(**kw) -> RoutingTrace:
    ex = np.array([[[0, 1], [2, 3]], [[1, 0], [3, 4]], [[5, 6], [7, 0]], [[0, 2], [1, 3]]], dtype=np.int32)  # [4, 2, 2]
    args = dict(experts=ex, meta={"n_experts": 8, "expert_bytes": 10}, weights=np.full(ex.shape, 0.5, np.float32),
                step=np.array([0, 0, 1, 2], np.int32))
    args.update(kw)
    return RoutingTrace(**args)


def write_npz(path: Path, **arrays) -> Path:
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return path


def test_round_trip(tmp_path: Path) -> None:
    tr = small(sequence=np.array([0, 1, 0, 1], np.int32)).validate()
    back = load_trace(save_trace(tmp_path / "t.npz", tr))
    for name in ("experts", "weights", "step", "sequence"):
        a, b = getattr(tr, name), getattr(back, name)
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert back.meta == tr.meta and back.experts.dtype == np.int32


def test_optional_arrays_absent(tmp_path: Path) -> None:
    tr = small(weights=None, step=None)
    back = load_trace(save_trace(tmp_path / "t.npz", tr))
    assert back.weights is None and back.step is None and back.sequence is None


@pytest.mark.parametrize("arrays, message", [
    (dict(experts=np.zeros((4, 2, 2), np.float64)), "experts has dtype float64; expected an integer dtype"),
    (dict(experts=np.zeros((4, 2), np.int32)), "experts has shape (4, 2); expected 3 dimensions"),
    (dict(experts=np.full((4, 3, 2), 9, np.int32)), "out of range [0, 8)"),
    (dict(weights=np.zeros((4, 2, 2), np.float32)), "weights shape (4, 2, 2) does not match experts (4, 3, 2)"),
    (dict(weights=np.zeros((4, 3, 2), np.int32)), "weights has dtype int32; expected a floating dtype"),
    (dict(step=np.array([0, 1, 1, 0], np.int32)), "step must be non-decreasing"),
    (dict(step=np.array([0, 1], np.int32)), "step shape (2,) does not match experts"),
])
def test_bad_arrays_get_clear_errors(tmp_path: Path, arrays: dict, message: str) -> None:
    base = dict(experts=np.tile(np.array([0, 1], np.int32), (4, 3, 1)), meta=np.array(json.dumps(
        {"n_experts": 8, "expert_bytes": 1})))
    base.update(arrays)
    path = write_npz(tmp_path / "bad.npz", **base)
    with pytest.raises(ValueError) as err:
        load_trace(path)
    assert message in str(err.value) and str(path) in str(err.value)


def test_out_of_range_id_names_its_index() -> None:
    ex = np.zeros((4, 1, 2), np.int32)
    ex[:, 0, 1] = 1
    ex[3, 0, 1] = 9
    with pytest.raises(ValueError, match=r"expert id 9 at \[3, 0, 1\] is out of range \[0, 8\)"):
        RoutingTrace(experts=ex, meta={"n_experts": 8, "expert_bytes": 1}).validate()


@pytest.mark.parametrize("meta, message", [
    ({"expert_bytes": 1}, "meta n_experts missing"),
    ({"n_experts": 8}, "meta expert_bytes missing"),
    ({"n_experts": "8", "expert_bytes": 1}, "meta n_experts must be an integer"),
    ({"n_experts": 8, "expert_bytes": 1, "moe_layers": [0, 1, 2]},
     "meta moe_layers has 3 entries, which does not match"),
    ({"n_experts": 8, "expert_bytes": 1, "top_k": 4}, "meta top_k=4 does not match experts shape (4, 2, 2)"),
])
def test_bad_meta_gets_clear_errors(meta: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        small(meta=meta).validate()


def test_duplicate_expert_in_a_token_is_rejected() -> None:
    ex = np.array([[[3, 3]]], np.int32)
    with pytest.raises(ValueError, match="token 0 layer 0 routes to expert 3 more than once"):
        RoutingTrace(experts=ex, meta={"n_experts": 8, "expert_bytes": 1}).validate()


def test_missing_arrays_and_bad_json(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="missing array.*meta"):
        load_trace(write_npz(tmp_path / "a.npz", experts=np.zeros((1, 1, 1), np.int32)))
    with pytest.raises(ValueError, match="meta is not valid JSON"):
        load_trace(write_npz(tmp_path / "b.npz", experts=np.zeros((1, 1, 1), np.int32), meta=np.array("{oops")))
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "absent.npz")


def test_reference_string() -> None:
    tr = RoutingTrace.from_reference_string([7, 0, 1, 2, 0])
    assert tr.experts.shape == (5, 1, 1) and tr.n_experts == 8 and tr.expert_bytes == 1
    assert lookup_sequences(tr) == {0: [7, 0, 1, 2, 0]}
    with pytest.raises(ValueError, match="out of range"):
        RoutingTrace.from_reference_string([7, 0, 1], n_experts=4)


def test_lookup_order_is_per_step_sorted_unique() -> None:
    tr = small().validate()
    # layer 0: step 0 = tokens 0,1 -> {0,1}; step 1 = {5,6}; step 2 = {0,2}
    # layer 1: step 0 = {2,3,4};          step 1 = {0,7}; step 2 = {1,3}
    assert lookup_sequences(tr) == {0: [0, 1, 5, 6, 0, 2], 1: [2, 3, 4, 0, 7, 1, 3]}
    ids, steps = lookup_arrays(tr)[1]
    assert steps.tolist() == [0, 0, 0, 1, 1, 2, 2]
    # without step every token is its own step
    no_step = small(step=None).validate()
    assert lookup_sequences(no_step)[0] == [0, 1, 0, 1, 5, 6, 0, 2]
    tr.meta["moe_layers"] = [1, 3]
    assert set(lookup_sequences(tr, model_layers=True)) == {1, 3}


def test_expert_counts() -> None:
    counts = expert_counts(small().validate())
    assert counts.shape == (2, 8) and counts.sum() == 16
    assert counts[0].tolist() == [3, 2, 1, 0, 0, 1, 1, 0]


def test_count_only_traces_round_trip_and_are_checked(tmp_path: Path) -> None:
    """A count-only trace: counts [L, E] with meta count_only, no tokens; anything else is refused."""
    meta = {"n_experts": 4, "expert_bytes": 8, "count_only": True}
    counts = np.array([[3, 0, 1, 2], [0, 5, 0, 1]])
    tr = RoutingTrace(experts=np.zeros((0, 2, 2), np.int32), meta=dict(meta), counts=counts)
    back = load_trace(save_trace(tmp_path / "c.npz", tr))
    assert back.count_only and back.counts.dtype == np.int64 and expert_counts(back).tolist() == counts.tolist()
    cases = [
        ({"counts": counts, "meta": {**meta, "count_only": False}}, "count_only=False but the counts array is present"),
        ({"meta": dict(meta)}, "count_only=True but the counts array is missing"),
        ({"counts": counts[:, :3], "meta": dict(meta)}, r"counts must be integers >= 0 of shape \(2, 4\).*\(2, 3\)"),
        ({"counts": -counts, "meta": dict(meta)}, "counts must be integers >= 0"),
        ({"counts": counts, "meta": dict(meta), "experts": np.array([[[0, 1], [2, 3]]], np.int32)}, "holds no tokens"),
    ]
    for fields, match in cases:
        fields = {"experts": np.zeros((0, 2, 2), np.int32), **fields}
        with pytest.raises(ValueError, match=match):
            RoutingTrace(**fields).validate()
