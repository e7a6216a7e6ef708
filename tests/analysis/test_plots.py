"""harness.plots and `moebench-plot` on the committed sample results: every standard figure is
written as a real PNG, emulated runs are marked, and figures whose data is absent are skipped
with a message naming what was missing."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from matplotlib.figure import Figure

from harness import plots
from harness import results as R
from harness.analysis_cli import plot_main

SAMPLES = Path(__file__).resolve().parents[2] / "results" / "samples"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def samples() -> pd.DataFrame:
    return R.load(SAMPLES)


@pytest.mark.slow
def test_samples_hold_every_kind_of_row(samples: pd.DataFrame) -> None:
    """The committed samples are what the notebooks need: speed rows, the timeline pass, the
    trace pass with its routing.npz, several capacities, placements and context lengths."""
    assert {"none", "timeline", "trace"} <= set(samples["profiler"].dropna())
    assert {"resident", "fetch", "cpu", "hybrid"} <= set(samples["placement"])
    assert samples["cache_capacity"].dropna().nunique() >= 3 and samples["context_tokens"].nunique() >= 2
    assert len(list(SAMPLES.rglob("routing.npz"))) >= 1
    assert (samples["status"] == "ok").all()
    size = sum(p.stat().st_size for p in SAMPLES.rglob("*") if p.is_file())
    assert size < 1_000_000, f"results/samples is {size} bytes; keep it small"


@pytest.mark.slow
def test_moebench_plot_writes_every_standard_figure(tmp_path: Path, capsys) -> None:
    assert plot_main([str(SAMPLES), "--out", str(tmp_path), "--dpi", "60"]) == 0
    for name in plots.STANDARD:
        png = tmp_path / f"{name}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5_000, name
    prov = json.loads((tmp_path / "figures.json").read_text())
    assert sorted(prov["figures"]) == sorted(f"{n}.png" for n in plots.STANDARD)
    # the samples are exact runs (no lossy treatment) without a load: the figures of those rows are
    # skipped, and say why
    assert list(prov["skipped"]) == ["treatment_frontier", "load_curve"]
    assert "no lossy run here" in prov["skipped"]["treatment_frontier"]
    out = capsys.readouterr().out
    assert "skipped treatment_frontier: treatment frontier: no lossy run here" in out
    assert "skipped load_curve: serving: no serve rows" in out
    assert not (tmp_path / "treatment_frontier.png").exists() and not (tmp_path / "load_curve.png").exists()
    assert len(prov["jobs"]) == 21 and prov["git_commits"]


@pytest.mark.slow
def test_figures_skip_with_a_message_when_their_data_is_absent(tmp_path: Path, samples: pd.DataFrame,
                                                                capsys) -> None:
    """A results dir without the timeline pass and without any cache placement: those two
    figures are skipped and say why; the others are still written."""
    keep = samples[(samples["profiler"] == "none") & samples["placement"].isin(["resident", "cpu"])]
    job = tmp_path / "results" / "job"
    R.write_job(job, [{k: (None if pd.isna(v) else v) for k, v in r.items()}
                      for r in keep.assign(sweep_id="s", job_id="j").to_dict("records")],
                {"sweep_id": "s", "job_id": "j"})
    assert plot_main([str(job), "--out", str(tmp_path / "figs"), "--dpi", "50"]) == 0
    out = capsys.readouterr().out
    assert "skipped overlap: overlap: no profiler=timeline rows" in out
    assert "skipped capacity_sweep" in out and "expert cache" in out
    assert (tmp_path / "figs" / "bytes_per_token.png").exists()
    assert not (tmp_path / "figs" / "overlap.png").exists()
    assert plot_main([str(job), "--only", "nosuchfigure"]) == 2


@pytest.mark.slow
def test_emulated_runs_are_marked_and_axes_carry_units(samples: pd.DataFrame) -> None:
    fig = plots.capacity_sweep(samples)
    assert isinstance(fig, Figure) and "emulated device" in fig._suptitle.get_text()
    labels = [ax.get_ylabel() for ax in fig.axes if ax.get_ylabel()]
    assert any("tok/s" in lab for lab in labels) and any(", s" in lab for lab in labels)
    mem = plots.memory_peaks(samples)
    texts = [t.get_text() for ax in mem.axes for t in ax.texts]
    assert any("not measured" in t for t in texts)             # device peak is null on the CPU, never 0
    assert any("MiB" in ax.get_ylabel() for ax in mem.axes)
    real = samples.assign(emulated=False, device_name="NVIDIA H200")
    assert "emulated" not in plots.capacity_sweep(real)._suptitle.get_text()


@pytest.mark.slow
def test_speed_figures_ignore_instrumented_rows(samples: pd.DataFrame) -> None:
    """Inflating every instrumented row does not move a speed figure's data."""
    noisy = samples.copy()
    noisy.loc[noisy["profiler"] != "none", "value"] *= 1000
    a = plots.bytes_per_token(samples).axes[0].patches
    b = plots.bytes_per_token(noisy).axes[0].patches
    assert [p.get_width() for p in a] == [p.get_width() for p in b]


