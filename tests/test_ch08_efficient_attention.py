"""Chapter 8: online softmax, tiled attention and the benchmark script."""

import itertools
import json
import math
import re
import subprocess
import sys
import types

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import ROOT, load_chapter
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.testing import assert_allclose
from scipy.special import softmax as scipy_softmax
from torch.testing import assert_close

ATOL = {torch.float32: 1e-5, torch.float64: 1e-12}


@pytest.fixture(scope="module")
def ch08():
    return load_chapter("08_efficient_attention.ipynb")


def qkv(T, S=None, d=16, d_v=None, batch=(2, 3), dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    S = T if S is None else S
    d_v = d if d_v is None else d_v
    return (
        torch.randn(*batch, T, d, generator=gen, dtype=dtype),
        torch.randn(*batch, S, d, generator=gen, dtype=dtype),
        torch.randn(*batch, S, d_v, generator=gen, dtype=dtype),
    )


# --- what the text states about the floor, the margin and the byte counts ----


@pytest.mark.parametrize(
    "dtype, s", [(torch.float32, 40.0), (torch.float64, 100.0)]
)
@pytest.mark.parametrize("B_r, B_c", [(4, 4), (2, 3)])
def test_tiled_floor_keeps_tiny_weights_on_diagonal_tiles(
    ch08, dtype, s, B_r, B_c
):
    """On a causal diagonal tile the exp is floored at 0.9 log(tiny) (-78.6
    in float32), far below any weight that matters: query 1's weight on key 0,
    exp(-s) / (1 + exp(-s)), survives to its last digits. A floor from eps
    (-14.3 in float32, -32.4 in float64) would make it exp(floor)."""
    q = torch.tensor([[0.0], [s], [1.0], [-1.0]], dtype=dtype)[None]
    k = torch.tensor([[0.0], [1.0], [0.5], [2.0]], dtype=dtype)[None]
    v = torch.tensor([[1.0], [0.0], [0.3], [-0.7]], dtype=dtype)[None]
    assert ch08.tile_schedule(4, 4, B_r, B_c, causal=True)[0][-1]  # masked
    got = ch08.tiled_attention(q, k, v, causal=True, B_r=B_r, B_c=B_c)
    tiny = torch.exp(torch.tensor(-s, dtype=torch.float64)).item()
    assert 0 < got[0, 1, 0].item() < 1.01 * tiny
    expected = ch08.attention_torch(q, k, v, causal=True)
    assert_close(got, expected, rtol=1e-4, atol=1e-30)


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.float32, torch.float64]
)
@pytest.mark.parametrize("T, d_k, H", [(64, 16, 1), (48, 8, 3), (4096, 64, 8)])
def test_attention_cost_counts_the_score_tensor_and_the_products(
    ch08, dtype, T, d_k, H
):
    """The bytes are those of an (H, T, T) tensor of scores; the FLOPs are
    what PyTorch's FLOP counter counts for Q K^T and A V (d_v = d_k)."""
    size = torch.empty((), dtype=dtype).element_size()
    flops, score_bytes = ch08.attention_cost(T, d_k, H, bytes_per_number=size)
    assert (
        score_bytes == torch.empty(H, T, T, dtype=dtype, device="meta").nbytes
    )
    from torch.utils.flop_counter import FlopCounterMode

    Q, K, V = (torch.empty(H, T, d_k, device="meta") for _ in range(3))
    with FlopCounterMode(display=False) as counter:
        (Q @ K.transpose(-2, -1)) @ V
    assert flops == counter.get_total_flops()


@pytest.mark.parametrize(
    "T, d_k, H, B_r, B_c, number",
    [(4096, 64, 8, 128, 512, 4), (100, 16, 2, 128, 512, 8),
     (300, 32, 3, 64, 200, 2), (50, 8, 1, 7, 64, 4)],
)  # fmt: skip
def test_tiled_bytes_counts_what_tiled_attention_allocates(
    ch08, T, d_k, H, B_r, B_c, number
):
    """One tile of scores (never larger than T x T), the scaled queries, the
    transposed keys and the running outputs (T x d_k each, d_v = d_k), the
    maxima m and sums l (T each), per head, `number` bytes per number."""
    shapes = [
        (H, min(B_r, T), min(B_c, T)),  # the tile buffer
        (H, T, d_k), (H, d_k, T), (H, T, d_k),  # Q3, Kt, C_acc
        (H, T, 1), (H, T, 1),  # m, l
    ]  # fmt: skip
    expected = sum(math.prod(s) for s in shapes) * number
    assert ch08.tiled_bytes(T, d_k, H, B_r, B_c, number) == expected


