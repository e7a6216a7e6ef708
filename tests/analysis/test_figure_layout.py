"""Every figure reads right on a real sweep (the `figure_sweep` and `serve_sweep` fixtures: results
written by the `moebench` CLI; and the committed samples): no two texts overlap and every text lies inside the
figure, read back from the drawn figure; capacity_sweep's title names what its axes show;
labels are words ("fetch (4 slots)"), never a stored options dict; the treatment frontier is
drawn only where a lossy run exists, each point in its placement's colour and its treatment's
marker, on a KL axis that starts at zero; the serving figure only where serve rows exist, one line
per placement in its colour, marked as emulated."""
from __future__ import annotations

import colorsys
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb
from matplotlib.container import ErrorbarContainer
from matplotlib.figure import Figure
from matplotlib.text import Text

from harness import plots, plotstyle
from harness import results as R
from harness.analysis_cli import plot_main

pytestmark = pytest.mark.slow     # runs the CLI and renders every figure: `make test` runs it
REPO = Path(__file__).resolve().parents[2]
TOLERANCE_PX = 1.0
# figures of the real sweep, its one-capacity part (drawn as bars), and the committed samples
SWEEP_FIGURES = [*plots.STANDARD, "treatment_frontier", "hit_rate_curves", "what_if"]
NAMES = [*(f"sweep/{n}" for n in SWEEP_FIGURES), *(f"one_capacity/{n}" for n in plots.STANDARD),
         *(f"samples/{n}" for n in plots.STANDARD), "samples-lossy/treatment_frontier", "serving/load_curve"]


# ----------------------------------------------------------------------------- the figures

def hit_rates(root: Path, df: pd.DataFrame) -> Figure:
    from engine.trace import load_trace
    from harness.sim.replay import replay

    sims = []
    for path in sorted(root.rglob("routing.npz")):
        trace = load_trace(path)
        ctx = int(R.load(path.parent)["context_tokens"].dropna().iloc[0])
        sims.append(replay(trace, ["lru", "fifo", "belady"], list(range(trace.top_k, trace.n_experts + 1)))
                    .assign(context_tokens=ctx))
    return plots.hit_rate_curves(pd.concat(sims, ignore_index=True), plots.measured_hit_rates(df),
                                 facet="context_tokens", emulated=True)


def predictions(df: pd.DataFrame) -> Figure:
    """The cost model's predictions for the sweep's own configs on two hardware profiles."""
    from harness.costmodel import WorkloadShape, predict

    shape = WorkloadShape(context_tokens=int(df["context_tokens"].iloc[0]), gen_tokens=int(df["gen_tokens"].iloc[0]))
    configs = df[["placement", "cache_capacity"]].drop_duplicates().itertuples(index=False)
    tables = [predict(str(df["model"].iloc[0]), placement, shape, profile, dtype="float32",
                      capacity=None if pd.isna(capacity) else int(capacity)).table(workload="chat")
              for placement, capacity in configs for profile in ("h100-pcie-80gb", "rtx3090-pcie3-x8")]
    return plots.what_if(pd.concat(tables, ignore_index=True))


@pytest.fixture(scope="module")
def sweep(figure_sweep: Path) -> pd.DataFrame:
    return R.load(figure_sweep)


@pytest.fixture(scope="module")
def figures(figure_sweep: Path, sweep: pd.DataFrame, serve_sweep: Path) -> dict[str, Figure]:
    one = sweep[sweep["cache_capacity"].isna() | (sweep["cache_capacity"] == "4")]
    samples = R.load(REPO / "results" / "samples")
    figs = {f"sweep/{n}": f(sweep) for n, f in {**plots.STANDARD, "treatment_frontier": plots.treatment_frontier}.items()}
    figs["sweep/hit_rate_curves"] = hit_rates(figure_sweep, sweep)
    figs["sweep/what_if"] = predictions(sweep)
    figs.update({f"one_capacity/{n}": f(one) for n, f in plots.STANDARD.items()})
    figs.update({f"samples/{n}": f(samples) for n, f in plots.STANDARD.items()})
    figs["samples-lossy/treatment_frontier"] = plots.treatment_frontier(R.load(REPO / "results" / "samples-lossy"))
    figs["serving/load_curve"] = plots.load_curve(R.load(serve_sweep))
    assert sorted(figs) == sorted(NAMES)
    for fig in figs.values():
        FigureCanvasAgg(fig)
        fig.canvas.draw()
    return figs


