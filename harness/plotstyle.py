"""How the standard figures look: the one style table, config labels in their natural order,
numeric axes, legends and titles. `harness.plots` decides what each figure shows; this module
makes every figure show it the same way.

Owns: the style table -- one fixed colour and marker for the placements, engines and cache
policies the guide shows (`STYLE_TABLE`, docs/ci.md) -- and a default for every other name (`style`): a
registered plugin without an entry (a new builtin or a third-party one) gets a colour no entry
and no other registered plugin has, an unknown name a colour from a hash of it, so adding a
plugin needs no edit here; the style and label of each config a figure draws (`configs`: its
placement's colour and marker, shaded and dashed when configs of one placement differ in other
factors; labels in words, "fetch (4 slots)", "hybrid (1 CPU layer)", the placement's options
described by the placement plugin itself); markers for things that are not placements
(`markers`); the order of factor values (numbers numerically, then text such as "auto", then
missing); axes of numbers that may arrive as text (`numeric_positions`); legends outside the
data (`legend`), titles wrapped to the figure (`suptitle`, `wrap`) and point labels placed clear
of each other (`label_points`). Does not own: which rows a figure reads or what it draws
(`harness.plots`).

    from harness.plotstyle import style
    style("placement", "fetch")      # Style(color='#ff7f0e', marker='s')
    style("placement", "my_offload") # a colour no table entry has, the same in every figure and process

Series of our engine take their placement's style; a series of another engine (transformers,
llama.cpp, whose placement knobs mean something else) takes that engine's style.
"""
from __future__ import annotations

import ast
import colorsys
import functools
import hashlib
import importlib
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

__all__ = ["Style", "Series", "STYLE_TABLE", "PLACEMENT_STYLES", "ENGINE_STYLES", "POLICY_STYLES", "MARKERS",
           "EXACT_TREATMENT", "style", "series_style", "natural_key", "ordered", "fmt", "configs", "config_label",
           "placement_words", "markers", "shade", "numeric_positions", "set_ticks", "legend", "suptitle", "wrap",
           "label_points", "is_rate", "from_zero"]


@dataclass(frozen=True)
class Style:
    color: str          # "#rrggbb"
    marker: str         # a matplotlib marker ("" for a line without markers)


