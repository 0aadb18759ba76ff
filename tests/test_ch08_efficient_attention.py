"""Chapter 8: online softmax, tiled attention and the benchmark script."""

import json
import re
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
def ch07():
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


# --- tiled attention equals the naive program ---------------------------------

# block sizes of 1, odd, equal to T, larger than T; lengths that are and are
# not multiples of them (tiny blocks only with short sequences, to stay fast)
CASES = [
    (T, bq, bk)
    for T in (1, 2, 15, 16, 17, 97, 200)
    for bq, bk in (
        (1, 1),
        (1, 7),
        (7, 1),
        (3, 5),
        (16, 16),
        (128, 512),
        (500, 600),
    )
    if T * T <= 2000 * bq * bk
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T, block_q, block_k", CASES)
def test_tiled_equals_naive(ch07, T, block_q, block_k, causal, dtype):
    q, k, v = qkv(T, dtype=dtype, seed=T)
    expected = ch07.attention_torch(q, k, v, causal)
    got = ch07.tiled_attention(q, k, v, causal, block_q, block_k)
    assert got.dtype == dtype and got.shape == expected.shape
    assert_close(got, expected, rtol=0, atol=ATOL[dtype])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("L, S", [(5, 40), (40, 5), (33, 100), (1, 9)])
def test_tiled_cross_attention_lengths(ch07, L, S, causal):
    q, k, v = qkv(L, S, d=8, d_v=5, batch=(3,))
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=causal
    )
    got = ch07.tiled_attention(q, k, v, causal, block_q=4, block_k=6)
    assert_close(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("block_q, block_k", [(4, 4), (3, 7), (16, 5)])
def test_tiled_causal_outputs_ignore_the_future(ch07, dtype, block_q, block_k):
    """Masked keys get weight exactly 0: outputs up to t do not change, bit for
    bit, when keys and values after t change."""
    q, k, v = qkv(30, dtype=dtype)
    k2, v2 = k.clone(), v.clone()
    k2[..., 13:, :] = 50.0 * torch.randn_like(k2[..., 13:, :])
    v2[..., 13:, :] = 1e30  # a weight of even 1e-34 would show
    a = ch07.tiled_attention(q, k, v, True, block_q, block_k)
    b = ch07.tiled_attention(q, k2, v2, True, block_q, block_k)
    assert torch.equal(a[..., :13, :], b[..., :13, :])
    assert not torch.equal(a[..., 13:, :], b[..., 13:, :])


def test_tiled_large_scores_do_not_overflow(ch07):
    """Scores of size 1e4 overflow exp() unless the running max is subtracted."""
    q, k, v = qkv(50, dtype=torch.float32)
    q = q * 300.0
    got = ch07.tiled_attention(q, k, v, block_q=8, block_k=8)
    assert torch.isfinite(got).all()
    assert_close(got, ch07.attention_torch(q, k, v), rtol=0, atol=1e-4)


def test_tiled_float32_at_benchmark_shape(ch07):
    """8 heads, d = 64, T = 1000 (not a multiple of the default tile)."""
    q, k, v = qkv(1000, d=64, batch=(1, 8), dtype=torch.float32)
    for causal in (False, True):
        assert_close(
            ch07.tiled_attention(q, k, v, causal),
            ch07.attention_torch(q, k, v, causal),
            rtol=0,
            atol=1e-5,
        )


def test_tiled_lse_is_logsumexp_of_scaled_scores(ch07):
    q, k, v = qkv(30, S=45)
    _, lse = ch07.tiled_attention(
        q, k, v, block_q=7, block_k=11, return_lse=True
    )
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    assert_close(lse, torch.logsumexp(scores, dim=-1), rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_all_programs_agree(ch07, causal):
    q, k, v = qkv(40, S=40, d=6, d_v=4)
    expected = ch07.attention_torch(q, k, v, causal).numpy()
    arrays = [t.numpy() for t in (q, k, v)]
    assert_allclose(
        ch07.attention_loop(*arrays, causal), expected, rtol=0, atol=1e-12
    )
    assert_allclose(
        ch07.attention_numpy(*arrays, causal), expected, rtol=0, atol=1e-12
    )
    assert_allclose(
        ch07.attention_sdpa(q, k, v, causal).numpy(),
        expected,
        rtol=0,
        atol=1e-12,
    )


# --- the tile schedule ----------------------------------------------------------


@pytest.mark.parametrize(
    "L, S, bq, bk",
    [(100, 100, 7, 13), (64, 64, 16, 16), (10, 30, 4, 3), (30, 10, 1, 1)],
)
def test_tile_schedule_covers_exactly_the_visible_pairs(ch07, L, S, bq, bk):
    for causal in (False, True):
        covered = np.zeros((L, S), dtype=int)
        for i0, i1, j0, j1, needs_mask in ch07.tile_schedule(
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


def test_causal_tile_counts(ch07):
    assert len(ch07.tile_schedule(4096, 4096, 128, 512)) == 256
    assert len(ch07.tile_schedule(4096, 4096, 128, 512, causal=True)) == 144
    assert len(ch07.tile_schedule(2048, 2048, 128, 512, causal=True)) == 40


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


@settings(max_examples=300, deadline=None)
@given(rows)
def test_online_softmax_of_a_stream_equals_softmax_of_the_row(ch07, row_cuts):
    row, cuts = row_cuts
    row = np.array(row)
    chunks = [
        c for c in np.split(row, sorted(set(c for c in cuts if c < len(row))))
    ]
    got = ch07.online_softmax(chunks)
    assert_allclose(got, scipy_softmax(row), rtol=0, atol=1e-14)
    assert (got[np.isneginf(row)] == 0).all()


def test_online_softmax_rows_with_leading_minus_inf(ch07):
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
        ch07.online_softmax(chunks),
        scipy_softmax(rows, axis=-1),
        rtol=0,
        atol=1e-15,
    )
    m, ell = next(iter(ch07.running_max_and_sum(chunks)))
    assert list(m) == [-np.inf, 0.5, -700.0] and list(ell) == [0.0, 1.0, 1.0]


def test_running_max_and_sum_invariant(ch07):
    rng = np.random.default_rng(3)
    row = rng.normal(scale=30.0, size=50)
    chunks = np.split(row, [3, 10, 11, 30])
    seen = 0
    for chunk, (m, ell) in zip(chunks, ch07.running_max_and_sum(chunks)):
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
    ],
)
def test_online_softmax_rejects_bad_streams(ch07, chunks, message):
    with pytest.raises(ValueError, match=message):
        ch07.online_softmax(chunks)


