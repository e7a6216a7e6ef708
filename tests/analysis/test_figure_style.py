"""Every figure read back from its artists: each placement (and engine) keeps one colour and
marker across all figures, numeric axes are in numeric order, rate axes start at zero, every
plotted series has a legend entry, titles and legends fit inside the figure and clear of the
data, and a sweep of one capacity is drawn as bars. Drawn from the committed samples and from a
small synthetic table (contexts as unsorted text, one capacity, a third-party placement)."""
from __future__ import annotations

import colorsys
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_hex, to_rgb
from matplotlib.container import BarContainer, ErrorbarContainer
from matplotlib.figure import Figure

from harness import plots, plotstyle
from harness import results as R

pytestmark = pytest.mark.slow     # renders every standard figure: `make test` runs it
REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "results" / "samples"
THIRD_PARTY = "my_offload"
RATE_WORDS = ("tok/s", "tok_per_s", "GB/s", "hit rate")


# ----------------------------------------------------------------------------- the figures

@pytest.fixture(scope="module")
def samples() -> pd.DataFrame:
    return R.load(SAMPLES)


def synthetic(samples: pd.DataFrame) -> pd.DataFrame:
    """One capacity (4), contexts as text in shuffled row order, `cpu` renamed to a third-party name."""
    keep = samples[(samples["cache_capacity"] == "4") | samples["placement"].isin(["resident", "cpu"])]
    keep = keep.assign(placement=keep["placement"].replace({"cpu": THIRD_PARTY}),
                       context_tokens=keep["context_tokens"].astype(str))
    return keep.sample(frac=1.0, random_state=0).reset_index(drop=True)


def predicted(samples: pd.DataFrame) -> pd.DataFrame:
    """What-if rows shaped like `harness.costmodel` tables: the samples' medians as source=model on
    two profiles, `resident` not fitting the small one."""
    rows = plots.speed_rows(samples)
    rows = rows[((rows["phase"] == "decode") & (rows["metric"] == "tok_per_s"))
                | ((rows["phase"] == "prefill_fresh") & (rows["metric"] == "ttft_s"))]
    rows = rows[rows["context_tokens"] == 512]
    keys = ["model", "placement", "cache_capacity", "phase", "metric"]
    med = rows.groupby(keys, dropna=False)["value"].median().reset_index()
    out = [med.assign(hardware_profile=p, value=med["value"] * f, fits_device_memory=(med["placement"] != "resident") | big,
                      source="model")
           for p, f, big in (("small-gpu-pcie4", 1.0, False), ("big-gpu-pcie5", 3.0, True))]
    return pd.concat(out, ignore_index=True)


def hit_rates(samples: pd.DataFrame, third_party: bool) -> Figure:
    from engine.trace import load_trace
    from harness.sim.replay import replay

    sims = []
    for path in sorted(SAMPLES.rglob("routing.npz")):
        ctx = int(R.load(path.parent)["context_tokens"].dropna().iloc[0])
        sims.append(replay(load_trace(path), ["lru", "fifo", "belady"], [2, 4, 6, 8]).assign(context_tokens=ctx))
    measured = plots.measured_hit_rates(samples)
    if third_party:
        measured = pd.concat([measured, measured.head(2).assign(placement=THIRD_PARTY)], ignore_index=True)
    return plots.hit_rate_curves(pd.concat(sims, ignore_index=True), measured, facet="context_tokens", emulated=True)


@pytest.fixture(scope="module")
def figures(samples: pd.DataFrame) -> dict[str, Figure]:
    figs = {f"samples/{name}": f(samples) for name, f in plots.STANDARD.items()}
    figs.update({f"synthetic/{name}": f(synthetic(samples)) for name, f in plots.STANDARD.items()})
    figs["samples/hit_rate_curves"] = hit_rates(samples, third_party=False)
    figs["synthetic/hit_rate_curves"] = hit_rates(samples, third_party=True)
    figs["samples/what_if"] = plots.what_if(predicted(samples))
    # narrow figures (one phase, one context): their long titles must wrap to fit
    figs["narrow/overlap"] = plots.overlap(samples[samples["phase"] == "decode"])
    figs["narrow/capacity_sweep"] = plots.capacity_sweep(samples[samples["context_tokens"] == 1024])
    for fig in figs.values():
        FigureCanvasAgg(fig)
        fig.canvas.draw()
    return figs


# ----------------------------------------------------------------------------- reading a figure back

def legend_texts(fig: Figure) -> list[str]:
    return [t.get_text() for leg in fig.legends for t in leg.get_texts()]


def hue(color) -> float:
    return colorsys.rgb_to_hls(*to_rgb(color))[0]


