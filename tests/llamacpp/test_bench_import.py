"""llama-bench output -> tidy rows + manifest, on a real short llama-bench run of the tiny model."""
from __future__ import annotations

import json
import subprocess

import pytest

from harness.compare import compare
from harness.llamacpp.bench_import import BenchImportError, file_type, import_file, main, read_records
from harness.llamacpp.flags import LlamaFlags
from harness.results import load, spread_table
from harness.table import sweep_table


@pytest.fixture(scope="module")
def bench_outputs(bins, gguf_f32, tmp_path_factory):
    """llama-bench -p 16 -n 4 -r 2 on the tiny f32 model, as JSONL and as JSON; and a sweep of
    -t 1,2 (four records: pp and tg at each thread count)."""
    d = tmp_path_factory.mktemp("llama-bench")
    knobs = LlamaFlags(threads=1, flash_attn="off").bench_argv(bins.bench)
    out = {}
    for name, fmt, argv in (("jsonl", "jsonl", knobs), ("json", "json", knobs),
                            ("threads", "jsonl", [*LlamaFlags(flash_attn="off").bench_argv(bins.bench), "-t", "1,2"])):
        proc = subprocess.run([str(bins.bench), "-m", str(gguf_f32.path), "-p", "16", "-n", "4", "-r", "2",
                               *argv, "-o", fmt], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        (d / f"bench-{name}.{fmt}").write_text(proc.stdout)
        out[name] = d / f"bench-{name}.{fmt}"
    return out


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["jsonl", "json"])
def test_import_round_trip(bench_outputs, fmt, tmp_path):
    path = bench_outputs[fmt]
    records = read_records(path)
    assert {(r["n_prompt"], r["n_gen"]) for r in records} == {(16, 0), (0, 4)}
    assert main([str(path), "--out", str(tmp_path / "sweep"), "--job-id", "j0"]) == 0
    df = load(tmp_path / "sweep")
    assert set(df["phase"]) == {"prefill_fresh", "decode"}
    # one job per test record, in the file's order
    for i, rec in enumerate(records):
        assert set(df[df.phase == ("prefill_fresh" if rec["n_prompt"] else "decode")]["job_id"]) == {f"j0-{i}"}
    assert (tmp_path / "sweep" / "results.parquet").is_file() and (tmp_path / "sweep" / "summary.csv").is_file()
    assert set(df["gguf_type"]) == {"f32"} and set(df["dtype"]) == {"float32"}    # "llama ?B all F32"
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
    manifest = json.loads((tmp_path / "sweep" / "1" / "manifest.json").read_text())
    build = manifest["llama_bench"]["build"]
    assert build["build_commit"] == records[1]["build_commit"] and "CPU" in build["backends"]
    assert manifest["job_id"] == "j0-1" and manifest["llama_bench"]["record"] == 1


@pytest.mark.slow
def test_a_knob_sweep_is_one_job_per_setting(bench_outputs, tmp_path):
    """llama-bench -t 1,2: each thread count is its own config in the summary, the table and a
    comparison, with its own repeats -- never one median over both."""
    path = bench_outputs["threads"]
    records = read_records(path)
    assert sorted((r["n_threads"], bool(r["n_gen"])) for r in records) == [(1, False), (1, True), (2, False), (2, True)]
    assert main([str(path), "--out", str(tmp_path / "sweep")]) == 0
    df = load(tmp_path / "sweep")
    assert df["job_id"].nunique() == 4
    for (threads, phase), g in df[df.metric == "tok_per_s"].groupby(["threads", "phase"]):
        rec = next(r for r in records if r["n_threads"] == threads and bool(r["n_gen"]) == (phase == "decode"))
        assert sorted(g["value"]) == pytest.approx(sorted(rec["samples_ts"]))
        assert sorted(g["repeat"]) == [0, 1]
    spread = spread_table(df)
    decode = spread[(spread.phase == "decode") & (spread.metric == "tok_per_s")]
    assert sorted(decode["n"]) == [2, 2]
    table = sweep_table(df)
    assert "threads" in table.columns and sorted(table["threads"]) == [1, 1, 2, 2]
    table = compare(df, df).table
    rows = table[(table.phase == "decode") & (table.metric == "tok_per_s")]
    assert sorted(rows["threads"]) == ["1", "2"] and set(rows["n_base"]) == {2}


@pytest.mark.parametrize("model_type, ftype", [
    ("llama ?B all F32", "f32"), ("mixtral 8x7B Q4_K - Medium", "q4_k_m"), ("llama 7B Q5_K - Small", "q5_k_s"),
    ("qwen3moe 30B.A3B Q8_0", "q8_0"), ("gpt-oss 20B MXFP4 MoE", "mxfp4_moe"), ("llama 7B IQ2_XS - 2.3125 bpw", "iq2_xs"),
    ("llama 7B (guessed) F16", "f16"), ("llama", None)])
def test_file_type_is_the_whole_ftype_name(model_type, ftype):
    assert file_type(model_type) == ftype


def test_not_llama_bench_output_is_refused(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('{"hello": 1}\n')
    with pytest.raises(BenchImportError, match="samples_ts"):
        import_file(p)
    assert main([str(p), "--out", str(tmp_path / "j")]) == 1