# ----------------------------------------------------------------------------- reading texts back

def _in_view(axis, loc: float) -> bool:
    lo, hi = sorted(axis.get_view_interval())
    slack = (hi - lo) * 1e-9
    return lo - slack <= loc <= hi + slack


def drawn_texts(fig: Figure) -> list[Text]:
    """Every Text the figure draws: titles, axis labels, tick labels of ticks in view, legend texts,
    annotations and notes -- visible, not empty, not on a hidden axes."""
    tick_labels, shown = set(), set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            for tick in [*axis.get_major_ticks(), *axis.get_minor_ticks()]:
                for label in (tick.label1, tick.label2):
                    tick_labels.add(id(label))
                    if tick.get_visible() and label.get_visible() and _in_view(axis, tick.get_loc()):
                        shown.add(id(label))
    return [t for t in fig.findobj(Text)
            if (id(t) not in tick_labels or id(t) in shown) and t.get_visible() and t.get_text().strip()
            and (t.axes is None or t.axes.get_visible())]


def corners(text: Text, renderer) -> np.ndarray:
    """The four corners of a text's box in pixels; a rotated text's box rotated with it (its window
    extent is the upright box around that, wider than what it covers)."""
    box = text.get_window_extent(renderer)
    angle = text.get_rotation()
    if angle % 90 == 0:
        return np.array([[box.x0, box.y0], [box.x1, box.y0], [box.x1, box.y1], [box.x0, box.y1]])
    text.set_rotation(0)
    flat = text.get_window_extent(renderer)
    text.set_rotation(angle)
    half = np.array([[-1, -1], [1, -1], [1, 1], [-1, 1]]) * [flat.width / 2, flat.height / 2]
    theta = np.deg2rad(angle)
    turn = np.array([[np.cos(theta), -np.sin(theta)], [np.sin(theta), np.cos(theta)]])
    return half @ turn.T + [(box.x0 + box.x1) / 2, (box.y0 + box.y1) / 2]    # rotation keeps the centre


def intersect(a: np.ndarray, b: np.ndarray, tol: float = TOLERANCE_PX) -> bool:
    """Two convex boxes overlap by more than `tol` pixels along every axis that could separate them."""
    for poly in (a, b):
        for i in range(len(poly)):
            edge = poly[(i + 1) % len(poly)] - poly[i]
            normal = np.array([-edge[1], edge[0]]) / np.hypot(*edge)
            pa, pb = a @ normal, b @ normal
            if min(pa.max(), pb.max()) - max(pa.min(), pb.min()) <= tol:
                return False
    return True


def overlapping(fig: Figure) -> list[tuple[str, str]]:
    r = fig.canvas.get_renderer()
    texts = drawn_texts(fig)
    boxes = [corners(t, r) for t in texts]
    return [(texts[i].get_text(), texts[j].get_text()) for i in range(len(texts)) for j in range(i + 1, len(texts))
            if intersect(boxes[i], boxes[j])]


# ----------------------------------------------------------------------------- the checks

def test_the_box_check_sees_an_overlap_and_a_rotated_miss() -> None:
    """The check itself: two texts drawn on top of each other overlap; two 45-degree labels whose
    upright boxes intersect but whose letters do not are apart; nothing is found in an empty figure."""
    fig = Figure(figsize=(3, 3))
    FigureCanvasAgg(fig)
    fig.text(0.2, 0.5, "first label")
    fig.text(0.25, 0.5, "second label")
    fig.text(0.1, 0.1, "a rotated label", rotation=45)
    fig.text(0.3, 0.1, "a rotated label", rotation=45)
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    assert overlapping(fig) == [("first label", "second label")]
    up = [t.get_window_extent(r) for t in fig.texts[2:]]
    assert up[0].overlaps(up[1])                       # their upright boxes do intersect
    empty = Figure()
    FigureCanvasAgg(empty)
    empty.canvas.draw()
    assert overlapping(empty) == []