def same_hue(a: float, b: float, tol: float = 0.006) -> bool:
    """Equal hues up to the rounding of a shade to 8-bit channels."""
    return min(abs(a - b), 1 - abs(a - b)) <= tol


def names_in(text: str, known: set[str]) -> list[str]:
    return [w for w in re.split(r"[\s()]+", text.replace("\n", " ")) if w in known]


def tick_label_at(fig: Figure, ax, pos: float, axis: str) -> str:
    """The tick label at `pos` on `ax` or on an axes sharing that axis (shared axes hide their labels)."""
    group = (ax.get_shared_y_axes() if axis == "y" else ax.get_shared_x_axes()).get_siblings(ax)
    for other in group:
        ticks = other.get_yticks() if axis == "y" else other.get_xticks()
        labels = other.get_yticklabels() if axis == "y" else other.get_xticklabels()
        for t, lab in zip(ticks, labels):
            if abs(t - pos) < 1e-6 and lab.get_text():
                return lab.get_text().replace("\n", " ")
    return ""


def series(fig: Figure, known: set[str]) -> list[dict]:
    """Every plotted series: its artist kind, label, colour, marker and the placement/engine it
    belongs to (from its label, its panel's title, or the tick label its bar stands at)."""
    out = []
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        contained = {id(a) for c in ax.containers for a in c.get_children()}
        title = ax.get_title()
        for c in ax.containers:
            if isinstance(c, ErrorbarContainer) and c.lines[0] is not None:    # (a bar's own error bars have none)
                line = c.lines[0]
                out.append(dict(ax=ax, kind="line", label=c.get_label(), color=line.get_color(),
                                marker=line.get_marker(), owner=names_in(c.get_label(), known) or names_in(title, known)))
            elif isinstance(c, BarContainer):
                horizontal = c.orientation == "horizontal"
                for p in c.patches:
                    at = p.get_y() + p.get_height() / 2 if horizontal else p.get_x() + p.get_width() / 2
                    tick = tick_label_at(fig, ax, at, "y" if horizontal else "x")
                    owner = names_in(c.get_label(), known) or names_in(tick, known)
                    out.append(dict(ax=ax, kind="bar", label=c.get_label(), color=p.get_facecolor(), marker=None,
                                    owner=owner, tick=tick))
        for line in ax.lines:
            if id(line) not in contained:
                out.append(dict(ax=ax, kind="line", label=line.get_label(), color=line.get_color(),
                                marker=line.get_marker(), owner=names_in(line.get_label(), known)))
        for patch in ax.patches:
            if id(patch) not in contained:
                out.append(dict(ax=ax, kind="band", label=patch.get_label(), color=patch.get_facecolor(), marker=None,
                                owner=names_in(patch.get_label(), known)))
        for coll in ax.collections:
            if id(coll) not in contained and len(coll.get_offsets()) + len(coll.get_paths()):
                face = coll.get_facecolor()
                out.append(dict(ax=ax, kind="collection", label=coll.get_label(),
                                color=face[0] if len(face) else None, marker=None,
                                owner=names_in(coll.get_label(), known)))
    return out


def known_names(samples: pd.DataFrame) -> set[str]:
    return {*samples["placement"].dropna(), *samples["engine"].dropna(), THIRD_PARTY}


# ----------------------------------------------------------------------------- the checks

def test_each_placement_keeps_one_colour_and_marker_in_every_figure(figures, samples) -> None:
    known = known_names(samples)
    seen: dict[str, set] = {}
    exact: dict[str, set[str]] = {}
    for name, fig in figures.items():
        for s in series(fig, known):
            if len(s["owner"]) != 1:
                continue                              # a policy curve, a prefill-state key: not a placement's
            owner = s["owner"][0]
            base = plotstyle.style("placement", owner)
            seen.setdefault(owner, set()).add(hue(s["color"]))
            if to_hex(s["color"]) == base.color:
                exact.setdefault(owner, set()).add(name.split("/")[1])
            if s["marker"] not in (None, "None", ""):
                assert s["marker"] == base.marker, (name, s["label"], s["marker"], base.marker)
    assert {"resident", "fetch", "cpu", "hybrid", THIRD_PARTY} <= set(seen)
    for owner, hues in seen.items():
        base = hue(plotstyle.style("placement", owner).color)
        assert all(same_hue(h, base) for h in hues), (owner, base, hues)
    # the placement's own colour (not only a shade of it) appears in every figure that draws it
    assert exact["fetch"] >= {"capacity_sweep", "ttft_by_prefix_state", "bytes_per_token", "overlap",
                              "memory_peaks", "hit_rate_curves", "what_if"}
    assert exact[THIRD_PARTY] >= {"capacity_sweep", "bytes_per_token", "memory_peaks", "hit_rate_curves"}
    bases = [plotstyle.style("placement", o).color for o in seen]
    assert len(set(bases)) == len(bases)


