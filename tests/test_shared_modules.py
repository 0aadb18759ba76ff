"""The shared drawing modules, book/plots.py and book/diagrams.py: what the
chapters say a figure shows, read back from the matplotlib objects drawn.

Each expectation is independent of the module's code: the tick labels a
reader sees, the image array against the input, the patches' coordinates in
data units, the colours looked up in matplotlib's colour map.
"""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pytest
from conftest import BOOK  # noqa: F401  (puts book/ on sys.path)
from matplotlib.colors import to_rgba
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle
from numpy.testing import assert_allclose, assert_array_equal

import diagrams
import plots

# a 2 x 3 matrix: queries and keys differ in number, so a transposed image
# or swapped labels cannot pass by symmetry
WEIGHTS = np.array([[0.1, 0.7, 0.2], [0.5, 0.25, 0.25]])
QUERIES = ["the", "cat"]
KEYS = ["a", "b", "c"]


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


# --- plots.plot_attention ----------------------------------------------------


def heatmap(**kw):
    return plots.plot_attention(WEIGHTS, QUERIES, KEYS, **kw)


def tick_labels(axis):
    return [t.get_text() for t in axis.get_ticklabels()]


def test_heatmap_rows_are_queries_and_columns_keys():
    ax = heatmap()
    (image,) = ax.get_images()
    assert_array_equal(image.get_array(), WEIGHTS)  # not transposed
    assert tick_labels(ax.xaxis) == KEYS
    assert tick_labels(ax.yaxis) == QUERIES
    assert_array_equal(ax.get_xticks(), range(3))
    assert_array_equal(ax.get_yticks(), range(2))
    assert ax.get_xlabel() == "key (attended to)"
    assert ax.get_ylabel() == "query (attending)"


def test_heatmap_keys_along_the_top():
    ax = heatmap()
    assert ax.xaxis.get_label_position() == "top"
    ticks = ax.xaxis.get_major_ticks()
    assert all(t.label2.get_visible() for t in ticks)  # top labels
    assert not any(t.label1.get_visible() for t in ticks)  # bottom labels


def test_heatmap_colour_scale_is_fixed_from_0_to_1():
    """Two heatmaps compare by eye only on one scale: 0 is the map's first
    colour and 1 its last, whatever the data's range."""
    ax = plots.plot_attention([[0.2, 0.3]], ["q"], ["k1", "k2"])
    (image,) = ax.get_images()
    assert image.get_clim() == (0.0, 1.0)
    viridis = matplotlib.colormaps["viridis"]
    assert image.get_cmap().name == "viridis"
    assert_allclose(image.to_rgba(0.0), viridis(0.0))
    assert_allclose(image.to_rgba(1.0), viridis(1.0))


def test_heatmap_annotations_sit_on_their_cells():
    ax = heatmap()
    texts = {t.get_position(): t for t in ax.texts}
    assert len(texts) == WEIGHTS.size
    for i in range(2):
        for j in range(3):
            text = texts[(j, i)]  # x = key column, y = query row
            assert text.get_text() == f"{WEIGHTS[i, j]:.2f}"
            # dark text on viridis' light (yellow) end, light text elsewhere
            ink = "black" if WEIGHTS[i, j] > 0.6 else "white"
            assert to_rgba(text.get_color()) == to_rgba(ink)
    assert len(heatmap(annotate=False).texts) == 0


def test_heatmap_colorbar_and_title():
    ax = heatmap(title="weights")
    assert ax.get_title() == "weights"
    colorbars = [a for a in ax.figure.axes if a is not ax]
    assert len(colorbars) == 1
    assert colorbars[0].get_ylabel() == "attention weight"
    ax = heatmap(colorbar=False)
    assert ax.figure.axes == [ax]


def test_heatmap_draws_on_the_given_axes():
    _, given = plt.subplots()
    assert heatmap(ax=given) is given


@pytest.mark.parametrize(
    "weights, queries, keys, message",
    [
        (np.ones(3), QUERIES, KEYS, "2-D"),
        (WEIGHTS, KEYS, KEYS, "labels do not match"),
        (WEIGHTS, QUERIES, QUERIES, "labels do not match"),
    ],
)
def test_heatmap_refuses_mismatched_input(weights, queries, keys, message):
    with pytest.raises(ValueError, match=message):
        plots.plot_attention(weights, queries, keys)


# --- diagrams ----------------------------------------------------------------


def test_canvas_has_the_asked_size_in_data_units():
    fig, ax = diagrams.new_diagram(10, 4)
    assert ax.get_xlim() == (0, 10)
    assert ax.get_ylim() == (0, 4)
    assert ax.get_aspect() == 1.0
    assert not ax.axison
    assert to_rgba(fig.get_facecolor()) == to_rgba("white")


@pytest.mark.parametrize("width, height", [(10, 4), (3, 8), (20, 20)])
def test_canvas_fits_the_page_and_keeps_the_aspect(width, height):
    fig, _ = diagrams.new_diagram(width, height)
    w, h = fig.get_size_inches()
    assert w <= 9.0 + 1e-9 and h <= 6.0 + 1e-9  # fits the page's width
    assert max(w / 9.0, h / 6.0) == pytest.approx(1.0)  # as large as fits
    assert w / h == pytest.approx(width / height)


