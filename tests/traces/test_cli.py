"""`moebench trace import` end to end in subprocesses: an imported vLLM trace through moebench-sim
and every cache policy, equal to the replay of the same routing built by hand; transformers'
router logits of a real checkpoint equal to our engine's routing; a count-only SGLang import that
the simulator refuses in one line, its popularity table, and static's profile in a moebench run;
--help and one-line errors."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from engine.config import preset
from engine.trace import RoutingTrace, load_trace
from engine.trace_recorder import TraceRecorder
from harness import results
from harness.sim.replay import replay
from tests.cli_runner import run_module
from tests.traces import fixtures as fx

REPO = Path(__file__).resolve().parents[2]
POLICIES = "lru,lfu,fifo,lfru,static,belady"
SMALL = ["model=tiny-mixtral", "workload=chat", "workload.context_tokens=256", "workload.gen_tokens=3",
         "run.repeats=1", "run.warmup=0", "run.quiet=true", "placement=fetch", "cache.capacity=3"]


def run(module: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return run_module(module, args, cwd, env)             # forked warm (tests/cli_runner.py)


def moebench(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return run("harness.cli", args, cwd)


def skewed(rng: np.random.Generator, n: int) -> np.ndarray:
    """[n, 4, 2] routing with hot experts, so caches of 2..4 slots both hit and miss."""
    p = np.array([8, 6, 3, 2, 1, 1, 1, 1], float)
    return np.stack([np.stack([rng.choice(8, 2, replace=False, p=p / p.sum()) for _ in range(4)])
                     for _ in range(n)]).astype(np.int64)


def test_vllm_import_replays_through_every_policy(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    p1, g1, p2, g2 = skewed(rng, 30), skewed(rng, 12), skewed(rng, 20), skewed(rng, 9)
    fx.write_jsonl(tmp_path / "r.jsonl", [fx.vllm_response(p1, [g1]), fx.vllm_response(p2, [g2], encode="base64")])
    proc = moebench(["trace", "import", "--from", "vllm", "r.jsonl", "--model", "tiny-mixtral", "--out", "t.npz"],
                    tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "vllm: 1 file(s) -> t.npz: 71 tokens x 4 layers x top-2 of 8 experts, 23 steps, 2 sequences" in proc.stdout
    sim = run("harness.sim.cli", ["t.npz", "--policy", POLICIES, "--capacity", "2,4", "--out", "sim.csv"], tmp_path)
    assert sim.returncode == 0, sim.stderr
    got = pd.read_csv(tmp_path / "sim.csv")
    # the same routing as a trace built by hand: each prompt one step, each generated token one
    steps = np.concatenate([[0] * 30, np.arange(1, 13), [13] * 20, np.arange(14, 23)]).astype(np.int32)
    hand = RoutingTrace(experts=np.concatenate([p1, g1, p2, g2]).astype(np.int32),
                        meta={"n_experts": 8, "expert_bytes": preset("tiny-mixtral").expert_bytes(4)}, step=steps)
    want = replay(hand, POLICIES.split(","), [2, 4])
    key = ["policy", "capacity", "layer"]
    merged = want.astype({"layer": str}).merge(got.astype({"layer": str}), on=key, suffixes=("_want", "_got"))
    assert len(merged) == len(want) == 6 * 2 * 5
    assert (merged.hits_want == merged.hits_got).all() and (merged.miss_bytes_want == merged.miss_bytes_got).all()
    total = got[(got.layer == "all") & (got.capacity == 2)].set_index("policy")
    assert 0 < total.loc["belady", "misses"] <= total.loc[["lru", "lfu", "fifo", "lfru"], "misses"].min()


def test_transformers_router_logits_equal_our_engine_routing(tmp_path: Path) -> None:
    """transformers' own Mixtral, saved as a checkpoint; its router logits of a batch-2 prefill,
    imported, route exactly as moebench's engine routes the same prompts from that checkpoint."""
    from engine import Engine
    from tests.conftest import hf_model
    model = hf_model("mixtral")
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    prompts = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.save(model(prompts, output_router_logits=True).router_logits, tmp_path / "pass0.pt")
    proc = moebench(["trace", "import", "--from", "transformers", "pass0.pt", "--model", str(ckpt), "--batch", "2",
                     "--out", "hf.npz"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    imported = load_trace(tmp_path / "hf.npz")
    eng = Engine.from_pretrained(str(ckpt), device="cpu")
    with TraceRecorder(eng) as rec:
        eng.generate(prompts.tolist(), max_new_tokens=1)
        ours = rec.trace()
    first = ours.step == 0
    assert imported.n_tokens == int(first.sum()) == 14
    assert np.array_equal(np.sort(imported.experts, axis=2), np.sort(ours.experts[first], axis=2))
    assert imported.sequence.tolist() == ours.sequence[first].tolist() == [0] * 7 + [1] * 7
    assert imported.moe_layers == ours.moe_layers and imported.n_experts == ours.n_experts


@pytest.fixture()
def counts_trace(tmp_path: Path) -> tuple[Path, np.ndarray]:
    counts = np.random.default_rng(5).integers(0, 40, size=(4, 8)) * np.array([9, 5, 3, 1, 1, 1, 1, 1])
    fx.sglang_stat_csv(tmp_path / "stat.csv", counts, [0, 1, 2, 3])
    proc = moebench(["trace", "import", "--from", "sglang-stat", "stat.csv", "--model", "tiny-mixtral",
                     "--out", "counts.npz"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "count-only" in proc.stdout and "replays refuse it" in proc.stdout
    return tmp_path / "counts.npz", counts


def test_count_only_refused_by_replays_accepted_by_popularity(tmp_path: Path, counts_trace, capsys) -> None:
    from harness.sim.cli import main as sim_main
    path, counts = counts_trace
    refusal = "count-only trace (expert counts per layer, no token order) cannot drive"
    proc = run("harness.sim.cli", [str(path)], tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and refusal in proc.stderr
    for extra in (["--curve"], ["--stats"], ["--policy", "static", "--capacity", "3"]):   # the same main, in process
        assert sim_main([str(path), *extra]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and refusal in err, err
    proc = run("harness.sim.cli", [str(path), "--popularity", "--capacity", "2,3", "--out", "pop.csv"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    pop = pd.read_csv(tmp_path / "pop.csv").astype({"layer": str})
    for c in (2, 3):
        want = np.sort(counts, axis=1)[:, -c:].sum() / counts.sum()
        assert np.isclose(pop[(pop.layer == "all") & (pop.capacity == c)].top_c_share.item(), want)


@pytest.mark.slow
def test_count_only_profile_pins_as_its_table_does(tmp_path: Path, counts_trace) -> None:
    """static with the imported counts as its profile runs, and hits exactly as with the same
    counts given as a popularity table: the profile is the counts, nothing invented."""
    path, counts = counts_trace
    (tmp_path / "pop.json").write_text(json.dumps(counts.tolist()))
    hits = {}
    for name, opt in (("trace", f"cache.policy_options.trace={path}"),
                      ("table", f"cache.policy_options.popularity={tmp_path / 'pop.json'}")):
        proc = moebench([*SMALL, "cache.policy=static", opt, f"hydra.run.dir={tmp_path / name}"], tmp_path)
        assert proc.returncode == 0, proc.stderr
        df = results.load(tmp_path / name)
        assert (df.status == "ok").all()
        hits[name] = df[df.metric == "expert_hits"].sort_values(["repeat", "phase"])["value"].tolist()
    assert hits["trace"] == hits["table"] and sum(hits["trace"]) > 0


def test_help_and_one_line_errors(tmp_path: Path, capsys, monkeypatch) -> None:
    """--help and a layer mismatch through `moebench`; the other errors through the same main in process."""
    from harness.traces.cli import main
    proc = moebench(["trace", "import", "--help"], tmp_path)
    assert proc.returncode == 0 and "--from FORMAT" in proc.stdout and "sglang-per-token" in proc.stdout
    monkeypatch.chdir(tmp_path)
    assert main(["--help"]) == 0 and "moebench trace import --from FORMAT" in capsys.readouterr().out
    (tmp_path / "empty.json").write_text("")
    (tmp_path / "flat.json").write_text(json.dumps({"prompt_routed_experts": [[1, 2], [3, 4]], "choices": []}))
    fx.write_jsonl(tmp_path / "three.jsonl", [fx.vllm_response(fx.routing(np.random.default_rng(0), 2, 3, 2, 8), [])])
    cases = {
        "empty.json": r"empty.json: not valid JSON (Expecting value at line 1 column 1); allowed: a vLLM completion",
        "flat.json": "prompt_routed_experts: expected expert ids of shape [tokens, layers, top_k], got shape (2, 2)",
        "three.jsonl": "layer count mismatch: the vllm routing has 3 MoE layers, model tiny-mixtral has 4",
    }
    proc = moebench(["trace", "import", "--from", "vllm", "three.jsonl", "--model", "tiny-mixtral", "--out", "x.npz"],
                    tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and cases["three.jsonl"] in proc.stderr
    for name, message in cases.items():
        assert main(["import", "--from", "vllm", name, "--model", "tiny-mixtral", "--out", "x.npz"]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "x.npz").exists()
    assert main(["import", "--from", "vllm", "three.jsonl", "--out", "x.npz"]) == 2
    assert "--n-experts N" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["import", "three.jsonl", "--out", "x.npz"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "the following arguments are required: --from" in err
