"""CUDA-only checks (skipped without a GPU): exact-size pinned host memory, copies on the
dedicated copy stream, the allocator cap, event-timed compute segments, per-phase device
peaks, planned vs measured transient memory, and the invariant on the real device."""
from __future__ import annotations

import gc

import pytest
import torch

from engine import Engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PROMPT = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]]


def close_enough(got, ref) -> bool:
    return got.tokens == ref.tokens and max((a - b).abs().max().item() for a, b in zip(got.logits, ref.logits)) <= 1e-5


@pytest.mark.parametrize("issue_ahead", [True, False])
def test_fetch_on_cuda_matches_resident_and_uses_pinned_store(issue_ahead):
    ref = Engine.from_pretrained("tiny-mixtral", device="cuda").generate(PROMPT, 8)
    eng = Engine.from_pretrained("tiny-mixtral", device="cuda", placement="fetch", cache_capacity=2,
                                 issue_ahead=issue_ahead)
    assert all(rows.is_pinned() for rows in eng.model.store.rows.values())
    assert eng.device.copy_stream is not None
    got = eng.generate(PROMPT, 8)
    assert close_enough(got, ref)
    assert eng.counters["h2d_bytes"] == eng.counters["h2d_expert_bytes"] == eng.counters["expert_miss_bytes"] > 0


@pytest.mark.parametrize("placement,opts", [("cpu", {}), ("hybrid", {"n_cpu_layers": 2}),
                                            ("stream", {"cache_capacity": 2, "stream_threshold": 4}),
                                            ("fetch", {"cache_capacity": 3, "prefetch": "next_layer_gate"})])
def test_other_placements_on_cuda(placement, opts):
    ref = Engine.from_pretrained("tiny-mixtral", device="cuda").generate(PROMPT, 8)
    eng = Engine.from_pretrained("tiny-mixtral", device="cuda", placement=placement, **opts)
    assert close_enough(eng.generate(PROMPT, 8), ref)
    host = [r for l, r in eng.model.store.rows.items() if not eng.model.store.on_device[l]]
    assert all(r.is_pinned() == (placement in ("stream", "fetch")) for r in host)   # only copied stores are pinned


def test_registered_host_buffer_is_pinned_exactly_and_unregistered():
    from engine.hostmem import host_alloc_bytes, host_empty, registered_bytes

    before = registered_bytes()
    n = (3 << 20) + 5
    t = host_empty((n,), torch.uint8, pin=True)
    assert t.is_pinned() and registered_bytes() - before == host_alloc_bytes(n, "register") < 2 * n
    t.copy_(torch.arange(n, dtype=torch.int64).remainder(251).to(torch.uint8))
    d = torch.empty(n, dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        d.copy_(t, non_blocking=True)
    s.synchronize()
    assert torch.equal(d.cpu(), t)
    del t
    gc.collect()
    assert registered_bytes() == before


def test_kv_offload_is_pinned_and_exact():
    eng = Engine.from_pretrained("tiny-mixtral", device="cuda")
    sess = eng.new_session(1)
    eng.generate(PROMPT, 4, session=sess)
    sess.offload()
    assert sess.k[0].is_pinned() and eng.counters["d2h_kv_bytes"] == sess.used_bytes()
    sess.restore()
    assert eng.counters["h2d_kv_bytes"] == eng.counters["d2h_kv_bytes"]
    sess.close()


def test_budget_caps_the_allocator_until_close():
    torch.cuda.empty_cache()
    budget = 96 << 20
    # a short planned context: at the defaults (4096 tokens, 512-token micro-batches) the CUDA plan's
    # attention workspace alone takes 76 MiB and the plan (110 MiB) is refused before the cap is set
    eng = Engine.from_pretrained("tiny-mixtral", device="cuda", placement="fetch", cache_capacity=2,
                                 device_memory=budget, max_context=256, ubatch=32)
    try:
        assert eng.device.allocator_cap == budget
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2 * budget, dtype=torch.uint8, device="cuda")
        eng.generate(PROMPT, 4)                                   # the planned run fits under the cap
    finally:
        eng.close()
    assert torch.empty(2 * budget, dtype=torch.uint8, device="cuda").numel() == 2 * budget


def test_expert_copies_run_on_the_copy_stream():
    """CUPTI stream ids in the profile: a marker copy on the engine's copy stream names it;
    every expert-sized copy is there, and no kernel runs there."""
    from harness.profiling.torchprof import copy_streams

    eng = Engine.from_pretrained("tiny-mixtral", device="cuda", placement="fetch", cache_capacity=2)
    got = copy_streams(lambda: eng.generate(PROMPT, 4), eng.device.copy_stream, eng.model.store.expert_bytes)
    (marker,) = got["marker"]
    assert len(got["copies"]) == eng.counters["expert_misses"] and set(got["copies"]) == {marker}
    assert marker not in got["kernels"]


def test_slow_copies_do_not_change_results():
    """Race amplifier: a spin on the copy stream before every copy; the compute stream's
    event waits must still order every read after its copy."""
    ref = Engine.from_pretrained("tiny-mixtral", device="cuda").generate(PROMPT, 8)
    for ahead in (True, False):
        eng = Engine.from_pretrained("tiny-mixtral", device="cuda", placement="fetch", cache_capacity=2,
                                     issue_ahead=ahead)
        eng.device.copy_delay_cycles = 2_000_000                  # ~1 ms at 2 GHz
        assert close_enough(eng.generate(PROMPT, 8), ref)


def test_timeline_compute_segments_and_copies():
    from engine.timeline import SEGMENT, Timeline
    from harness.profiling.overlap import overlap_metrics, union_length

    eng = Engine.from_pretrained("tiny-mixtral", device="cuda", placement="fetch", cache_capacity=2)
    tl = Timeline("cuda")
    eng.set_instrument(tl)
    eng.generate(PROMPT, 6)
    eng.set_instrument(None)
    tl.collect()
    segments, copies = tl.intervals(SEGMENT), tl.intervals("copy")
    assert segments and copies and all(b >= a for a, b in segments + copies)
    steps = tl.intervals("step")
    assert union_length(segments) <= union_length(steps) + 1e-3     # device compute lies within the steps
    m = overlap_metrics(copies, tl.compute_intervals(), eng.counters["h2d_bytes"])
    assert m["copy_busy_s"] > 0 and m["link_gbps"] is not None and 0 <= m["overlap_frac"] <= 1


def test_phase_probe_reports_allocated_and_reserved_peaks():
    from harness.measure import PhaseProbe

    eng = Engine.from_pretrained("tiny-mixtral", device="cuda")
    with PhaseProbe("cuda", None) as p:
        eng.generate(PROMPT, 4)
    assert 0 < p.peak_device_bytes <= p.peak_device_reserved_bytes


@pytest.mark.parametrize("dtype,tokens", [("float32", 256), ("bfloat16", 512)])
def test_planned_transient_bounds_the_cuda_peak(dtype, tokens):
    """Upper bound only: the plan assumes SDPA's math kernel, a faster kernel allocates less."""
    from tests.engine.test_planner_memory import measured_and_planned

    peak, planned = measured_and_planned("cuda", tokens, 2, dtype)
    assert 0 < peak <= planned
