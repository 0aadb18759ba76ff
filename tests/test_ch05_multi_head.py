"""Chapter 5: the head and the two multi-head modules of the notebook, built
on book/attention.py's function (which the chapter imports), against
PyTorch's own functions and references written here independently of the
chapter's code (PyTorch's causal masks, hand-written masks)."""

import json
import re

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import BOOK, load_chapter, r_chunks
from hypothesis import given, settings
from hypothesis import strategies as st

NOTEBOOK = "05_multi_head.ipynb"
ATOL = 1e-6  # float32, as in the chapter

# (B, T, d, H): one head, many heads, one token, head size 1, odd sizes
SHAPES = [
    (1, 3, 32, 4),
    (2, 5, 12, 3),
    (3, 1, 8, 8),
    (4, 7, 16, 1),
    (2, 6, 30, 5),
    (1, 9, 6, 6),
]
MODULES = ["AttentionHead", "MultiHeadAttention", "BatchedMultiHeadAttention"]


@pytest.fixture(scope="module")
def ch05():
    return load_chapter(NOTEBOOK)


def make_modules(ch05, d, H, seed, dropout=0.0):
    """A head-list module, and the batched and PyTorch modules with its weights."""
    torch.manual_seed(seed)
    heads = ch05.MultiHeadAttention(d, H, dropout)
    with torch.no_grad():  # non-zero output bias, so it is compared
        heads.output_linear.bias.normal_()
    batched = ch05.copy_heads_to_batched(
        heads, ch05.BatchedMultiHeadAttention(d, H, dropout)
    )
    return heads, batched, ch05.to_torch_mha(batched)


def make_mask(kind, B, T_q, T_k, H, ch05, seed=0):
    """Our mask (True = may attend) and a mask for nn.MultiheadAttention that
    does not come from the chapter's code (for the causal case PyTorch's own,
    additive: -inf above the diagonal)."""
    if kind is None:
        return None, None
    if kind == "causal":
        return (
            ch05.causal_mask(T_q),
            nn.Transformer.generate_square_subsequent_mask(T_q),
        )
    gen = torch.Generator().manual_seed(seed)  # "random": per batch entry, 3-D
    mask = torch.rand(B, T_q, T_k, generator=gen) < 0.6
    mask[..., 0] = True  # no row entirely masked (PyTorch's module: NaN)
    # torch wants (B * H, T_q, T_k), True = blocked
    return mask, (~mask).repeat_interleave(H, dim=0)