def test_policy_curves_use_the_policy_table(figures) -> None:
    for name in ("samples/hit_rate_curves", "synthetic/hit_rate_curves"):
        curves = {line.get_label(): line.get_color() for ax in figures[name].axes for line in ax.lines}
        assert curves["simulated lru"] == plotstyle.POLICY_STYLES["lru"].color
        assert curves["simulated fifo"] == plotstyle.POLICY_STYLES["fifo"].color
        assert to_hex(curves["simulated belady (offline optimum: the bound)"]) == plotstyle.POLICY_STYLES["belady"].color


def _numbers(labels: list[str]) -> list[float]:
    return [float(m.group()) for m in (re.search(r"\d+(\.\d+)?", t) for t in labels) if m]


def _details(label: str) -> list[str]:
    """The bracketed details of a config label: "fetch (4 slots, ctx 512)" -> ["4 slots", "ctx 512"]."""
    inside = re.search(r"\((.*)\)", label)
    return inside.group(1).split(", ") if inside else []


def test_numeric_axes_are_in_numeric_order(figures) -> None:
    for prefix in ("samples", "synthetic"):
        for name in ("capacity_sweep", "memory_peaks"):
            fig = figures[f"{prefix}/{name}"]
            top = sorted((ax for ax in fig.axes if "context" in ax.get_title()), key=lambda a: a.get_position().x0)
            contexts = _numbers([ax.get_title() for ax in top])
            assert contexts[:3] == [256, 512, 1024], (prefix, name, contexts)
        ttft = figures[f"{prefix}/ttft_by_prefix_state"]
        shown = 0
        for ax in ttft.axes:
            pairs = [(t, lab.get_text()) for t, lab in zip(ax.get_xticks(), ax.get_xticklabels()) if lab.get_text()]
            if pairs:                               # shared x: only the bottom row shows its labels
                assert [lab for _, lab in sorted(pairs)] == ["256", "512", "1024"]
                shown += 1
        assert shown >= 3
        for name in ("bytes_per_token", "overlap"):
            ax = figures[f"{prefix}/{name}"].axes[0]
            labels = [t.get_text().replace("\n", " ") for t in ax.get_yticklabels()]
            by_placement: dict[str, list[tuple]] = {}
            for lab in labels:
                head = lab.split()[0]
                by_placement.setdefault(head, []).append(tuple(_numbers(_details(lab))))
            for head, keys in by_placement.items():
                assert keys == sorted(keys), (prefix, name, head, keys)
            assert any(len(keys) > 1 and keys[0] for keys in by_placement.values()), (prefix, name, labels)
            heads = list(by_placement)
            builtin = [h for h in heads if h in plotstyle.PLACEMENT_STYLES]
            assert builtin == [p for p in plotstyle.PLACEMENT_STYLES if p in builtin]   # table order
    curves = figures["samples/hit_rate_curves"]
    assert _numbers([ax.get_title() for ax in curves.axes]) == [256, 512, 1024]


def test_text_capacities_sort_numerically_with_auto_last(samples: pd.DataFrame) -> None:
    df = samples[samples["cache_capacity"].isin(["2", "4", "6"]) | (samples["placement"] == "resident")]
    auto = samples[samples["cache_capacity"] == "8"].assign(cache_capacity="auto", resolved_capacity=None)
    ten = samples[samples["cache_capacity"] == "2"].assign(cache_capacity="10", resolved_capacity=10)
    fig = plots.capacity_sweep(pd.concat([df, auto, ten]).sample(frac=1.0, random_state=1))
    ax = fig.axes[-1]
    ticks = [lab.get_text() for _, lab in sorted(zip(ax.get_xticks(), ax.get_xticklabels()), key=lambda p: p[0])]
    assert ticks == ["2", "4", "6", "10", "auto"]
    fetch = next(c for c in ax.containers if isinstance(c, ErrorbarContainer) and c.get_label() == "fetch")
    x = list(fetch.lines[0].get_xdata())
    assert x == sorted(x) and len(x) == 5


