"""Knobs -> argv, and validation against what the real binaries' --help accepts."""
from __future__ import annotations

import pytest

from harness.llamacpp.flags import (CPU_MOE_OVERRIDE, DEFAULTS, EXACT, FlagError, LlamaFlags, cpu_expert_layers,
                                    cpu_layers_override, help_spec, kv_treatment)


def test_argv_spelling_server_and_bench():
    f = LlamaFlags(n_gpu_layers=99, n_cpu_moe=3, override_tensor=("exps=CPU",), ubatch=128, batch=512, ctx=1024,
                   cache_type_k="q8_0", cache_type_v="q8_0", flash_attn="on", threads=2, cache_ram=0)
    assert f.server_argv() == ["-t", "2", "-ngl", "99", "--n-cpu-moe", "3", "-ot", "exps=CPU", "-ub", "128",
                               "-b", "512", "-c", "1024", "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on",
                               "-np", "1", "-cram", "0"]
    assert f.bench_argv() == ["-t", "2", "-ngl", "99", "-ncmoe", "3", "-ot", "exps=CPU", "-ub", "128",
                              "-b", "512", "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"]
    assert LlamaFlags(cpu_moe=True).server_argv() == ["--cpu-moe", "-np", "1"]
    # llama-bench has no --cpu-moe: the same override spelled out, in the one -ot of the test
    assert LlamaFlags(cpu_moe=True, override_tensor=("a=CPU",)).bench_argv() == ["-ot", "a=CPU;" + CPU_MOE_OVERRIDE]
    assert DEFAULTS.server_argv() == ["-np", "1"]
    assert EXACT.server_argv() == ["-ctk", "f32", "-ctv", "f32", "-fa", "off", "-np", "1"]


def test_factors_name_the_knobs():
    f = EXACT.replace(threads=2, batch=256).as_factors()
    assert f["kv_dtype"] == "f32" and f["flash_attn"] == "off" and f["n_batch"] == 256 and f["threads"] == 2
    assert f["override_tensor"] is None and f["n_gpu_layers"] is None
    assert LlamaFlags(cache_type_k="q8_0").as_factors()["kv_dtype"] == "q8_0/default"


@pytest.mark.parametrize("kw, words", [
    (dict(flash_attn="yes"), ["flash_attn", "'yes'", "on", "off", "auto"]),
    (dict(ubatch=0), ["ubatch", "0"]),
    (dict(n_gpu_layers="most"), ["n_gpu_layers", "'most'", "auto"]),
    (dict(cpu_moe=True, n_cpu_moe=2), ["cpu_moe", "n_cpu_moe=2"]),
    (dict(override_tensor=("exps",)), ["PATTERN=BUFFER", "'exps'"]),
    (dict(cache_ram=-5), ["cache_ram", "-5"]),
])
def test_bad_values_fail_at_construction(kw, words):
    with pytest.raises(FlagError) as e:
        LlamaFlags(**kw)
    for w in words:
        assert w in str(e.value)


def test_help_of_the_real_build_is_parsed(bins):
    server = help_spec(bins.server)
    for flag in ("-ngl", "--cpu-moe", "--n-cpu-moe", "-ot", "-ub", "-b", "-c", "-ctk", "-ctv", "-fa", "-t", "-np",
                 "-cram", "--slot-save-path"):
        assert flag in server.flags, flag
    assert "f32" in server.choices["-ctk"] and "q8_0" in server.choices["-ctk"]
    assert set(server.choices["-fa"]) >= {"on", "off", "auto"}
    bench = help_spec(bins.bench)
    assert "-ncmoe" in bench.flags and "-ctk" in bench.flags


def test_validation_names_knob_value_and_what_the_build_accepts(bins):
    EXACT.replace(threads=1, ubatch=64).server_argv(bins.server)            # accepted
    with pytest.raises(FlagError) as e:
        LlamaFlags(cache_type_k="q3_k").server_argv(bins.server)
    msg = str(e.value)
    assert "cache_type_k='q3_k'" in msg and "llama-server" in msg and "f32" in msg and "q8_0" in msg


def test_llama_bench_rejects_f32_kv_before_launch(bins):
    """llama-bench cannot run the exact configuration: its -ctk has no f32."""
    with pytest.raises(FlagError) as e:
        EXACT.bench_argv(bins.bench)
    assert "cache_type_k='f32'" in str(e.value) and "llama-bench" in str(e.value)
    LlamaFlags(cache_type_k="f16", cache_type_v="f16", flash_attn="off", threads=1).bench_argv(bins.bench)


def test_a_ubatch_above_the_batch_is_refused_not_clamped():
    """llama.cpp clamps -ub to -b: the rows would say ubatch 512 for micro-batches of 256."""
    LlamaFlags(batch=512, ubatch=512)                                        # equal: accepted
    with pytest.raises(FlagError, match=r"ubatch 512 > batch 256: llama.cpp would clamp -ub to -b"):
        LlamaFlags(batch=256, ubatch=512)


def test_llamacpp_maps_kv_dtype_to_cache_types():
    assert kv_treatment(EXACT, "model", {}) == EXACT
    for kv, ctype in (("f16", "f16"), ("bf16", "bf16"), ("q8", "q8_0"), ("q4", "q4_0")):
        f = kv_treatment(EXACT, kv, {})
        assert (f.cache_type_k, f.cache_type_v) == (ctype, ctype)
        assert f.flash_attn == ("on" if kv in ("q8", "q4") else "off")     # llama.cpp quantises V only with -fa
        pairs = f._pairs(bench=False)
        assert ("cache_type_k", "-ctk", ctype) in pairs and ("cache_type_v", "-ctv", ctype) in pairs
    with pytest.raises(FlagError, match=r"kv.dtype=fp8: llama.cpp has no such KV cache type; allowed .*q8"):
        kv_treatment(DEFAULTS, "fp8", {})
    with pytest.raises(FlagError, match=r"engine.cache_type_k=f32 was given"):
        kv_treatment(EXACT, "q8", {"cache_type_k": "f32"})
    with pytest.raises(FlagError, match=r"engine.flash_attn=off was given"):
        kv_treatment(EXACT, "q4", {"flash_attn": "off"})


def test_the_cpu_layers_of_each_flag():
    """Which layers' experts stay on the CPU, as llama.cpp reads its flags (no launch needed)."""
    assert cpu_expert_layers(EXACT, 6) is None                                   # -ngl auto: decided at load
    full = EXACT.replace(n_gpu_layers="all")
    assert cpu_expert_layers(full, 6) == frozenset()
    assert cpu_expert_layers(full.replace(n_cpu_moe=2), 6) == {0, 1}
    assert cpu_expert_layers(full.replace(cpu_moe=True), 6) == set(range(6))
    assert cpu_expert_layers(full.replace(override_tensor=cpu_layers_override([1, 4])), 6) == {1, 4}
    assert cpu_expert_layers(EXACT.replace(n_gpu_layers=4), 6) == {0, 1}            # the last 4 offloaded
    # one layer's pattern matches that layer only (blk.1 is not blk.10)
    assert cpu_expert_layers(full.replace(override_tensor=cpu_layers_override([1])), 12) == {1}
    assert cpu_expert_layers(full.replace(override_tensor=("attn=CPU",)), 6) == frozenset()
