"""Chapter 3: scaled dot-product attention, the functions defined in the notebook."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import load_chapter, source_004_qkv
from torch.testing import assert_close

SOURCE_WEIGHTS = [
    [0.3668, 0.3001, 0.3331],
    [0.2955, 0.4472, 0.2573],
    [0.3729, 0.2933, 0.3338],
]
SOURCE_MASKED = [
    [1.0000, 0.0, 0.0],
    [0.3979, 0.6021, 0.0],
    [0.3729, 0.2933, 0.3338],
]
SOURCE_SHARPENED = [
    [0.7122, 0.0640, 0.2237],
    [0.0069, 0.9918, 0.0013],
    [0.7576, 0.0424, 0.2001],
]


@pytest.fixture(scope="module")
def ch03():
    return load_chapter("03_scaled_dot_product.ipynb")


def random_case(seed):
    """Random batch/head dims, lengths and sizes; q, k, v in float32."""
    g = torch.Generator().manual_seed(seed)
    n_batch_dims = seed % 3  # (), (B,), (B, H)
    batch = tuple(
        int(n) for n in torch.randint(1, 4, (n_batch_dims,), generator=g)
    )
    L, S, d_k, d_v = (int(n) for n in torch.randint(1, 9, (4,), generator=g))
    q = torch.randn(*batch, L, d_k, generator=g)
    k = torch.randn(*batch, S, d_k, generator=g)
    v = torch.randn(*batch, S, d_v, generator=g)
    return g, q, k, v


def test_source_numbers(ch03):
    Q, K, V = source_004_qkv()
    out, w = ch03.scaled_dot_product_attention(Q, K, V)
    assert_close(w, torch.tensor([SOURCE_WEIGHTS]), rtol=0, atol=5e-5)
    assert_close(w.sum(-1), torch.ones(1, 3), rtol=0, atol=1e-6)
    assert out.shape == (1, 3, 16)
    _, w_masked = ch03.scaled_dot_product_attention(
        Q, K, V, mask=torch.tril(torch.ones(3, 3, dtype=torch.bool))
    )
    assert_close(w_masked, torch.tensor([SOURCE_MASKED]), rtol=0, atol=5e-5)


def test_saturation_numbers_are_deterministic(ch03):
    Q, K, _ = source_004_qkv()
    scores = (Q @ K.transpose(-2, -1) * 16**-0.5)[0]
    multipliers = [0.25, 1, 4, 12, 32, 128]
    first = ch03.saturation_curve(scores, multipliers)
    second = ch03.saturation_curve(scores, multipliers)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    max_weight, jac_norm = first
    assert_close(
        max_weight[multipliers.index(12)],
        torch.tensor(SOURCE_SHARPENED).max(-1).values,
        rtol=0,
        atol=5e-5,
    )
    assert (jac_norm[1:] <= jac_norm[:-1] + 1e-6).all()
    assert (jac_norm <= math.sqrt(2) / 3 + 1e-6).all()
    assert (jac_norm[-1] < 1e-3).all()


@pytest.mark.parametrize("seed", range(10))
def test_softmax_jacobian_equals_autograd(ch03, seed):
    z = (
        torch.randn(
            6,
            generator=torch.Generator().manual_seed(seed),
            dtype=torch.float64,
        )
        * 3
    )
    expected = torch.autograd.functional.jacobian(
        lambda s: F.softmax(s, -1), z
    )
    assert_close(
        ch03.softmax_jacobian(F.softmax(z, -1)), expected, rtol=0, atol=1e-12
    )


def test_dot_product_variance(ch03):
    raw, scaled = ch03.dot_product_variance(
        [1, 16, 256], n_samples=4000, seed=5
    )
    assert (raw, scaled) == ch03.dot_product_variance([1, 16, 256], 4000, 5)
    assert_close(
        torch.tensor(raw), torch.tensor([1.0, 16.0, 256.0]), rtol=0.15, atol=0
    )
    assert_close(torch.tensor(scaled), torch.ones(3), rtol=0, atol=0.15)


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("kind", ["none", "bool", "float", "causal"])
def test_equals_torch_sdpa(ch03, seed, kind):
    g, q, k, v = random_case(seed)
    L, S = q.shape[-2], k.shape[-2]
    if kind == "causal":
        ours, w = ch03.scaled_dot_product_attention(
            q, k, v, mask=torch.ones(L, S, dtype=torch.bool).tril()
        )
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        mask = None
        if kind == "bool":
            mask = torch.rand(L, S, generator=g) > 0.4
            mask[:, int(torch.randint(S, (1,), generator=g))] = (
                True  # no empty row
            )
        elif kind == "float":
            mask = torch.randn(q.shape[:-2] + (L, S), generator=g)
        ours, w = ch03.scaled_dot_product_attention(q, k, v, mask=mask)
        theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert ours.shape == q.shape[:-1] + (v.shape[-1],)
    assert w.shape == q.shape[:-1] + (S,)
    assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert_close(w.sum(-1), torch.ones(w.shape[:-1]), rtol=0, atol=1e-6)


def test_multi_head_shapes(ch03):
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 4, 6, 8, generator=g)  # (B, H, L, d_k)
    k = torch.randn(2, 4, 9, 8, generator=g)  # (B, H, S, d_k)
    v = torch.randn(2, 4, 9, 5, generator=g)
    mask = torch.rand(2, 1, 6, 9, generator=g) > 0.3  # broadcast over heads
    mask[..., 0] = True
    out, w = ch03.scaled_dot_product_attention(q, k, v, mask=mask)
    assert out.shape == (2, 4, 6, 5) and w.shape == (2, 4, 6, 9)
    assert_close(
        out,
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        rtol=0,
        atol=1e-6,
    )
    assert (w[~mask.expand_as(w)] == 0).all()


@pytest.mark.parametrize("seed", range(10))
def test_causal_outputs_ignore_the_future(ch03, seed):
    g = torch.Generator().manual_seed(seed)
    T, t = 7, seed % 6
    q, k, v = (torch.randn(2, T, 4, generator=g) for _ in range(3))
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for tensor in (q2, k2, v2):
        tensor[:, t + 1 :] = torch.randn(2, T - t - 1, 4, generator=g)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    out, _ = ch03.scaled_dot_product_attention(q, k, v, mask=causal)
    out2, _ = ch03.scaled_dot_product_attention(q2, k2, v2, mask=causal)
    assert_close(out2[:, : t + 1], out[:, : t + 1], rtol=0, atol=1e-6)
    assert not torch.allclose(out2[:, t + 1 :], out[:, t + 1 :])


@pytest.mark.parametrize("n_pad", [1, 3])
def test_padding_leaves_real_outputs_unchanged(ch03, n_pad):
    g = torch.Generator().manual_seed(n_pad)
    q, k, v = (torch.randn(5, 4, generator=g) for _ in range(3))
    out, _ = ch03.scaled_dot_product_attention(q, k, v)
    q_p, k_p, v_p = (
        torch.cat([t, 50 * torch.randn(n_pad, 4, generator=g)])
        for t in (q, k, v)
    )
    keep = torch.arange(5 + n_pad) < 5  # (S,) broadcasts
    out_p, w_p = ch03.scaled_dot_product_attention(q_p, k_p, v_p, mask=keep)
    assert_close(out_p[:5], out, rtol=0, atol=1e-6)
    assert (w_p[:, 5:] == 0).all()


def test_fully_masked_row_raises(ch03):
    Q, K, V = source_004_qkv()
    mask = torch.ones(3, 3, dtype=torch.bool)
    mask[1] = False
    with pytest.raises(ValueError, match="every key masked"):
        ch03.scaled_dot_product_attention(Q, K, V, mask=mask)
    additive = torch.zeros(3, 3)
    additive[2] = float("-inf")
    with pytest.raises(ValueError, match="every key masked"):
        ch03.scaled_dot_product_attention(Q, K, V, mask=additive)


@pytest.mark.parametrize(
    "shapes, message",
    [
        (((3, 4), (5, 2), (5, 6)), "same size d_k: q has 4, k has 2"),
        (((3, 4), (5, 4), (6, 6)), "k has 5 positions, v has 6"),
        (
            ((4,), (5, 4), (5, 6)),
            r"q must have shape \(\.\.\., length, size\)",
        ),
        (((2, 3, 4), (3, 5, 4), (3, 5, 6)), "batch dimensions do not match"),
        (((3, 4), (0, 4), (0, 6)), "at least one key"),
    ],
)
def test_bad_shapes_raise(ch03, shapes, message):
    q, k, v = (torch.ones(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        ch03.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize(
    "mask, message",
    [
        (
            torch.ones(4, 4, dtype=torch.bool),
            r"mask of shape \(4, 4\) does not broadcast",
        ),
        (torch.ones(3, 1, 3, dtype=torch.bool), "does not broadcast"),
        (torch.ones(3, dtype=torch.bool), "does not broadcast"),
        (torch.ones(2, 5, dtype=torch.int64), "boolean or floating point"),
    ],
)
def test_bad_masks_raise(ch03, mask, message):
    q, k, v = torch.ones(2, 4), torch.ones(5, 4), torch.ones(5, 3)
    with pytest.raises(ValueError, match=message):
        ch03.scaled_dot_product_attention(q, k, v, mask=mask)


def test_bad_values_raise(ch03):
    q = torch.ones(2, 4)
    with pytest.raises(ValueError, match="floating-point"):
        ch03.scaled_dot_product_attention(q.long(), q, q)
    with pytest.raises(ValueError, match="NaN or infinite"):
        ch03.scaled_dot_product_attention(
            q, q, torch.full((2, 4), float("nan"))
        )