# --- tiled attention equals the naive program ---------------------------------

# tile sides of 1, odd, equal to T, larger than T; lengths that are and are
# not multiples of them (tiny tiles only with short sequences, to stay fast)
TILES = [(1, 1), (1, 7), (7, 1), (3, 5), (16, 16), (128, 512), (500, 600)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T", [1, 2, 15, 16, 17, 97, 200])
def test_tiled_equals_naive(ch08, T, causal):
    for dtype, (B_r, B_c) in itertools.product(ATOL, TILES):
        if T * T > 2000 * B_r * B_c:
            continue
        q, k, v = qkv(T, dtype=dtype, seed=T)
        expected = ch08.attention_torch(q, k, v, causal)
        got = ch08.tiled_attention(q, k, v, causal, B_r, B_c)
        assert got.dtype == dtype and got.shape == expected.shape
        assert_close(
            got, expected, rtol=0, atol=ATOL[dtype], msg=f"{B_r} x {B_c}"
        )


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("L, S", [(5, 40), (40, 5), (33, 100), (1, 9)])
def test_tiled_cross_attention_lengths(ch08, L, S, causal):
    q, k, v = qkv(L, S, d=8, d_v=5, batch=(3,))
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=causal
    )
    got = ch08.tiled_attention(q, k, v, causal, B_r=4, B_c=6)
    assert_close(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("B_r, B_c", [(4, 4), (3, 7), (16, 5)])
def test_tiled_causal_outputs_ignore_the_future(ch08, dtype, B_r, B_c):
    """Masked keys get weight exactly 0: outputs up to t do not change, bit for
    bit, when keys and values after t change."""
    q, k, v = qkv(30, dtype=dtype)
    k2, v2 = k.clone(), v.clone()
    k2[..., 13:, :] = 50.0 * torch.randn_like(k2[..., 13:, :])
    v2[..., 13:, :] = 1e30  # a weight of even 1e-34 would show
    a = ch08.tiled_attention(q, k, v, True, B_r, B_c)
    b = ch08.tiled_attention(q, k2, v2, True, B_r, B_c)
    assert torch.equal(a[..., :13, :], b[..., :13, :])
    assert not torch.equal(a[..., 13:, :], b[..., 13:, :])


def test_tiled_large_scores_do_not_overflow(ch08):
    """Scores of size 1e4 overflow exp() unless the running max is subtracted."""
    q, k, v = qkv(50, dtype=torch.float32)
    q = q * 300.0
    got = ch08.tiled_attention(q, k, v, B_r=8, B_c=8)
    assert torch.isfinite(got).all()
    assert_close(got, ch08.attention_torch(q, k, v), rtol=0, atol=1e-4)


def test_tiled_float32_at_benchmark_shape(ch08):
    """8 heads, d = 64, T = 1000 (not a multiple of the default tile)."""
    q, k, v = qkv(1000, d=64, batch=(1, 8), dtype=torch.float32)
    for causal in (False, True):
        assert_close(
            ch08.tiled_attention(q, k, v, causal),
            ch08.attention_torch(q, k, v, causal),
            rtol=0,
            atol=1e-5,
        )


def test_tiled_lse_is_logsumexp_of_scaled_scores(ch08):
    q, k, v = qkv(30, S=45)
    _, lse = ch08.tiled_attention(q, k, v, B_r=7, B_c=11, return_lse=True)
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    assert_close(lse, torch.logsumexp(scores, dim=-1), rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_all_programs_agree(ch08, causal):
    q, k, v = qkv(40, S=40, d=6, d_v=4)
    expected = ch08.attention_torch(q, k, v, causal).numpy()
    arrays = [t.numpy() for t in (q, k, v)]
    assert_allclose(
        ch08.attention_loop(*arrays, causal), expected, rtol=0, atol=1e-12
    )
    assert_allclose(
        ch08.attention_numpy(*arrays, causal), expected, rtol=0, atol=1e-12
    )
    assert_allclose(
        ch08.attention_sdpa(q, k, v, causal).numpy(),
        expected,
        rtol=0,
        atol=1e-12,
    )


# --- the tile schedule ----------------------------------------------------------


@pytest.mark.parametrize(
    "L, S, bq, bk",
    [(100, 100, 7, 13), (64, 64, 16, 16), (10, 30, 4, 3), (30, 10, 1, 1)],
)
def test_tile_schedule_covers_exactly_the_visible_pairs(ch08, L, S, bq, bk):
    for causal in (False, True):
        covered = np.zeros((L, S), dtype=int)
        for i0, i1, j0, j1, needs_mask in ch08.tile_schedule(
            L, S, bq, bk, causal
        ):
            covered[i0:i1, j0:j1] += 1
            block_future = (
                np.arange(j0, j1)[None, :] > np.arange(i0, i1)[:, None]
            )
            assert needs_mask == (causal and block_future.any())
        visible = np.tri(L, S, dtype=bool) if causal else np.ones((L, S), bool)
        # every visible pair is in exactly one tile; a skipped tile has no
        # visible pair (tiles that are kept may contain masked pairs)
        assert (covered[visible] == 1).all()
        assert covered.max() == 1


def test_causal_tile_counts(ch08):
    assert len(ch08.tile_schedule(4096, 4096, 128, 512)) == 256
    assert len(ch08.tile_schedule(4096, 4096, 128, 512, causal=True)) == 144
    assert len(ch08.tile_schedule(2048, 2048, 128, 512, causal=True)) == 40


@pytest.mark.parametrize(
    "T, B_r, B_c", [(8, 1, 1), (100, 7, 13), (64, 16, 64), (50, 64, 8)]
)
def test_computed_scores_counts_tiles_with_a_visible_pair(ch08, T, B_r, B_c):
    """A causal tile is computed iff it holds a pair (i, j) with j <= i; the
    share counts all scores of those tiles over the T (T + 1) / 2 visible."""
    visible = np.tri(T, dtype=bool)
    computed = sum(
        visible[i : i + B_r, j : j + B_c].size
        for i in range(0, T, B_r)
        for j in range(0, T, B_c)
        if visible[i : i + B_r, j : j + B_c].any()
    )
    got = ch08.computed_scores(T, B_r, B_c)
    assert got == pytest.approx(computed / (T * (T + 1) / 2), rel=1e-12)


def test_hbm_accesses_ratio_tends_to_d_squared_over_M(ch08):
    """Theorem 2's counts without constants: flash / standard -> d_k^2 / M."""
    standard, flash = ch08.hbm_accesses(10**6, d_k=64, M=25_600)
    assert flash / standard == pytest.approx(64**2 / 25_600, rel=1e-4)
    standard, flash = ch08.hbm_accesses(100, d_k=8, M=64)
    assert (standard, flash) == (100 * 8 + 100**2, 100**2 * 8**2 / 64)


# --- the online softmax ---------------------------------------------------------

rows = st.integers(1, 30).flatmap(
    lambda n: st.tuples(
        st.lists(
            st.floats(-1e4, 1e4, allow_nan=False) | st.just(-np.inf),
            min_size=n,
            max_size=n,
        ).filter(lambda r: any(np.isfinite(r))),
        st.lists(st.integers(1, n), max_size=6),
    )
)


@settings(max_examples=150, deadline=None)
@given(rows)
def test_online_softmax_of_a_stream_equals_softmax_of_the_row(ch08, row_cuts):
    row, cuts = row_cuts
    row = np.array(row)
    chunks = [
        c for c in np.split(row, sorted(set(c for c in cuts if c < len(row))))
    ]
    got = ch08.online_softmax(chunks)
    assert_allclose(got, scipy_softmax(row), rtol=0, atol=1e-14)
    assert (got[np.isneginf(row)] == 0).all()


def test_online_softmax_rows_with_leading_minus_inf(ch08):
    """A row whose first chunks are all -inf (the 0-shift convention)."""
    rows = np.array(
        [
            [-np.inf, -np.inf, -np.inf, 2.0, -np.inf, 1.0],
            [0.5, -np.inf, -np.inf, -np.inf, -np.inf, -np.inf],
            [-700.0, -np.inf, 700.0, -np.inf, 3.0, 3.0],
        ]
    )
    chunks = np.split(rows, [1, 2, 3, 5], axis=-1)
    assert_allclose(
        ch08.online_softmax(chunks),
        scipy_softmax(rows, axis=-1),
        rtol=0,
        atol=1e-15,
    )
    m, ell = next(iter(ch08.running_max_and_sum(chunks)))
    assert list(m) == [-np.inf, 0.5, -700.0] and list(ell) == [0.0, 1.0, 1.0]


def test_running_max_and_sum_invariant(ch08):
    rng = np.random.default_rng(3)
    row = rng.normal(scale=30.0, size=50)
    chunks = np.split(row, [3, 10, 11, 30])
    seen = 0
    for chunk, (m, ell) in zip(chunks, ch08.running_max_and_sum(chunks)):
        seen += len(chunk)
        assert m == row[:seen].max()
        assert_allclose(ell, np.exp(row[:seen] - m).sum(), rtol=1e-14)


@pytest.mark.parametrize(
    "chunks, message",
    [
        ([], "empty"),
        ([[-np.inf, -np.inf], [-np.inf]], "entirely -inf"),
        ([[1.0, np.nan]], "NaN"),
        ([[1.0], [np.inf]], r"\+inf"),
        ([[1.0], []], "at least one score"),
        ([np.zeros((2, 3)), np.zeros((3, 3))], "leading shape"),
        ([[1j, 2.0]], "real numbers, got complex"),
        ([[1.0], ["2"]], "real numbers"),
    ],
)
def test_online_softmax_rejects_bad_streams(ch08, chunks, message):
    with pytest.raises(ValueError, match=message):
        ch08.online_softmax(chunks)


# --- bad inputs -------------------------------------------------------------------


@pytest.mark.parametrize(
    "fn", ["tiled_attention", "attention_torch", "attention_sdpa"]
)
@pytest.mark.parametrize(
    "shapes, message",
    [
        (((4, 3), (4, 2), (4, 3)), "same size d_k: Q has 3, K has 2"),
        (((4, 3), (4, 3), (5, 3)), "K has 4 rows, V has 5"),
        (((3,), (4, 3), (4, 3)), r"Q must have shape .* got \(3,\)"),
        (
            ((2, 4, 3), (3, 4, 3), (3, 4, 3)),
            "mismatched batches",
        ),
        (((4, 3), (0, 3), (0, 3)), "at least one key"),
        (((0, 3), (0, 3), (0, 3)), "at least one key"),  # flash.check_qkv's
        (((1, 4, 3), (2, 4, 3), (2, 4, 3)), "mismatched batches"),  # broadcast
    ],
)
def test_bad_shapes_raise(ch08, fn, shapes, message):
    q, k, v = (torch.ones(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        getattr(ch08, fn)(q, k, v)


@pytest.mark.parametrize("fn", ["check_qkv", "check_qkv_shapes"])
@pytest.mark.parametrize("Q", [[[1.0, 2.0]], None, 1.5])
def test_printed_checks_name_what_has_no_shape(ch08, fn, Q):
    """The chapter prints both checks; they raised AttributeError on a list,
    None or a float (issue 47, fresh review F3)."""
    K = np.ones((4, 2))
    with pytest.raises(
        ValueError, match=r"Q must have shape \(\.\.\., T, size\)"
    ):
        getattr(ch08, fn)(Q, K, K)


@pytest.mark.parametrize("fn", ["attention_loop", "attention_numpy"])
def test_numpy_programs_check_inputs(ch08, fn):
    with pytest.raises(ValueError, match="same size d"):
        getattr(ch08, fn)(np.ones((4, 3)), np.ones((4, 2)), np.ones((4, 3)))
    with pytest.raises(ValueError, match="floating point"):
        getattr(ch08, fn)(
            np.ones((4, 3), int), np.ones((4, 3), int), np.ones((4, 3), int)
        )
    with pytest.raises(ValueError, match="NaN or infinite"):
        getattr(ch08, fn)(
            np.full((4, 3), np.nan), np.ones((4, 3)), np.ones((4, 3))
        )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"B_r": 0}, "B_r must be a positive integer, got 0"),
        ({"B_c": -3}, "B_c must be a positive integer"),
        ({"B_r": 2.5}, "B_r must be a positive integer, got 2.5"),
        ({"B_c": True}, "B_c must be a positive integer"),
    ],
)
def test_tiled_rejects_bad_block_sizes(ch08, kwargs, message):
    q, k, v = qkv(10)
    with pytest.raises(ValueError, match=message):
        ch08.tiled_attention(q, k, v, **kwargs)