# --- bad inputs -------------------------------------------------------------------


@pytest.mark.parametrize(
    "fn", ["tiled_attention", "attention_torch", "attention_sdpa"]
)
@pytest.mark.parametrize(
    "shapes, message",
    [
        (((4, 3), (4, 2), (4, 3)), "same size d: q has 3, k has 2"),
        (((4, 3), (4, 3), (5, 3)), "k has 4 positions, v has 5"),
        (((3,), (4, 3), (4, 3)), r"q must have shape .* got \(3,\)"),
        (
            ((2, 4, 3), (3, 4, 3), (3, 4, 3)),
            "batch and head dimensions differ",
        ),
        (((4, 3), (0, 3), (0, 3)), "at least one key"),
    ],
)
def test_bad_shapes_raise(ch07, fn, shapes, message):
    q, k, v = (torch.ones(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        getattr(ch07, fn)(q, k, v)


@pytest.mark.parametrize("fn", ["attention_loop", "attention_numpy"])
def test_numpy_programs_check_inputs(ch07, fn):
    with pytest.raises(ValueError, match="same size d"):
        getattr(ch07, fn)(np.ones((4, 3)), np.ones((4, 2)), np.ones((4, 3)))
    with pytest.raises(ValueError, match="floating point"):
        getattr(ch07, fn)(
            np.ones((4, 3), int), np.ones((4, 3), int), np.ones((4, 3), int)
        )
    with pytest.raises(ValueError, match="NaN or infinite"):
        getattr(ch07, fn)(
            np.full((4, 3), np.nan), np.ones((4, 3)), np.ones((4, 3))
        )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"block_q": 0}, "block_q must be a positive integer, got 0"),
        ({"block_k": -3}, "block_k must be a positive integer"),
        ({"block_q": 2.5}, "block_q must be a positive integer, got 2.5"),
        ({"block_k": True}, "block_k must be a positive integer"),
    ],
)
def test_tiled_rejects_bad_block_sizes(ch07, kwargs, message):
    q, k, v = qkv(10)
    with pytest.raises(ValueError, match=message):
        ch07.tiled_attention(q, k, v, **kwargs)


