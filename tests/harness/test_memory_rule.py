"""One memory rule: `moebench plan`'s verdict, `moebench fit`'s answer and the cost model's
"fits" (what `moebench predict` and the `what_if` API report) are the same planner with the same
terms and the same reserve, on every preset and placement at several contexts."""
from __future__ import annotations

import dataclasses

import pytest

from engine.config import PRESETS
from engine.dtypes import dtype_bytes
from harness.contract import session_tokens
from harness.costmodel import PlacementSpec, predict
from harness.costmodel.profiles import load_profile
from harness.costmodel.timemodel import planned_bytes
from harness.plan import budget_of, fit_cpu_layers, spec_of, verdict
from harness.predict_inputs import shape_of

MODELS = sorted(name for name in PRESETS if not name.startswith("tiny-"))
PLACEMENTS = ("resident", "cpu", "hybrid", "fetch")
PROFILE = "rtx4090-pcie4-x16"


def job(model: str, placement: str, context: int) -> list[str]:
    options = {"hybrid": ["placement.n_cpu_layers=4"],
               "fetch": [f"cache.capacity={min(2 * PRESETS[model].top_k, PRESETS[model].n_experts)}"]}
    return [f"model={model}", "model.dtype=bfloat16", f"hardware={PROFILE}", f"placement={placement}",
            *options.get(placement, []), f"workload.context_tokens={context}", "run.check_reference=false"]


def allowed(model: str, context: int) -> bool:
    return session_tokens(context, 32, 64) <= PRESETS[model].max_position_embeddings


def api_verdict(spec, budget: int | None) -> tuple[int, bool | None]:
    """The cost model's planned bytes and verdict for the job's configuration."""
    pl = PlacementSpec(spec.placement, spec.capacity if isinstance(spec.capacity, int) else None,
                       options=dict(spec.placement_options))
    return planned_bytes(spec.planned_config, pl, shape_of(spec), dtype_bytes(spec.dtype), budget)


@pytest.mark.parametrize("model", MODELS)
def test_plan_and_the_cost_model_agree_on_every_placement(model):
    seen = set()
    for placement in PLACEMENTS:
        for context in (2048, 32768):
            if not allowed(model, context):
                continue
            spec = spec_of(job(model, placement, context))
            v = verdict(spec)
            total, fits = api_verdict(spec, budget_of(spec))
            assert fits == v.fits, (model, placement, context, v.message)
            if v.fits:
                assert total == v.plan.total - v.plan.reserve    # the same terms; the reserve is the budget's
            seen.add(fits)
    assert seen, model


def test_a_plan_inside_the_reserve_does_not_fit_in_either():
    """The what-if used to compare the plan without its reserve to the card: 22.97 GiB "fits"
    24 GiB while the planner, keeping 5% back, refuses it. Now both refuse it."""
    spec = spec_of(job("qwen3-30b-a3b", "fetch", 4096))
    total, _ = api_verdict(spec, None)
    budget = int(total / 0.97)                                   # inside the 5% reserve, under the card
    hw = dataclasses.replace(load_profile(PROFILE), device_memory_gib=budget / 2**30)
    pl = PlacementSpec("fetch", 16, options=dict(spec.placement_options))
    p = predict(spec.planned_config, pl, shape_of(spec), hw, dtype=spec.dtype)
    assert p.planned_device_bytes == total < budget and p.fits_device_memory is False
    assert verdict(dataclasses.replace(spec, hardware=dataclasses.replace(
        spec.hardware, device_memory=f"{budget}B"))).fits is False


@pytest.mark.parametrize("model", ["gpt-oss-120b", "qwen3-30b-a3b", "mixtral-8x7b"])
def test_fit_answers_the_fewest_cpu_layers_the_cost_model_accepts(model):
    spec = spec_of(job(model, "hybrid", 32768 if allowed(model, 32768) else 16384))
    n, text = fit_cpu_layers(spec)
    assert n is not None, text
    budget = budget_of(spec)
    at = lambda k: api_verdict(dataclasses.replace(spec, placement_options={   # noqa: E731
        **spec.placement_options, "n_cpu_layers": k}), budget)[1]
    assert at(n) is True
    assert n == 0 or at(n - 1) is False