def test_tiled_rejects_bad_tensors(ch08):
    q, k, v = qkv(10)
    with pytest.raises(ValueError, match="NaN or infinite"):
        ch08.tiled_attention(q.clone().fill_(float("nan")), k, v)
    with pytest.raises(ValueError, match="one dtype"):
        ch08.tiled_attention(q.float(), k, v)
    with pytest.raises(ValueError, match="floating-point torch tensor"):
        ch08.tiled_attention(*(t.long() for t in (q, k, v)))
    with pytest.raises(ValueError, match="floating-point torch tensor"):
        ch08.tiled_attention(q.numpy(), k, v)


def test_cost_model_counts_the_flops_of_the_tile_schedule(ch08):
    """4 T^2 d per head is what the tiles' two products add up to: 2 b_q b_k d
    for the scores and 2 b_q b_k d for P V, summed over every tile."""
    for T, bq, bk in ((4096, 128, 512), (1000, 96, 70), (5, 2, 3)):
        tiles = ch08.tile_schedule(T, T, bq, bk)
        per_head = sum(
            4 * (i1 - i0) * (j1 - j0) * 64 for i0, i1, j0, j1, _ in tiles
        )
        assert ch08.attention_cost(T, d_k=64, H=8)[0] == 8 * per_head


@pytest.mark.parametrize("causal", [False, True])
def test_tiled_maxima_rising_late(ch08, causal):
    """Scores rise key by key, the largest by far in the last tile: every tile
    raises the running maximum and must rescale all that came before."""
    T, gen = 64, torch.Generator().manual_seed(5)
    q = torch.zeros(1, T, 2, dtype=torch.float64)
    q[..., 0] = 1.0
    k = torch.zeros(1, T, 2, dtype=torch.float64)
    k[0, :, 0] = torch.linspace(0.0, 400.0, T, dtype=torch.float64) ** 1.5 / 20
    v = torch.randn(1, T, 3, generator=gen, dtype=torch.float64)
    out = ch08.tiled_attention(q, k, v, causal, B_r=8, B_c=8)
    assert_close(
        out, ch08.attention_torch(q, k, v, causal), rtol=0, atol=1e-12
    )


