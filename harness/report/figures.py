"""PNG figures for the report: deterministic bytes, atomic writes, relative links.

Committed figures must not change between two runs that measured the same
numbers, so every figure has a fixed size and resolution, and the PNG carries
no "Software" (matplotlib version) text chunk; Agg writes no date. Figures are
built on ``matplotlib.figure.Figure`` directly rather than through pyplot: no
global state, no GUI backend, nothing left open between figures.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from harness.results import atomic_path

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

#: Folder of the figures, relative to REPORT.md.
FIGURES_DIR = "figures"
#: Pixels per inch: a 10-inch-wide figure is 1000 px, a forge page's content width.
DPI = 100
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
#: Colours that stay distinct for colour-blind readers (Okabe-Ito).
COLOURS = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000")
MARKERS = ("o", "s", "^", "D", "v", "P", "X")


@contextmanager
def style() -> Iterator[None]:
    """The report's look, for everything drawn and saved inside the block.

    matplotlib reads some settings when an artist is created and others when
    the figure is saved, so a section builds *and* saves its figures inside.
    """
    import matplotlib

    with matplotlib.rc_context(STYLE):
        yield


@dataclass(frozen=True)
class Margins:
    """Where the axes sit, as fractions of the figure (matplotlib's subplots_adjust).

    Fixed per figure instead of computed by a layout engine: every figure has a
    fixed size and labels of known length, and the engine would more than double
    the time a report takes to draw.
    """

    left: float = 0.08
    right: float = 0.98
    bottom: float = 0.12
    top: float = 0.92
    wspace: float = 0.2
    hspace: float = 0.3


def new_figure(width: float, height: float, rows: int = 1, cols: int = 1,
               margins: Margins = Margins()):
    """A figure of ``width`` x ``height`` inches and its grid of axes (always 2-D)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=DPI)
    axes = figure.subplots(rows, cols, squeeze=False)
    figure.subplots_adjust(**vars(margins))
    return figure, axes


def zero_floor(residuals: pd.Series, rtol: float) -> float:
    """A power of ten below every positive residual (and the tolerance): where zeros are drawn."""
    positive = residuals[residuals > 0]
    smallest = min([rtol, *positive.tolist()])
    return 10.0 ** (math.floor(math.log10(smallest)) - 1)


#: Unicode superscripts: tick labels like 10⁻⁹ without matplotlib's (slow) mathtext parser.
SUPERSCRIPTS = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def power_of_ten(exponent: int) -> str:
    return "10" + str(exponent).translate(SUPERSCRIPTS)


def label_floor_as_zero(axis, floor: float, largest: float) -> None:
    """Decade ticks up to ``largest`` and a tick at the floor reading 0 (log axes have no 0)."""
    largest = largest if largest > 10 * floor else 10 * floor  # also when NaN: nothing to show
    low_exp = round(math.log10(floor))
    high_exp = math.ceil(math.log10(largest))
    step = max(1, (high_exp - low_exp) // 6)
    # No decade right above the floor: its label would collide with the floor's "0".
    exponents = [e for e in range(high_exp, low_exp + 1, -step)][::-1]
    ticks = [floor, *(10.0 ** e for e in exponents)]
    labels = ["0", *(power_of_ten(e) for e in exponents)]
    axis.set_yticks(ticks, labels)
    axis.minorticks_off()
    axis.set_ylim(floor / 3, ticks[-1] * 3)


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
        link = f"{FIGURES_DIR}/{target.name}"
        return f"![{alt}]({link})\n\n*{caption}*"

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