def assert_all_equal(ch05, B, T_q, T_k, d, H, mask_kind, seed, cross):
    heads, batched, torch_mha = make_modules(ch05, d, H, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(B, T_q, d, generator=gen)
    context = torch.randn(B, T_k, d, generator=gen) if cross else None
    kv = context if cross else x
    mask, torch_mask = make_mask(mask_kind, B, T_q, T_k, H, ch05, seed)
    with torch.no_grad():
        out_a, w_a = heads(x, context, mask, return_weights=True)
        out_b, w_b = batched(x, context, mask, return_weights=True)
        out_t, w_t = torch_mha(
            x, kv, kv, attn_mask=torch_mask, average_attn_weights=False
        )
    assert out_a.shape == out_b.shape == (B, T_q, d)
    assert w_a.shape == w_b.shape == (B, H, T_q, T_k)
    torch.testing.assert_close(out_a, out_t, rtol=0, atol=ATOL)
    torch.testing.assert_close(w_a, w_t, rtol=0, atol=ATOL)
    torch.testing.assert_close(out_b, out_t, rtol=0, atol=ATOL)
    torch.testing.assert_close(w_b, w_t, rtol=0, atol=ATOL)


# --- Agreement with PyTorch ---------------------------------------------------


@pytest.mark.parametrize("mask_kind", [None, "causal", "random"])
@pytest.mark.parametrize("B, T, d, H", SHAPES)
def test_head_list_batched_and_torch_agree(ch05, B, T, d, H, mask_kind):
    assert_all_equal(
        ch05, B, T, T, d, H, mask_kind, seed=B * 100 + T, cross=False
    )


@pytest.mark.parametrize("mask_kind", [None, "random"])
@pytest.mark.parametrize(
    "B, T_q, T_k, d, H",
    [(1, 3, 5, 32, 4), (2, 6, 2, 12, 3), (3, 1, 4, 8, 2), (2, 4, 1, 10, 5)],
)
def test_cross_attention_agrees_and_kas_query_length(
    ch05, B, T_q, T_k, d, H, mask_kind
):
    assert_all_equal(
        ch05, B, T_q, T_k, d, H, mask_kind, seed=T_q * 10 + T_k, cross=True
    )


@settings(max_examples=30, deadline=None)
@given(
    B=st.integers(1, 3),
    T_q=st.integers(1, 8),
    T_k=st.integers(1, 8),
    head_size=st.integers(1, 6),
    H=st.integers(1, 6),
    mask_kind=st.sampled_from([None, "causal", "random"]),
    cross=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_agree(
    ch05, B, T_q, T_k, head_size, H, mask_kind, cross, seed
):
    if not cross:
        T_k = T_q
    if mask_kind == "causal" and T_q != T_k:
        mask_kind = "random"
    assert_all_equal(
        ch05, B, T_q, T_k, head_size * H, H, mask_kind, seed, cross
    )


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("masked", [False, True])
def test_scaled_dot_product_equals_torch(ch05, seed, masked):
    gen = torch.Generator().manual_seed(seed)
    Q = torch.randn(2, 3, 4, 8, generator=gen)
    K = torch.randn(2, 3, 6, 8, generator=gen)
    V = torch.randn(2, 3, 6, 5, generator=gen)
    mask = None
    if masked:
        mask = torch.rand(4, 6, generator=gen) < 0.5
        mask[:, seed % 6] = True
    out, w = ch05.scaled_dot_product_attention(Q, K, V, mask)
    torch.testing.assert_close(
        out,
        F.scaled_dot_product_attention(Q, K, V, attn_mask=mask),
        rtol=0,
        atol=ATOL,
    )
    torch.testing.assert_close(
        w.sum(-1), torch.ones(2, 3, 4), rtol=0, atol=ATOL
    )
    if masked:
        assert (w[..., ~mask] == 0).all()


@pytest.mark.parametrize("T", [1, 2, 5, 9])
def test_causal_attention_equals_is_causal(ch05, T):
    gen = torch.Generator().manual_seed(T)
    Q, K, V = torch.randn(3, 2, T, 4, generator=gen).unbind(0)
    out, _ = ch05.scaled_dot_product_attention(Q, K, V, ch05.causal_mask(T))
    expected = F.scaled_dot_product_attention(Q, K, V, is_causal=True)
    torch.testing.assert_close(out, expected, rtol=0, atol=ATOL)


def test_causal_mask_is_lower_triangular(ch05):
    """Against a mask written out by hand."""
    expected = torch.tensor(
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]],
        dtype=torch.bool,
    )
    assert torch.equal(ch05.causal_mask(4), expected)
    assert torch.equal(ch05.causal_mask(1), torch.ones(1, 1, dtype=torch.bool))


# --- Fully masked rows --------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")
@pytest.mark.parametrize("seed", range(4))
def test_fully_masked_rows_give_zeros(ch05, seed):
    gen = torch.Generator().manual_seed(seed)
    Q = torch.randn(2, 5, 4, generator=gen)
    K = torch.randn(2, 6, 4, generator=gen)
    V = torch.randn(2, 6, 3, generator=gen)
    mask = torch.rand(2, 5, 6, generator=gen) < 0.5
    mask[:, 1] = False  # query 2 sees nothing, in both batch entries
    mask[0, 3] = False
    mask[..., 4, 2] = True  # query 5 sees at least key 3
    Q.requires_grad_(True)
    out, w = ch05.scaled_dot_product_attention(Q, K, V, mask)
    empty = ~mask.any(dim=-1)  # (2, 5)
    assert empty.sum() == 3
    assert not out.isnan().any() and not w.isnan().any()
    assert (w[empty] == 0).all() and (out[empty] == 0).all()
    torch.testing.assert_close(
        w[~empty].sum(-1), torch.ones(int((~empty).sum())), rtol=0, atol=ATOL
    )
    expected = F.scaled_dot_product_attention(Q, K, V, attn_mask=mask)
    torch.testing.assert_close(
        out[~empty], expected[~empty], rtol=0, atol=ATOL
    )
    # no NaN anywhere, not even one masked out later: anomaly mode raises if
    # a backward step (the softmax's of a 0/0 row) produces one
    with torch.autograd.detect_anomaly():
        out.sum().backward()
    assert not Q.grad.isnan().any()


