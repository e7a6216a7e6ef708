"""`engine=llamacpp` through the real CLI and the real pinned llama.cpp: every phase, agreement
with our exact reference in the exact configuration and not in a lossy one, its knobs as sweep
axes in one table, validation before launch, a server killed mid-job, llama-bench import."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from harness import results
from tests.cli_runner import run_cli

REPO = Path(__file__).resolve().parents[2]
SMALL = ["engine=llamacpp", "workload=chat", "workload.context_tokens=256", "workload.gen_tokens=8",
         "run.repeats=1", "run.quiet=true"]
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _built(bins):          # the real build (tests/llamacpp/conftest.py): skip or fail when missing
    return bins


def cli(args: list[str], cwd: Path, check: bool = True, **env_extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env_extra}
    proc = run_cli(args, cwd, env, timeout=900)
    if check:
        assert proc.returncode == 0, f"{args}\n{proc.stdout}\n{proc.stderr}"
    return proc


def run_dir(cwd: Path) -> Path:
    return next((cwd / "results" / "runs").iterdir())


def test_every_phase_in_the_exact_configuration(tmp_path, bins):
    cli(SMALL, tmp_path)
    d = run_dir(tmp_path)
    df = results.load(d)
    assert (df.status == "ok").all()
    assert {"load", "prefill_fresh", "decode", "prefill_continuation", "kv_offload", "prefill_restored"} <= set(df.phase)
    speed = df[df.profiler == "none"]
    eng = speed[speed.source == "engine"].set_index(["phase", "metric"])["value"]
    assert (speed[speed.metric == "token_agreement"].value == 1.0).all()        # tokens of our exact reference
    assert speed[speed.metric == "max_abs_logprob_diff"].value.max() < 1e-3     # and its top-k logprobs
    # it reports logprobs, not logits: each phase with tokens has a logprob difference and no logit row
    # (a null one no column would explain)
    assert "max_abs_logit_diff" not in set(speed.metric)
    checked = speed[speed.metric == "token_agreement"].phase
    logprob = speed[speed.metric == "max_abs_logprob_diff"]
    assert set(logprob.phase) == set(checked) and logprob.value.notna().all()
    client = speed[speed.source == "client"].set_index(["phase", "metric"])["value"]
    assert eng[("prefill_fresh", "reused_tokens")] == 0                         # a fresh prefill is fresh
    for phase in ("prefill_continuation", "prefill_restored"):                  # the server reused the whole history
        assert eng[(phase, "reused_tokens")] == client[(phase, "reused_tokens")] > 256
    assert eng[("kv_offload", "saved_state_bytes")] > 0 and eng[("prefill_restored", "restore_s")] >= 0
    assert eng[("decode", "time_s")] > 0 and eng[("prefill_fresh", "peak_host_rss_bytes")] > 0
    assert speed[speed.metric == "h2d_bytes"].value.isna().all()                # not measurable: null, never 0
    # the context the server runs: the 395 tokens asked for (-c), which llama.cpp pads up to 512;
    # and the commit of the server that ran, from the server itself
    assert set(df.n_ctx.dropna()) == {512} and set(df.llamacpp_commit.dropna()) == {bins.info.llama_cpp_commit}
    assert set(speed.placement.dropna()) == set() and set(speed.flash_attn.dropna()) == {"off"}
    assert (d / "llama-server.log").stat().st_size > 0


def test_a_lossy_setting_is_reported_not_hidden(tmp_path):
    cli([*SMALL, "engine.weights=q8_0", "workload.gen_tokens=32"], tmp_path)
    df = results.load(run_dir(tmp_path))
    decode = df[(df.profiler == "none") & (df.phase == "decode")].set_index("metric")["value"]
    # the reference check sees the quantised weights: log-probabilities differ from the exact model's
    # (greedy tokens may all still agree: on the trained default model q8_0 changes none of 32)
    assert decode["max_abs_logprob_diff"] > 0 and decode["token_agreement"] <= 1.0
    assert set(df.gguf_type.dropna()) == {"q8_0"} and set(df.lossy.dropna()) == {True}   # quantised weights are lossy


def test_the_model_dtype_picks_the_weights_and_the_exact_kv(tmp_path):
    """model.dtype=bfloat16 runs bf16 weights with a bf16 KV (the exact configuration in that
    dtype), not f32 ones labelled bfloat16; not lossy."""
    (tmp_path / "tmp").mkdir()
    cli([*SMALL, "model.dtype=bfloat16"], tmp_path, TMPDIR=str(tmp_path / "tmp"))
    assert not list((tmp_path / "tmp").glob("moebench-llamacpp-*"))       # the server's dir removed at exit
    df = results.load(run_dir(tmp_path))
    assert (df.status == "ok").all() and set(df.dtype) == {"bfloat16"}
    assert set(df.gguf_type.dropna()) == {"bf16"} and set(df.cache_type_k.dropna()) == {"bf16"}
    assert not df.lossy.fillna(False).astype(bool).any()
    log = (run_dir(tmp_path) / "llama-server.log").read_text()
    assert "-ctk bf16" in log and "model-bf16.gguf" in log


def test_each_thread_count_gets_its_own_server(tmp_path):
    """run.threads is the server's -t, fixed at launch: a sweep over it starts a server per value."""
    cli(["-m", "run.threads=1,2", "run.sweep_id=thr", *SMALL], tmp_path)
    sweep = tmp_path / "results" / "sweeps" / "thr"
    jobs = sorted(p.parent for p in sweep.glob(f"*/{results.ROWS_FILE}"))
    assert len(jobs) == 2
    seen = set()
    for job in jobs:
        g = results.load(job)
        threads = set(g.threads.dropna().astype(int))
        assert (g.status == "ok").all() and len(threads) == 1, threads   # every row at the job's own -t
        assert set(g[g.phase == "load"].model_load) == {"cold"}         # a new server, not the other job's
        assert f" -t {next(iter(threads))} " in (job / "llama-server.log").read_text()
        seen |= threads
    assert seen == {1, 2}