# --- the backward pass of exercise 3 ----------------------------------------------


@pytest.mark.parametrize("L, S, B_c", [(37, 50, 16), (20, 20, 1), (9, 4, 64)])
def test_tiled_attention_backward_equals_autograd(ch08, L, S, B_c):
    q, k, v = (t.requires_grad_() for t in qkv(L, S, d=6, d_v=5))
    d_out = torch.randn(2, 3, L, 5, dtype=torch.float64)
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    reference.backward(d_out)
    with torch.no_grad():
        out, lse = ch08.tiled_attention(q, k, v, B_r=8, B_c=7, return_lse=True)
        grads = ch08.tiled_attention_backward(q, k, v, out, lse, d_out, B_c)
    for name, ours, theirs in zip("qkv", grads, (q.grad, k.grad, v.grad)):
        assert_close(ours, theirs, rtol=0, atol=1e-12, msg=f"d{name}")


# --- the benchmark script ------------------------------------------------------------

TINY = [
    "--sizes", "24", "40", "--heads", "2", "--d", "8", "--loop-max", "24",
    "--min-repeats", "1", "--max-repeats", "2", "--max-seconds", "0.01",
    "--pairs", "2",
    "--matmul-size", "64", "--block-q", "16", "--block-k", "16", "--no-memory",
    "--sweep-q", "8", "16", "--sweep-k", "8", "32",
]  # fmt: skip


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "tools" / "bench"))
    import bench_attention

    return bench_attention