def test_tiled_rejects_bad_tensors(ch07):
    q, k, v = qkv(10)
    with pytest.raises(ValueError, match="NaN or infinite"):
        ch07.tiled_attention(q.clone().fill_(float("nan")), k, v)
    with pytest.raises(ValueError, match="one dtype"):
        ch07.tiled_attention(q.float(), k, v)
    with pytest.raises(ValueError, match="floating point"):
        ch07.tiled_attention(*(t.long() for t in (q, k, v)))
    with pytest.raises(ValueError, match="torch tensors"):
        ch07.tiled_attention(q.numpy(), k, v)


def test_cost_model_counts_the_flops_of_the_tile_schedule(ch07):
    """4 T^2 d per head is what the tiles' two products add up to: 2 b_q b_k d
    for the scores and 2 b_q b_k d for P V, summed over every tile."""
    for T, bq, bk in ((4096, 128, 512), (1000, 96, 70), (5, 2, 3)):
        tiles = ch07.tile_schedule(T, T, bq, bk)
        per_head = sum(
            4 * (i1 - i0) * (j1 - j0) * 64 for i0, i1, j0, j1, _ in tiles
        )
        assert ch07.attention_cost(T, d=64, heads=8)[0] == 8 * per_head


@pytest.mark.parametrize("causal", [False, True])
def test_tiled_maxima_rising_late(ch07, causal):
    """Scores rise key by key, the largest by far in the last tile: every tile
    raises the running maximum and must rescale all that came before."""
    T, gen = 64, torch.Generator().manual_seed(5)
    q = torch.zeros(1, T, 2, dtype=torch.float64)
    q[..., 0] = 1.0
    k = torch.zeros(1, T, 2, dtype=torch.float64)
    k[0, :, 0] = torch.linspace(0.0, 400.0, T, dtype=torch.float64) ** 1.5 / 20
    v = torch.randn(1, T, 3, generator=gen, dtype=torch.float64)
    out = ch07.tiled_attention(q, k, v, causal, block_q=8, block_k=8)
    assert_close(
        out, ch07.attention_torch(q, k, v, causal), rtol=0, atol=1e-12
    )


# --- the fast tiled attention ---------------------------------------------------

ALL_LEVERS = ["as set", "all on", "all off"] + [
    f"toggle {name}" for name in ("base2", "inside", "ones", "lazy")
]


def levers_of(ch07, name):
    """The levers argument: the chapter's own, all on, all off, or the
    chapter's with one change toggled."""
    if name.startswith("all"):
        return dict.fromkeys(ch07.LEVERS, name == "all on")
    lever = name.removeprefix("toggle ")
    return {lever: not ch07.LEVERS[lever]} if lever in ch07.LEVERS else {}


# lengths that are and are not multiples of the tile sides, tiles of one
# query and key, odd tiles, tiles larger than the sequence
FAST_CASES = [
    (1, 1, 1), (1, 512, 512), (2, 1, 1), (17, 1, 1), (17, 3, 5),
    (17, 16, 16), (97, 3, 5), (97, 7, 64), (97, 512, 512), (200, 16, 16),
    (200, 7, 64),
]  # fmt: skip