@pytest.mark.parametrize(
    "cls", ["MultiHeadAttention", "BatchedMultiHeadAttention"]
)
def test_modules_fully_masked_row_gives_output_bias(ch05, cls):
    torch.manual_seed(4)
    module = getattr(ch05, cls)(8, 2)
    x = torch.randn(2, 4, 8)
    mask = ch05.causal_mask(4).clone()
    mask[2] = False
    with torch.no_grad():
        out, w = module(x, mask=mask, return_weights=True)
    assert (w[:, :, 2] == 0).all()
    bias = module.output_linear.bias
    torch.testing.assert_close(out[:, 2], bias.expand(2, -1), rtol=0, atol=0)
    assert not out.isnan().any()


# --- The source's shape and its bug -------------------------------------------


def test_source_head_shape(ch05):
    B, T, head_size = ch05.SOURCE_HEAD_SHAPE
    x = torch.randn(B, T, 32)  # the source's embed_dim
    assert list(ch05.AttentionHead(32, head_size)(x).shape) == [
        B,
        T,
        head_size,
    ]
    for cls in (ch05.MultiHeadAttention, ch05.BatchedMultiHeadAttention):
        assert cls(32, 4)(x).shape == x.shape


def test_each_head_scales_by_its_own_size(ch05):
    """The source's bug: a global head_size must not change anything."""
    torch.manual_seed(3)
    head = ch05.AttentionHead(d=32, d_k=16)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        Q, K, V = head.query(x), head.key(x), head.value(x)
        expected = (
            F.softmax(Q @ K.transpose(-1, -2) / 4.0, dim=-1) @ V
        )  # sqrt(16)
        ch05.head_size = 8  # a stray global, as in the source
        try:
            got = head(x)
            mha = ch05.MultiHeadAttention(d=64, H=4)
        finally:
            del ch05.head_size
    torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)
    assert [h.d_k for h in mha.heads] == [16, 16, 16, 16]
    assert [h.query.weight.shape for h in mha.heads] == [(16, 64)] * 4
    assert mha(torch.randn(1, 3, 64)).shape == (1, 3, 64)


# --- The batched layout -------------------------------------------------------


@pytest.mark.parametrize("B, T, d, H", SHAPES)
def test_split_heads_gives_each_head_its_columns(ch05, B, T, d, H):
    module = ch05.BatchedMultiHeadAttention(d, H)
    t = torch.randn(B, T, d)
    split = module.split_heads(t)
    d_k = d // H
    assert split.shape == (B, H, T, d_k)
    for h in range(H):
        assert torch.equal(split[:, h], t[..., h * d_k : (h + 1) * d_k])


def test_copy_heads_to_batched_layout(ch05):
    heads, batched, _ = make_modules(ch05, 12, 3, seed=2)
    W = batched.qkv.weight.view(3, 3, 4, 12)  # (Q/K/V, head, d_k, d)
    for i, name in enumerate(("query", "key", "value")):
        for h, head in enumerate(heads.heads):
            assert torch.equal(W[i, h], getattr(head, name).weight)
    for name in ("weight", "bias"):
        assert torch.equal(
            getattr(batched.output_linear, name),
            getattr(heads.output_linear, name),
        )


# --- Causality, gradients, parameters -----------------------------------------


@pytest.mark.parametrize("kind", ["heads", "batched"])
def test_causal_outputs_ignore_future_tokens(ch05, kind):
    heads, batched, _ = make_modules(ch05, 24, 4, seed=7)
    module = heads if kind == "heads" else batched
    x = torch.randn(2, 8, 24)
    mask = ch05.causal_mask(8)
    with torch.no_grad():
        for t in range(8):
            changed = x.clone()
            changed[:, t + 1 :] = torch.randn(2, 7 - t, 24)
            torch.testing.assert_close(
                module(changed, mask=mask)[:, : t + 1],
                module(x, mask=mask)[:, : t + 1],
                rtol=0,
                atol=0,
            )
            if t < 7:  # without the mask the future does leak in
                assert not torch.allclose(
                    module(changed)[:, : t + 1], module(x)[:, : t + 1]
                )