# --- the style table ----------------------------------------------------------------------------
# Fixed entries for the plugins the guide names by colour (docs/ci.md); any other registered plugin of
# engine.registry.PLACEMENTS / POLICIES or harness.engines.ENGINES gets a default (`style`), so a new
# one needs no entry. Placements and other engines take tab10's colours, policies the rest, so a
# policy curve is never mistaken for a placement.
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
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "p", "h", "*", "8", "d")
# where each kind's plugins are registered (imported only when a name has no table entry)
_REGISTRIES = {"placement": "engine.registry:PLACEMENTS", "policy": "engine.registry:POLICIES",
               "engine": "harness.engines:ENGINES"}


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
    free = [m for m in MARKERS if m not in fixed] or list(MARKERS)
    return Style(_FREE[(h + probe) % len(_FREE)], free[(h // len(_FREE)) % len(free)])


def _probed(kind: str, names: Iterable[str], used: set[str]) -> dict[str, Style]:
    """The hashed style of each name, in text order; a name whose colour is in `used` (or taken by
    an earlier name) probes on to the next free colour, so none of them share one -- and once
    every free colour is taken, to a marker no name has with that colour, so no two share a style."""
    out: dict[str, Style] = {}
    pairs: set[tuple[str, str]] = set()
    for name in sorted(set(names), key=str):
        tries = [_hashed(kind, str(name), probe) for probe in range(len(_FREE))]
        s = next((t for t in tries if t.color not in used), None)
        if s is None:
            s = next((Style(t.color, m) for m in dict.fromkeys([tries[0].marker, *MARKERS]) for t in tries
                      if (t.color, m) not in pairs), tries[0])
        out[name] = s
        used.add(s.color)
        pairs.add((s.color, s.marker))
    return out


def _registered_names(kind: str) -> tuple[str, ...]:
    module, _, attr = _REGISTRIES[kind].partition(":")
    return tuple(getattr(importlib.import_module(module), attr).names())


# the kinds whose registered defaults another kind's keep clear of (they share figures)
_CLEAR_OF = {"placement": (), "engine": ("placement",), "policy": ("placement",)}


@functools.lru_cache(maxsize=None)
def _defaults(kind: str, names: tuple[str, ...], taken: frozenset[str]) -> dict[str, Style]:
    return _probed(kind, [n for n in names if STYLE_TABLE[kind].get(n) is None], set(taken))


def _registered(kind: str) -> dict[str, Style]:
    """The default style of each registered plugin of `kind` that has no table entry: no two alike,
    and none like a registered placement's."""
    taken = frozenset(s.color for other in _CLEAR_OF[kind] for s in _registered(other).values())
    return _defaults(kind, _registered_names(kind), taken)


def style(kind: str, name: str) -> Style:
    """The style of a placement, engine or policy: its table entry; for a registered plugin without
    one (a new builtin, an installed third-party plugin) a colour that no entry and no other
    registered plugin has; for any other name a colour from a hash of the name that no entry has."""
    table = STYLE_TABLE[kind]
    if table.get(name) is not None:
        return table[name]  # type: ignore[return-value]
    return _registered(kind).get(name) or _hashed(kind, str(name))


def _styles(kind: str, names: Iterable[str]) -> dict[str, Style]:
    """`style` for each name; an unregistered name whose hash lands on a colour another series of
    the figure has probes on, so no two series of a figure share a colour."""
    names = set(names)
    known = {n for n in names if STYLE_TABLE[kind].get(n) is not None or n in _registered(kind)}
    out = {n: style(kind, n) for n in known}
    return {**out, **_probed(kind, names - known, {s.color for s in out.values()})}


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
_BARE = ("engine", "placement")            # named alone, ahead of the details: "hf", "fetch (4 slots)"
_FIRST = ("cache_capacity", "placement_options")      # the details that qualify the placement come first
# how a column reads in a label ("policy lru", "ctx 512"); others by their own name ("ubatch 64")
_WORDS = {"cache_policy": "policy", "context_tokens": "ctx", "gen_tokens": "gen", "kv_dtype": "KV",
          "expert_quant": "experts"}
# values that go without saying in a label: the exact treatment (KV in the model's dtype, experts
# unquantised) and no prefetch -- "fetch (4 slots)" beside "fetch (4 slots, KV q8)"
EXACT_TREATMENT = {"kv_dtype": "model", "expert_quant": "none"}
_UNSAID = {**EXACT_TREATMENT, "prefetch": "none"}
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


def _options(value: object) -> dict | None:
    """Placement options as stored in a row (the repr of a dict), or None when not a dict."""
    if isinstance(value, dict):
        return value
    try:
        parsed = ast.literal_eval(str(value))
    except (ValueError, SyntaxError):
        return None
    return parsed if isinstance(parsed, dict) else None


@functools.lru_cache(maxsize=256)
def _described(placement: str, options: str) -> str | None:
    from engine.registry import PLACEMENTS

    try:
        return PLACEMENTS.get(placement).describe(_options(options))
    except (ImportError, AttributeError, TypeError, ValueError):   # not installed here, no describe, options of
        return None                                                 # another version: the caller writes them out


def placement_words(placement: object, options: object, ours: bool = True) -> str:
    """A placement's options in a few words, as the placement plugin describes them
    (`Placement.describe`: "1 CPU layer"; "" for its defaults). Each option as name=value where
    the plugin cannot say (not installed here, options it does not take, another engine's rows)."""
    opts = _options(options)
    if opts is None:
        return "" if _missing(options) else str(options)
    if not opts:
        return ""
    words = _described(str(placement), repr(opts)) if ours and not _missing(placement) else None
    return words if words is not None else ", ".join(f"{k}={v}" for k, v in opts.items())


def _detail(col: str, value: object, combo: dict, raw: bool) -> str:
    if raw:
        return f"{col}={value}"
    if col == "cache_capacity":
        x = _number(value)
        return f"{value} slots" if x is None else f"{fmt(x)} slot{'' if x == 1 else 's'}"
    if col == "placement_options":
        ours = series_style(combo.get("engine"), combo.get("placement"))[0] == "placement"
        return placement_words(combo.get("placement"), value, ours)
    return f"{_WORDS.get(col, col)} {fmt(value)}"


def config_label(combo: dict, cols: Sequence[str], raw: bool = False) -> str:
    """A config in words: engine and placement by name, then what qualifies them in brackets --
    "fetch (4 slots, policy lru)", "hybrid (1 CPU layer, ctx 512)", "cpu (KV q8)"; an exact
    treatment and no prefetch go without saying. `raw`: every detail as the column=value it is
    stored as (what tells apart two configs that read alike)."""
    cols = list(cols)
    head = [str(combo[c]) for c in cols if c in _BARE and not _missing(combo[c])]
    rest = sorted((c for c in cols if c not in _BARE and not _missing(combo[c])
                   and (raw or _UNSAID.get(c) != combo[c])),
                  key=lambda c: _FIRST.index(c) if c in _FIRST else len(_FIRST))
    details = [d for d in (_detail(c, combo[c], combo, raw) for c in rest) if d]
    label = " ".join(head)
    if details:
        label = f"{label} ({', '.join(details)})" if label else ", ".join(details)
    return label or "all"


def configs(df: pd.DataFrame, cols: Sequence[str]) -> tuple[pd.DataFrame, dict[str, Series]]:
    """Label each row with its config (`config` column, e.g. "fetch (4 slots, ctx 512)", see
    `config_label`) and style each config: ordered by engine, placement (table order, then
    others by name) and the other factors' natural order; the k-th of n configs of one placement
    gets the k-th line style and a shade k/(n-1) of the way to SHADE_RANGE, so its hue stays the
    placement's. Configs whose words read alike (options a plugin does not describe) are labelled
    with their stored values instead, so no two configs ever pool into one series."""
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
    words = [config_label(c, cols) for c in combos]
    alike = {w for w in words if words.count(w) > 1}
    seen: dict[tuple, int] = {}
    styles: dict[str, Series] = {}
    labels: dict[tuple, str] = {}
    for combo, (kind, name), label in zip(combos, idents, words):
        k, n = seen.get((kind, name), 0), members[(kind, name)]
        seen[(kind, name)] = k + 1
        base = bases[kind][name]
        label = config_label(combo, cols, raw=True) if label in alike else label
        labels[tuple(combo.values())] = label
        styles.setdefault(label, Series(label, shade(base.color, SHADE_RANGE * k / max(n - 1, 1)), base.marker,
                                        LINESTYLES[k % len(LINESTYLES)], base, kind, name))
    out = df.assign(config=[labels[t] for t in norm.itertuples(index=False, name=None)])
    return out, styles


def markers(names: Sequence[str]) -> dict[str, str]:
    """One marker per name, in the order given: for what a figure tells apart by marker while
    colour stays the placement's (a lossy treatment)."""
    return {name: MARKERS[i % len(MARKERS)] for i, name in enumerate(names)}


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


# offsets (points) tried in turn for a point's label: beside it, then further above and below
_BESIDE = [(dx, dy) for dy in (3, -3, 12, -12, 21, -21) for dx in (4, -4)]


def label_points(fig: Figure, ax: Axes, points: Sequence[tuple[float, float, str]], fontsize: float = 7) -> None:
    """Name data points with short texts beside them, each at the first offset where it stays
    inside the axes and clear of the texts already there (call last: it lays the figure out).
    A label that finds no clear place takes the first offset."""
    if not points:
        return
    fig.draw_without_rendering()
    frame = ax.get_window_extent()
    placed = [t.get_window_extent() for t in ax.texts if t.get_visible() and t.get_text()]
    for x, y, text in points:
        label = ax.annotate(text, (x, y), xytext=_BESIDE[0], textcoords="offset points", fontsize=fontsize,
                            annotation_clip=False)
        label.set_in_layout(False)           # the axes keep their place; the label finds one inside them
        for dx, dy in _BESIDE:
            label.set_position((dx, dy))
            label.set_horizontalalignment("left" if dx > 0 else "right")
            label.set_verticalalignment("bottom" if dy > 0 else "top")
            box = label.get_window_extent()
            inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
            if inside and not any(box.overlaps(other) for other in placed):
                break
        else:
            dx, dy = _BESIDE[0]
            label.set_position((dx, dy))
            label.set_horizontalalignment("left")
            label.set_verticalalignment("bottom")
        placed.append(label.get_window_extent())
