"""PNG figures: two generic parts (:class:`Lines`, :class:`Heatmap`), deterministic bytes.

Each figure's title states its finding, computed from the rows by a function the
study declares. Committed figures must not change between two runs that measured
the same numbers: fixed size and resolution, no "Software" text chunk (Agg writes
no date). Built on ``matplotlib.figure.Figure`` directly: no pyplot global state.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from harness.report.rows import ordered
from harness.report.section import Rows
from harness.report.text import letter, small
from harness.results import atomic_path

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

#: Folder of the figures, relative to REPORT.md.
FIGURES_DIR = "figures"
#: Pixels per inch: a 10-inch-wide figure is 1000 px, a forge page's content width.
DPI = 100
WIDTH = 10.0
#: One look for every figure, independent of the user's matplotlibrc.
STYLE = {
    "font.size": 10,
    "axes.titlesize": 10,
    "axes.labelsize": 10,
    "legend.fontsize": 9,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "savefig.facecolor": "white",
}
#: Colours that stay distinct for colour-blind readers (Okabe-Ito); six series at most.
COLOURS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9")
MARKERS = ("o", "s", "^", "D", "v", "P")
#: Unicode superscripts: tick labels like 10⁻⁹ without matplotlib's (slow) mathtext parser.
SUPERSCRIPTS = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")

Title = Callable[["pd.DataFrame", float], str]


@contextmanager
def style() -> Iterator[None]:
    """The report's look, for everything drawn and saved inside the block.

    matplotlib reads some settings when an artist is created and others when
    the figure is saved, so a section builds *and* saves its figures inside. The
    figure machinery is imported here, before the report forks: importing it takes
    longer than drawing, and the child then inherits it instead of importing it again.
    """
    import matplotlib
    import matplotlib.figure  # noqa: F401
    from matplotlib.backends import backend_agg  # noqa: F401

    with matplotlib.rc_context(STYLE):
        yield


def new_figure(height: float, title: str, rows: int = 1, cols: int = 1, left: float = 0.07,
               right: float = 0.98, legend_rows: int = 1, hspace: float = 0.55, **grid):
    """A figure ``WIDTH`` x ``height`` inches titled ``title``, and its grid of axes (2-D).

    Margins are fixed in inches instead of computed by a layout engine: every
    figure has a fixed size and labels of known length, and the engine would more
    than double the time a report takes to draw.
    """
    from matplotlib.figure import Figure

    figure = Figure(figsize=(WIDTH, height), dpi=DPI)
    lines = textwrap.wrap(title, 110)
    figure.suptitle("\n".join(lines), fontsize=11, fontweight="bold", y=1 - 0.12 / height)
    axes = figure.subplots(rows, cols, squeeze=False, gridspec_kw=grid or None)
    figure.subplots_adjust(left=left, right=right, wspace=0.22, hspace=hspace,
                           top=1 - (0.35 + 0.22 * len(lines)) / height,
                           bottom=(0.62 + 0.3 * legend_rows) / height)
    return figure, axes


def zero_floor(values: pd.Series, rtol: float | None) -> float:
    """A power of ten below every positive value (and the tolerance): where zeros are drawn."""
    positive = values[values > 0].tolist()
    smallest = min([*([rtol] if rtol else []), *positive], default=1.0)
    return 10.0 ** (math.floor(math.log10(smallest)) - 1)


def power_of_ten(exponent: int) -> str:
    return "10" + str(exponent).translate(SUPERSCRIPTS)


def label_floor_as_zero(axis, floor: float, largest: float) -> None:
    """Decade ticks up to ``largest`` and a tick at the floor reading 0 (log axes have no 0)."""
    largest = largest if largest > 10 * floor else 10 * floor  # also when NaN: nothing to show
    low_exp, high_exp = round(math.log10(floor)), math.ceil(math.log10(largest))
    step = max(1, (high_exp - low_exp) // 6)
    # No decade right above the floor: its label would collide with the floor's "0".
    exponents = list(range(high_exp, low_exp + 1, -step))[::-1]
    axis.set_yscale("log")
    axis.set_yticks([floor, *(10.0 ** e for e in exponents)],
                    ["0", *(power_of_ten(e) for e in exponents)])
    axis.minorticks_off()
    axis.set_ylim(floor / 3, 10.0 ** exponents[-1] * 3 if exponents else largest * 3)


def ratio_axis(axis, counts: list[int], name: str = "N") -> list:
    """A log2 axis with ticks at 1/N, 1 and N (``name``: the count's letter), and the 1/N and
    1 curves; their legend handles."""
    import numpy as np
    from matplotlib.lines import Line2D

    grid = np.linspace(min(counts), max(counts), 100)
    axis.plot(grid, 1 / grid, color="0.55", linestyle="--", linewidth=1, zorder=1)
    axis.plot(grid, np.ones_like(grid), color="0.55", linestyle=":", linewidth=1.2, zorder=1)
    axis.set_yscale("log", base=2)
    low, high = axis.get_ylim()
    ticks = {1.0: "1", **{1 / n: f"1/{n}" for n in counts if n > 1},
             **{float(n): str(n) for n in counts}}
    shown = sorted(t for t in ticks if low <= t <= high)
    axis.set_yticks(shown, [ticks[t] for t in shown])
    axis.minorticks_off()
    axis.set_ylim(low, high)
    # The lines name what y is of the N gradients, not what a reduction did: a mean loss
    # puts 1/N into a sum too.
    return [Line2D([], [], color="0.55", linestyle="--", label=f"1/{name} (their mean)"),
            Line2D([], [], color="0.55", linestyle=":", label="1 (their sum)")]


def _shifts(n: int, width: float) -> list[float]:
    """Sideways shifts so that n series at the same x do not hide each other."""
    return [0.0] * n if n == 1 else [-width / 2 + width * i / (n - 1) for i in range(n)]


@dataclass(frozen=True, kw_only=True)
class Lines:
    """``y`` against ``x``: one colour and marker per ``series``, a panel per ``panels`` value.

    With several ``y`` the panels form a grid (a row per ``panels`` value, a
    column per ``y``); with one, the panels stand side by side. Where a series has
    several rows at one x, every value is a marker and the line goes through
    their mean. ``log_y`` columns draw zeros on a floor labelled 0; ``ratio_y``
    puts y on a log2 axis with 1/N and 1 reference curves (N: the count ``x``); ``decorate(axis,
    rows of the panel)`` adds what only this figure has (and returns its legend handles).
    """

    name: str
    title: Title
    caption: str
    x: str
    y: tuple[str, ...]
    series: str
    panels: str = ""
    where: str = ""
    log_x: bool = False
    log_y: tuple[str, ...] = ()
    #: Zeros of ``log_y`` columns drawn below the tolerance (distances), or below the data.
    tolerance_floor: bool = True
    ratio_y: bool = False
    jitter: float = 0.0
    decorate: Callable | None = None
    height: float = 3.8

    def __call__(self, rows: Rows) -> str | None:
        data = rows.select(self.where)
        if data.empty:
            return None
        panels = dict(iter(data.groupby(self.panels, sort=False))) if self.panels else {"": data}
        series = ordered(data, self.series)
        shape = (len(panels), len(self.y)) if len(self.y) > 1 else (1, len(panels))
        title = self.title(data, rows.rtol)
        figure, axes = new_figure(self.height, title, *shape)
        floors = {y: zero_floor(data[y].dropna(), rows.rtol if self.tolerance_floor else None)
                  for y in self.log_y}
        references, extra = [], []
        cells = [(p, y) for p in panels for y in self.y]
        for axis, (panel, y) in zip(axes.flat, cells, strict=True):
            self._draw(axis, panels[panel], y, series, floors.get(y))
            if y in floors:
                label_floor_as_zero(axis, floors[y], float(data[y].max()))
            if self.ratio_y:
                references = ratio_axis(axis, sorted(int(n) for n in data[self.x].unique()),
                                        letter(self.x))
            if self.decorate:
                extra = self.decorate(axis, panels[panel]) or []
            # One y: panels are titled by their value, the y named once on the left.
            axis.set_title(f"{y}: {panel}" if len(self.y) > 1 and panel else panel or y)
            axis.set_xlabel(self.x)
        if len(self.y) == 1:
            axes[0, 0].set_ylabel(self.y[0])
        handles = _handles(series) + references + extra
        figure.legend(handles=handles, loc="lower center", ncols=min(len(handles), 7),
                      frameon=False, columnspacing=1.2)
        caption = rows.fill(self.caption, len(data)) + f" Colour and marker: `{self.series}`."
        return rows.inputs.figures.save(figure, self.name, title, caption)

    def _draw(self, axis, panel: pd.DataFrame, y: str, series: list, floor: float | None):
        xs = sorted(panel[self.x].dropna().unique())
        by_series = dict(iter(panel.groupby(self.series, sort=False)))
        for i, (name, shift) in enumerate(zip(series, _shifts(len(series), self.jitter),
                                              strict=True)):
            points = by_series.get(name, panel.iloc[:0])[[self.x, y]].dropna()
            values = points[y].clip(lower=floor) if floor else points[y]
            line = values.groupby(points[self.x]).mean()
            style = {"color": COLOURS[i % len(COLOURS)], "zorder": 3, "markersize": 4.5,
                     "marker": MARKERS[i % len(MARKERS)]}
            # One line with its markers where a series has one value per x, else markers for
            # every value and the line through their mean (each artist costs drawing time).
            axis.plot(line.index + shift, line.to_numpy(), linewidth=1.2, **(
                style if len(line) == len(points) else {"color": style["color"]}))
            if len(line) < len(points):
                axis.plot(points[self.x] + shift, values, linestyle="", **style)
        if self.log_x:
            axis.set_xscale("log")
            axis.minorticks_off()
        axis.set_xticks(xs, [f"{x:g}" for x in xs], fontsize=8 if len(xs) > 6 else None)


def _handles(series: list) -> list:
    from matplotlib.lines import Line2D

    return [Line2D([], [], color=COLOURS[i % len(COLOURS)], marker=MARKERS[i % len(MARKERS)],
                   label=str(name)) for i, name in enumerate(series)]


@dataclass(frozen=True, kw_only=True)
class Heatmap:
    """A grid of cells: a line per value of the ``rows`` columns, a column per ``column`` (a
    count: N, k).

    A cell's colour is log10 of the largest ``value`` of its rows (0 drawn on
    the floor below the tolerance); its text says ✓ where ``within(rows of the
    cell)``, else the value (or ``text(rows, within)``). ``panels`` stack groups
    of lines: (panel title, where, the columns whose values name a line).
    """

    name: str
    title: Title
    caption: str
    panels: tuple[tuple[str, str, tuple[str, ...]], ...]
    column: str
    value: str
    within: Callable[[pd.DataFrame], bool]
    text: Callable[[pd.DataFrame, bool], str] | None = None
    left: float = 0.3

    def __call__(self, rows: Rows) -> str | None:
        panels = [(title, rows.select(where), columns) for title, where, columns in self.panels]
        panels = [(title, _lines(data, columns)) for title, data, columns in panels
                  if not data.empty]
        if not panels:
            return None
        import pandas as pd

        data = pd.concat([d for _, d in panels])
        floor = zero_floor(data[self.value].dropna(), rows.rtol)
        largest = data[self.value].max()
        # Every value exactly 0 (a run of world size 1 alone) or none measured: the scale
        # still spans the floor to 1.
        top = math.ceil(math.log10(largest)) if largest > 0 else 0
        scale = (math.log10(floor), max(0.0, top))
        heights = [data_["_line"].nunique() for _, data_ in panels]
        title = self.title(data, rows.rtol)
        figure, axes = new_figure(1.3 + 0.3 * sum(heights) + 0.45 * len(panels), title,
                                  rows=len(panels), left=self.left, right=0.84, legend_rows=0,
                                  height_ratios=heights,
                                  # 0.75 inch between panels, as a fraction of their mean height
                                  hspace=0.75 * len(panels) / (0.3 * sum(heights)))
        for axis, (panel_title, panel) in zip(axes[:, 0], panels, strict=True):
            image = self._draw(axis, panel, floor, scale)
            axis.set_title(panel_title)
        low, high = axes[-1, 0].get_position().y0, axes[0, 0].get_position().y1
        bar = figure.colorbar(image, cax=figure.add_axes((0.86, low, 0.015, high - low)))
        exponents = range(math.ceil(scale[0]), int(scale[1]) + 1, 3)
        # The floor is where exact zeros are drawn: its tick reads 0, as on the line plots.
        bar.set_ticks(list(exponents), labels=["0" if e == exponents[0] else power_of_ten(e)
                                               for e in exponents])
        bar.ax.axhline(math.log10(rows.rtol), color="white", linewidth=2)
        bar.set_label(f"{self.value} (log scale; white line: tolerance {small(rows.rtol)})")
        caption = rows.fill(self.caption, len(data))
        return rows.inputs.figures.save(figure, self.name, title, caption)

    def _draw(self, axis, panel: pd.DataFrame, floor: float, scale: tuple[float, float]):
        import numpy as np

        lines = list(panel["_line"].cat.categories)
        counts = sorted(panel[self.column].unique())
        grid = np.full((len(lines), len(counts)), np.nan)
        for (line, n), cell in panel.groupby(["_line", self.column], sort=False, observed=True):
            i, j = lines.index(line), counts.index(n)
            largest = float(cell[self.value].max())
            grid[i, j] = math.log10(max(largest, floor))
            inside = bool(self.within(cell))
            text = self.text(cell, inside) if self.text else "✓" if inside else small(largest)
            dark = (grid[i, j] - scale[0]) / (scale[1] - scale[0] or 1) < 0.6
            axis.text(j, i, text, ha="center", va="center", fontsize=8,
                      color="white" if dark else "black")
        image = axis.imshow(grid, cmap="viridis", vmin=scale[0], vmax=scale[1], aspect="auto")
        axis.set_xticks(range(len(counts)), [f"{letter(self.column)} = {n:g}" for n in counts])
        # Line names as plain text: a tick per line would cost five artists each.
        axis.set_yticks([])
        for i, line in enumerate(lines):
            axis.text(-0.55, i, line, ha="right", va="center", fontsize=8)
        axis.grid(False)
        return image


def _lines(data: pd.DataFrame, columns: tuple[str, ...]) -> pd.DataFrame:
    """The rows with ``_line``, the heatmap line they belong to: its label, ordered by the
    columns in turn, each column's values in the CSV's order."""
    import pandas as pd

    keys = data[list(columns)].astype(str)
    ranks = {c: {v: i for i, v in enumerate(dict.fromkeys(keys[c]))} for c in columns}
    label = keys[columns[0]]
    for column in columns[1:]:
        label = label + " · " + keys[column]
    order = sorted(dict.fromkeys(map(tuple, keys.to_numpy())),
                   key=lambda key: [ranks[c][v] for c, v in zip(columns, key, strict=True)])
    return data.assign(_line=pd.Categorical(label, [" · ".join(key) for key in order]))


@dataclass
class FigureWriter:
    """Saves a section's figures under ``<out>/figures`` and embeds them in Markdown."""

    out: Path
    written: list[str] = field(default_factory=list)

    @property
    def folder(self) -> Path:
        return self.out / FIGURES_DIR

    def save(self, figure: Figure, name: str, alt: str, caption: str) -> str:
        """Write ``figure`` as ``figures/<name>.png``; the Markdown that shows it."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        FigureCanvasAgg(figure)
        target = self.folder / f"{name}.png"
        with atomic_path(target) as temp:
            figure.savefig(temp, format="png", dpi=DPI, metadata={"Software": None})
        self.written.append(target.name)
        return f"![{alt}]({FIGURES_DIR}/{target.name})\n\n*{caption}*"

    def remove_stale(self) -> None:
        """Delete PNGs of earlier reports that this one no longer draws.

        ``figures/`` belongs to the report; a figure left from an older run
        would otherwise sit in a committed results folder, unreferenced.
        """
        if not self.folder.is_dir():
            return
        for path in self.folder.glob("*.png"):
            if path.name not in self.written:
                path.unlink()