@pytest.mark.parametrize("name", NAMES)
def test_no_two_texts_overlap(figures: dict[str, Figure], name: str) -> None:
    fig = figures[name]
    assert len(drawn_texts(fig)) >= 8, name             # titles, labels, ticks and legend were all read
    assert overlapping(fig) == [], name


@pytest.mark.parametrize("name", NAMES)
def test_every_text_lies_inside_the_figure(figures: dict[str, Figure], name: str) -> None:
    fig = figures[name]
    r = fig.canvas.get_renderer()
    frame = fig.bbox.padded(TOLERANCE_PX)
    outside = [t.get_text() for t in drawn_texts(fig)
               if not all(frame.contains(x, y) for x, y in corners(t, r))]
    assert outside == [], name


@pytest.mark.parametrize("name", [n for n in NAMES if n.endswith("/capacity_sweep")])
def test_capacity_sweep_title_names_what_its_axes_show(figures: dict[str, Figure], name: str) -> None:
    """The title says "vs expert-cache capacity" where the x axis is the capacity and "per config"
    where it names configs (one capacity: bars); the y quantities it names are those of the panels."""
    fig = figures[name]
    title = fig._suptitle.get_text().replace("\n", " ")
    quantity = re.match(r"Decode rate and TTFT (vs (.+?)|per (config))  \[", title)
    assert quantity, title
    what = quantity.group(2) or quantity.group(3)
    xlabels = {ax.get_xlabel().replace("\n", " ") for ax in fig.axes if ax.get_xlabel()}
    assert xlabels and all(x.startswith(what) for x in xlabels), (title, xlabels)
    assert (what == "config") == name.startswith("one_capacity/")
    ylabels = [ax.get_ylabel().replace("\n", " ") for ax in fig.axes if ax.get_ylabel()]
    assert any(y.startswith("decode tok/s") for y in ylabels) and any("TTFT" in y for y in ylabels), ylabels


@pytest.mark.parametrize("name", NAMES)
def test_labels_are_words_not_stored_options(figures: dict[str, Figure], name: str) -> None:
    texts = [t.get_text() for t in drawn_texts(figures[name])]
    assert not [t for t in texts if "{'" in t or "placement_options" in t], (name, texts)     # a stored dict


def test_configs_are_named_in_words(figures: dict[str, Figure]) -> None:
    legend = {t.get_text() for leg in figures["sweep/memory_peaks"].legends for t in leg.get_texts()}
    assert {"resident", "cpu", "hybrid (1 CPU layer)", "fetch (2 slots)", "fetch (4 slots)",
            "fetch (4 slots, KV q8)"} <= legend, legend
    ticks = {t.get_text() for t in figures["one_capacity/capacity_sweep"].axes[-1].get_xticklabels()}
    assert {"resident", "fetch", "cpu", "hybrid (1 CPU layer)", "fetch (KV q8)"} <= ticks, ticks


def hue(color) -> float:
    return colorsys.rgb_to_hls(*to_rgb(color))[0]


