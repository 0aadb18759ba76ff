"""Chapter 1: the softmax and attention functions defined in the notebook.

Every source number comes from the chapter itself, through its UPPER_CASE
constants (the source's words, what it printed, the seed-42 matrices): this
file holds no source number.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from numpy.testing import assert_allclose
from scipy.special import softmax as scipy_softmax

finite = st.floats(
    min_value=-1e4,
    max_value=1e4,
    allow_nan=False,
    allow_infinity=False,
    width=64,
)
score_matrices = arrays(
    np.float64,
    st.tuples(st.integers(1, 6), st.integers(1, 8)),
    elements=finite,
)


def qkv(seed, n_q=5, n_k=7, d_k=4, d_v=3):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(n_q, d_k)),
        rng.normal(size=(n_k, d_k)),
        rng.normal(size=(n_k, d_v)),
    )


@pytest.fixture(scope="module")
def seed42_qkv(ch01):
    """Q, K, V of the source's example, from the chapter's constants: its
    four words times its seed-42 matrices."""
    X = np.array(ch01.WORDS)
    return tuple(
        X @ np.array(W)
        for W in (ch01.SEED42_W_Q, ch01.SEED42_W_K, ch01.SEED42_W_V)
    )


@settings(max_examples=200, deadline=None)
@given(score_matrices)
def test_softmax_rows_sum_to_one_without_overflow(ch01, z):
    w = ch01.softmax(z, axis=1)
    assert np.isfinite(w).all()
    assert (w >= 0).all()
    assert_allclose(w.sum(axis=1), 1.0, rtol=0, atol=1e-12)


def test_softmax_extreme_scores(ch01):
    w = ch01.softmax(np.array([[1e4, -1e4, 0.0], [-1e4, -1e4, -1e4]]), axis=1)
    assert_allclose(
        w, [[1.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3]], rtol=0, atol=1e-15
    )


@settings(max_examples=200, deadline=None)
@given(score_matrices, st.floats(-1e4, 1e4))
def test_softmax_ignores_a_constant_added_to_a_row(ch01, z, c):
    assert_allclose(
        ch01.softmax(z + c, axis=1), ch01.softmax(z, axis=1), rtol=0, atol=1e-9
    )


@settings(max_examples=100, deadline=None)
@given(score_matrices)
def test_softmax_equals_scipy(ch01, z):
    assert_allclose(
        ch01.softmax(z, axis=1), scipy_softmax(z, axis=1), rtol=0, atol=1e-14
    )


def test_softmax_axis(ch01):
    z = np.arange(12.0).reshape(3, 4)
    assert_allclose(ch01.softmax(z, axis=0), scipy_softmax(z, axis=0))
    assert_allclose(ch01.softmax(z), scipy_softmax(z, axis=-1))


def test_softmax_allows_minus_inf_entries(ch01):
    assert_allclose(ch01.softmax([0.0, -np.inf, 0.0]), [0.5, 0.0, 0.5])


@pytest.mark.parametrize(
    "z, message",
    [
        ([], "empty"),
        ([1.0, np.nan], "NaN"),
        ([1.0, np.inf], r"\+inf"),
        ([-np.inf, -np.inf], "entirely -inf"),
        ([[0.0, 1.0], [-np.inf, -np.inf]], "entirely -inf"),
    ],
)
def test_softmax_rejects_undefined_input(ch01, z, message):
    with pytest.raises(ValueError, match=message):
        ch01.softmax(np.array(z, dtype=float))


@pytest.mark.parametrize("seed", range(20))
def test_permuting_keys_and_values_together_changes_nothing(ch01, seed):
    Q, K, V = qkv(seed)
    perm = np.random.default_rng(100 + seed).permutation(K.shape[0])
    out, w = ch01.attention_matrix(Q, K, V)
    out_p, w_p = ch01.attention_matrix(Q, K[perm], V[perm])
    assert_allclose(out_p, out, rtol=0, atol=1e-12)
    assert_allclose(w_p, w[:, perm], rtol=0, atol=1e-15)


@pytest.mark.parametrize("seed", range(20))
def test_loop_equals_matrix_form(ch01, seed):
    Q, K, V = qkv(seed, n_q=1 + seed % 4, n_k=1 + seed % 7)
    out, _ = ch01.attention_matrix(Q, K, V)
    assert out.shape == (Q.shape[0], V.shape[1])
    assert_allclose(ch01.attention_loop(Q, K, V), out, rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", range(10))
def test_equals_torch_scaled_dot_product_attention(ch01, seed):
    """An independent reference: PyTorch's own function, in float64."""
    Q, K, V = qkv(seed, n_q=2 + seed % 5, n_k=1 + seed % 6, d_k=3 + seed)
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(M) for M in (Q, K, V))
    ).numpy()
    out, w = ch01.attention_matrix(Q, K, V)
    assert_allclose(out, expected, rtol=0, atol=1e-12)
    assert_allclose(ch01.attention_loop(Q, K, V), expected, rtol=0, atol=1e-12)
    assert_allclose(w.sum(axis=1), 1.0, rtol=0, atol=1e-12)


