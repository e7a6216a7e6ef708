"""The GPU check's machinery, on the CPU: rows are on disk the moment they are added, one
failing check becomes a failed row and the next check still runs, and the script refuses
an unknown part."""
from __future__ import annotations

import csv
import importlib.util
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_rows_are_flushed_and_failures_isolated(gpu_check, tmp_path):
    out = tmp_path / "gpu_check.csv"
    table = gpu_check.Table(out)

    def good(t):
        t.add("good", "a", "x", 1, True)
        assert rows(out)[-1]["metric"] == "x"          # already on disk, before the check ends

    def bad(t):
        t.add("bad", "a", "before_the_error", 2)
        raise RuntimeError("copy stream exploded")

    table.isolated("good", good)
    table.isolated("bad", bad)
    table.isolated("after", lambda t: t.add("after", "-", "still_runs", True, True))
    table.close()
    got = rows(out)
    assert [r["metric"] for r in got] == ["x", "check_wall_s", "before_the_error", "exception", "check_wall_s",
                                          "still_runs", "check_wall_s"]
    failed = [r for r in got if r["ok"] == "False"]
    assert len(failed) == 1 and failed[0]["error"] == "RuntimeError: copy stream exploded"
    assert table.failed == 1
    again = gpu_check.Table(out)                          # appending keeps one header
    again.add("more", "-", "m", 3)
    again.close()
    assert len(rows(out)) == len(got) + 1


def test_without_cuda_it_writes_a_failed_row(gpu_check, tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    out = tmp_path / "t.csv"
    assert gpu_check.main(["--out", str(out)]) == 1
    assert rows(out)[0]["metric"] == "cuda_available" and rows(out)[0]["ok"] == "False"
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(out), "--only", "nope"])


def test_script_parts(tmp_path):
    r = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "3"], capture_output=True, text=True,
                       env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and "usage" in r.stderr


def test_token_agreement_is_the_shared_fraction(gpu_check):
    assert gpu_check.agreement([[1, 2], [3, 4]], [[1, 2], [3, 5]]) == 0.75
    assert gpu_check.agreement([[7]], [[7]]) == 1.0
