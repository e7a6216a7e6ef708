"""How the standard figures look: the one style table, config labels in their natural order,
numeric axes, legends and titles. `harness.plots` decides what each figure shows; this module
makes every figure show it the same way.

Owns: the style table -- one fixed colour and marker per builtin placement, engine and cache
policy (`STYLE_TABLE`), and a deterministic one for a third-party name (`style`); the style of
each config a figure draws (`configs`: its placement's colour and marker, shaded and dashed
when configs of one placement differ in other factors); the order of factor values (numbers
numerically, then text such as "auto", then missing); axes of numbers that may arrive as text
(`numeric_positions`); legends outside the data (`legend`) and titles wrapped to the figure
(`suptitle`, `wrap`). Does not own: which rows a figure reads or what it draws (`harness.plots`).

    from harness.plotstyle import style
    style("placement", "fetch")      # Style(color='#ff7f0e', marker='s')
    style("placement", "my_offload") # a colour no builtin has, the same in every figure and process

Series of our engine take their placement's style; a series of another engine (transformers,
llama.cpp, whose placement knobs mean something else) takes that engine's style.
"""
from __future__ import annotations

import colorsys
import hashlib
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.colors import to_hex, to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from harness.contract import METRIC_UNITS
from harness.order import missing as _missing, natural_key, number as _number  # noqa: F401 (natural_key re-exported)

__all__ = ["Style", "Series", "STYLE_TABLE", "PLACEMENT_STYLES", "ENGINE_STYLES", "POLICY_STYLES", "style",
           "series_style", "natural_key", "ordered", "fmt", "configs", "shade", "numeric_positions", "set_ticks", "legend",
           "suptitle", "wrap", "is_rate", "from_zero"]


@dataclass(frozen=True)
class Style:
    color: str          # "#rrggbb"
    marker: str         # a matplotlib marker ("" for a line without markers)


# --- the style table ----------------------------------------------------------------------------
# One entry per builtin plugin of engine.registry.PLACEMENTS / POLICIES and harness.engines.ENGINES
# (tests/analysis/test_figure_style.py fails when a builtin has none). Placements and other engines
# take tab10's colours, policies the rest, so a policy curve is never mistaken for a placement.
PLACEMENT_STYLES: dict[str, Style] = {
    "resident": Style("#1f77b4", "o"),      # blue
    "fetch": Style("#ff7f0e", "s"),         # orange
    "cpu": Style("#2ca02c", "^"),           # green
    "hybrid": Style("#9467bd", "D"),        # purple
    "stream": Style("#8c564b", "v"),        # brown
    "resident_grouped": Style("#6baed6", "h"),   # light blue: resident's variant
}
ENGINE_STYLES: dict[str, Style | None] = {
    "moebench": None,                       # ours: drawn in its placements' styles
    "hf": Style("#e377c2", "P"),            # pink
    "llamacpp": Style("#17becf", "X"),      # cyan
}
POLICY_STYLES: dict[str, Style] = {
    "lru": Style("#d62728", "o"),           # red
    "lfu": Style("#bcbd22", "s"),           # olive
    "fifo": Style("#7f7f7f", "^"),          # grey
    "static": Style("#393b79", "D"),        # indigo
    "belady": Style("#000000", ""),         # black: the offline optimum, drawn as the bound
}
STYLE_TABLE: dict[str, dict[str, Style | None]] = {"placement": PLACEMENT_STYLES, "engine": ENGINE_STYLES,
                                                   "policy": POLICY_STYLES}

_TAKEN = [to_rgb(s.color) for table in STYLE_TABLE.values() for s in table.values() if s is not None]
SHADE_RANGE = 0.6        # the last variant of a placement: this far towards white
MIN_DELTA_E = 30.0       # CIELAB distance a third-party colour keeps from the others
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "p", "h", "*", "8", "d")


def _lab(rgb: Sequence[float]) -> np.ndarray:
    """CIELAB (D65) of an sRGB colour: where distance is what the eye sees."""
    c = np.asarray(rgb, dtype=float)
    c = np.where(c > 0.04045, ((c + 0.055) / 1.055) ** 2.4, c / 12.92)
    xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]]) @ c
    f = np.cbrt(xyz / np.array([0.9505, 1.0, 1.089]))
    f = np.where(f > 0.2069, f, (xyz / np.array([0.9505, 1.0, 1.089])) / 0.1284 + 4 / 29)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def _free_colors() -> list[str]:
    """Colours for third-party names, in a fixed order: candidates around the hue circle at two
    lightnesses, each kept only when it is at least MIN_DELTA_E (CIELAB) from every fixed entry,
    every shade a variant of one may take, and every colour kept before it."""
    avoid = [_lab(np.asarray(rgb) + a * (1 - np.asarray(rgb))) for rgb in _TAKEN for a in (0.0, 0.3, SHADE_RANGE)]
    out: list[str] = []
    for lightness in (0.42, 0.3):
        for h in np.arange(0.0, 1.0, 0.01):
            rgb = colorsys.hls_to_rgb(float(h), lightness, 0.75)
            if min(np.linalg.norm(_lab(rgb) - a) for a in avoid) >= MIN_DELTA_E:
                out.append(to_hex(rgb))
                avoid.append(_lab(rgb))
    return out


