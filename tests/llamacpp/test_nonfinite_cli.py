"""engine=llamacpp on broken checkpoints, through the real `moebench` CLI: a NaN in one tensor is
refused before it converts, in our loader's words (the verdict kept beside its GGUFs, read once),
and finite weights that overflow make llama-server write null logprobs, a failed row naming the
phase. The checkpoints and our engine's refusal come from tests/harness/test_nonfinite_cli.py."""
from __future__ import annotations

import json

import pytest

from tests.engine.test_nonfinite import EXPERT_W1
from tests.harness.test_nonfinite_cli import loader_error, nan_ckpt, overflow_ckpt, sweep, the_error  # noqa: F401

pytestmark = pytest.mark.slow     # subprocess/CLI runs


def test_llamacpp_refuses_the_nan_checkpoint_in_the_loaders_words(loader_error, nan_ckpt, bins, tmp_path):
    from harness.llamacpp.convert import cache_dir, checkpoint_identity

    args = ["engine=llamacpp", f"model.path={nan_ckpt}", "run.check_reference=true,false"]
    assert the_error(sweep(args, tmp_path / "a", "nan", rc=1)) == loader_error
    verdict = cache_dir(checkpoint_identity(nan_ckpt)) / "nonfinite.json"     # beside the GGUFs, never made here
    assert [b["name"] for b in json.loads(verdict.read_text())["bad"]] == [EXPERT_W1]
    assert not list(verdict.parent.glob("*.gguf"))
    before = verdict.stat().st_mtime_ns
    assert the_error(sweep(args, tmp_path / "b", "nan", rc=1)) == loader_error     # from the verdict: not read again
    assert verdict.stat().st_mtime_ns == before


def test_llama_servers_null_logprobs_are_a_failed_row(overflow_ckpt, bins, tmp_path):
    """The finite checkpoint converts and runs; llama-server computes NaN and writes its logprobs as null."""
    df = sweep(["engine=llamacpp", f"model.path={overflow_ckpt}", "run.check_reference=false"], tmp_path, "ll", rc=1)
    assert the_error(df) == ("NonFiniteError: engine=llamacpp returned 5 of 5 top logprobs NaN or inf in phase "
                             "prefill_fresh for token 0 of row 0 (ids [0, 1, 2, 3, 4]; the server writes NaN as null)")