@pytest.mark.parametrize("kind", ["heads", "batched"])
@pytest.mark.parametrize("cross", [False, True])
def test_gradients_reach_every_parameter(ch05, kind, cross):
    torch.manual_seed(11)
    d, H = 12, 3
    module = (
        ch05.MultiHeadAttention
        if kind == "heads"
        else ch05.BatchedMultiHeadAttention
    )(d, H)
    x = torch.randn(2, 5, d, requires_grad=True)
    context = torch.randn(2, 4, d, requires_grad=True) if cross else None
    mask = None if cross else ch05.causal_mask(5)
    out = module(x, context, mask)
    (out * torch.randn_like(out)).sum().backward()
    names = [name for name, _ in module.named_parameters()]
    assert len(names) == (3 * H + 2 if kind == "heads" else 3)
    for name, p in module.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert p.grad.abs().sum() > 0, f"{name} got a zero gradient"
    if kind == "batched":  # every head's block of the stacked Q/K/V weight
        blocks = module.qkv.weight.grad.view(3, H, d // H, d)
        assert (blocks.abs().sum(dim=(2, 3)) > 0).all()
    for inp in (x, context):
        if inp is not None:
            assert inp.grad is not None and inp.grad.abs().sum() > 0


@pytest.mark.parametrize("d", [8, 32, 100])
@pytest.mark.parametrize("H", [1, 2, 4])
def test_parameter_count(ch05, d, H):
    for cls in (ch05.MultiHeadAttention, ch05.BatchedMultiHeadAttention):
        assert ch05.count_parameters(cls(d, H, dropout=0.5)) == 4 * d * d + d


# --- Attention dropout --------------------------------------------------------


@pytest.mark.parametrize("cls", MODULES)
def test_a_fraction_of_dropout_is_stored_as_a_float(ch05, cls):
    """check_sizes accepts any real number; nn's dropout takes a float:
    the module keeps float(dropout) (review R3)."""
    from fractions import Fraction

    module = getattr(ch05, cls)(8, 2, dropout=Fraction(1, 10))
    kept = module.heads[0] if cls == "MultiHeadAttention" else module
    assert type(kept.dropout) is float and kept.dropout == 0.1
    assert torch.isfinite(module(torch.randn(1, 3, 8))).all()  # training


@pytest.mark.parametrize("cls", MODULES)
def test_dropout_zero_and_eval_reproduce_no_dropout(ch05, cls):
    torch.manual_seed(12)
    args = (16, 4)
    plain = getattr(ch05, cls)(*args)  # dropout 0, training mode
    dropped = getattr(ch05, cls)(*args, dropout=0.4)
    dropped.load_state_dict(plain.state_dict())
    x = torch.randn(3, 5, 16)
    mask = ch05.causal_mask(5)
    with torch.no_grad():
        reference = plain(x, mask=mask)
        assert plain.training and dropped.training
        assert not torch.equal(dropped(x, mask=mask), reference)  # random
        dropped.eval()
        assert torch.equal(dropped(x, mask=mask), reference)
        dropped.train()
        assert not torch.equal(dropped(x, mask=mask), reference)


def test_dropout_zero_in_the_function_changes_nothing(ch05):
    gen = torch.Generator().manual_seed(13)
    Q, K, V = torch.randn(3, 2, 4, 8, generator=gen).unbind(0)
    state = torch.random.get_rng_state()
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            ch05.scaled_dot_product_attention(Q, K, V, dropout_p=0.0),
            ch05.scaled_dot_product_attention(Q, K, V),
        )
    )
    assert torch.equal(state, torch.random.get_rng_state())  # no draw


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_dropout_acts_on_the_weights_after_the_softmax(ch05, p):
    """Each weight is 0 or its softmax value / (1 - p); the output is the
    product of these weights with V."""
    gen = torch.Generator().manual_seed(14)
    Q = torch.randn(50, 6, 8, generator=gen)
    K = torch.randn(50, 7, 8, generator=gen)
    V = torch.randn(50, 7, 3, generator=gen)
    mask = ch05.causal_mask(7)[1:]  # (6, 7)
    _, exact = ch05.scaled_dot_product_attention(Q, K, V, mask)
    torch.manual_seed(15)
    out, w = ch05.scaled_dot_product_attention(Q, K, V, mask, dropout_p=p)
    kept = w != 0
    torch.testing.assert_close(w[kept], exact[kept] / (1 - p))
    torch.testing.assert_close(out, w @ V, rtol=0, atol=ATOL)
    share_dropped = 1 - kept[exact > 0].float().mean()
    n = int((exact > 0).sum())
    assert abs(share_dropped - p) < 5 * (p * (1 - p) / n) ** 0.5


