"""`moebench predict` through the CLI in subprocesses: the human table of a preset, the JSON rows'
schema and their `fits` -- the verdict `moebench plan` gives for the same overrides, over presets x
placements x contexts -- a sweep's row per job with the hit rate it was told or the synthetic one it
states, bad input in one line; and, in process, that a prediction at 128k context for the largest
preset runs (its routing is bounded) and predicts a slower decode at a longer context."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine.config import PRESETS
from harness.contract import session_tokens
from harness.costmodel import WorkloadShape, predict
from harness.costmodel.timemodel import RESOURCES
from harness.plan import gpu_driver_present, plan_main
from harness.predict_inputs import SOURCES
from tests.harness.test_cli_help import LOADED
from tests.harness.test_trust import REPO, cli
from tests.plugins import needs_engine

REQUIRED = {"placement": str, "options": dict, "fits": bool, "prefill_tok_s": (float, type(None)),
            "ttft_s": (float, type(None)), "decode_tok_s": (float, type(None)), "bound": dict, "inputs": dict}
BOX = ["hardware=rtx4090-pcie4-x16", "hardware.device_memory=24GiB", "model.dtype=bfloat16"]


def rows_of(args: list[str], code: int | None = 0) -> list[dict]:
    """The JSON rows; `code`: the exit status asked for (None: 0 or 1, fits or not)."""
    proc = cli(["predict", *args, "--format", "json"], REPO)
    assert proc.returncode == code if code is not None else proc.returncode in (0, 1), proc.stderr
    return json.loads(proc.stdout)


def check_schema(row: dict) -> None:
    for key, kind in REQUIRED.items():
        assert isinstance(row[key], kind), (key, row[key])
    assert set(row["bound"]) == {"prefill", "decode"}
    for name, entry in row["inputs"].items():
        if name == "hit_rate_source":
            assert isinstance(entry, str) and entry
            continue
        assert set(entry) >= {"value", "unit", "source"} and entry["source"] in SOURCES, (name, entry)
    if row["fits"] and row["reason"] is None:        # predicted: every figure, and what bounds each phase
        assert row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0
        assert row["ttft_s"] == pytest.approx(row["context_tokens"] / row["prefill_tok_s"])
        assert row["bound"]["prefill"] in RESOURCES and row["bound"]["decode"] in RESOURCES
        for phase, spent in row["spent_s"].items():
            assert max(spent, key=spent.get) == row["bound"][phase]
    else:                                            # no figures without a plan that fits
        assert (row["prefill_tok_s"], row["ttft_s"], row["decode_tok_s"]) == (None, None, None)
        assert row["reason"].startswith("does not fit: " if not row["fits"] else "cannot predict: ")


@pytest.mark.slow
def test_human_table_lists_every_registered_placement_of_one_preset():
    proc = cli(["predict", "model=mixtral-8x7b", *BOX], REPO)
    assert proc.returncode == 0, proc.stderr          # at least one placement fits
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("mixtral-8x7b, bfloat16, context 4096 (+32 generated) x batch 1, ubatch 512, "
                               "hardware=rtx4090-pcie4-x16, budget 24.00 GiB")
    assert lines[1].split() == ["placement", "options", "fits", "plan", "prefill", "tok/s", "TTFT", "s", "decode",
                                "tok/s", "hit", "rate", "bound:", "prefill", "/", "decode"]
    registered = subprocess.run([sys.executable, "-c", "from engine.registry import PLACEMENTS; "
                                 "print(' '.join(PLACEMENTS.names()))"], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.split()
    table = {line.split()[0]: line for line in lines[2:2 + len(registered)]}
    assert sorted(table) == sorted(registered)
    cpu = table["cpu"].split()
    assert cpu[1:3] == ["-", "yes"] and float(cpu[5]) > 0 and "host RAM bandwidth" in table["cpu"]
    assert table["resident"].split()[2] == "no"       # 88.8 GiB of bf16 weights on a 24 GiB card
    assert "  resident: does not fit: placement 'resident' does not fit the device budget: " in proc.stdout
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_json_rows_have_the_schema_and_fit_as_moebench_plan_says(capsys):
    grid = ["model=mixtral-8x7b,qwen3-30b-a3b,gpt-oss-20b", "placement=resident,fetch,hybrid,cpu",
            "placement.n_cpu_layers=12", "cache.capacity=auto", "workload.context_tokens=4096,16384"]
    rows = rows_of(["-m", *grid, *BOX], code=1)         # exit 1: some job has no placement that fits
    assert len(rows) == 3 * 4 * 2                     # one row per job: each job chooses its placement
    for row in rows:
        check_schema(row)
        assert plan_main(row["overrides"]) == (0 if row["fits"] else 1), row["overrides"]
        capsys.readouterr()
    assert {r["fits"] for r in rows} == {True, False}                 # the grid holds both verdicts
    assert {r["placement"] for r in rows if r["fits"]} >= {"cpu", "hybrid", "fetch"}
    fetch = next(r for r in rows if r["placement"] == "fetch" and r["fits"])
    assert fetch["inputs"]["hit_rate_source"] == "synthetic routing trace (uniform: zipf=0, reuse=0)"
    assert fetch["inputs"]["hardware.h2d_gbps"] == {"value": 25.0, "unit": "GB/s", "source": "assumed"}
    assert fetch["inputs"]["hardware.device_mem_gbps"]["source"] == "datasheet"
    assert fetch["inputs"]["workload.context_tokens"]["source"] == "overridden"
    assert fetch["inputs"]["workload.gen_tokens"] == {"value": 32, "unit": "tokens", "source": "assumed"}


@pytest.mark.slow
def test_a_sweep_is_one_row_per_job_at_the_hit_rate_it_gives():
    """A job whose config is invalid (a context longer than Mixtral's positions) is its row with the
    reason, the sweep goes on, and the command exits 1."""
    rows = rows_of(["-m", "model=mixtral-8x7b", "placement=fetch,hybrid", "cache.hit_rate=0.5,0.9",
                    "placement.n_cpu_layers=16", "hardware=h100-pcie-80gb", "hardware.device_memory=80GiB",
                    "hardware.h2d_gbps=40", "model.dtype=bfloat16", "workload.context_tokens=4096,32768"], code=1)
    assert len(rows) == 8
    invalid = [r for r in rows if "workload.context_tokens=32768" in r["overrides"]]
    assert len(invalid) == 4 and all(not r["fits"] and r["decode_tok_s"] is None for r in invalid)
    assert all(r["reason"].startswith("workload.context_tokens: 32768 (+ 32 generated + 2 turns of 64) = 32930 "
                                      "tokens is longer than the model allows") for r in invalid)
    rows = [r for r in rows if r not in invalid]
    assert all(r["fits"] for r in rows)
    fetch = {r["inputs"]["hit_rate"]["value"]: r for r in rows if r["placement"] == "fetch"}
    assert sorted(fetch) == [0.5, 0.9] and [fetch[h]["hit_rate"] for h in (0.5, 0.9)] == pytest.approx([0.5, 0.9])
    for r in fetch.values():
        check_schema(r)
        assert r["inputs"]["hit_rate_source"] == "cache.hit_rate"
        assert r["inputs"]["hit_rate"]["source"] == "overridden"
        assert r["inputs"]["hardware.h2d_gbps"] == {"value": 40.0, "unit": "GB/s", "source": "overridden"}
        assert r["bound"]["decode"] == "link"
    assert fetch[0.9]["decode_tok_s"] > fetch[0.5]["decode_tok_s"]
    assert fetch[0.9]["prefill_tok_s"] == fetch[0.5]["prefill_tok_s"]     # the rate is decode's; prefill's simulated
    hybrid = [r for r in rows if r["placement"] == "hybrid"]
    assert all("hit_rate" not in r["inputs"] and r["options"]["n_cpu_layers"] == 16
               and r["options"]["cpu_layers"] == "first_n" for r in hybrid)


@pytest.mark.slow
@pytest.mark.parametrize("args, line", [
    (["model=nonesuch", "hardware=h100-pcie-80gb"], "moebench predict: model=nonesuch: no such option; allowed: "),
    (["placement=teleport", "hardware=h100-pcie-80gb"], "moebench predict: placement=teleport: no such option; "
                                                         "allowed: cpu, fetch, "),
    (["--format", "xml"], "moebench predict: --format: allowed human, json; got 'xml'"),
    (["cache.hit_rate=1.5", "hardware=h100-pcie-80gb"], "moebench predict: cache.hit_rate: allowed a fraction in "
                                                        "[0, 1] or null, got 1.5"),
    ([], "moebench predict: hardware=local: holds no figures to predict with; allowed: hardware=<a profile: "),
])
def test_bad_input_is_one_line(args, line):
    proc = cli(["predict", *args], REPO)
    assert proc.returncode == 2
    assert proc.stderr.startswith(line) and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stdout == ""


def test_a_run_and_a_plan_refuse_a_hit_rate(capsys):
    assert plan_main(["cache.hit_rate=0.5"]) == 2
    assert "cache.hit_rate: a what-if of `moebench predict`" in capsys.readouterr().err


@pytest.mark.slow
def test_predict_loads_no_torch():
    argv = ["predict", "model=mixtral-8x7b", "hardware=h100-pcie-80gb"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", LOADED.format(heavy={"torch"}, argv=argv)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stderr.strip().splitlines()[-1])
    if gpu_driver_present():                          # device=auto: the plan asks torch for the card
        loaded = [m for m in loaded if m.split(".")[0] != "torch"]
    assert [m for m in loaded if "llamacpp" not in m] == []


def largest_preset_at(context: int) -> str:
    """The preset of most expert bytes whose positions hold a session at `context`."""
    fits = [n for n, c in PRESETS.items() if c.max_position_embeddings >= session_tokens(context, 32, 64)]
    return max(fits, key=lambda n: PRESETS[n].n_moe_layers * PRESETS[n].n_experts * PRESETS[n].expert_bytes(2))


@pytest.mark.slow
def test_a_prediction_at_128k_for_the_largest_preset_runs_and_decode_slows_with_context():
    model = largest_preset_at(131072)
    k = PRESETS[model].top_k
    for placement, kw in (("resident", {}), ("fetch", {"capacity": 2 * k})):
        decode = []
        for context in (4096, 32768, 131072):
            p = predict(model, placement, WorkloadShape(context), "h200-sxm-141gb", dtype="bfloat16", **kw)
            decode.append(p.phases["decode"].tok_per_s)
        assert decode[0] > decode[1] > decode[2] > 0, (placement, decode)


@pytest.mark.slow
def test_a_skewed_synthetic_trace_is_stated_and_raises_the_hit_rate():
    """Uniform routing gives LRU about capacity/E (0.5 here); a skewed, reusing router hits more."""
    rows = rows_of(["model=mixtral-8x7b", "placement=fetch", "cache.capacity=4", "workload.gen_tokens=257",
                    "hardware=h100-pcie-80gb", "model.dtype=bfloat16", "--zipf", "1.2", "--reuse", "0.3"])
    (row,) = rows
    check_schema(row)
    assert row["inputs"]["hit_rate_source"] == "synthetic routing trace (zipf=1.2, reuse=0.3)"
    assert row["inputs"]["hit_rate"]["source"] == "assumed" and row["inputs"]["hit_rate"]["value"] == row["hit_rate"]
    assert row["hit_rate"] > 0.6


def test_the_budget_says_where_it_came_from():
    """The card of a datasheet profile is a datasheet figure; one given on the command line is
    overridden; and a model routing to 8 experts is predicted without naming a capacity."""
    args = ["model=deepseek-v3", "placement=fetch", "hardware=h200-sxm-141gb", "model.dtype=bfloat16"]
    (row,) = rows_of(args, code=None)
    assert row["inputs"]["hardware.device_memory"]["source"] == "datasheet"
    assert row["fits"] is True and row["options"]["capacity"] >= 8       # auto: the slots the card holds
    (row,) = rows_of([*args, "hardware.device_memory=100GiB"], code=None)
    assert row["inputs"]["hardware.device_memory"] == {"value": 100 << 30, "unit": "B", "source": "overridden"}


@needs_engine("llamacpp")
def test_an_engine_lists_only_the_placements_its_knobs_lay_out(tmp_path):
    """llama.cpp has -ngl, --cpu-moe and --n-cpu-moe (resident, cpu, hybrid): no expert cache and
    no streaming, so neither predict nor plan lists fetch or stream for it, and predict says why."""
    args = ["model=qwen3-30b-a3b", "model.weight_format=q4_k_m", "engine=llamacpp", "cache.capacity=auto", *BOX]
    assert sorted(r["placement"] for r in rows_of(args)) == ["cpu", "hybrid", "resident"]
    text = cli(["predict", *args], tmp_path).stdout
    assert "not applicable: fetch: engine=llamacpp has no such layout (its knobs lay out cpu, hybrid, resident)" in text
    plan = cli(["plan", *args], tmp_path).stdout
    listed = plan.split("every placement engine=llamacpp lays out at this context and budget")[1].splitlines()[1:]
    assert [line.split()[0] for line in listed] == ["cpu", "hybrid", "resident"]
    ours = rows_of([a for a in args if not a.startswith(("engine=", "model.weight_format"))])
    assert {"fetch", "stream"} <= {r["placement"] for r in ours}          # ours lays out every registered one