def test_benchmark_script_runs_end_to_end(bench, ch08, tmp_path, capsys):
    paths = {
        name: tmp_path / f"{name}.{ext}"
        for name, ext in (
            ("csv", "csv"),
            ("png", "png"),
            ("ablation-csv", "csv"),
            ("tiles-csv", "csv"),
        )
    }
    options = [
        x for name, path in paths.items() for x in (f"--{name}", str(path))
    ]
    bench.main(bench.parse_args(TINY + options))
    df = pd.read_csv(paths["csv"])
    assert set(df["implementation"]) == set(bench.PROGRAMS) | {
        "matmul ceiling"
    }
    timed = df[df["implementation"] != "matmul ceiling"]
    assert len(timed) == 9 + 8  # the loop only at T = 24
    assert (timed["min_ms"] <= timed["median_ms"]).all()
    assert (timed["median_ms"] <= timed["max_ms"]).all()
    assert (timed["gflop_per_s"] > 0).all()
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ablation = pd.read_csv(paths["ablation-csv"])
    variants = bench.ablation_variants(ch08)
    assert set(ablation["variant"]) == set(variants)
    assert len(ablation) == 2 * len(variants)  # causal and not
    tiles = pd.read_csv(paths["tiles-csv"]).dropna(subset=["tile_q"])
    assert sorted(tiles["causal"]) == [False] * 4 + [True] * 4
    tiles = tiles[tiles["causal"]]
    assert sorted(zip(tiles["tile_q"], tiles["tile_k"])) == [
        (8, 8), (8, 32), (16, 8), (16, 32)
    ]  # fmt: skip
    for table in (ablation, tiles):
        assert (table["ratio_min"] <= table["ratio_median"]).all()
        assert (table["ratio_median"] <= table["ratio_max"]).all()
    # tools/measure.py's record in every row of the three tables
    record = {"median_ms_lo", "median_ms_hi", "load_before", "load_after"}
    record |= {"busy", "cpu", "cores", "torch", "threads", "machine"}
    for table in (df, ablation, tiles):
        assert record <= set(table)
    assert {"ratio_lo", "ratio_hi", "interval"} <= set(ablation)
    for table in (df, ablation):  # the tiles and levers the fast one ran
        assert (table["fast_tile"] == str(ch08.FAST_TILE)).all()
        assert (table["fast_levers"] == str(ch08.LEVERS)).all()
    out = capsys.readouterr().out
    assert re.search(
        r"fast tiled \(ours\), causal / SDPA throughput \d+\.\d\d by median "
        r"times, bounds \[(\d+\.\d\d|nan), (\d+\.\d\d|nan)\]: "
        r"(above|below|cannot be told apart|no interval)",
        out,
    )