@pytest.mark.parametrize("cls", MODULES)
def test_dropout_is_unbiased(ch05, cls):
    """The training-mode output averages to the evaluation output (within six
    standard errors of the mean, element by element)."""
    torch.manual_seed(16)
    module = getattr(ch05, cls)(16, 4, dropout=0.3)
    x = torch.randn(1, 5, 16)
    N = 20000
    with torch.no_grad():
        many = module.train()(x.expand(N, 5, 16), mask=ch05.causal_mask(5))
        expected = module.eval()(x, mask=ch05.causal_mask(5))[0]
    mean, se = many.mean(dim=0), many.std(dim=0) / N**0.5
    assert (se > 0).all()  # every output is random in training mode
    assert ((mean - expected).abs() <= 6 * se + 1e-6).all()


def test_torch_module_with_dropout_agrees_in_eval_mode(ch05):
    heads, batched, torch_mha = make_modules(ch05, 16, 4, seed=17, dropout=0.2)
    assert torch_mha.dropout == 0.2 and not torch_mha.training
    x = torch.randn(2, 6, 16)
    torch_causal = nn.Transformer.generate_square_subsequent_mask(6)
    with torch.no_grad():
        expected, _ = torch_mha(x, x, x, attn_mask=torch_causal)
        for module in (heads.eval(), batched.eval()):
            got = module(x, mask=ch05.causal_mask(6))
            torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)


# --- Errors -------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls", ["MultiHeadAttention", "BatchedMultiHeadAttention"]
)
@pytest.mark.parametrize("d, H", [(30, 4), (32, 0), (7, 2), (8, 16)])
def test_indivisible_sizes_raise(ch05, cls, d, H):
    with pytest.raises(ValueError, match=f"d={d}, H={H}"):
        getattr(ch05, cls)(d, H)


@pytest.mark.parametrize("cls", MODULES)
@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_bad_dropout_raises(ch05, cls, p):
    with pytest.raises(
        ValueError, match=rf"dropout must be in \[0, 1\), got {p}"
    ):
        getattr(ch05, cls)(8, 2, dropout=p)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        ch05.scaled_dot_product_attention(
            torch.ones(2, 4), torch.ones(3, 4), torch.ones(3, 4), dropout_p=p
        )


@pytest.mark.parametrize(
    "cls", ["MultiHeadAttention", "BatchedMultiHeadAttention"]
)
@pytest.mark.parametrize(
    "x_shape, ctx_shape, mask_shape, message",
    [
        (
            (1, 3, 30),
            None,
            None,
            r"x must have shape \(B, T, 32\), got \(1, 3, 30\)",
        ),
        (
            (3, 32),
            None,
            None,
            r"x must have shape \(B, T, 32\), got \(3, 32\)",
        ),
        (
            (2, 3, 32),
            (1, 5, 32),
            None,
            r"context must have shape \(2, T_k, 32\), "
            r"got \(1, 5, 32\)",
        ),
        (
            (2, 3, 32),
            (2, 5, 16),
            None,
            r"context must have shape \(2, T_k, 32\), "
            r"got \(2, 5, 16\)",
        ),
        (
            (1, 3, 32),
            None,
            (4, 4),
            r"mask of shape \(4, 4\) does not broadcast",
        ),
        ((1, 3, 32), (1, 5, 32), (3, 3), r"shape \(3, 3\) does not broadcast"),
        (
            (2, 3, 32),
            None,
            (3, 3, 3),
            r"mask must have shape \(T_q, T_k\) or "
            r"\(2, T_q, T_k\), got \(3, 3, 3\)",
        ),
        ((2, 3, 32), None, (1, 2, 3, 3), r"got \(1, 2, 3, 3\)"),
    ],
)
def test_bad_shapes_raise(ch05, cls, x_shape, ctx_shape, mask_shape, message):
    module = getattr(ch05, cls)(32, 4)
    context = None if ctx_shape is None else torch.randn(ctx_shape)
    mask = (
        None
        if mask_shape is None
        else torch.ones(mask_shape, dtype=torch.bool)
    )
    with pytest.raises(ValueError, match=message):
        module(torch.randn(x_shape), context, mask)