_FREE = _free_colors()


def _hashed(kind: str, name: str, probe: int = 0) -> Style:
    h = int.from_bytes(hashlib.sha256(f"{kind}:{name}".encode()).digest()[:8], "big")
    fixed = {s.marker for s in STYLE_TABLE[kind].values() if s is not None}
    markers = [m for m in _MARKERS if m not in fixed] or list(_MARKERS)
    return Style(_FREE[(h + probe) % len(_FREE)], markers[(h // len(_FREE)) % len(markers)])


def style(kind: str, name: str) -> Style:
    """The style of a placement, engine or policy: its fixed entry, or for a name the table does
    not know (a third-party plugin) a colour from a hash of the name that no fixed entry has."""
    table = STYLE_TABLE[kind]
    if name in table and table[name] is not None:
        return table[name]  # type: ignore[return-value]
    return _hashed(kind, str(name))


def _styles(kind: str, names: Iterable[str]) -> dict[str, Style]:
    """`style` for each name; two unknown names that hash to one colour keep it apart in a figure
    (the later in text order probes on), so no two series of a figure share a colour."""
    out: dict[str, Style] = {}
    used = set()
    for name in sorted(set(names), key=lambda n: (n not in STYLE_TABLE[kind], str(n))):
        s, probe = style(kind, name), 0
        while name not in STYLE_TABLE[kind] and s.color in used and probe < len(_FREE):
            probe += 1
            s = _hashed(kind, str(name), probe)
        out[name] = s
        used.add(s.color)
    return out


def series_style(engine: object, placement: object) -> tuple[str, str, Style]:
    """(kind, name, style) of a series: our engine's rows by placement, another engine's by engine."""
    ours = _missing(engine) or (str(engine) in ENGINE_STYLES and ENGINE_STYLES[str(engine)] is None)
    if not ours:
        return "engine", str(engine), style("engine", str(engine))
    name = "none" if _missing(placement) else str(placement)
    return "placement", name, style("placement", name)


# --- order of values ----------------------------------------------------------------------------
def ordered(values: Iterable) -> list:
    """The distinct values in natural order (see `natural_key`), missing ones dropped."""
    seen = {v: None for v in values if not _missing(v)}
    return sorted(seen, key=natural_key)


def fmt(v: object) -> str:
    x = _number(v)
    return str(v) if x is None else (f"{x:.0f}" if x == int(x) else f"{x:g}")


def _rank(kind: str, name: object) -> tuple:
    table = list(STYLE_TABLE[kind])
    if _missing(name):
        return (2, 0, "")
    return (0, table.index(name), "") if name in table else (1, 0, str(name))


# --- configs: what tells the series of a figure apart --------------------------------------------
_SHORT = {"cache_capacity": "cap", "cache_policy": "policy", "context_tokens": "ctx", "gen_tokens": "gen"}
_BARE = ("engine", "placement")            # shown by name alone: "hf", "fetch cap=4"
LINESTYLES = ("-", "--", "-.", ":")


@dataclass(frozen=True)
class Series:
    label: str
    color: str          # the placement's (or engine's) colour, shaded for a variant
    marker: str
    linestyle: str
    base: Style         # the placement's (or engine's) entry in the style table
    kind: str           # "placement" or "engine": which table `base` comes from
    name: str


def shade(color: str, amount: float) -> str:
    """Blend towards white (amount > 0) or black (< 0); the hue stays the colour's own."""
    rgb = np.asarray(to_rgb(color))
    out = rgb + amount * (1 - rgb) if amount >= 0 else rgb * (1 + amount)
    return to_hex(np.clip(out, 0, 1))


def _label(combo: dict, cols: Sequence[str]) -> str:
    parts = [(str(combo[c]) if c in _BARE else f"{_SHORT.get(c, c)}={fmt(combo[c])}")
             for c in cols if not _missing(combo[c])]
    return " ".join(parts) or "all"


def configs(df: pd.DataFrame, cols: Sequence[str]) -> tuple[pd.DataFrame, dict[str, Series]]:
    """Label each row with its config (`config` column, e.g. "fetch cap=4 ctx=512") and style
    each config: ordered by engine, placement (table order, then third-party by name) and the
    other factors' natural order; the k-th of n configs of one placement gets the k-th line
    style and a shade k/(n-1) of the way to SHADE_RANGE, so its hue stays the placement's."""
    cols = list(cols)
    if df.empty or not cols:
        return df.assign(config="all"), {}
    norm = df[cols].astype(object).where(df[cols].notna(), None)
    combos = [dict(zip(cols, t)) for t in dict.fromkeys(norm.itertuples(index=False, name=None))]

    def key(c: dict) -> tuple:
        head = (_rank("engine", c.get("engine")), _rank("placement", c.get("placement")))
        return head + tuple(natural_key(c[k]) for k in cols if k not in _BARE)

    combos.sort(key=key)
    idents = [series_style(c.get("engine"), c.get("placement"))[:2] for c in combos]
    bases = {kind: _styles(kind, [n for k, n in idents if k == kind]) for kind in ("placement", "engine")}
    members: dict[tuple, int] = {}
    for ident in idents:
        members[ident] = members.get(ident, 0) + 1
    seen: dict[tuple, int] = {}
    styles: dict[str, Series] = {}
    labels: dict[tuple, str] = {}
    for combo, (kind, name) in zip(combos, idents):
        k, n = seen.get((kind, name), 0), members[(kind, name)]
        seen[(kind, name)] = k + 1
        base = bases[kind][name]
        label = _label(combo, cols)
        labels[tuple(combo.values())] = label
        styles.setdefault(label, Series(label, shade(base.color, SHADE_RANGE * k / max(n - 1, 1)), base.marker,
                                        LINESTYLES[k % len(LINESTYLES)], base, kind, name))
    out = df.assign(config=[labels[t] for t in norm.itertuples(index=False, name=None)])
    return out, styles


# --- axes ---------------------------------------------------------------------------------------
def numeric_positions(values: pd.Series) -> tuple[pd.Series, dict[float, str]]:
    """Positions for a numeric factor whose values may arrive as text ("1024", "auto"): numbers
    at their value, text after the largest number one step apart (in text order), missing NaN.
    Returns the positions (aligned with `values`) and the tick label of each position."""
    num = pd.Series([_number(v) for v in values], index=values.index, dtype=float)
    numbers = sorted(set(num.dropna()))
    texts = ordered(str(v) for v, x in zip(values, num) if pd.isna(x) and not _missing(v))
    step = float(np.median(np.diff(numbers))) if len(numbers) > 1 else 1.0
    top = numbers[-1] if numbers else 0.0
    at = {t: top + step * (i + 1) for i, t in enumerate(texts)}
    pos = num.copy()
    for i, (v, x) in enumerate(zip(values, num)):
        if pd.isna(x) and not _missing(v):
            pos.iloc[i] = at[str(v)]
    return pos, {**{x: fmt(x) for x in numbers}, **{p: t for t, p in at.items()}}


def set_ticks(ax: Axes, ticks: dict[float, str], axis: str = "x", most: int = 12) -> None:
    """Tick every position when there are few; always tick and label the text ones ("auto")."""
    keep = dict(ticks)
    if len(ticks) > most:
        numbers = [p for p, t in ticks.items() if _number(t) is not None]
        keep = {p: t for p, t in ticks.items() if p not in numbers or numbers.index(p) % -(-len(numbers) // most) == 0}
    (ax.set_xticks if axis == "x" else ax.set_yticks)(list(keep), list(keep.values()))


def is_rate(metric: str) -> bool:
    """A per-second rate or a ratio (tok/s, GB/s, hit rate): its axis starts at zero."""
    unit = METRIC_UNITS.get(metric, "")
    return unit.endswith("/s") or unit == "ratio"


def from_zero(ax: Axes, axis: str = "y") -> None:
    """Start a linear axis at zero (call after drawing); a log axis is left alone."""
    if (ax.get_yscale() if axis == "y" else ax.get_xscale()) != "linear":
        return
    if axis == "y":
        ax.set_ylim(bottom=0)
    else:
        ax.set_xlim(left=0)


# --- legends and titles -------------------------------------------------------------------------
_CHAR_EM = 0.6          # a DejaVu Sans character is at most ~0.6 em wide on average


def wrap(text: str, width_in: float, fontsize: float) -> str:
    """`text` wrapped (line by line) to fit `width_in` inches at `fontsize` points."""
    chars = max(12, int(width_in * 72 / (fontsize * _CHAR_EM)))
    return "\n".join(textwrap.fill(line, chars) if line else line for line in text.split("\n"))


def suptitle(fig: Figure, text: str, fontsize: float = 10) -> None:
    fig.suptitle(wrap(text, fig.get_figwidth() * 0.97, fontsize), fontsize=fontsize)


def legend(fig: Figure, axes: Sequence[Axes], extra: Sequence[Artist] = (), fontsize: float = 8) -> None:
    """One legend below the axes (outside the data, clear of the title). Artists of one label
    (a reference line and its shaded band) become one entry; `extra` adds proxy entries (keys)."""
    entries: dict[str, list] = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            group = entries.setdefault(lab, [])
            if type(h) not in {type(g) for g in group}:
                group.append(h)
    for h in extra:
        entries.setdefault(h.get_label(), [h])
    if not entries:
        return
    handles = [g[0] if len(g) == 1 else tuple(sorted(g, key=lambda a: not isinstance(a, Patch))) for g in entries.values()]
    labels = list(entries)
    entry_in = (max(len(lab) for lab in labels) * fontsize * _CHAR_EM + 40) / 72
    ncols = max(1, min(len(labels), int(fig.get_figwidth() * 0.95 / entry_in)))
    fig.legend(handles, labels, loc="outside lower center", ncols=ncols, fontsize=fontsize, frameon=False)
