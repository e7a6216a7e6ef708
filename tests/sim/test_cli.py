"""`moebench-sim` command line: replay, curve, stats, synthetic traces, outputs and errors."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from engine.trace import RoutingTrace, load_trace, save_trace
from harness.sim.cli import main

SILBERSCHATZ = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]


@pytest.fixture()
def textbook(tmp_path: Path) -> Path:
    return save_trace(tmp_path / "ref.npz", RoutingTrace.from_reference_string(SILBERSCHATZ))


def test_replay_prints_and_writes_parquet(textbook: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "sim.parquet"
    assert main([str(textbook), "--policy", "fifo,lru,belady", "--capacity", "3", "--curve", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "== replay" in text and "== LRU curve" in text
    df = pd.read_parquet(out)
    rep = df[(df.kind == "replay") & (df.layer == "all")].set_index("policy")
    assert rep.loc[["fifo", "lru", "belady"], "misses"].tolist() == [15, 12, 9]
    assert (df[df.kind == "curve"].capacity.max()) == 8


@pytest.mark.slow
def test_synthetic_with_stats_csv_and_saved_trace(tmp_path: Path, capsys) -> None:
    out, saved = tmp_path / "s.csv", tmp_path / "syn.npz"
    rc = main(["--synthetic", "mixtral-like", "--tokens", "300", "--capacity", "2,4", "--prefetch", "oracle",
               "--stats", "--save-trace", str(saved), "--out", str(out)])
    assert rc == 0
    assert "routing statistics" in capsys.readouterr().out
    assert load_trace(saved).experts.shape == (300, 32, 2)
    df = pd.read_csv(out)
    assert set(df.prefetch) == {"oracle"} and {"hidden_misses", "exposed_misses"} <= set(df.columns)
    assert len(pd.read_csv(tmp_path / "s.stats.csv")) == 32


@pytest.mark.parametrize("args, message", [
    ([], "give either a TRACE.npz or --synthetic"),
    (["{trace}", "--capacity", "9"], "capacity must be in [top_k=1, n_experts=8]"),
    (["{trace}", "--capacity", "2,x"], "--capacity must be comma-separated integers"),
    (["{trace}", "--prefetch", "next_layer_gate", "--capacity", "2"], "cannot be replayed from a routing trace"),
    (["{trace}", "--capacity", "2", "--out", "x.txt"], "--out must end in .parquet or .csv"),
    (["--synthetic", "nope"], "unknown synthetic preset 'nope'"),
    (["missing.npz"], "does not exist"),
])
def test_errors_exit_2_with_a_message(textbook: Path, tmp_path: Path, capsys, args: list[str], message: str) -> None:
    args = [a.replace("{trace}", str(textbook)).replace("x.txt", str(tmp_path / "x.txt")) for a in args]
    assert main(args) == 2
    assert message in capsys.readouterr().err