def test_canvas_refuses_an_empty_size():
    with pytest.raises(ValueError, match="positive size"):
        diagrams.new_diagram(0, 3)


def test_fill_names_and_passes_colours_through():
    assert diagrams.fill("query") == diagrams.COLORS["query"]
    assert diagrams.fill("#123456") == "#123456"


def test_box_is_centred_on_its_point_with_its_text():
    _, ax = diagrams.new_diagram(10, 6)
    patch = diagrams.box(ax, (4.0, 2.5), "Q", width=2.0, height=1.0)
    assert isinstance(patch, FancyBboxPatch)
    assert patch in ax.patches
    left, bottom = patch.get_x(), patch.get_y()
    assert (left + patch.get_width() / 2, bottom + patch.get_height() / 2) == (
        pytest.approx(4.0),
        pytest.approx(2.5),
    )
    assert (patch.get_width(), patch.get_height()) == (2.0, 1.0)
    (text,) = ax.texts
    assert text.get_text() == "Q"
    assert text.get_position() == (4.0, 2.5)
    assert (text.get_ha(), text.get_va()) == ("center", "center")


def test_box_colour_by_name():
    _, ax = diagrams.new_diagram(10, 6)
    patch = diagrams.box(ax, (1, 1), "K", color="key")
    assert to_rgba(patch.get_facecolor()) == to_rgba(diagrams.COLORS["key"])
    assert to_rgba(patch.get_edgecolor()) == to_rgba(diagrams.INK)


def test_arrow_points_from_start_to_end():
    _, ax = diagrams.new_diagram(10, 6)
    diagrams.arrow(ax, (1.0, 2.0), (5.0, 3.0))
    (patch,) = ax.patches
    assert isinstance(patch, FancyArrowPatch)
    # the tail is posA and the head posB; the style draws a head at B only
    assert_allclose(patch._posA_posB, [(1.0, 2.0), (5.0, 3.0)])
    style = patch.get_arrowstyle()
    assert (style._beginarrow_head, style._endarrow_head) == (False, True)
    assert len(ax.texts) == 0  # no label unless one is given


def test_arrow_label_above_its_middle():
    _, ax = diagrams.new_diagram(10, 6)
    diagrams.arrow(ax, (1.0, 2.0), (5.0, 2.0), text="scores")
    (text,) = ax.texts
    assert text.get_text() == "scores"
    assert_allclose(text.get_position(), (3.0, 2.15))
    assert text.get_va() == "bottom"


def test_grid_cells_in_reading_order_from_the_top_left():
    _, ax = diagrams.new_diagram(10, 6)
    shade = np.arange(6).reshape(2, 3) / 5  # distinct shades, row by row
    extent = diagrams.grid(ax, (1.0, 5.0), 2, 3, cell=0.5, shade=shade)
    cells = [p for p in ax.patches if isinstance(p, Rectangle)]
    assert len(cells) == 6
    viridis = matplotlib.colormaps["viridis"]
    by_corner = {(p.get_x(), p.get_y()): p for p in cells}
    for i in range(2):
        for j in range(3):
            # row i, column j: x grows with j, y falls with i
            p = by_corner[(1.0 + 0.5 * j, 5.0 - 0.5 * (i + 1))]
            assert (p.get_width(), p.get_height()) == (0.5, 0.5)
            assert_allclose(p.get_facecolor(), viridis(shade[i, j]))
    assert extent == (1.0, 4.0, 2.5, 5.0)  # (x0, y0, x1, y1)


def test_grid_shade_is_clipped_to_the_colour_map():
    _, ax = diagrams.new_diagram(10, 6)
    diagrams.grid(ax, (0, 6), 1, 3, shade=[[-0.5, 0.5, 2.0]], cmap="magma")
    magma = matplotlib.colormaps["magma"]
    faces = [p.get_facecolor() for p in ax.patches]
    assert_allclose(faces, [magma(0.0), magma(0.5), magma(1.0)])


def test_grid_masked_cells_are_hatched_grey():
    _, ax = diagrams.new_diagram(10, 6)
    diagrams.grid(ax, (0, 6), 1, 2, shade=[[np.nan, 0.3]])
    masked, kept = ax.patches
    assert masked.get_hatch() == "////"
    grey = to_rgba(diagrams.COLORS["masked"])
    assert to_rgba(masked.get_facecolor()) == grey
    assert kept.get_hatch() is None


def test_grid_plain_colour_and_label_under_it():
    _, ax = diagrams.new_diagram(10, 6)
    x0, y0, x1, _ = diagrams.grid(
        ax, (2, 4), 3, 2, cell=0.4, color="value", label="V (T, d_v)"
    )
    faces = {to_rgba(p.get_facecolor()) for p in ax.patches}
    assert faces == {to_rgba(diagrams.COLORS["value"])}
    (text,) = ax.texts
    assert text.get_text() == "V (T, d_v)"
    x, y = text.get_position()
    assert x == pytest.approx((x0 + x1) / 2)
    assert y < y0 and text.get_va() == "top"