def test_knobs_are_sweep_axes_in_one_table_beside_our_hybrid(tmp_path):
    cli(["-m", "engine.n_cpu_moe=0,2", "workload.ubatch=64,128", "run.sweep_id=both", *SMALL], tmp_path)
    cli(["-m", "placement=hybrid", "placement.n_cpu_layers=0,2", "run.sweep_id=both", "run.resume=add",
         *[a for a in SMALL if a != "engine=llamacpp"]], tmp_path)
    sweep = tmp_path / "results" / "sweeps" / "both"
    df = results.load(sweep / results.SWEEP_TABLE)
    assert df.job_id.nunique() == 6 and (df.status == "ok").all()
    ll = df[df.engine == "llamacpp"].groupby("job_id")[["n_cpu_moe", "ubatch"]].first()
    assert sorted(map(tuple, ll.astype(int).to_numpy())) == [(0, 64), (0, 128), (2, 64), (2, 128)]
    table = cli(["table", str(sweep), "--format", "csv"], tmp_path).stdout
    header = table.splitlines()[0].split(",")
    assert {"engine", "n_cpu_moe", "ubatch", "placement_options", "tg tok/s"} <= set(header)
    assert len(table.strip().splitlines()) == 1 + 6


def test_a_last_n_map_is_the_same_on_both_engines(tmp_path):
    """engine.cpu_layers=last_n becomes llama.cpp's -ot list for the last layer; ours runs the same
    map as placement.cpu_layers=last_n; both rows say GGGC."""
    lean = [*SMALL, "run.passes=[speed]", "run.sweep_id=map"]
    cli(["-m", *lean, "engine.n_gpu_layers=all", "engine.n_cpu_moe=1", "engine.cpu_layers=last_n"], tmp_path)
    cli(["-m", "placement=hybrid", "placement.n_cpu_layers=1", "placement.cpu_layers=last_n", "run.resume=add",
         *[a for a in lean if a != "engine=llamacpp"]], tmp_path)
    df = results.load(tmp_path / "results" / "sweeps" / "map" / results.SWEEP_TABLE)
    assert (df.status == "ok").all() and set(df.engine) == {"llamacpp", "moebench"}
    assert set(df.placement_map) == {"GGGC"}
    ll = df[df.engine == "llamacpp"].iloc[0]
    assert ll.override_tensor == r"blk\.3\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU" and ll.n_cpu_moe is None