@pytest.mark.parametrize("levers", ALL_LEVERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T, block_q, block_k", FAST_CASES)
def test_fast_equals_naive(ch07, T, block_q, block_k, causal, dtype, levers):
    q, k, v = qkv(T, dtype=dtype, seed=T + 1)
    expected = ch07.attention_torch(q, k, v, causal)
    got = ch07.fast_attention(
        q, k, v, causal, block_q, block_k, levers_of(ch07, levers)
    )
    assert got.dtype == dtype and got.shape == expected.shape
    assert_close(got, expected, rtol=0, atol=ATOL[dtype])


@pytest.mark.parametrize("levers", ALL_LEVERS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("L, S", [(5, 40), (40, 5), (33, 100), (1, 9)])
def test_fast_cross_attention_lengths(ch07, L, S, causal, levers):
    q, k, v = qkv(L, S, d=8, d_v=5, batch=(3,))
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=causal
    )
    got = ch07.fast_attention(q, k, v, causal, 4, 6, levers_of(ch07, levers))
    assert_close(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_fast_float32_at_benchmark_shape(ch07, causal):
    """T = 4096, 8 heads, d = 64, the default tiles: within 1e-5 of the fused
    kernel (an independent program) in float32."""
    q, k, v = qkv(4096, d=64, batch=(1, 8), dtype=torch.float32)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=causal
    )
    assert_close(
        ch07.fast_attention(q, k, v, causal), expected, rtol=0, atol=1e-5
    )


def late_rising_scores(T, top, dtype, seed=0):
    """One query row per head whose scores wander in [-8, 8] and then climb
    to `top` over the last keys: the last key tile holds the largest score
    by far, much more than MARGIN (base 2) above key 0's."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.rand(2, T, generator=gen, dtype=dtype) * 16 - 8
    s[:, -40:] = torch.linspace(0.0, top, 40, dtype=dtype)
    q = torch.zeros(2, T, 2, dtype=dtype)
    q[..., 0] = 2**0.5  # score q . k / sqrt(2) = s
    k = torch.zeros(2, T, 2, dtype=dtype)
    k[..., 0] = s
    v = torch.randn(2, T, 3, generator=gen, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize(
    "levers", ["as set", "all on", "all off", "toggle lazy"]
)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "dtype, top", [(torch.float32, 300.0), (torch.float64, 1000.0)]
)
def test_fast_maxima_rising_late(ch07, dtype, top, causal, levers):
    """Every term above the margin, and 2 ** (top log2 e) overflows: only a
    row of tiles recomputed with the exact reference gives the answer."""
    q, k, v = late_rising_scores(200, top, dtype)
    expected = ch07.attention_torch(q, k, v, causal)
    assert torch.isfinite(expected).all()
    for block_q, block_k in ((16, 16), (7, 50), (512, 512), (200, 30)):
        got = ch07.fast_attention(
            q, k, v, causal, block_q, block_k, levers_of(ch07, levers)
        )
        assert_close(got, expected, rtol=0, atol=ATOL[dtype])


def test_fast_moderate_rise_within_float32(ch07):
    """Scores 60 above key 0's: 2 ** 86 does not overflow float32, so only
    the margin check (not an infinity) sends the rows to the exact path."""
    q, k, v = late_rising_scores(100, 60.0, torch.float32)
    expected = ch07.attention_torch(q, k, v)
    got = ch07.fast_attention(q, k, v, block_q=8, block_k=16)
    assert_close(got, expected, rtol=0, atol=1e-5)


def test_fast_large_scores_do_not_overflow(ch07):
    q, k, v = qkv(50, dtype=torch.float32)
    got = ch07.fast_attention(300.0 * q, k, v, block_q=8, block_k=8)
    assert torch.isfinite(got).all()
    expected = ch07.attention_torch(300.0 * q, k, v)
    assert_close(got, expected, rtol=0, atol=1e-4)


def test_fast_large_values_do_not_overflow(ch07):
    """Terms up to about 2 ** 16 pass the margin check on the sums, and
    values of 1e35 then overflow float32 in the accumulator: the check must
    also require finite accumulators, and send those rows to the exact path."""
    q, k, v = late_rising_scores(100, 11.0, torch.float32)
    k[:, 0, 0] = 0.0  # key 0's score is 0, the others at most 11
    v = v * 1e35
    got = ch07.fast_attention(q, k, v, block_q=8, block_k=16)
    expected = ch07.attention_torch(q, k, v)
    assert torch.isfinite(expected).all() and torch.isfinite(got).all()
    assert_close(got / 1e35, expected / 1e35, rtol=0, atol=1e-5)


@pytest.mark.parametrize("levers", ALL_LEVERS)
def test_fast_causal_outputs_ignore_the_future(ch07, levers):
    """Masked keys get weight 0: values of 1e300 after t do not move the
    outputs up to t beyond rounding (a row block that meets large future
    scores takes the exact path, so the bits may differ, not the values)."""
    q, k, v = qkv(30)
    k2, v2 = k.clone(), v.clone()
    k2[..., 13:, :] = 50.0 * torch.randn_like(k2[..., 13:, :])
    v2[..., 13:, :] = 1e300
    args = (True, 4, 6, levers_of(ch07, levers))
    a = ch07.fast_attention(q, k, v, *args)
    b = ch07.fast_attention(q, k2, v2, *args)
    assert_close(a[..., :13, :], b[..., :13, :], rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "levers, message",
    [
        ({"speed": True}, "levers must be a dict with keys from"),
        ({"lazy": 1}, "True or False"),
        ([("lazy", False)], "levers must be a dict"),
    ],
)
def test_fast_rejects_bad_levers(ch07, levers, message):
    q, k, v = qkv(10)
    with pytest.raises(ValueError, match=message):
        ch07.fast_attention(q, k, v, levers=levers)


@pytest.mark.parametrize(
    "kwargs", [{"block_q": 0}, {"block_k": 2.5}, {"block_k": True}]
)
def test_fast_rejects_bad_block_sizes(ch07, kwargs):
    q, k, v = qkv(10)
    with pytest.raises(ValueError, match="must be a positive integer"):
        ch07.fast_attention(q, k, v, **kwargs)


def test_fast_rejects_bad_tensors(ch07):
    q, k, v = qkv(10)
    with pytest.raises(ValueError, match="NaN or infinite"):
        ch07.fast_attention(q, k.clone().fill_(float("inf")), v)
    with pytest.raises(ValueError, match="one dtype"):
        ch07.fast_attention(q, k.float(), v)
    with pytest.raises(ValueError, match="torch tensors"):
        ch07.fast_attention(q, k, v.numpy())


# --- the backward pass of exercise 3 ----------------------------------------------


@pytest.mark.parametrize(
    "L, S, block_k", [(37, 50, 16), (20, 20, 1), (9, 4, 64)]
)
def test_tiled_attention_backward_equals_autograd(ch07, L, S, block_k):
    q, k, v = (t.requires_grad_() for t in qkv(L, S, d=6, d_v=5))
    d_out = torch.randn(2, 3, L, 5, dtype=torch.float64)
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    reference.backward(d_out)
    with torch.no_grad():
        out, lse = ch07.tiled_attention(
            q, k, v, block_q=8, block_k=7, return_lse=True
        )
        grads = ch07.tiled_attention_backward(
            q, k, v, out, lse, d_out, block_k
        )
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
    sys.path.insert(0, str(ROOT / "tools"))
    import bench_attention

    return bench_attention


def test_benchmark_script_runs_end_to_end(bench, ch07, tmp_path, capsys):
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
    variants = bench.ablation_variants(ch07)
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
    out = capsys.readouterr().out
    assert re.search(
        r"fast tiled \(ours\), causal / SDPA throughput \d\.\d\d by median "
        r"times, \d\.\d\d by fastest calls",
        out,
    )


def test_benchmark_measures_memory(bench, capsys):
    """The naive program at T = 4096 holds at least one 4096 x 4096 float32
    matrix (64 MiB for 1 head); the measurement must see it. The script runs
    this in a fresh process; here it runs in the test's, so the matrix is
    made larger than any block the memory allocator keeps for reuse (32 MiB
    at most, glibc), and its pages are fresh."""
    args = bench.parse_args(["--heads", "1", "--d", "8"])
    bench.child_measure("PyTorch by hand", 4096, args)
    peak = json.loads(capsys.readouterr().out)["peak_extra_bytes"]
    assert 4096 * 4096 * 4 <= peak < 2**30


def broken_chapter(ch07, name, wrong):
    broken = types.SimpleNamespace(**vars(ch07))
    setattr(broken, name, wrong)
    return broken


def test_benchmark_catches_a_wrong_program(bench, ch07):
    """The script refuses to time a program whose output is wrong."""
    args = bench.parse_args(TINY)
    bench.check_equal(ch07, 24, args)  # the real chapter passes
    broken = broken_chapter(
        ch07,
        "attention_numpy",
        lambda q, k, v, causal=False: (
            ch07.attention_numpy(q, k, v, causal) + 1e-3
        ),
    )
    with pytest.raises(
        RuntimeError, match="NumPy differs from PyTorch by hand"
    ):
        bench.check_equal(broken, 24, args)


def test_benchmark_catches_a_wrong_variant(bench, ch07):
    """The ablation's and the sweep's variants are checked too, causal and
    not: a fast version that forgets the mask is refused."""
    args = bench.parse_args(TINY)
    variants = bench.ablation_variants(ch07) | bench.sweep_variants(args)
    bench.check_variants(ch07, 24, args, variants)  # the real chapter passes
    broken = broken_chapter(
        ch07,
        "fast_attention",
        lambda q, k, v, causal=False, **kw: ch07.fast_attention(q, k, v, **kw),
    )
    with pytest.raises(RuntimeError, match=r"causal=True\) differs"):
        bench.check_variants(broken, 24, args, variants)