def test_frontier_points_take_their_placements_colour_and_their_treatments_marker(figures) -> None:
    for name in ("sweep/treatment_frontier", "samples-lossy/treatment_frontier"):
        fig = figures[name]
        keys = {t.get_text(): h for leg in fig.legends for t, h in zip(leg.get_texts(), leg.legend_handles)}
        treatments = {label: h.get_marker() for label, h in keys.items() if label.startswith("KV ")}
        assert len(treatments) >= 2 and len(set(treatments.values())) == len(treatments), treatments
        placements = {label.split(" ")[0] for label in keys if label.split(" ")[0] in plotstyle.PLACEMENT_STYLES}
        points = [c.lines[0] for ax in fig.axes for c in ax.containers if isinstance(c, ErrorbarContainer)]
        assert points and placements
        for line in points:
            assert line.get_marker() in treatments.values()
            assert any(abs(hue(line.get_color()) - hue(plotstyle.style("placement", p).color)) < 0.01
                       for p in placements), line.get_color()
        for ax in fig.axes:
            assert ax.get_xlim()[0] == 0, name          # KL is never negative: no tick below 0
            assert all(t >= 0 for t in ax.get_xticks() if _in_view(ax.xaxis, t)), ax.get_xticks()
    sweep = figures["sweep/treatment_frontier"]
    placements = {hue(c.lines[0].get_color()) for ax in sweep.axes for c in ax.containers
                  if isinstance(c, ErrorbarContainer)}
    assert len(placements) >= 4                         # resident, fetch, cpu, hybrid: four hues, not one


def test_the_frontier_is_drawn_only_where_a_lossy_run_exists(figure_sweep: Path, sweep: pd.DataFrame,
                                                            tmp_path: Path, capsys) -> None:
    """The exact sweep alone has quality rows (KL 0 for every job) but no trade to show: the figure
    raises MissingData with the reason, and moebench-plot skips it with that reason."""
    exact = sweep[sweep["sweep_id"] == "placements"]
    assert (exact["profiler"] == "quality").any() and not exact["lossy"].astype(bool).any()
    with pytest.raises(plots.MissingData, match="no lossy run"):
        plots.treatment_frontier(exact)
    assert plot_main([str(figure_sweep / "sweeps" / "placements"), "--out", str(tmp_path), "--dpi", "40"]) == 0
    assert "skipped treatment_frontier: treatment frontier: no lossy run" in capsys.readouterr().out
    assert not (tmp_path / "treatment_frontier.png").exists() and (tmp_path / "capacity_sweep.png").exists()
    assert plot_main([str(figure_sweep), "--out", str(tmp_path / "all"), "--dpi", "40"]) == 0
    assert (tmp_path / "all" / "treatment_frontier.png").exists()


def test_the_serving_figure_is_drawn_only_where_serve_rows_exist(figure_sweep: Path, serve_sweep: Path,
                                                                 figures: dict[str, Figure], tmp_path: Path,
                                                                 capsys) -> None:
    """moebench-plot draws load_curve from a sweep of serving runs -- each placement one line in its
    colour, a point per offered load at that run's goodput, the emulated device said -- and skips it,
    saying why, where the results hold no serve rows."""
    fig = figures["serving/load_curve"]
    goodput, tpot = fig.axes
    summary = R.load(serve_sweep)
    summary = summary[(summary["phase"] == "serve") & summary["request_id"].isna()]
    lines = {line.get_label(): line for line in goodput.get_lines()}
    assert set(lines) == {"resident", "fetch"}
    for placement, line in lines.items():
        want = summary[(summary["placement"] == placement) & (summary["metric"] == "request_goodput")]
        assert list(line.get_xdata()) == [5.0, 10.0]
        assert list(line.get_ydata()) == want.sort_values("load_rate")["value"].tolist()
        assert abs(hue(line.get_color()) - hue(plotstyle.style("placement", placement).color)) < 0.01
    assert goodput.get_xlabel() == tpot.get_xlabel() == "offered load (requests/s)"
    assert "emulated device" in fig._suptitle.get_text() and "SLO mixtral-8x7b" in fig._suptitle.get_text()
    assert plot_main([str(serve_sweep), "--out", str(tmp_path / "serving"), "--dpi", "40"]) == 0
    assert (tmp_path / "serving" / "load_curve.png").stat().st_size > 0
    assert plot_main([str(figure_sweep), "--only", "load_curve", "--out", str(tmp_path / "none"), "--dpi", "40"]) == 1
    assert "skipped load_curve: serving: no serve rows" in capsys.readouterr().out
    assert not (tmp_path / "none" / "load_curve.png").exists()