@pytest.mark.parametrize("cls", MODULES)
def test_non_boolean_mask_raises(ch05, cls):
    module = getattr(ch05, cls)(8, 2)
    with pytest.raises(
        ValueError,
        match=r"boolean tensor \(True = attend\), got torch\.float32",
    ):
        module(torch.randn(1, 3, 8), mask=torch.ones(3, 3))


@pytest.mark.parametrize("cls", MODULES)
@pytest.mark.parametrize(
    "sizes, message",
    [
        ((32, 4.0), r"must be integers, got .*4\.0"),
        ((32.0, 4), r"must be integers, got .*32\.0"),
        ((32, True), "must be integers, got .*True"),
        ((32, "4"), "must be integers, got .*'4'"),
    ],
)
def test_non_integer_sizes_raise(ch05, cls, sizes, message):
    """Issue 47: BatchedMultiHeadAttention(32, 4.0) was built and failed in
    forward with a TypeError; the others failed in nn.Linear."""
    with pytest.raises(ValueError, match=message):
        getattr(ch05, cls)(*sizes)


@pytest.mark.parametrize("cls", MODULES)
def test_non_number_dropout_raises(ch05, cls):
    with pytest.raises(ValueError, match="dropout must be a number, got 'a'"):
        getattr(ch05, cls)(8, 2, dropout="a")


@pytest.mark.parametrize("cls", MODULES)
@pytest.mark.parametrize(
    "arg, value, message",
    [
        (
            "x",
            np.zeros((1, 3, 8), np.float32),
            "x must be a tensor, got ndarray",
        ),
        ("x", [[[0.0] * 8]], "x must be a tensor, got list"),
        (
            "x",
            torch.zeros(1, 3, 8, dtype=torch.long),
            r"torch\.float32, got torch\.int64",
        ),
        (
            "x",
            torch.zeros(1, 3, 8, dtype=torch.float64),
            r"got torch\.float64",
        ),
        (
            "context",
            np.zeros((1, 5, 8)),
            "context must be a tensor, got ndarray",
        ),
        (
            "context",
            torch.zeros(1, 5, 8, dtype=torch.long),
            r"got torch\.int64",
        ),
        ("mask", np.ones((3, 3), bool), "mask must be a tensor, got ndarray"),
    ],
)
def test_inputs_of_the_wrong_kind_raise(ch05, cls, arg, value, message):
    """Issue 47: a NumPy array gave an AttributeError, a long or float64
    tensor a RuntimeError deep in nn.Linear."""
    args = {"x": torch.zeros(1, 3, 8), "context": None, "mask": None}
    args[arg] = value
    with pytest.raises(ValueError, match=message):
        getattr(ch05, cls)(8, 2)(**args)


def test_a_float64_module_takes_float64_inputs(ch05):
    for cls in MODULES:
        module = getattr(ch05, cls)(8, 2).double()
        out = module(torch.zeros(1, 3, 8, dtype=torch.float64))
        assert out.dtype == torch.float64
        with pytest.raises(
            ValueError, match=r"dtype torch\.float64, got torch\.float32"
        ):
            module(torch.zeros(1, 3, 8))


def test_helpers_refuse_the_wrong_kind(ch05):
    for T in (2.5, True, "3"):
        with pytest.raises(ValueError, match="T >= 1 tokens"):
            ch05.causal_mask(T)
    heads, batched = (
        ch05.MultiHeadAttention(8, 2),
        ch05.BatchedMultiHeadAttention(8, 2),
    )
    with pytest.raises(
        ValueError, match="a BatchedMultiHeadAttention, got Multi"
    ):
        ch05.copy_heads_to_batched(heads, heads)
    with pytest.raises(ValueError, match="a MultiHeadAttention, got Batched"):
        ch05.copy_heads_to_batched(batched, batched)
    with pytest.raises(
        ValueError, match="a BatchedMultiHeadAttention, got Multi"
    ):
        ch05.to_torch_mha(heads)