def test_rate_axes_start_at_zero(figures) -> None:
    checked = 0
    for name, fig in figures.items():
        for ax in fig.axes:
            if not ax.get_visible():
                continue
            for label, lim, scale in ((ax.get_ylabel(), ax.get_ylim(), ax.get_yscale()),
                                      (ax.get_xlabel(), ax.get_xlim(), ax.get_xscale())):
                if any(w in label for w in RATE_WORDS):
                    assert scale == "linear" and lim[0] == 0, (name, label, lim, scale)
                    checked += 1
    assert checked >= 9      # decode panels of both capacity sweeps, hit rates (shared y), what-if


def test_every_plotted_series_has_a_legend_entry(figures, samples) -> None:
    known = known_names(samples)
    for name, fig in figures.items():
        texts = legend_texts(fig)
        assert len(fig.legends) == 1 and texts, name
        plotted = [s for s in series(fig, known) if s["kind"] != "line" or s["label"] != "_nolegend_"]
        assert plotted, name
        for s in plotted:
            if s["label"] in texts:
                continue
            # a bar named by its tick label: its placement has a key in the legend
            assert s["kind"] == "bar" and s["tick"] and set(s["owner"]) <= set(texts), (name, s["label"], s.get("tick"))
        owners = {o for s in plotted for o in s["owner"]}
        assert not {t for t in texts if t in known} - owners, name     # no key for a placement not drawn
        bands = [s for s in plotted if s["kind"] in ("band", "collection")]
        assert all(s["label"] in texts for s in bands), name        # shaded bands and bounds are in the legend
    assert any("band: min..max" in t for t in legend_texts(figures["samples/capacity_sweep"]))
    assert any("offline optimum" in t for t in legend_texts(figures["samples/hit_rate_curves"]))


def _inside(inner, outer, tol: float = 1.0) -> bool:
    return (inner.x0 >= outer.x0 - tol and inner.y0 >= outer.y0 - tol
            and inner.x1 <= outer.x1 + tol and inner.y1 <= outer.y1 + tol)


def test_titles_and_legends_fit_inside_the_figure_and_clear_of_the_data(figures) -> None:
    for name, fig in figures.items():
        r = fig.canvas.get_renderer()
        box = fig.bbox
        title = fig._suptitle.get_window_extent(r)
        assert _inside(title, box), (name, title, box)
        for ax in fig.axes:
            if not ax.get_visible():
                continue
            for text in (ax.title, ax.xaxis.label, ax.yaxis.label):
                if text.get_text():
                    assert _inside(text.get_window_extent(r), box), (name, text.get_text())
        for leg in fig.legends:
            lb = leg.get_window_extent(r)
            assert _inside(lb, box), (name, lb, box)
            assert not lb.overlaps(title), name
            for ax in fig.axes:
                if ax.get_visible() and ax.axison:
                    assert not lb.overlaps(ax.get_window_extent(r)), (name, ax.get_title())


