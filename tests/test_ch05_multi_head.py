"""Chapter 5: the attention head and the two multi-head modules of the notebook."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import load_chapter
from hypothesis import given, settings
from hypothesis import strategies as st

ATOL = 1e-6  # float32, as in the chapter

# (B, T, E, H): one head, many heads, one token, head size 1, odd sizes
SHAPES = [
    (1, 3, 32, 4),
    (2, 5, 12, 3),
    (3, 1, 8, 8),
    (4, 7, 16, 1),
    (2, 6, 30, 5),
    (1, 9, 6, 6),
]


@pytest.fixture(scope="module")
def ch05():
    torch.set_num_threads(1)
    return load_chapter("05_multi_head.ipynb")


def make_modules(ch05, E, H, seed):
    """A head-list module, and the batched and PyTorch modules with its weights."""
    torch.manual_seed(seed)
    heads = ch05.MultiHeadAttention(E, H)
    with torch.no_grad():  # non-zero output bias, so it is compared
        heads.output_linear.bias.normal_()
    batched = ch05.copy_heads_to_batched(
        heads, ch05.BatchedMultiHeadAttention(E, H)
    )
    return heads, batched, ch05.to_torch_mha(batched)


def make_mask(kind, B, T_q, T_k, H, ch05, seed=0):
    """Our mask (True = may attend) and nn.MultiheadAttention's (True = blocked)."""
    if kind is None:
        return None, None
    if kind == "causal":
        mask = ch05.causal_mask(T_q)
        return mask, ~mask
    gen = torch.Generator().manual_seed(seed)  # "random": per batch entry, 3-D
    mask = torch.rand(B, T_q, T_k, generator=gen) < 0.6
    mask[..., 0] = True  # no row entirely masked
    return mask, (~mask).repeat_interleave(
        H, dim=0
    )  # torch wants (B * H, T_q, T_k)


