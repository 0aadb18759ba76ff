"""Chapter 4: masks, and the mask argument of the book's one attention function
(book/attention.py, imported by the chapter), with the chapter's mask helpers.

The book's causal-masked weights (`CAUSAL_WEIGHTS`) are read from the
chapter and checked on the chapter's own Q, K, V (every cell run once), with
a causal mask written out by hand."""

import json
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import BOOK, load_chapter, r_chunks
from torch.testing import assert_close

NOTEBOOK = "04_masking.ipynb"

CAUSAL_3 = torch.tensor(
    [
        [True, False, False],
        [True, True, False],
        [True, True, True],
    ]
)


@pytest.fixture(scope="module")
def ch04():
    return load_chapter(NOTEBOOK)


@pytest.fixture(scope="module")
def ch04_run():
    """Every cell of the chapter run top to bottom: its Q, K, V."""
    return load_chapter(NOTEBOOK, run_all=True)


def randn(generator, *shape):
    return torch.randn(*shape, generator=generator)


def test_causal_weights(ch04, ch04_run):
    Q, K, V = ch04_run.Q, ch04_run.K, ch04_run.V
    _, w = ch04.scaled_dot_product_attention(Q, K, V, mask=CAUSAL_3)
    expected = torch.tensor(ch04.CAUSAL_WEIGHTS)
    assert_close(w[0], expected, rtol=0, atol=5e-5)
    _, w_builder = ch04.scaled_dot_product_attention(
        Q, K, V, mask=ch04.causal_mask(3)
    )
    assert torch.equal(w_builder, w)


def test_mask_builders(ch04):
    assert torch.equal(ch04.causal_mask(3), CAUSAL_3)
    assert torch.equal(
        ch04.causal_mask(2, 3),
        torch.tensor([[True, False, False], [True, True, False]]),
    )
    assert torch.equal(
        ch04.padding_mask([2, 0, 3], 3),
        torch.tensor(
            [[True, True, False], [False, False, False], [True, True, True]]
        ),
    )
    add = ch04.to_additive(torch.tensor([True, False]))
    assert add[0] == 0 and torch.isneginf(add[1])


@pytest.mark.parametrize(
    "n, w, expected",
    [
        (
            5,
            2,
            [
                [1, 0, 0, 0, 0],
                [1, 1, 0, 0, 0],
                [0, 1, 1, 0, 0],
                [0, 0, 1, 1, 0],
                [0, 0, 0, 1, 1],
            ],
        ),
        (
            4,
            3,
            [
                [1, 0, 0, 0],
                [1, 1, 0, 0],
                [1, 1, 1, 0],
                [0, 1, 1, 1],
            ],
        ),
        (3, 1, [[1, 0, 0], [0, 1, 0], [0, 0, 1]]),
        (3, 3, [[1, 0, 0], [1, 1, 0], [1, 1, 1]]),
        (3, 7, [[1, 0, 0], [1, 1, 0], [1, 1, 1]]),
    ],
)
def test_window_mask_by_hand(ch04, n, w, expected):
    assert torch.equal(ch04.window_mask(n, w), torch.tensor(expected).bool())


def test_window_mask_refuses_an_empty_window(ch04):
    with pytest.raises(ValueError, match="w >= 1"):
        ch04.window_mask(4, 0)