def test_a_single_capacity_is_drawn_as_bars(figures) -> None:
    fig = figures["synthetic/capacity_sweep"]
    for ax in fig.axes:
        bars = [c for c in ax.containers if isinstance(c, BarContainer)]
        assert {c.get_label() for c in bars} == {"resident", "fetch", THIRD_PARTY}
        assert not [c for c in ax.containers if isinstance(c, ErrorbarContainer) and c.lines[0] is not None]
        assert not [line for line in ax.lines if len(line.get_xdata()) > 1 and line.get_label() != "_nolegend_"]
    assert "4 slots per layer" in fig.axes[-1].get_xlabel()
    lines = [c for ax in figures["samples/capacity_sweep"].axes for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert lines and not any(isinstance(c, BarContainer) for ax in figures["samples/capacity_sweep"].axes
                             for c in ax.containers)


# ----------------------------------------------------------------------------- the style table

def colliding(kind: str) -> list[str]:
    """Two names that an unregistered lookup hashes to one colour (what a registry must keep apart)."""
    by_colour: dict[str, list[str]] = {}
    for i in range(200):
        name = f"new_{kind}_{i}"
        by_colour.setdefault(plotstyle.style(kind, name).color, []).append(name)
    return next(names[:2] for names in by_colour.values() if len(names) > 1)


def register(monkeypatch, kind: str, names: list[str]):
    from engine.registry import PLACEMENTS, POLICIES
    from harness.engines import ENGINES

    registry = {"placement": PLACEMENTS, "policy": POLICIES, "engine": ENGINES}[kind]
    for name in names:
        monkeypatch.setitem(registry._targets, name, "engine.placements.fetch:Fetch")
    return registry


def test_every_registered_plugin_gets_a_distinct_style(monkeypatch) -> None:
    """No plugin needs an entry in the style table: every registered placement, policy and engine
    -- builtin or not, in the table or not -- has a colour no other of its kind has, and one that
    is not in the table keeps clear of every table colour (and a policy or engine of a registered
    placement's). Shown with new plugins registered under names the table does not know, as a new
    builtin or an installed third-party one is, two of each kind hashing to one colour."""
    fixed = [s.color for table in plotstyle.STYLE_TABLE.values() for s in table.values() if s is not None]
    assert len(set(fixed)) == len(fixed)
    new = {kind: [*colliding(kind), f"brand_new_{kind}"] for kind in ("placement", "policy", "engine")}
    registries = {kind: register(monkeypatch, kind, names) for kind, names in new.items()}
    defaults: dict[str, set[str]] = {}
    for kind, registry in registries.items():
        names = [n for n in registry.names() if n not in plotstyle.STYLE_TABLE[kind]
                 or plotstyle.STYLE_TABLE[kind][n] is not None]        # our engine is drawn in its placements' styles
        assert set(new[kind]) <= set(names)
        styles = {n: plotstyle.style(kind, n) for n in names}
        colors = [st.color for st in styles.values()]
        assert len(set(colors)) == len(colors), (kind, styles)
        defaults[kind] = {st.color for n, st in styles.items() if n not in plotstyle.STYLE_TABLE[kind]}
        assert len(defaults[kind]) >= len(new[kind]) and not defaults[kind] & set(fixed), (kind, defaults[kind])
    assert not defaults["policy"] & defaults["placement"] and not defaults["engine"] & defaults["placement"]
    # a figure of every registered placement draws each in that style
    placements = registries["placement"].names()
    _, series = plotstyle.configs(pd.DataFrame({"placement": placements, "value": 1.0}), ["placement"])
    assert {st.name: st.color for st in series.values()} == {n: plotstyle.style("placement", n).color
                                                            for n in placements}


def test_more_new_placements_than_free_colours_still_differ_in_style(monkeypatch) -> None:
    """Past the colours kept for plugins without an entry, a new placement still has a style (colour
    and marker) no other registered placement has."""
    registry = register(monkeypatch, "placement", [f"extra_{i}" for i in range(24)])
    styles = [plotstyle.style("placement", n) for n in registry.names()]
    assert len(set(styles)) == len(styles)


def test_a_third_party_name_gets_a_stable_colour_no_builtin_has() -> None:
    fixed = {s.color for table in plotstyle.STYLE_TABLE.values() for s in table.values() if s is not None}
    names = [f"plugin_{i}" for i in range(200)]
    colors = {plotstyle.style("placement", n).color for n in names}
    assert not colors & fixed and len(colors) > 3
    assert plotstyle.style("placement", THIRD_PARTY) == plotstyle.style("placement", THIRD_PARTY)
    code = f"from harness.plotstyle import style; print(style('placement', {THIRD_PARTY!r}).color)"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "12345"}).stdout.strip()
    assert other == plotstyle.style("placement", THIRD_PARTY).color        # not Python's per-process hash
    # several third-party placements in one figure never share a colour
    df = pd.DataFrame({"placement": [f"ext_{i}" for i in range(6)] + ["fetch"], "value": 1.0})
    _, styles = plotstyle.configs(df, ["placement"])
    assert len({s.color for s in styles.values()}) == 7


def test_variants_of_a_placement_keep_its_hue_and_vary_shade_and_line() -> None:
    df = pd.DataFrame({"placement": ["fetch"] * 3 + ["cpu"], "cache_policy": ["lru", "lfu", "fifo", None],
                       "context_tokens": ["1024", "256", "auto", "512"]})
    labelled, styles = plotstyle.configs(df, ["placement", "cache_policy", "context_tokens"])
    assert list(styles) == ["fetch (policy fifo, ctx auto)", "fetch (policy lfu, ctx 256)",
                            "fetch (policy lru, ctx 1024)", "cpu (ctx 512)"]
    fetch = [s for s in styles.values() if s.name == "fetch"]
    assert all(same_hue(hue(s.color), hue(fetch[0].color)) for s in fetch) and len({s.color for s in fetch}) == 3
    assert len({s.linestyle for s in fetch}) == 3 and fetch[0].color == plotstyle.PLACEMENT_STYLES["fetch"].color
    assert set(labelled["config"]) == set(styles)
    assert plotstyle.ordered(["1024", "auto", "256", None, "512", 64]) == [64, "256", "512", "1024", "auto"]
    x, ticks = plotstyle.numeric_positions(pd.Series(["1024", "auto", "256", None]))
    assert list(x.iloc[[2, 0, 1]]) == sorted(x.iloc[[2, 0, 1]]) and np.isnan(x.iloc[3])
    assert list(ticks.values()) == ["256", "1024", "auto"]
