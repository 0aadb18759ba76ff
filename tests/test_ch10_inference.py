"""Chapter 10: the shared block with a causal mask equals PyTorch's; the KV
cache changes no token; grouped-query attention equals PyTorch's fused kernel
and its special cases; the sliding window and its rolling cache; bad inputs."""

import pytest
import torch
import torch.nn.functional as F
from conftest import load_chapter
from torch import nn
from torch.testing import assert_close

ch10 = load_chapter("10_inference.ipynb")
import transformer  # noqa: E402  (book/, put on the path by the loader)


def small_gpt(G=None, w=None, seed=0):
    """An untrained float64 GPT of the chapter's class (vocab 11)."""
    torch.manual_seed(seed)
    model = ch10.GPT(11, d=32, H=4, layers=2, d_ff=64, G=G, w=w)
    # random weights give logits of a spread where greedy ties do not occur
    return model.double().eval()


def torch_layer(block):
    """nn.TransformerEncoderLayer (pre-norm) holding the block's weights."""
    d, d_ff = block.linear1.in_features, block.linear1.out_features
    layer = nn.TransformerEncoderLayer(
        d,
        block.self_attn.H,
        d_ff,
        dropout=0.0,
        batch_first=True,
        norm_first=True,
    )
    layer.load_state_dict(
        {
            k.replace("in_proj.", "in_proj_"): v
            for k, v in block.state_dict().items()
        }
    )
    return layer.eval()


def test_causal_block_equals_torch_layer():
    """The shared block (chapter 6's, tested there against PyTorch without
    options) with causal=True equals PyTorch's pre-norm layer with a causal
    mask, and the rotary decoder block equals the rotary encoder block given
    that mask explicitly."""
    torch.manual_seed(0)
    block = transformer.EncoderBlock(32, 4, 64, causal=True).eval()
    with torch.no_grad():
        for norm in (block.norm1, block.norm2):
            norm.weight.normal_(1, 0.1), norm.bias.normal_(0, 0.1)
    x = torch.randn(3, 7, 32)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    padding = torch.ones(3, 7, dtype=torch.bool)
    padding[0, 5:] = False
    with torch.no_grad():
        theirs = torch_layer(block)(x, src_mask=~causal)
        assert_close(block(x), theirs, rtol=0, atol=1e-6)
        theirs = torch_layer(block)(
            x, src_mask=~causal, src_key_padding_mask=~padding
        )
        assert_close(block(x, padding_mask=padding), theirs, rtol=0, atol=1e-6)
        decoder = transformer.DecoderBlock(32, 4, 64).eval()
        encoder = transformer.EncoderBlock(32, 4, 64, rotary=True).eval()
        encoder.load_state_dict(decoder.state_dict())
        assert_close(decoder(x), encoder(x, causal), rtol=0, atol=1e-6)


@pytest.mark.parametrize("G, w", [(None, None), (2, None), (1, 3)])
def test_cached_equals_uncached(G, w):
    model = small_gpt(G, w)
    prompt = torch.tensor([1, 2, 3, 4, 5, 6, 7])  # prefill longer than w
    plain, plain_logits = ch10.generate(model, prompt, 40, cached=False)
    fast, fast_logits = ch10.generate(model, prompt, 40, cached=True)
    assert torch.equal(plain, fast)
    assert_close(fast_logits, plain_logits, rtol=0, atol=1e-10)