def test_identical_keys_give_the_mean_of_the_values(ch01):
    Q, _, V = qkv(3)
    K = np.ones((V.shape[0], Q.shape[1]))
    out, w = ch01.attention_matrix(Q, K, V)
    assert_allclose(w, 1 / V.shape[0], rtol=0, atol=1e-15)
    assert_allclose(out, np.tile(V.mean(axis=0), (len(Q), 1)), atol=1e-12)


def test_the_source_numbers(ch01, seed42_qkv):
    """The chapter's functions, on the source's words and seed-42 matrices,
    give the table the source printed and the weights the chapter states."""
    out, w = ch01.attention_matrix(*seed42_qkv)
    assert_allclose(out, ch01.SOURCE_ATTENTION, rtol=0, atol=1e-8)
    assert_allclose(out[0], ch01.SOURCE_ATTENTION_WORD_1, rtol=0, atol=1e-8)
    assert_allclose(w[0], ch01.WORD_1_WEIGHTS, rtol=0, atol=1e-8)
    loop = ch01.attention_loop(*seed42_qkv)
    assert_allclose(loop, ch01.SOURCE_ATTENTION, rtol=0, atol=1e-8)


@pytest.mark.parametrize("fn", ["attention_matrix", "attention_loop"])
@pytest.mark.parametrize(
    "shapes, message",
    [
        (((4, 3), (4, 2), (4, 3)), "same size d_k: Q has 3 columns, K has 2"),
        (((4, 3), (4, 3), (5, 3)), "K has 4 rows, V has 5"),
        (
            ((3,), (4, 3), (4, 3)),
            r"Q must be a 2-D matrix .* got shape \(3,\)",
        ),
        (
            ((4, 3), (2, 4, 3), (4, 3)),
            r"K must be a 2-D matrix .* got shape \(2, 4, 3\)",
        ),
        (
            ((4, 3), (4, 3), (4,)),
            r"V must be a 2-D matrix .* got shape \(4,\)",
        ),
        (((4, 3), (0, 3), (0, 3)), "at least one key"),
    ],
)
def test_bad_shapes_raise_value_error(ch01, fn, shapes, message):
    Q, K, V = (np.ones(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        getattr(ch01, fn)(Q, K, V)


def test_seed42_matrices_follow_the_randint_rule(ch01):
    """The chapter's account of `randint(3)`: keep the lowest two bits of
    each 32-bit Mersenne Twister word, throw away a 3. Checked with an
    independent twister, Python's `random` module, started in the state
    NumPy's legacy `seed(42)` leaves: the kept numbers are the seed-42
    matrices, and W_Q, W_K, W_V use 11, 15 and 13 words."""
    import random

    _, key, pos, *_ = np.random.RandomState(42).get_state()
    twister = random.Random()
    twister.setstate((3, (*(int(k) for k in key), int(pos)), None))
    kept, used = [], []
    for word_count in range(1, 100):
        two_bits = twister.getrandbits(32) & 3
        if two_bits != 3:
            kept.append(two_bits)
            if len(kept) % 9 == 0:
                used.append(word_count)
        if len(kept) == 27:
            break
    assert np.diff(used, prepend=0).tolist() == [11, 15, 13]
    np.testing.assert_array_equal(
        np.reshape(kept, (3, 3, 3)),
        [ch01.SEED42_W_Q, ch01.SEED42_W_K, ch01.SEED42_W_V],
    )


def test_naive_softmax_is_the_literal_formula_and_overflows(ch01):
    """The chapter's literal softmax: exp(z) / sum(exp(z)), equal to SciPy's
    where nothing overflows, and NaN (inf / inf) for a score of 1000, the
    failure the chapter shows before its stable softmax."""
    z = np.random.default_rng(0).normal(scale=3.0, size=7)
    assert_allclose(ch01.naive_softmax(z), scipy_softmax(z), rtol=1e-13)
    with np.errstate(over="ignore", invalid="ignore"):
        broken = ch01.naive_softmax(np.array([1000.0, 0.0]))
    assert np.isnan(broken[0]) and broken[1] == 0.0