def test_unsupported_knobs_fail_before_any_server_starts(tmp_path):
    proc = cli([*SMALL, "engine.cache_type_k=q9_9"], tmp_path, check=False)
    assert proc.returncode == 1
    err = results.load(run_dir(tmp_path)).error.dropna().iloc[0]
    assert "q9_9" in err and "accepts" in err
    proc = cli([*SMALL, "engine.config=fastest"], tmp_path, check=False)
    assert proc.returncode == 1
    errs = results.load(tmp_path / "results" / "runs").error.dropna()
    assert errs.str.contains("config: allowed \\['exact', 'defaults'\\], got 'fastest'").any()


def test_a_server_killed_mid_job_becomes_a_failed_row_with_its_log(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    args = ["-m", "engine.n_cpu_moe=0,1", "run.sweep_id=k", *[a for a in SMALL if not a.startswith("run.repeats")],
            "run.repeats=200", "workload.gen_tokens=16"]   # ~10 s a job here: the kill lands inside it
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    victim = None
    deadline = time.time() + 300
    while victim is None and time.time() < deadline and proc.poll() is None:
        servers = [c for c in psutil.Process(proc.pid).children(recursive=True) if "llama-server" in c.name()]
        if servers:
            time.sleep(1.0)                   # mid-job: past the server's start, inside the repeats
            try:
                servers[0].send_signal(signal.SIGKILL)     # psutil refuses a pid that is no longer that server
                victim = servers[0]
            except psutil.NoSuchProcess:       # it had already ended (its job done): kill the next one
                continue
        time.sleep(0.2)
    assert victim is not None, "no llama-server started"
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 1, err
    df = results.load(tmp_path / "results" / "sweeps" / "k" / results.SWEEP_TABLE)
    failed = df[df.status == "failed"]
    assert failed.job_id.nunique() == 1 and "last lines of the llama-server log" in failed.error.iloc[0]
    assert (df[df.status == "ok"].groupby("job_id").size() > 0).sum() == 1      # the next job ran on a new server
    job_dir = next(p for p in (tmp_path / "results" / "sweeps" / "k").iterdir()
                   if p.is_dir() and (p / "DONE").is_file() and json.loads((p / "DONE").read_text())["status"] == "failed")
    assert (job_dir / "llama-server.log").stat().st_size > 0


def test_llama_bench_results_join_the_tables(tmp_path, bins, gguf_f32):
    out = tmp_path / "bench.jsonl"
    subprocess.run([str(bins.bench), "-m", str(gguf_f32.path), "-p", "16", "-n", "4", "-r", "2", "-t", "1",
                    "-o", "jsonl"], stdout=out.open("w"), check=True, timeout=300)
    cli(["import", "llama-bench", str(out), "--out", str(tmp_path / "imported")], tmp_path)
    df = results.load(tmp_path / "imported")
    assert set(df.engine) == {"llamacpp"} and {"prefill_fresh", "decode"} <= set(df.phase)
    assert df[df.metric == "tok_per_s"].groupby("phase").size().min() == 2       # the raw samples as repeats
    assert "pp tok/s" in cli(["table", str(tmp_path / "imported")], tmp_path).stdout
    # the columns a moebench llama.cpp run of the same f32 model has, spelled alike: a table over both
    # groups them by the weights, not by two spellings of one setting
    (tmp_path / "run").mkdir()
    cli([*SMALL, "run.check_reference=false", "run.ablation=false"], tmp_path / "run")
    ran = results.load(run_dir(tmp_path / "run"))
    for col, value in (("dtype", "float32"), ("gguf_type", "f32")):
        assert set(df[col]) == set(ran[col].dropna()) == {value}, col
    assert df.override_tensor.isna().all() and ran.override_tensor.isna().all()     # llama-bench's "none"


def test_an_artifact_that_cannot_be_saved_loses_no_measurement(tmp_path):
    """The server log cannot be copied into the job dir (a directory stands at its path): the
    job keeps every measured row and records the failed part, instead of becoming one failed row."""
    job = tmp_path / "job"
    (job / "llama-server.log").mkdir(parents=True)
    proc = cli([*SMALL, f"hydra.run.dir={job}"], tmp_path, check=False)
    df = results.load(job)
    ok = df[df.status == "ok"]
    assert {"prefill_fresh", "decode"} <= set(ok.phase)
    assert ok[(ok.phase == "decode") & (ok.metric == "tok_per_s")].value.notna().all()
    failed = df[df.status == "failed"]
    assert list(failed.phase) == ["artifacts"] and proc.returncode == 1


def test_an_end_of_generation_token_neither_shortens_the_decode_nor_passes_as_agreement(tmp_path):
    """A checkpoint with its own tokenizer and an eos_token_id that our greedy decode emits at its
    second step: llama.cpp would stop there (2 tokens timed, 3 counted, agreement over 2). It
    generates every token asked for instead (ignore_eos), the engine and the client count the same
    tokens, and the agreement is over all of the reference's tokens."""
    from engine import Engine
    from engine.config import preset
    from engine.export import export_preset
    from harness.llamacpp.convert import _placeholder_sentencepiece
    from workloads import build as build_workload
    from workloads.tokenize import load_tokenizer

    ckpt = tmp_path / "ckpt"                                            # the default preset, as a checkpoint
    shutil.copytree(export_preset("tiny-mixtral", 0, preset("tiny-mixtral"), tmp_path / "export"), ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    tok = load_tokenizer(str(ckpt), cfg["vocab_size"], "text")
    sample = build_workload("chat", tok, 256, 64, 1, 0, "text")      # the job's prompt (SMALL, defaults)
    ours = Engine.from_pretrained(ckpt, device="cpu").generate(sample.contexts, 8).tokens[0]
    cfg["eos_token_id"] = ours[2]                                   # the second decode step's token
    (ckpt / "config.json").write_text(json.dumps(cfg))
    (ckpt / "tokenizer.model").write_bytes(_placeholder_sentencepiece(cfg["vocab_size"]))
    cli([*SMALL, f"model.path={ckpt}"], tmp_path)
    df = results.load(run_dir(tmp_path))
    assert (df.status == "ok").all()
    decode = df[(df.phase == "decode") & (df.profiler == "none")]
    tokens = decode[decode.metric == "tokens"].set_index("source")["value"]
    assert tokens["engine"] == tokens["client"] == 7
    agreement = decode[decode.metric == "token_agreement"].value.iloc[0]
    assert agreement < 1.0           # the masked end-of-generation token: a different continuation, said so
    verdict = decode[(decode.metric == "token_agreement")].iloc[0]
    assert verdict.check_ok is not False and "ends generation" in verdict.check_reason


def test_a_cached_server_that_died_between_jobs_is_replaced(tmp_path):
    """The next job of the same engine configuration starts a new server instead of failing on
    the dead one (a real SIGKILL of the real process)."""
    from hydra import compose, initialize_config_dir

    import harness.cli  # noqa: F401 -- registers the ConfigStore
    from harness.cli import CONF_DIR
    from harness.config import validate
    from harness.engines import EngineCache

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        spec = validate(compose(config_name="config", overrides=[*SMALL, f"run.out={tmp_path}"]))
    engines = EngineCache()
    try:
        first, loaded = engines.get(spec)
        assert loaded and first.alive()
        os.kill(first.server.pid, signal.SIGKILL)
        first.server.proc.wait(timeout=30)
        second, loaded = engines.get(spec)
        assert loaded and second is not first and second.alive()
    finally:
        engines.release()