def test_cached_float32_logits_close():
    model = small_gpt().float()
    prompt = torch.tensor([3, 1, 4, 1, 5])
    _, plain_logits = ch10.generate(model, prompt, 30, cached=False)
    _, fast_logits = ch10.generate(model, prompt, 30, cached=True)
    assert_close(fast_logits, plain_logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("G", [8, 4, 2, 1])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_equals_sdpa(G, causal):
    torch.manual_seed(G)
    attn = ch10.SelfAttention(64, 8, G, causal=causal)
    x = torch.randn(2, 9, 64)
    with torch.no_grad():
        out, _ = attn(x)
        Q, K, V = attn.heads(x)
        assert K.shape == V.shape == (2, G, 9, 8)
        ref = F.scaled_dot_product_attention(
            Q, K, V, is_causal=causal, enable_gqa=True
        )
        ref = attn.out_proj(ref.transpose(1, 2).reshape(2, 9, 64))
    assert_close(out, ref, rtol=0, atol=1e-6)


def test_g_equals_h_is_multihead():
    torch.manual_seed(1)
    attn = ch10.SelfAttention(48, 6)
    assert attn.G == attn.H == 6 and attn.in_proj.out_features == 3 * 48
    mha = nn.MultiheadAttention(48, 6, batch_first=True)
    mha.load_state_dict(
        {
            k.replace("in_proj.", "in_proj_"): v
            for k, v in attn.state_dict().items()
        }
    )
    x = torch.randn(2, 5, 48)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    with torch.no_grad():
        assert_close(attn(x)[0], mha(x, x, x)[0], rtol=0, atol=1e-6)
        masked = ch10.SelfAttention(48, 6, causal=True)
        masked.load_state_dict(attn.state_dict())
        assert_close(
            masked(x)[0],
            mha(x, x, x, attn_mask=~causal)[0],
            rtol=0,
            atol=1e-6,
        )


def test_g1_is_multiquery():
    torch.manual_seed(2)
    attn = ch10.SelfAttention(64, 8, 1)
    assert attn.in_proj.out_features == 64 + 2 * 8
    x = torch.randn(1, 6, 64)
    with torch.no_grad():
        Q, K, _ = attn.heads(x)
        _, weights = attn(x)
        # every query head attends with the one shared key head
        for h in range(8):
            E = Q[:, h] @ K[:, 0].transpose(-2, -1) / 8**0.5
            assert_close(weights[:, h], E.softmax(-1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("extra", [0, 1, 5])
def test_window_at_least_T_is_causal(extra):
    torch.manual_seed(3)
    T = 8
    full = ch10.SelfAttention(32, 4, 2, causal=True)
    windowed = ch10.SelfAttention(32, 4, 2, causal=True, w=T + extra)
    windowed.load_state_dict(full.state_dict())
    x = torch.randn(2, T, 32)
    with torch.no_grad():
        assert torch.equal(windowed(x)[0], full(x)[0])


@pytest.mark.parametrize("w", [1, 2, 3, 7])
def test_window_is_band_mask(w):
    torch.manual_seed(4)
    T = 9
    attn = ch10.SelfAttention(32, 4, 4, causal=True, w=w)
    x = torch.randn(2, T, 32)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    band = (j <= i) & (i - j < w)
    with torch.no_grad():
        _, weights = attn(x)
    assert torch.equal(weights > 0, band.expand_as(weights))
    assert torch.equal(ch10.band_mask(T, w), band)


@pytest.mark.parametrize("w", [1, 4, 6])
def test_rolling_cache(w):
    model = small_gpt(G=2, w=w, seed=5)
    prompt = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9])  # longer than w
    plain, plain_logits = ch10.generate(model, prompt, 30, cached=False)
    fast, fast_logits = ch10.generate(model, prompt, 30, cached=True)
    assert torch.equal(plain, fast)
    assert_close(fast_logits, plain_logits, rtol=0, atol=1e-10)
    caches = model.new_caches()
    with torch.no_grad():
        for token in plain:
            model(token.view(1, 1), caches)
            assert caches[0].K.shape[-2] == w  # fixed size
    assert sorted(caches[0].pos.tolist()) == list(
        range(len(plain) - w, len(plain))
    )


def test_cache_bytes():
    model = small_gpt(G=2)
    caches = model.new_caches()
    with torch.no_grad():
        model(torch.arange(11).repeat(3)[None], caches)
    measured = sum(c.nbytes() for c in caches)
    assert measured == ch10.cache_bytes(2, 2, 8, 33, nbytes=8)


def test_sampling():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0, 2.5]])
    assert ch10.sample_next(logits, temperature=0).item() == 1
    gen = torch.Generator().manual_seed(0)
    draws = torch.cat(
        [
            ch10.sample_next(logits, 1.0, top_k=2, generator=gen)
            for _ in range(300)
        ]
    )
    assert set(draws.flatten().tolist()) == {1, 4}
    draws = torch.cat(
        [ch10.sample_next(logits, 5.0, generator=gen) for _ in range(300)]
    )
    assert len(set(draws.flatten().tolist())) == 5


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"H=8.*G=3"):
        ch10.SelfAttention(64, 8, 3)
    with pytest.raises(ValueError, match="G=0"):
        ch10.SelfAttention(64, 8, 0)
    with pytest.raises(ValueError, match="window"):
        ch10.SelfAttention(64, 8, 2, causal=True, w=0)
    with pytest.raises(ValueError, match="causal"):
        ch10.SelfAttention(64, 8, 2, w=4)
    with pytest.raises(ValueError, match="window"):
        ch10.KVCache(w=2.5)
    with pytest.raises(ValueError, match="context"):
        ch10.GPT(11, context=8)(torch.zeros(1, 9, dtype=torch.long))
    logits = torch.zeros(1, 5)
    with pytest.raises(ValueError, match="temperature"):
        ch10.sample_next(logits, temperature=-1)
    with pytest.raises(ValueError, match="top_k"):
        ch10.sample_next(logits, top_k=6)
    with pytest.raises(ValueError, match="top_k"):
        ch10.sample_next(logits, top_k=0)
    attn = ch10.SelfAttention(32, 4, causal=True)
    with pytest.raises(ValueError, match="mask"):
        attn(
            torch.zeros(1, 1, 32),
            torch.ones(1, 1, dtype=torch.bool),
            ch10.KVCache(),
        )
