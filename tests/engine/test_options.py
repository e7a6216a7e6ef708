"""`EngineOptions`: the one object `Engine.from_pretrained` reads, and the keyword form that builds
the same engine from it (the public API: options as keywords, placement options among them)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from engine import Engine, EngineOptions

PROMPT = [[5, 17, 99, 3, 42, 8]]


def test_keywords_sort_into_fields_and_placement_options():
    o = EngineOptions.of(placement="fetch", cache_capacity=2, device="cpu", issue_ahead=True)
    assert (o.placement, o.cache_capacity, o.device) == ("fetch", 2, "cpu")
    assert o.placement_options == {"issue_ahead": True}
    assert EngineOptions.of(placement_options={"issue_ahead": True}, n_cpu_layers=2).placement_options == \
        {"issue_ahead": 1, "n_cpu_layers": 2}


def test_replace_keeps_what_it_does_not_name():
    o = EngineOptions(placement="fetch", cache_capacity=2, placement_options={"issue_ahead": True})
    r = o.replace(device="cpu", cache_capacity=3)
    assert (r.placement, r.cache_capacity, r.device, r.placement_options) == ("fetch", 3, "cpu", {"issue_ahead": True})
    assert o.device == "auto" and o.cache_capacity == 2                     # frozen: the original is unchanged
    assert o.replace(placement="resident", placement_options={}).placement_options == {}


def test_an_options_object_and_keywords_build_the_same_engine():
    by_object = Engine.from_pretrained("tiny-mixtral", EngineOptions(
        placement="fetch", cache_capacity=2, device="cpu", max_context=64, placement_options={"issue_ahead": False}))
    by_keywords = Engine.from_pretrained("tiny-mixtral", placement="fetch", cache_capacity=2, device="cpu",
                                         max_context=64, issue_ahead=False)
    mixed = Engine.from_pretrained("tiny-mixtral", EngineOptions(placement="fetch", device="cpu"),
                                   cache_capacity=2, max_context=64, issue_ahead=False)
    assert by_object.options == by_keywords.options == mixed.options
    assert by_object.options["issue_ahead"] is False and by_object.plan.capacity == 2
    outs = [e.generate(PROMPT, 4) for e in (by_object, by_keywords, mixed)]
    assert outs[0].tokens == outs[1].tokens == outs[2].tokens
    assert by_object.counters == by_keywords.counters


def test_a_wrong_option_is_refused_in_the_same_words_either_way():
    for build in (lambda: Engine.from_pretrained("tiny-mixtral", device="cpu", placement="hybrid", n_cpu_layer=2),
                  lambda: Engine.from_pretrained("tiny-mixtral", EngineOptions(
                      device="cpu", placement="hybrid", placement_options={"n_cpu_layer": 2}))):
        with pytest.raises((TypeError, ValueError), match="n_cpu_layer"):
            build()


def test_options_import_without_torch():
    code = "import sys; from engine import EngineOptions; EngineOptions.of(placement='fetch'); " \
           "assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