@pytest.mark.slow
def test_measured_hit_rates_match_the_trace_replay(samples: pd.DataFrame) -> None:
    from engine.trace import load_trace
    from harness.sim.replay import replay

    measured = plots.measured_hit_rates(samples)
    for path in SAMPLES.rglob("routing.npz"):
        ctx = int(R.load(path.parent)["context_tokens"].iloc[0])
        sim = replay(load_trace(path), ["lru"], [2, 4, 6, 8])
        sim = sim[sim["layer"] == "all"].set_index("capacity")["hit_rate"]
        m = measured[measured["context_tokens"] == ctx].set_index("capacity")["hit_rate"]
        assert len(m) == 4
        pd.testing.assert_series_equal(m.sort_index(), sim.sort_index().rename_axis("capacity"), check_names=False,
                                       check_index_type=False)
    assert isinstance(plots.hit_rate_curves(replay(load_trace(path), ["lru", "belady"], [2, 4, 8]), measured),
                      Figure)


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_moebench_plot_writes_to_figures_name_in_the_current_directory(tmp_path: Path, monkeypatch) -> None:
    """By default the figures go to ./figures/<results dir name>, never next to the results."""
    before = _files(SAMPLES)
    monkeypatch.chdir(tmp_path)
    assert plot_main([str(SAMPLES), "--only", "bytes_per_token", "--dpi", "40"]) == 0
    assert (tmp_path / "figures" / "samples" / "bytes_per_token.png").read_bytes()[:8] == PNG_MAGIC
    assert (tmp_path / "figures" / "samples" / "figures.json").is_file()
    assert _files(SAMPLES) == before


@pytest.mark.slow
def test_moebench_plot_refuses_committed_results_unless_asked(tmp_path: Path, samples: pd.DataFrame,
                                                              capsys, monkeypatch) -> None:
    before = _files(SAMPLES)
    assert plot_main([str(SAMPLES), "--out", str(SAMPLES / "figures")]) == 2
    err = capsys.readouterr().err
    assert "results/samples" in err and "committed" in err and "--allow-committed" in err
    assert _files(SAMPLES) == before
    # a committed-looking tree of our own: refused by default (also as the current directory), written when asked
    keep = samples[(samples["profiler"] == "none") & (samples["placement"] == "resident")]
    job = tmp_path / "results" / "baselines" / "machine" / "job"
    R.write_job(job, [{k: (None if pd.isna(v) else v) for k, v in r.items()}
                      for r in keep.assign(sweep_id="s", job_id="j").to_dict("records")],
                {"sweep_id": "s", "job_id": "j"})
    monkeypatch.chdir(job.parent)
    assert plot_main([str(job), "--only", "bytes_per_token"]) == 2
    assert "results/baselines" in capsys.readouterr().err and not (job.parent / "figures").exists()
    assert plot_main([str(job), "--only", "bytes_per_token", "--dpi", "40", "--allow-committed"]) == 0
    assert (job.parent / "figures" / "job" / "bytes_per_token.png").is_file()


def _lines(ax) -> dict[str, list[float]]:
    return {str(line.get_label()): list(line.get_ydata()) for line in ax.get_lines()
            if not str(line.get_label()).startswith("_")}


@pytest.mark.slow
def test_series_never_pool_two_settings_or_two_sources(samples: pd.DataFrame) -> None:
    """Configs that differ only outside the factors (a placement option) are two series, and a
    metric measured by both the client and the engine (llama.cpp's decode rate) is two series,
    each with its own values -- never one median over both."""
    ours = samples[(samples["sweep_id"] == "fetch_capacity") & (samples["context_tokens"] == 256)]
    other = ours.assign(job_id=ours["job_id"] + "b", placement_options="{'prefetch_depth': 9}")
    other.loc[other["metric"] == "tok_per_s", "value"] *= 10
    f = {"engine": "llamacpp", "model": "tiny-mixtral", "workload": "chat", "context_tokens": 256, "gen_tokens": 32,
         "batch": 1, "dtype": "float32"}
    dev = {"device_kind": "cpu", "device_name": "llama.cpp cpu", "emulated": False}
    rows = []
    for rep in range(3):
        for source, rate in (("client", 100.0), ("engine", 400.0)):
            rows += R.make_rows(f, dev, "fetch_capacity", "lcpp", rep, "decode", {"tok_per_s": rate}, source,
                                extra={"profiler": "none"})
        rows += R.make_rows(f, dev, "fetch_capacity", "lcpp", rep, "prefill_fresh", {"ttft_s": 0.01}, "client",
                            extra={"profiler": "none"})
    fig = plots.capacity_sweep(pd.concat([ours, other, pd.DataFrame(rows)], ignore_index=True))
    lines = _lines(fig.axes[0])                       # the decode panel (one context length)
    llama = {k: v for k, v in lines.items() if k.startswith("llamacpp")}
    assert sorted(set(v) for v in llama.values()) == [{100.0}, {400.0}], llama
    assert any("source client" in k for k in llama) and any("source engine" in k for k in llama)
    legend = [t.get_text() for lg in fig.legends for t in lg.get_texts()]
    fetch = [k for k in legend if "fetch" in k.split(" ")[:2]]
    assert len(fetch) == 2 and sum("prefetch_depth" in k for k in fetch) == 1, legend
