"""llama-bench output -> tidy rows + manifest, on a real short llama-bench run of the tiny model."""
from __future__ import annotations

import json
import subprocess

import pytest

from harness.llamacpp.bench_import import BenchImportError, import_file, main, read_records
from harness.llamacpp.flags import LlamaFlags
from harness.results import load


@pytest.fixture(scope="module")
def bench_outputs(bins, gguf_f32, tmp_path_factory):
    """llama-bench -p 16 -n 4 -r 2 on the tiny f32 model, as JSONL and as JSON."""
    d = tmp_path_factory.mktemp("llama-bench")
    knobs = LlamaFlags(threads=1, flash_attn="off").bench_argv(bins.bench)
    out = {}
    for fmt in ("jsonl", "json"):
        proc = subprocess.run([str(bins.bench), "-m", str(gguf_f32.path), "-p", "16", "-n", "4", "-r", "2",
                               *knobs, "-o", fmt], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        (d / f"bench.{fmt}").write_text(proc.stdout)
        out[fmt] = d / f"bench.{fmt}"
    return out


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["jsonl", "json"])
def test_import_round_trip(bench_outputs, fmt, tmp_path):
    path = bench_outputs[fmt]
    records = read_records(path)
    assert {(r["n_prompt"], r["n_gen"]) for r in records} == {(16, 0), (0, 4)}
    assert main([str(path), "--out", str(tmp_path / "job"), "--job-id", "j0"]) == 0
    df = load(tmp_path / "job")
    assert set(df["phase"]) == {"prefill_fresh", "decode"}
    assert set(df["engine"]) == {"llamacpp"} and set(df["source"]) == {"engine"}
    assert set(df["token_source"]) == {"random"}
    for phase, n, rec in (("prefill_fresh", 16, next(r for r in records if r["n_prompt"])),
                          ("decode", 4, next(r for r in records if r["n_gen"]))):
        tps = df[(df.phase == phase) & (df.metric == "tok_per_s")].sort_values("repeat")
        assert list(tps["repeat"]) == [0, 1] and list(tps["value"]) == pytest.approx(rec["samples_ts"])
        t = df[(df.phase == phase) & (df.metric == "time_s")].sort_values("repeat")
        assert list(t["value"]) == pytest.approx([ns / 1e9 for ns in rec["samples_ns"]])
        assert set(df[(df.phase == phase) & (df.metric == "tokens")]["value"]) == {n}
    # knobs as columns, under the names LlamaFlags.as_factors uses
    assert set(df["threads"]) == {1} and set(df["flash_attn"]) == {"off"} and set(df["kv_dtype"]) == {"f16"}
    assert {"n_gpu_layers", "ubatch", "n_batch", "cache_type_k", "n_cpu_moe"} <= set(df.columns)
    # what llama-bench does not measure is absent, never 0
    assert not {"peak_host_rss_bytes", "h2d_bytes", "expert_hits", "hit_rate"} & set(df["metric"])
    assert df["value"].notna().all()
    manifest = json.loads((tmp_path / "job" / "manifest.json").read_text())
    build = manifest["llama_bench"]["build"]
    assert build["build_commit"] == records[0]["build_commit"] and "CPU" in build["backends"]
    assert manifest["job_id"] == "j0"


def test_not_llama_bench_output_is_refused(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('{"hello": 1}\n')
    with pytest.raises(BenchImportError, match="samples_ts"):
        import_file(p)
    assert main([str(p), "--out", str(tmp_path / "j")]) == 1