def test_benchmark_checks_variants_where_it_times_them(
    bench, ch08, monkeypatch
):
    """The ablation's and the sweep's variants are checked at the length
    they are timed at (the largest), where their tiles accumulate."""
    import bench_attention_parts as parts

    lengths = []
    monkeypatch.setattr(
        parts,
        "check_variants",
        lambda ch, T, *rest: lengths.append(("check", T)),
    )
    monkeypatch.setattr(
        parts,
        "time_variants",
        lambda ch, problem, part, *rest: lengths.append(("time", part.T)),
    )
    monkeypatch.setattr(parts, "write_csv", lambda rows, path: None)
    parts.run_variants(ch08, bench.parse_args(TINY), {})
    assert lengths == [("check", 40), ("time", 40)] * 2


def test_benchmark_redraws_the_figure_only(bench, tmp_path, monkeypatch):
    """--plot-only draws the figure from the stored table and times
    nothing: neither the chapter nor any part is run."""

    def refuse(*args, **kwargs):
        raise AssertionError("--plot-only must not time anything")

    for name in ("load_chapter", "run_main", "run_variants"):
        monkeypatch.setattr(bench, name, refuse)
    png = tmp_path / "figure.png"
    csv = ROOT / "book" / "data" / "bench_attention.csv"
    bench.main(
        bench.parse_args(["--plot-only", "--csv", str(csv), "--png", str(png)])
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):
        bench.parse_args(["--plot-only", "--no-plot"])


