"""The timeline's device compute and copies on the emulated device: compute is all of a step's
work minus stalls and synchronous copies, activation copies are timed where they run, and
issuing a layer's copies ahead lets them overlap compute."""
from __future__ import annotations

import pytest

from engine import Engine
from engine.timeline import IDLE, Timeline
from harness.profiling.overlap import intersection_length, overlap_metrics, union_length

PROMPT = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]]


def timed(placement: str, **options) -> tuple[Engine, Timeline]:
    eng = Engine.from_pretrained("tiny-mixtral", device="cpu", placement=placement, **options)
    tl = Timeline("cpu")
    eng.set_instrument(tl)
    eng.generate(PROMPT, 6)
    eng.set_instrument(None)
    tl.collect()
    return eng, tl


def test_compute_is_the_steps_minus_stalls_and_sync_copies():
    tl = Timeline("cpu")
    with tl.span("step"):
        with tl.idle("wait"):
            pass
        with tl.idle("host"):
            tl.copy(tl.spans[-1].t1, tl.spans[-1].t1, 8, {"sync": True})
    step = tl.intervals("step")
    compute = tl.compute_intervals()
    assert union_length(compute) <= union_length(step)
    assert intersection_length(compute, tl.intervals(IDLE)) == 0


def test_cpu_placement_copies_are_synchronous_and_hide_nothing():
    eng, tl = timed("cpu")
    copies = [s for s in tl.spans if s.kind == "copy"]
    assert copies and all(s.attrs.get("sync") for s in copies)
    c = eng.counters
    assert sum(s.attrs["bytes"] for s in copies) == c["h2d_activation_bytes"] + c["d2h_activation_bytes"]
    m = overlap_metrics(tl.intervals("copy"), tl.compute_intervals(), c["h2d_bytes"], emulated=True)
    assert m["overlap_s"] == 0.0 and m["overlap_frac"] == 0.0 and m["link_gbps"] is None
    assert union_length(tl.intervals("host")) > 0       # the device idles while the CPU runs experts


def test_fetch_copies_are_asynchronous_and_counted_once():
    eng, tl = timed("fetch", cache_capacity=2)
    copies = [s for s in tl.spans if s.kind == "copy"]
    assert copies and not any(s.attrs.get("sync") for s in copies)
    assert sum(s.attrs["bytes"] for s in copies) == eng.counters["h2d_expert_bytes"] > 0
    assert union_length(tl.compute_intervals()) > 0


@pytest.mark.parametrize("issue_ahead", [True, False])
def test_both_schedules_record_every_copy(issue_ahead):
    eng, tl = timed("fetch", cache_capacity=2, issue_ahead=issue_ahead)
    assert sum(1 for s in tl.spans if s.kind == "copy") == eng.counters["expert_misses"]


def test_kv_offload_and_restore_copies_are_timed_with_their_bytes():
    """Displacing a session's KV to host RAM is a timed copy like its restore: the kv_offload
    phase's copy time is measured, never a 0 beside the bytes it moved."""
    eng = Engine.from_pretrained("tiny-mixtral", device="cpu", placement="resident", max_context=64)
    sess = eng.new_session(1)
    eng.prefill(sess, PROMPT)
    tl = Timeline("cpu")
    eng.set_instrument(tl)
    eng.reset_counters()
    sess.offload()
    sess.restore()
    eng.set_instrument(None)
    tl.collect()
    copies = {s.attrs["what"]: s for s in tl.spans if s.kind == "copy"}
    c = eng.counters
    assert copies["kv_offload"].attrs["bytes"] == c["d2h_kv_bytes"] > 0
    assert copies["kv_restore"].attrs["bytes"] == c["h2d_kv_bytes"] == c["d2h_kv_bytes"]
    assert copies["kv_offload"].t1 > copies["kv_offload"].t0
