"""Chapter 13's own code (book/13_tiled_backward.ipynb): `dense_backward`,
the four equations with whole matrices, against autograd on shapes the
chapter never prints; `naive` against SDPA; `draw_order`'s numbering of a
schedule against the schedule itself; `draw_speed`'s legend and labels
clear of its markers and of each other."""

import itertools

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from chapter_loader import BOOK
from conftest import LazyChapter
from torch.testing import assert_close

import flash

ch13 = LazyChapter("13_tiled_backward.ipynb")


@pytest.mark.parametrize(
    "T_q, T_k, d_k, d_v", [(1, 1, 2, 1), (11, 4, 6, 9), (16, 33, 8, 8)]
)
def test_dense_backward_equals_autograd(T_q, T_k, d_k, d_v):
    gen = torch.Generator().manual_seed(T_q + T_k)
    f64 = torch.float64
    Q = torch.randn(3, T_q, d_k, generator=gen, dtype=f64, requires_grad=True)
    K = torch.randn(3, T_k, d_k, generator=gen, dtype=f64, requires_grad=True)
    V = torch.randn(3, T_k, d_v, generator=gen, dtype=f64, requires_grad=True)
    dC = torch.randn(3, T_q, d_v, generator=gen, dtype=f64)
    C = F.scaled_dot_product_attention(Q, K, V)
    expected = torch.autograd.grad(C, (Q, K, V), dC)
    got = ch13.dense_backward(Q.detach(), K.detach(), V.detach(), dC)
    for name, a, b in zip("QKV", got, expected):
        assert_close(a, b, rtol=0, atol=1e-12, msg=f"d{name}")


def test_naive_equals_sdpa():
    q, k, v = (torch.randn(2, 5, T, 6, dtype=torch.float64) for T in (7, 3, 3))
    expected = F.scaled_dot_product_attention(q, k, v)
    assert_close(ch13.naive(q, k, v), expected, rtol=0, atol=1e-14)


def test_autograd_cannot_follow_fast_attention():
    """The chapter's opening claim: chapter 8's program writes its tiles with
    out=, which autograd refuses, so a backward pass of its own is needed."""
    q = torch.ones(1, 1, 5, 4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"out=\.\.\. arguments don't"):
        flash.fast_attention(q, q, q).sum().backward()


def test_lazy_reference_and_exp_each_move_the_output():
    """As in the chapter's comparison with SDPA: our tiles with `exp` and the
    maximum differ from SDPA by the orders alone; each of the two levers
    (base2, lazy) moves ours."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(3, 1, 2, 64, 8, generator=gen, dtype=torch.float64)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    runs = [
        flash.fast_attention(q, k, v, True, levers={"base2": b, "lazy": lz})
        for b, lz in [(True, True), (False, True), (False, False)]
    ]
    for a, b in [(runs[0], runs[1]), (runs[1], runs[2]), (runs[2], sdpa)]:
        assert 0 < (a - b).abs().max() < 1e-14


@pytest.mark.parametrize("by_keys", [False, True])
def test_draw_order_numbers_each_tile_where_it_lies(by_keys):
    """Tile number n is written at the n-th tile's (key block, query block),
    and only the tiles of the schedule are coloured."""
    tiles = flash.tile_schedule(4 * 8, 4 * 8, 8, 8, causal=True)
    if by_keys:
        tiles = sorted(tiles, key=lambda t: (t[2], t[0]))
    fig, ax = plt.subplots()
    ch13.draw_order(ax, tiles, "t")
    where = {int(t.get_text()): t.get_position() for t in ax.texts}
    assert sorted(where) == list(range(1, len(tiles) + 1))
    for n, (i0, _, j0, _, _) in enumerate(tiles, start=1):
        assert where[n] == (j0 // 8, i0 // 8)
    grid = ax.images[0].get_array()
    assert int((~grid.mask).sum()) == len(tiles) == 10
    plt.close(fig)


def test_the_speed_legend_covers_no_marker():
    """The speed figure's legend sits beside the axes: inside them, at the
    centre left, it hid the markers of the first line (issue 47); the
    names of the lines do not run into each other."""
    speed = pd.read_csv(BOOK / "data" / "bench_flash.csv")
    speed = speed.query("run != 'previous'").copy()  # the three runs shown
    speed["mask"] = speed["causal"].map({False: "no mask", True: "causal"})
    fig, ax = plt.subplots(figsize=(9, 3.6), layout="constrained")
    ch13.draw_speed(ax, speed)
    fig.canvas.draw()
    legend = ax.get_legend().get_window_extent()
    markers = [
        ax.transData.transform(xy)
        for line in ax.lines
        for xy in line.get_xydata()
    ]
    assert len(markers) == 3 * 6  # three runs of six lines
    assert not any(legend.contains(*xy) for xy in markers)
    labels = [t.get_window_extent() for t in ax.get_xticklabels()]
    assert all(a.x1 < b.x0 for a, b in itertools.pairwise(labels))  # apart
    plt.close(fig)


@pytest.mark.parametrize(
    "medians", [[0.68, 0.54, 0.58], [0.8, 0.8, 0.9], [1.2, 0.7, 0.95]]
)
def test_between_runs_equals_the_measuring_module(medians):
    """The chapter's t interval over three runs (2 degrees of freedom, its
    closed-form t*) against tools/measure.py's between_runs, and its
    verdict against measure.verdict's."""
    import measure

    mean, lo, hi = ch13.between_runs(medians)
    ref = measure.between_runs(medians)
    assert abs(ch13.T_STAR - measure.t_quantile(0.975, 2)) < 1e-12
    for got, key in ((mean, "mean"), (lo, "lo"), (hi, "hi")):
        assert abs(got - ref[key]) < 1e-12, key
    for target in (lo - 0.01, (lo + hi) / 2, hi + 0.01):
        expected = measure.verdict(lo, hi, target)
        got = ch13.verdict(lo, hi, target) or "cannot be told apart"
        assert got == expected, target
