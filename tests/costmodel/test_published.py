"""The published-results table: every row predicted on a profile that exists, and the table in
docs/published_results.md is what the rows predict now (regenerate it when a prediction moves)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from harness.costmodel import list_profiles
from tests.plugins import needs_engine

pytestmark = needs_engine("llamacpp")     # the published runs are llama.cpp's (and ktransformers' GGUF layout)
REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("published_results", REPO / "benchmarks" / "published_results.py")
published = importlib.util.module_from_spec(spec)
spec.loader.exec_module(published)


@pytest.fixture(scope="module")
def preds():
    return published.predict_rows(published.load_rows())


def test_every_row_names_its_source_and_a_shipped_profile_and_is_predicted(preds):
    rows = published.load_rows()
    assert len(rows) >= 3 and len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        assert r["source"].startswith("https://") and r["published"]
        for key in ("model", "format", "engine", "hardware"):
            assert r[key], (r["id"], key)
    assert {p["profile"] for p in preds} <= set(list_profiles())
    for p in preds:
        assert p["predicted"] and p["predicted"] > 0 and p["bound"], p["row"]["id"]
        assert p["error"] == pytest.approx(p["predicted"] / p["published"] - 1)


def test_the_doc_table_is_what_the_rows_predict(preds):
    assert published.doc_table(published.DOC.read_text()) == published.table(preds).strip(), (
        f"docs/published_results.md is stale: run `{published.COMMAND}`")


def test_the_summary_reports_median_and_worst(preds):
    text = published.table(preds)
    errors = [abs(p["error"]) for p in preds]
    import statistics
    assert f"median |error| {statistics.median(errors):.0%}, worst {max(errors):.0%}" in text


def test_an_unknown_metric_is_refused(tmp_path):
    bad = tmp_path / "rows.yaml"
    bad.write_text("- {id: x, published: {ttft_ms: 3}}\n")
    with pytest.raises(ValueError, match="ttft_ms.*allowed"):
        published.load_rows(bad)