def assert_all_equal(ch05, B, T_q, T_k, E, H, mask_kind, seed, cross):
    heads, batched, torch_mha = make_modules(ch05, E, H, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(B, T_q, E, generator=gen)
    context = torch.randn(B, T_k, E, generator=gen) if cross else None
    kv = context if cross else x
    mask, torch_mask = make_mask(mask_kind, B, T_q, T_k, H, ch05, seed)
    with torch.no_grad():
        out_a, w_a = heads(x, context, mask, return_weights=True)
        out_b, w_b = batched(x, context, mask, return_weights=True)
        out_t, w_t = torch_mha(
            x, kv, kv, attn_mask=torch_mask, average_attn_weights=False
        )
    assert out_a.shape == out_b.shape == (B, T_q, E)
    assert w_a.shape == w_b.shape == (B, H, T_q, T_k)
    torch.testing.assert_close(out_b, out_a, rtol=0, atol=ATOL)
    torch.testing.assert_close(w_b, w_a, rtol=0, atol=ATOL)
    torch.testing.assert_close(out_b, out_t, rtol=0, atol=ATOL)
    torch.testing.assert_close(w_b, w_t, rtol=0, atol=ATOL)


@pytest.mark.parametrize("mask_kind", [None, "causal", "random"])
@pytest.mark.parametrize("B, T, E, H", SHAPES)
def test_head_list_batched_and_torch_agree(ch05, B, T, E, H, mask_kind):
    assert_all_equal(
        ch05, B, T, T, E, H, mask_kind, seed=B * 100 + T, cross=False
    )


@pytest.mark.parametrize("mask_kind", [None, "random"])
@pytest.mark.parametrize(
    "B, T_q, T_k, E, H",
    [(1, 3, 5, 32, 4), (2, 6, 2, 12, 3), (3, 1, 4, 8, 2), (2, 4, 1, 10, 5)],
)
def test_cross_attention_agrees_and_has_query_length(
    ch05, B, T_q, T_k, E, H, mask_kind
):
    assert_all_equal(
        ch05, B, T_q, T_k, E, H, mask_kind, seed=T_q * 10 + T_k, cross=True
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


def test_source_shapes(ch05):
    x = torch.randn(1, 3, 32)
    assert ch05.AttentionHead(embed_dim=32, head_size=8)(x).shape == (1, 3, 8)
    assert ch05.MultiHeadAttention(embed_dim=32, num_heads=4)(x).shape == (
        1,
        3,
        32,
    )
    assert ch05.BatchedMultiHeadAttention(32, 4)(x).shape == (1, 3, 32)


def test_each_head_scales_by_its_own_size(ch05):
    """The source's bug: a global head_size must not change anything."""
    torch.manual_seed(3)
    head = ch05.AttentionHead(embed_dim=32, head_size=16)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        Q, K, V = head.query(x), head.key(x), head.value(x)
        expected = (
            F.softmax(Q @ K.transpose(-1, -2) / 4.0, dim=-1) @ V
        )  # sqrt(16)
        ch05.head_size = 8  # a stray global, as in the source
        try:
            got = head(x)
            mha = ch05.MultiHeadAttention(embed_dim=64, num_heads=4)
        finally:
            del ch05.head_size
    torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)
    assert [h.head_size for h in mha.heads] == [16, 16, 16, 16]
    assert [h.query.weight.shape for h in mha.heads] == [(16, 64)] * 4
    assert mha(torch.randn(1, 3, 64)).shape == (1, 3, 64)


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
    E, H = 12, 3
    module = (
        ch05.MultiHeadAttention
        if kind == "heads"
        else ch05.BatchedMultiHeadAttention
    )(E, H)
    x = torch.randn(2, 5, E, requires_grad=True)
    context = torch.randn(2, 4, E, requires_grad=True) if cross else None
    mask = None if cross else ch05.causal_mask(5)
    out = module(x, context, mask)
    (out * torch.randn_like(out)).sum().backward()
    names = [name for name, _ in module.named_parameters()]
    assert len(names) == (3 * H + 2 if kind == "heads" else 3)
    for name, p in module.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert p.grad.abs().sum() > 0, f"{name} got a zero gradient"
    if kind == "batched":  # every head's block of the stacked Q/K/V weight
        blocks = module.qkv.weight.grad.view(3, H, E // H, E)
        assert (blocks.abs().sum(dim=(2, 3)) > 0).all()
    for inp in (x, context):
        if inp is not None:
            assert inp.grad is not None and inp.grad.abs().sum() > 0


@pytest.mark.parametrize("E", [8, 32, 100])
@pytest.mark.parametrize("H", [1, 2, 4])
def test_parameter_count(ch05, E, H):
    for cls in (ch05.MultiHeadAttention, ch05.BatchedMultiHeadAttention):
        assert ch05.count_parameters(cls(E, H)) == 4 * E * E + E


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
    out, w = ch05.scaled_dot_product(Q, K, V, mask)
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


@pytest.mark.parametrize(
    "cls", ["MultiHeadAttention", "BatchedMultiHeadAttention"]
)
@pytest.mark.parametrize("E, H", [(30, 4), (32, 0), (7, 2), (8, 16)])
def test_indivisible_sizes_raise(ch05, cls, E, H):
    with pytest.raises(ValueError, match=f"embed_dim={E}, num_heads={H}"):
        getattr(ch05, cls)(E, H)


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
            r"mask must end in \(T_q, T_k\) = \(3, 3\), "
            r"got \(4, 4\)",
        ),
        ((1, 3, 32), (1, 5, 32), (3, 3), r"= \(3, 5\), got \(3, 3\)"),
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


@pytest.mark.parametrize(
    "cls", ["AttentionHead", "MultiHeadAttention", "BatchedMultiHeadAttention"]
)
def test_bad_masks_raise(ch05, cls):
    module = getattr(ch05, cls)(8, 2)
    x = torch.randn(1, 3, 8)
    with pytest.raises(
        ValueError, match=r"boolean tensor, got torch\.float32"
    ):
        module(x, mask=torch.ones(3, 3))
    empty_row = ch05.causal_mask(3).clone()
    empty_row[1] = False
    with pytest.raises(ValueError, match="entirely False"):
        module(x, mask=empty_row)


def test_other_errors(ch05):
    with pytest.raises(ValueError, match="at least one token, got T = 0"):
        ch05.causal_mask(0)
    with pytest.raises(ValueError, match="must be positive, got 8 and 0"):
        ch05.AttentionHead(8, 0)
    with pytest.raises(
        ValueError, match="embed_dim 32 vs 16, num_heads 4 vs 4"
    ):
        ch05.copy_heads_to_batched(
            ch05.MultiHeadAttention(32, 4),
            ch05.BatchedMultiHeadAttention(16, 4),
        )
    with pytest.raises(ValueError, match="Q has 8, K has 4"):
        ch05.scaled_dot_product(
            torch.ones(2, 8), torch.ones(3, 4), torch.ones(3, 4)
        )
    with pytest.raises(ValueError, match="K has 3 rows, V has 2"):
        ch05.scaled_dot_product(
            torch.ones(2, 4), torch.ones(3, 4), torch.ones(2, 4)
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
    assert (
        isinstance(torch_mha, nn.MultiheadAttention) and torch_mha.batch_first
    )
    assert torch.equal(torch_mha.in_proj_weight, batched.qkv.weight)
    assert torch.equal(torch_mha.in_proj_bias, torch.zeros(48))
    assert torch.equal(torch_mha.out_proj.bias, batched.output_linear.bias)