@pytest.mark.parametrize(
    "rows, cols, shade, message",
    [
        (0, 2, None, "at least one cell"),
        (2, 2, np.zeros((2, 3)), "shade must have shape"),
    ],
)
def test_grid_refuses_bad_input(rows, cols, shade, message):
    _, ax = diagrams.new_diagram(10, 6)
    with pytest.raises(ValueError, match=message):
        diagrams.grid(ax, (0, 6), rows, cols, shade=shade)


# --- bad input gets a ValueError that names it (issue 47) --------------------


@pytest.mark.parametrize(
    "weights, queries, keys, ax, message",
    [
        (np.full((2, 3), np.nan), QUERIES, KEYS, None, "NaN or inf"),
        (np.zeros((0, 3)), [], KEYS, None, "non-empty 2-D"),
        (WEIGHTS + 0j, QUERIES, KEYS, None, "real numbers"),
        ([[0.5, 0.5], [1.0]], QUERIES, KEYS, None, "real numbers"),
        (WEIGHTS, None, KEYS, None, "query_labels must be a list"),
        (WEIGHTS, "ab", KEYS, None, "query_labels must be a list"),
        (WEIGHTS, QUERIES, 3, None, "key_labels must be a list"),
        (WEIGHTS, QUERIES, KEYS, "axes", "ax must be matplotlib Axes"),
    ],
)
def test_heatmap_names_bad_input(weights, queries, keys, ax, message):
    with pytest.raises(ValueError, match=message):
        plots.plot_attention(weights, queries, keys, ax=ax)


def test_heatmap_takes_a_tensor_with_a_gradient():
    torch = pytest.importorskip("torch")
    A = torch.tensor(WEIGHTS, requires_grad=True)
    (image,) = plots.plot_attention(A, QUERIES, KEYS).get_images()
    assert_array_equal(image.get_array(), WEIGHTS)


@pytest.mark.parametrize(
    "size, figsize, message",
    [
        (("4", 3), None, "positive size"),
        ((float("nan"), 3), None, "positive size"),
        ((4, float("inf")), None, "positive size"),
        ((None, 3), None, "positive size"),
        ((4, 3), 5, "figsize must be"),
        ((4, 3), (5, -1), "figsize must be"),
    ],
)
def test_canvas_names_bad_sizes(size, figsize, message):
    with pytest.raises(ValueError, match=message):
        diagrams.new_diagram(*size, figsize=figsize)


@pytest.mark.parametrize("color", [None, "no such colour", [1], "#12345"])
def test_fill_refuses_what_is_no_colour(color):
    with pytest.raises(ValueError, match="neither a name of COLORS"):
        diagrams.fill(color)


@pytest.mark.parametrize(
    "draw, message",
    [
        (lambda ax: diagrams.box(ax, (1, 2, 3), "Q"), "center must be"),
        (lambda ax: diagrams.box(ax, "ab", "Q"), "center must be"),
        (lambda ax: diagrams.box(ax, (1, 1), "Q", width=0), "positive size"),
        (lambda ax: diagrams.box(ax, (1, 1), "Q", height=-1), "positive"),
        (lambda ax: diagrams.box(None, (1, 1), "Q"), "ax must be"),
        (lambda ax: diagrams.arrow(ax, (1,), (2, 2)), "start must be"),
        (lambda ax: diagrams.arrow(ax, (1, 1), (2, "b")), "end must be"),
        (
            lambda ax: diagrams.arrow(ax, (1, 1), (2, 2), "t", offset=(1,)),
            "offset must be",
        ),
        (lambda ax: diagrams.grid(ax, (0,), 1, 1), "origin must be"),
        (lambda ax: diagrams.grid(ax, (0, 6), 2.5, 2), "integers"),
        (lambda ax: diagrams.grid(ax, (0, 6), "2", 2), "integers"),
        (lambda ax: diagrams.grid(ax, (0, 6), 2, 2, cell=0), "cell must be"),
        (lambda ax: diagrams.grid(ax, (0, 6), 2, 2, cell=-1), "cell must"),
        (lambda ax: diagrams.grid(ax, (0, 6), 1, 1, color=None), "neither"),
    ],
)
def test_drawing_names_bad_input(draw, message):
    _, ax = diagrams.new_diagram(10, 6)
    with pytest.raises(ValueError, match=message):
        draw(ax)
    assert not ax.patches  # nothing half drawn


def test_drawing_takes_numpy_and_torch_numbers():
    """Points may hold NumPy or torch scalars, as the chapters' do."""
    torch = pytest.importorskip("torch")
    _, ax = diagrams.new_diagram(10, 6)
    diagrams.arrow(ax, np.add((1, 1), (0.5, 0)), (torch.tensor(3.0), 2))
    diagrams.grid(ax, (0, 6), np.int64(2), 2, cell=np.float64(0.5))
    assert len(ax.patches) == 1 + 4