def test_other_errors(ch05):
    with pytest.raises(
        ValueError, match=r"needs T >= 1 tokens \(an integer\), got 0"
    ):
        ch05.causal_mask(0)
    with pytest.raises(ValueError, match="must be positive, got 8 and 0"):
        ch05.AttentionHead(8, 0)
    with pytest.raises(ValueError, match="d 32 vs 16, H 4 vs 4"):
        ch05.copy_heads_to_batched(
            ch05.MultiHeadAttention(32, 4),
            ch05.BatchedMultiHeadAttention(16, 4),
        )
    with pytest.raises(ValueError, match="Q has 8, K has 4"):
        ch05.scaled_dot_product_attention(
            torch.ones(2, 8), torch.ones(3, 4), torch.ones(3, 4)
        )
    with pytest.raises(ValueError, match="K has 3 rows, V has 2"):
        ch05.scaled_dot_product_attention(
            torch.ones(2, 4), torch.ones(3, 4), torch.ones(2, 4)
        )
    with pytest.raises(ValueError, match="does not broadcast"):
        ch05.scaled_dot_product_attention(
            torch.ones(3, 2, 4),
            torch.ones(3, 5, 4),
            torch.ones(3, 5, 4),
            torch.ones(2, 2, 5, dtype=torch.bool),
        )


def test_torch_module_layout(ch05, monkeypatch):
    """to_torch_mha copies the stacked weights and zeroes the input biases."""

    class BiasedMHA(nn.MultiheadAttention):  # as if PyTorch's default changed
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            with torch.no_grad():
                self.in_proj_bias.fill_(1.0)

    monkeypatch.setattr(ch05.nn, "MultiheadAttention", BiasedMHA)
    _, batched, torch_mha = make_modules(ch05, 16, 4, seed=5)
    assert isinstance(torch_mha, BiasedMHA)
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        torch.testing.assert_close(
            torch_mha(x, x, x)[0], batched(x), rtol=0, atol=ATOL
        )
    assert torch_mha.batch_first
    assert torch.equal(torch_mha.in_proj_weight, batched.qkv.weight)
    assert torch.equal(torch_mha.in_proj_bias, torch.zeros(48))
    assert torch.equal(torch_mha.out_proj.bias, batched.output_linear.bias)


# --- One attention function, and the post's R code -----------------------------


def test_one_attention_function(ch05):
    """The chapter imports book/attention.py's function and defines no
    attention function of its own."""
    assert ch05.scaled_dot_product_attention.__module__ == "attention"
    cells = json.loads((BOOK / NOTEBOOK).read_text(encoding="utf-8"))["cells"]
    code = "\n".join(
        "".join(c["source"]) for c in cells if c["cell_type"] == "code"
    )
    assert "from attention import scaled_dot_product_attention" in code
    defined = re.findall(r"^def (\w+)", code, flags=re.M)
    assert not [name for name in defined if "product" in name], defined


def test_the_posts_r_code_is_shown_unrun():
    """The post's four R chunks (two modules, two examples), `eval: false`."""
    chunks = r_chunks(NOTEBOOK)
    assert len(chunks) == 4
    assert all(chunk.startswith("#| eval: false\n") for chunk in chunks)
    assert sum("nn_module" in chunk for chunk in chunks) == 2


def test_count_parameters_counts_trainable_numbers_only(ch05):
    """The text: "Number of trainable numbers in a module"."""
    module = ch05.MultiHeadAttention(8, 2)
    assert ch05.count_parameters(module) == 4 * 8 * 8 + 8
    module.output_linear.requires_grad_(False)  # W_O and b_O frozen
    assert ch05.count_parameters(module) == 3 * 8 * 8


@pytest.mark.parametrize("bad", [3, None, [nn.Linear(2, 2)]])
def test_count_parameters_refuses_a_non_module(ch05, bad):
    """count_parameters(3) raised AttributeError ('int' has no parameters)."""
    with pytest.raises(ValueError, match=r"expected a torch\.nn\.Module, got"):
        ch05.count_parameters(bad)