@pytest.mark.parametrize("seed", range(15))
@pytest.mark.parametrize("kind", ["none", "bool", "causal"])
def test_equals_torch_sdpa(ch04, seed, kind):
    g = torch.Generator().manual_seed(seed)
    batch = tuple(
        int(n) for n in torch.randint(1, 4, (seed % 3,), generator=g)
    )
    T_q, T_k, d_k, d_v = (
        int(n) for n in torch.randint(1, 9, (4,), generator=g)
    )
    q, k = randn(g, *batch, T_q, d_k), randn(g, *batch, T_k, d_k)
    v = randn(g, *batch, T_k, d_v)
    if kind == "causal":
        ours, _ = ch04.scaled_dot_product_attention(
            q, k, v, mask=ch04.causal_mask(T_q, T_k)
        )
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        # random boolean masks, fully masked rows included (PyTorch gives 0 there)
        mask = (
            None if kind == "none" else torch.rand(T_q, T_k, generator=g) > 0.5
        )
        ours, _ = ch04.scaled_dot_product_attention(q, k, v, mask=mask)
        theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert_close(ours, theirs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("seed", range(12))
def test_causal_outputs_ignore_the_future(ch04, seed):
    g = torch.Generator().manual_seed(seed)
    T, t = 8, seed % 7
    q, k, v = randn(g, 2, 3, T, 4), randn(g, 2, 3, T, 4), randn(g, 2, 3, T, 6)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for tensor in (q2, k2, v2):
        tensor[..., t + 1 :, :] = 10 * torch.randn(
            tensor[..., t + 1 :, :].shape, generator=g
        )
    out, _ = ch04.scaled_dot_product_attention(
        q, k, v, mask=ch04.causal_mask(T)
    )
    out2, _ = ch04.scaled_dot_product_attention(
        q2, k2, v2, mask=ch04.causal_mask(T)
    )
    assert_close(
        out2[..., : t + 1, :], out[..., : t + 1, :], rtol=0, atol=1e-6
    )
    assert not torch.allclose(out2[..., t + 1 :, :], out[..., t + 1 :, :])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_appending_padding_leaves_real_outputs_unchanged(ch04, seed, causal):
    g = torch.Generator().manual_seed(seed)
    lengths = [int(n) for n in torch.randint(1, 7, (3,), generator=g)]
    T_k = max(lengths) + 2  # at least two padded positions
    d, d_v = 4, 5
    seqs = [
        (randn(g, n, d), randn(g, n, d), randn(g, n, d_v)) for n in lengths
    ]
    padded = [
        100 * randn(g, 3, T_k, d),
        100 * randn(g, 3, T_k, d),
        100 * randn(g, 3, T_k, d_v),
    ]  # garbage padding
    for b, seq in enumerate(seqs):
        for full, part in zip(padded, seq):
            full[b, : len(part)] = part
    mask = ch04.padding_mask(lengths, T_k)[:, None, :]  # (B, 1, T_k)
    if causal:
        mask = mask & ch04.causal_mask(T_k)
    out, w = ch04.scaled_dot_product_attention(*padded, mask=mask)
    for b, (q, k, v) in enumerate(seqs):
        n = len(q)
        alone, _ = ch04.scaled_dot_product_attention(
            q, k, v, mask=ch04.causal_mask(n) if causal else None
        )
        assert_close(out[b, :n], alone, rtol=0, atol=1e-6)
        assert (w[b, :, n:] == 0).all()


def test_fully_masked_rows_are_zero_not_nan(ch04):
    g = torch.Generator().manual_seed(0)
    q = randn(g, 2, 4, 3).requires_grad_()
    k = randn(g, 2, 5, 3).requires_grad_()
    v = randn(g, 2, 5, 6).requires_grad_()
    mask = torch.rand(2, 4, 5, generator=g) > 0.5
    mask[0, 1] = False  # a fully masked row
    mask[1, 3] = False
    mask[0, 0] = True
    out, w = ch04.scaled_dot_product_attention(q, k, v, mask=mask)
    assert not torch.isnan(out).any() and not torch.isnan(w).any()
    assert (out[0, 1] == 0).all() and (w[0, 1] == 0).all()
    assert (out[1, 3] == 0).all() and (w[1, 3] == 0).all()
    assert_close(w[0, 0].sum(), torch.tensor(1.0), rtol=0, atol=1e-6)
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


@pytest.mark.parametrize(
    "mask_shape", [(4, 4), (3, 4), (2, 1, 3, 5), (4,), (3, 3, 5)]
)
def test_mismatched_mask_shape_raises(ch04, mask_shape):
    q, k, v = torch.ones(2, 3, 4), torch.ones(2, 5, 4), torch.ones(2, 5, 6)
    with pytest.raises(ValueError, match="does not broadcast"):
        ch04.scaled_dot_product_attention(
            q, k, v, mask=torch.ones(mask_shape, dtype=torch.bool)
        )


def test_other_bad_inputs_raise(ch04):
    q, k, v = torch.ones(3, 4), torch.ones(5, 4), torch.ones(5, 6)
    with pytest.raises(ValueError, match="must be a boolean tensor"):
        ch04.scaled_dot_product_attention(q, k, v, mask=torch.zeros(3, 5))
    with pytest.raises(ValueError, match="same size d_k"):
        ch04.scaled_dot_product_attention(q, torch.ones(5, 2), v)
    with pytest.raises(ValueError, match="every key needs one value"):
        ch04.scaled_dot_product_attention(q, k, torch.ones(4, 6))
    with pytest.raises(ValueError, match="batch dimensions do not match"):
        ch04.scaled_dot_product_attention(
            torch.ones(2, 3, 4), torch.ones(3, 5, 4), v
        )
    with pytest.raises(ValueError, match="lengths must be"):
        ch04.padding_mask([2, 7], 5)
    with pytest.raises(ValueError, match="positive sizes"):
        ch04.causal_mask(0)
    with pytest.raises(ValueError, match="boolean mask"):
        ch04.to_additive(torch.zeros(2))


def test_one_attention_function(ch04):
    """The chapter uses book/attention.py's function and defines no second
    attention function of its own."""
    assert ch04.scaled_dot_product_attention.__module__ == "attention"
    cells = json.loads((BOOK / NOTEBOOK).read_text(encoding="utf-8"))["cells"]
    code = "\n".join(
        "".join(c["source"]) for c in cells if c["cell_type"] == "code"
    )
    assert "from attention import scaled_dot_product_attention" in code
    assert (
        "F.softmax(scores" not in code and "def masked_attention" not in code
    )
    defined = re.findall(r"^def (\w+)", code, flags=re.M)
    assert not [name for name in defined if "attention" in name], defined


def test_the_posts_r_code_is_shown_unrun():
    """The post's three R chunks for the mask, each `eval: false`."""
    chunks = r_chunks(NOTEBOOK)
    assert len(chunks) == 3
    assert all(chunk.startswith("#| eval: false\n") for chunk in chunks)


# --- What the text states about the mask helpers (issue 31) -------------------


def test_mask_helpers_refuse_bad_sizes(ch04):
    """causal_mask needs positive sizes for both axes; padding_mask lengths in
    [0, T], one per row; to_additive a boolean mask (an integer 0/1 mask
    would be negated bitwise, silently)."""
    for sizes in ((3, 0), (0, 3), (0,)):
        with pytest.raises(ValueError, match="positive sizes"):
            ch04.causal_mask(*sizes)
    for lengths in ([6], [3, 6], [-1, 2], [[1, 2]]):
        with pytest.raises(ValueError, match=r"lengths must be .* \[0, 5\]"):
            ch04.padding_mask(lengths, 5)
    assert torch.equal(ch04.padding_mask([5, 0], 5)[0], torch.ones(5).bool())
    for dtype in (torch.int64, torch.uint8, torch.float64):
        with pytest.raises(ValueError, match="boolean mask"):
            ch04.to_additive(torch.ones(2, dtype=dtype))


def test_mask_helpers_refuse_non_integers_and_non_tensors(ch04):
    """Issue 47: a float size, a list for a mask, an integer dtype for -inf
    and float lengths are ValueErrors naming the problem (before: TypeError,
    AttributeError, RuntimeError, or a mask built from 1.5 tokens)."""
    for sizes in ((2.5,), (3, 2.5), (True,), (3, False), ("3",)):
        with pytest.raises(ValueError, match="integer sizes"):
            ch04.causal_mask(*sizes)
    assert torch.equal(ch04.causal_mask(np.int64(3)), ch04.causal_mask(3))
    for mask, kind in (([[True]], "list"), (np.array([True]), "ndarray")):
        with pytest.raises(ValueError, match=f"mask tensor, got {kind}"):
            ch04.to_additive(mask)
    for dtype in (torch.int64, torch.bool, "float32"):
        with pytest.raises(ValueError, match="-inf needs a float dtype"):
            ch04.to_additive(torch.tensor([True, False]), dtype=dtype)
    bad_lengths = (
        [1.5],
        [True, False],
        torch.tensor([2.0]),
        ["a"],
        [[1], [2, 3]],
    )
    for lengths in bad_lengths:
        with pytest.raises(ValueError, match=r"lengths must be .* \[0, 3\]"):
            ch04.padding_mask(lengths, 3)
    for T_pad in (2.5, -1, True, None):
        with pytest.raises(ValueError, match="T_pad must be an integer"):
            ch04.padding_mask([1], T_pad)
    assert ch04.padding_mask([], 3).shape == (0, 3)  # an empty batch
    assert torch.equal(
        ch04.padding_mask(np.array([1, 3]), np.int64(3)),
        ch04.padding_mask([1, 3], 3),
    )
    with pytest.raises(ValueError, match="integer w >= 1"):
        ch04.window_mask(4, 1.5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_additive_mask_dtype_and_values(ch04, dtype):
    keep = ch04.causal_mask(4)
    add = ch04.to_additive(keep, dtype=dtype)
    assert add.dtype == dtype
    assert (add[keep] == 0).all() and torch.isneginf(add[~keep]).all()
    # PyTorch's own additive causal mask
    expected = torch.nn.Transformer.generate_square_subsequent_mask(4)
    assert torch.equal(add.float(), expected)


def test_draw_masks_hatches_future_and_padding_keys(ch04):
    r"""The figure: a key hidden by the causal mask hatched \, by padding /,
    at row i (query) and column j (key)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    try:
        causal = ch04.causal_mask(4)
        padding = torch.tensor([True, True, True, False]).expand(4, 4)
        ch04.draw_masks(
            ax, (0.0, 0.0), causal, padding, list("abcd"), "t", 1.0
        )
        hatched = {}
        for patch in ax.patches:
            if patch.get_hatch():
                x, y = patch.get_xy()
                hatched[(round(-y) - 1, round(x))] = patch.get_hatch()
    finally:
        plt.close(fig)
    expected = {
        (i, j): "\\\\" * (j > i) + "//" * (j == 3)
        for i in range(4)
        for j in range(4)
        if j > i or j == 3
    }
    assert hatched == expected