def test_benchmark_measures_memory(bench):
    """The naive program at T = 4096 holds at least one 4096 x 4096 float32
    matrix (64 MiB for 1 head); the measurement must see it. It runs in a
    fresh process, as the script runs it: in the test's own process, pages
    left resident by earlier tests could be reused and the peak read 0
    (seen once under pytest-xdist, 2026-12-07)."""
    problem = bench.parse_args(["--heads", "1", "--d", "8"]).problem
    peak = bench.measure_memory("PyTorch by hand", 4096, problem)
    assert 4096 * 4096 * 4 <= peak < 2**30


def broken_chapter(ch08, name, wrong):
    broken = types.SimpleNamespace(**vars(ch08))
    setattr(broken, name, wrong)
    return broken


def test_benchmark_catches_a_wrong_program(bench, ch08):
    """The script refuses to time a program whose output is wrong."""
    problem = bench.parse_args(TINY).problem
    bench.check_equal(ch08, 24, problem)  # the real chapter passes
    broken = broken_chapter(
        ch08,
        "attention_numpy",
        lambda q, k, v, causal=False: (
            ch08.attention_numpy(q, k, v, causal) + 1e-3
        ),
    )
    with pytest.raises(
        RuntimeError, match="NumPy differs from PyTorch by hand"
    ):
        bench.check_equal(broken, 24, problem)


def test_benchmark_catches_a_wrong_variant(bench, ch08):
    """The ablation's and the sweep's variants are checked too, causal and
    not: a fast version that forgets the mask is refused."""
    settings = bench.parse_args(TINY)
    variants = bench.ablation_variants(ch08) | bench.sweep_variants(
        settings.tiles
    )
    bench.check_variants(ch08, 24, settings.problem, variants)  # it passes
    broken = broken_chapter(
        ch08,
        "fast_attention",
        lambda q, k, v, causal=False, **kw: ch08.fast_attention(q, k, v, **kw),
    )
    with pytest.raises(RuntimeError, match=r"causal=True\) differs"):
        bench.check_variants(broken, 24, settings.problem, variants)


# ------------------------------------------------ the printed source, last
# As in tests/test_ch10_inference.py: the chapter prints what it imports from
# book/flash.py, and the stored output must be the module's current source.
# These fail on any edit of those functions until `make outputs`; they come
# last so that `make mutants` (pytest -x) names the behavioural test that
# catches a planted bug, not this one.

FROM_FLASH = (
    "check_qkv",
    "check_qkv_shapes",  # attention.py's, which flash.py imports
    "check_torch",
    "check_qkv_tensors",  # attention.py's, which check_torch calls
    "tile_schedule",
    "augment",
    "raise_reference",
    "fast_row",
    "fast_attention",
    "check_fast",
)


def chapter_code_cells():
    """(source, stored stdout) of every code cell of chapter 8."""
    cells = json.loads(
        (ROOT / "book" / "08_efficient_attention.ipynb").read_text("utf-8")
    )["cells"]
    return [
        (
            "".join(c["source"]),
            "".join(
                "".join(o["text"])
                for o in c.get("outputs", [])
                if o.get("name") == "stdout"
            ),
        )
        for c in cells
        if c["cell_type"] == "code"
    ]


@pytest.mark.parametrize("name", FROM_FLASH)
def test_chapter_prints_the_module_source(name):
    """Each function is printed once, where the chapter used to define it,
    and the stored output is the module's current source."""
    import inspect

    import flash

    shown = [
        out
        for code, out in chapter_code_cells()
        if f"inspect.getsource({name})" in code
    ]
    assert len(shown) == 1, name
    assert inspect.getsource(getattr(flash, name)) in shown[0], name


def test_chapter_prints_the_module_constants():
    """FAST_TILE, MARGIN and LEVERS: printed from the module's source."""
    import inspect

    import flash

    source = inspect.getsource(flash)
    start, end = source.index("# the tiles"), source.index("\n\n\ndef augment")
    (shown,) = [
        out for code, out in chapter_code_cells() if "# the tiles" in code
    ]
    assert source[start:end] in shown
    for name in ("FAST_TILE", "MARGIN", "LEVERS"):
        assert f"\n{name} = " in source[start:end]


