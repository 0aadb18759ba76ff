"""Drawing helpers for the book's pictures of mechanisms (one definition,
imported by each chapter that draws one).

A diagram is drawn on an empty canvas in data coordinates (x to the right,
y upwards), with three shapes: labelled boxes, arrows, and grids of cells
that stand for a matrix or tensor (optionally shaded, with a shape label).
Every diagram has an opaque white background and dark ink, so that it reads
the same on the site's light and dark pages.
"""

import numbers

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import is_color_like
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

INK = "#222222"
# soft fills, one per role
COLORS = {
    "input": "#dbe9f6",
    "query": "#fde0c5",
    "key": "#d5efd0",
    "value": "#e6dcf2",
    "score": "#f6f2c4",
    "output": "#f9d5d3",
    "neutral": "#eeeeee",
    "masked": "#9e9e9e",
}


def new_diagram(width, height, figsize=None):
    """A blank canvas of `width` x `height` data units; returns (fig, ax)."""
    if not (is_positive(width) and is_positive(height)):
        raise ValueError(
            f"a diagram needs a positive size, got {width!r} x {height!r}"
        )
    if figsize is not None and not (
        isinstance(figsize, tuple | list)
        and len(figsize) == 2
        and all(is_positive(f) for f in figsize)
    ):
        raise ValueError(
            f"figsize must be None or (width, height) in inches, got "
            f"{figsize!r}"
        )
    if figsize is None:
        scale = min(9.0 / width, 6.0 / height)
        figsize = (width * scale, height * scale)
    fig, ax = plt.subplots(figsize=figsize, facecolor="white")
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.set_aspect("equal")
    ax.axis("off")
    return fig, ax


def fill(color):
    """A colour of COLORS by name, or any matplotlib colour as it is."""
    if isinstance(color, str) and color in COLORS:
        return COLORS[color]
    if not is_color_like(color) or color is None:
        raise ValueError(
            f"{color!r} is neither a name of COLORS ({', '.join(COLORS)}) "
            f"nor a matplotlib colour"
        )
    return color


def number(x):
    """float(x) for a finite real number (a NumPy or torch scalar too),
    else None."""
    if isinstance(x, str | bytes | bool):
        return None
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if np.isfinite(x) else None


def is_positive(x):
    """True for a finite real number > 0."""
    x = number(x)
    return x is not None and x > 0


def check_drawing(ax, **points):
    """Raise ValueError unless ax is matplotlib Axes and each point is an
    (x, y) pair of finite numbers."""
    if not isinstance(ax, Axes):
        raise ValueError(f"ax must be matplotlib Axes, got {ax!r}")
    for name, point in points.items():
        pair = not isinstance(point, str) and len(np.shape(point)) == 1
        if not (pair and len(point) == 2 and None not in map(number, point)):
            raise ValueError(
                f"{name} must be an (x, y) pair of numbers, got {point!r}"
            )


def box(ax, center, text, width=1.6, height=0.7, color="neutral", **text_kw):
    """A rounded box centred at `center` with `text` inside; returns the box."""
    check_drawing(ax, center=center)
    if not (is_positive(width) and is_positive(height)):
        raise ValueError(
            f"a box needs a positive size, got {width!r} x {height!r}"
        )
    x, y = center
    patch = FancyBboxPatch(
        (x - width / 2, y - height / 2),
        width,
        height,
        boxstyle="round,pad=0.02,rounding_size=0.12",
        facecolor=fill(color),
        edgecolor=INK,
        linewidth=1.2,
    )
    ax.add_patch(patch)
    ax.text(
        x,
        y,
        text,
        ha="center",
        va="center",
        color=INK,
        **{"fontsize": 11, **text_kw},
    )
    return patch


def arrow(ax, start, end, text=None, offset=(0.0, 0.15), **text_kw):
    """An arrow from `start` to `end`, with an optional label near its middle."""
    check_drawing(ax, start=start, end=end, offset=offset)
    ax.add_patch(
        FancyArrowPatch(
            start,
            end,
            arrowstyle="-|>",
            mutation_scale=14,
            color=INK,
            linewidth=1.2,
            shrinkA=2,
            shrinkB=2,
        )
    )
    if text:
        mid = (np.asarray(start) + np.asarray(end)) / 2 + np.asarray(offset)
        ax.text(
            *mid,
            text,
            ha="center",
            va="bottom",
            color=INK,
            **{"fontsize": 10, **text_kw},
        )


def grid(
    ax,
    origin,
    rows,
    cols,
    cell=0.3,
    color="neutral",
    shade=None,
    label=None,
    cmap="viridis",
):
    """A `rows` x `cols` grid of cells whose top-left corner is at `origin`.

    `color` fills every cell (a name of COLORS or a matplotlib colour);
    `shade`, a (rows, cols) array of numbers in [0, 1], colours each cell from
    `cmap` instead (NaN cells are drawn hatched, as masked). `label` is
    written under the grid. Returns the grid's (x0, y0, x1, y1) extent.
    """
    check_drawing(ax, origin=origin)
    if not all(isinstance(n, numbers.Integral) for n in (rows, cols)):
        raise ValueError(
            f"rows and cols must be integers, got {rows!r}, {cols!r}"
        )
    if rows < 1 or cols < 1:
        raise ValueError(
            f"a grid needs at least one cell, got {rows} x {cols}"
        )
    if not is_positive(cell):
        raise ValueError(f"cell must be a positive size, got {cell!r}")
    if shade is not None:
        shade = np.asarray(shade, dtype=float)
        if shade.shape != (rows, cols):
            raise ValueError(
                f"shade must have shape ({rows}, {cols}), got {shade.shape}"
            )
    x0, y_top = origin
    colormap = plt.get_cmap(cmap)
    for i in range(rows):
        for j in range(cols):
            face, hatch = fill(color), None
            if shade is not None:
                if np.isnan(shade[i, j]):
                    face, hatch = fill("masked"), "////"
                else:
                    face = colormap(float(np.clip(shade[i, j], 0, 1)))
            ax.add_patch(
                Rectangle(
                    (x0 + j * cell, y_top - (i + 1) * cell),
                    cell,
                    cell,
                    facecolor=face,
                    edgecolor=INK,
                    linewidth=0.6,
                    hatch=hatch,
                )
            )
    x1, y0 = x0 + cols * cell, y_top - rows * cell
    if label:
        ax.text(
            (x0 + x1) / 2,
            y0 - 0.08,
            label,
            ha="center",
            va="top",
            color=INK,
            fontsize=10,
        )
    return x0, y0, x1, y_top
