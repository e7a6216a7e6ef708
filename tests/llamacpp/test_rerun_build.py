"""`moebench rerun` of an `engine=llamacpp` job says when the llama-server it would run is another
build than the one the job ran: the real pinned build, a real job, its real manifest edited."""
from __future__ import annotations

import json

import pytest

from harness import results
from tests.llamacpp.test_engine import SMALL, cli, run_dir

pytestmark = pytest.mark.slow


def test_a_rerun_names_another_llama_cpp_build(tmp_path, bins):
    cli(SMALL, tmp_path)
    job = run_dir(tmp_path)
    path = job / results.MANIFEST_FILE
    manifest = json.loads(path.read_text())
    commit = bins.info.llama_cpp_commit if bins.info else manifest["engine_builds"]["llamacpp_commit"]
    # the manifest records the build the server reported running (its rows' llamacpp_commit)
    assert manifest["engine_builds"] == {"llamacpp_commit": commit}
    assert set(results.load(job).llamacpp_commit.dropna()) == {commit}

    same = cli(["rerun", str(job), "--out", str(tmp_path / "same")], tmp_path)
    assert "llamacpp_commit" not in same.stderr
    path.write_text(json.dumps({**manifest, "engine_builds": {"llamacpp_commit": "0000000"}}))
    other = cli(["rerun", str(job), "--out", str(tmp_path / "again")], tmp_path)
    assert f"moebench rerun: engine=llamacpp: llamacpp_commit is {commit} here, the job ran with 0000000" \
        in other.stderr.splitlines()