@pytest.mark.parametrize(
    "name", [*FROM_FLASH, "FAST_TILE", "LEVERS", "MARGIN"]
)
def test_chapter_uses_the_module_and_defines_none_again(ch08, name):
    import ast

    import flash

    assert getattr(ch08, name) is getattr(flash, name)
    for code, _ in chapter_code_cells():
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                assert node.name != name
            if isinstance(node, ast.Assign):
                targets = [
                    t.id for t in node.targets if isinstance(t, ast.Name)
                ]
                assert name not in targets


# --- empty and degenerate inputs (review round 2 of issue 47) ----------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("fn", ["tiled_attention", "attention_torch"])
def test_torch_programs_give_an_empty_output_for_no_query(ch08, fn, causal):
    """T_q = 0: an empty (..., 0, d_v) output, as fast_attention gives, not
    a RuntimeError from reshape(-1, 0, d_k)."""
    q, k, v = qkv(0, S=6, d_v=5)
    out = getattr(ch08, fn)(q, k, v, causal)
    assert out.shape == (2, 3, 0, 5) and out.dtype == q.dtype


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("fn", ["attention_loop", "attention_numpy"])
def test_numpy_programs_give_an_empty_output_for_no_query(ch08, fn, causal):
    q, k, v = (t.numpy() for t in qkv(0, S=6, d_v=5))
    assert getattr(ch08, fn)(q, k, v, causal).shape == (2, 3, 0, 5)


@pytest.mark.parametrize(
    "fn, to_numpy",
    [
        ("tiled_attention", False),
        ("attention_torch", False),
        ("attention_sdpa", False),
        ("attention_numpy", True),
        ("attention_loop", True),
    ],
)
def test_programs_refuse_d_k_zero(ch08, fn, to_numpy):
    """d_k = 0: a ValueError naming d_k, as flash_attention's, not a
    ZeroDivisionError (1 / sqrt(0)) or reshape's RuntimeError."""
    q, k, v = qkv(4, S=6, d=0, d_v=5)
    if to_numpy:
        q, k, v = (t.numpy() for t in (q, k, v))
    with pytest.raises(ValueError, match="got d_k = 0"):
        getattr(ch08, fn)(q, k, v)


@pytest.mark.parametrize("chunks", [5, None, 2.5])
def test_online_softmax_refuses_a_stream_that_is_not_iterable(ch08, chunks):
    with pytest.raises(ValueError, match="chunks must be an iterable"):
        ch08.online_softmax(chunks)


MEASURE_AFTER_A_FREED_BUFFER = """
import json, sys
import numpy as np
sys.path.insert(0, "tools/bench")
import bench_attention, bench_attention_memory as memory

BIG = {big}
real_make_call = memory.make_call

def make_call(chapter, name, T, problem):
    call = real_make_call(chapter, name, T, problem)
    if T != 16:  # the warm-up call, before the reset point
        return call
    def warm_up():
        buffer = np.ones(BIG // 8)  # every page written: resident
        del buffer  # freed: the resident size drops, the peak (VmHWM) not
        return call()
    return warm_up

memory.make_call = make_call
problem = bench_attention.parse_args(["--heads", "1", "--d", "8"]).problem
memory.child_measure("PyTorch by hand", 64, problem)
"""


def test_benchmark_memory_forgets_what_was_freed_before_the_call():
    """test_benchmark_measures_memory cannot see a missing reset of the
    peak (/proc/self/clear_refs): at T = 4096 the call's own matrix is the
    largest. Here the measured process allocates and frees 256 MiB before
    the reset point (in the warm-up): the reported peak of a T = 64 call
    must not include them (fresh review of issue 47, round 4)."""
    big = 256 * 2**20
    code = MEASURE_AFTER_A_FREED_BUFFER.format(big=big)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    peak = json.loads(out.strip().splitlines()[-1])["peak_extra_bytes"]
    assert 0 <= peak < big // 4
