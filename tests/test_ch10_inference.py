"""Chapter 10: the shared block with a causal mask equals PyTorch's; the KV
cache changes no token, never attends to its empty slots and refuses a layer
it cannot serve; the work it saves as PyTorch's FLOP counter counts it;
grouped-query attention equals PyTorch's fused kernel and its special cases;
the sliding window and its rolling cache; sampling; bad inputs."""

import itertools
import math
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import LazyChapter
from torch import nn
from torch.testing import assert_close

ch10 = LazyChapter("10_inference.ipynb")
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


# --- the baselines, the data, training and sampling as the text states -------


def assert_fed_in_parts_equals_one_call(block, x, cache):
    """x (B, 9, d) fed through the cache as 5, 1 and 3 tokens gives the
    outputs of one uncached call on all 9."""
    with torch.no_grad():
        full = block(x)
        parts = [
            block(x[:, a:b], cache=cache) for a, b in ((0, 5), (5, 6), (6, 9))
        ]
    assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=1e-12)


def test_unigram_and_bigram_baselines_equal_counting_by_hand():
    """Unigram: -mean log of the training text's character frequencies.
    Bigram: -mean log (count(a, b) + 1) / (count(a, .) + vocab), the next
    character b given the previous a, counted in the training text."""
    from collections import Counter

    gen = torch.Generator().manual_seed(0)
    vocab = 6
    train = torch.multinomial(
        torch.tensor([5.0, 1.0, 3.0, 0.5, 2.0, 0.0]), 400, True, generator=gen
    )
    x = torch.tensor([[0, 1, 2, 4], [2, 2, 3, 0]])
    y = torch.tensor([[1, 2, 4, 4], [2, 3, 0, 1]])
    seen = train.tolist()
    unigram = Counter(seen)
    expected = (
        -sum(math.log(unigram[b] / len(seen)) for b in y.flatten().tolist())
        / y.numel()
    )
    assert ch10.unigram_loss(train, y, vocab) == pytest.approx(expected, 1e-12)
    pairs = Counter(itertools.pairwise(seen))
    first = Counter(seen[:-1])
    expected = (
        -sum(
            math.log((pairs[(a, b)] + 1) / (first[a] + vocab))
            for a, b in zip(x.flatten().tolist(), y.flatten().tolist())
        )
        / y.numel()
    )
    got = ch10.bigram_loss(train, x, y, vocab)
    assert got == pytest.approx(expected, 1e-12)
    # character 5 never occurs: the plus one keeps its loss finite
    assert math.isfinite(ch10.bigram_loss(train, x, torch.full_like(y, 5), 6))


def test_validation_slice_and_batches_target_the_next_token():
    data = torch.arange(ch10.VAL_ROWS * ch10.VAL_T + 50)
    x, y = ch10.validation_slice(data)
    assert x.shape == y.shape == (ch10.VAL_ROWS, ch10.VAL_T)
    assert torch.equal(x.flatten(), data[: x.numel()])
    assert torch.equal(y, x + 1)
    gen = torch.Generator().manual_seed(0)
    x, y = ch10.get_batch(torch.arange(100), 5, 12, gen)
    assert x.shape == y.shape == (5, 12)
    assert torch.equal(x[:, 1:], x[:, :-1] + 1)  # windows of the data
    assert torch.equal(y, x + 1)


def test_train_decays_the_learning_rate_linearly_to_zero(monkeypatch):
    """The rate AdamW uses at step s of n is lr (1 - s / n)."""
    used = []

    class Recording(torch.optim.AdamW):
        def step(self, closure=None):
            used.append(self.param_groups[0]["lr"])
            return super().step(closure)

    monkeypatch.setattr(torch.optim, "AdamW", Recording)
    model = ch10.GPT(11, d=16, H=2, layers=1, d_ff=32)
    losses = ch10.train(model, torch.arange(100) % 11, 4, B=2, T=8, lr=0.01)
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)
    assert used == pytest.approx([0.01, 0.0075, 0.005, 0.0025], abs=1e-15)


def test_validation_loss_is_the_mean_over_characters():
    model = small_gpt()
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(11, (5, 6), generator=gen) for _ in range(2))
    with torch.no_grad():
        expected = F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    got = ch10.validation_loss(model, x, y, rows=2)  # 5 rows, 2 at a time
    assert got == pytest.approx(expected, rel=1e-12)


def test_gpt_context_and_final_layer_norm():
    model = ch10.GPT(11, d=16, H=2, layers=1, d_ff=32, context=8).eval()
    with torch.no_grad():
        assert model(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, 11)
        caches = model.new_caches()
        model(torch.zeros(1, 5, dtype=torch.long), caches)
        model(torch.zeros(1, 3, dtype=torch.long), caches)  # 8 in all
        with pytest.raises(ValueError, match="9 tokens exceed"):
            model(torch.zeros(1, 1, dtype=torch.long), caches)
        # the readout reads the final LayerNorm: with its gain and bias 0,
        # every position's logits are the readout's bias
        model.norm.weight.zero_(), model.norm.bias.zero_()
        logits = model(torch.tensor([[1, 2, 3]]))
    assert_close(logits, model.readout.bias.expand(1, 3, 11))


@pytest.mark.parametrize(
    "temperature, top_k", [(0.5, None), (2.0, None), (1.0, 3)]
)
def test_sampling_frequencies_follow_the_tempered_softmax(temperature, top_k):
    """Drawn 20000 times, each token's frequency is within 0.015 (over 4
    standard deviations) of softmax(logits / temperature), restricted to the
    top_k largest logits and renormalised."""
    logits = torch.tensor([0.1, 3.0, 2.0, -1.0, 2.5], dtype=torch.float64)
    p = (logits / temperature).softmax(-1)
    if top_k is not None:
        p[p.argsort(descending=True)[top_k:]] = 0
        p /= p.sum()
    gen = torch.Generator().manual_seed(0)
    draws = ch10.sample_next(
        logits.expand(20000, 5), temperature, top_k, generator=gen
    )
    assert draws.shape == (20000, 1)
    freq = torch.bincount(draws.flatten(), minlength=5).double() / 20000
    assert_close(freq, p, rtol=0, atol=0.015)
    assert torch.equal(freq == 0, p == 0)


def test_sampling_refuses_bad_settings():
    logits = torch.zeros(2, 5)
    for temperature in (-0.5, -1e-9, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            ch10.sample_next(logits, temperature)
    # temperatures the logits cannot be divided by: 5 / 1e-39 overflows
    # float32, 1e300 is infinite in float32, 1e-320 underflows it to 0
    big = torch.tensor([[5.0, 1.0]])
    for temperature in (1e-39, 1e300, 1e-320):
        message = re.escape(f"temperature {temperature} is out of range")
        with pytest.raises(ValueError, match=message):
            ch10.sample_next(big, temperature, top_k=1)
    with pytest.raises(ValueError, match="temperature 1e-300"):
        ch10.sample_next(big.double() * 1e10, 1e-300)
    with pytest.raises(ValueError, match=r"\(B, vocab\)"):
        ch10.sample_next(torch.zeros(5), 1.0)
    assert torch.equal(
        ch10.sample_next(torch.tensor([[0.0, 1.0], [2.0, 1.0]]), 0),
        torch.tensor([[1], [0]]),
    )


# temperatures m 10^e: every tenth e, and every e near float32's limits
# (1e-45, 3e38) and float64's largest (1.8e308)
TEMPERATURES = [
    m * 10.0**e
    for e in sorted({*range(-300, 301, 10), *range(-46, 40), *range(296, 309)})
    for m in (1.0, 3.7)
]


@pytest.mark.parametrize(
    "dtype, scale",
    [(torch.float32, 1), (torch.float32, 1e-6), (torch.float64, 1e-22)],
)
def test_top_1_is_greedy_at_every_temperature_accepted(dtype, scale):
    """Exercise 1: without ties, top_k=1 draws the largest logit at every
    temperature sample_next accepts, from 1e-300 to 1e308, for logits of
    any size; it refuses only those that are infinite in the logits' dtype
    or overflow the largest logit. (Were the logits divided before top-k, a
    huge temperature would round small logits into ties with the largest.)"""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(50, 11, generator=gen) * scale).to(dtype)
    assert len(logits.unique()) == logits.numel()  # no ties
    greedy = ch10.sample_next(logits, 0)
    limit = torch.finfo(dtype).max
    largest = logits.amax(dim=-1).abs().max().item()  # of any row
    for tau in TEMPERATURES:
        overflows = tau > limit or largest / tau > limit
        if overflows:
            with pytest.raises(ValueError, match="temperature"):
                ch10.sample_next(logits, tau, 1, generator=gen)
        else:
            drawn = ch10.sample_next(logits, tau, 1, generator=gen)
            assert torch.equal(drawn, greedy), tau


def test_top_k_keeps_ties_with_the_kth_logit():
    """Logits tied with the k-th largest survive top-k (as in nanoGPT), so
    top-1 on a tie draws among the tied tokens; greedy takes the first."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([[2.0, 2.0, 0.0, 2.0, 1.0]]).expand(600, 5)
    draws = ch10.sample_next(logits, 1.0, top_k=1, generator=gen).flatten()
    freq = torch.bincount(draws, minlength=5).double() / 600
    expected = torch.tensor([1, 1, 0, 1, 0], dtype=torch.float64) / 3
    assert_close(freq, expected, rtol=0, atol=0.1)
    assert set(draws.tolist()) == {0, 1, 3}
    assert ch10.sample_next(logits[:1], 0).item() == 0


def test_windows_are_positive_integers():
    for w in (True, 0, -1, 2.0, "3"):
        with pytest.raises(ValueError, match="window"):
            ch10.KVCache(w=w)
        with pytest.raises(ValueError, match="window"):
            ch10.SelfAttention(32, 4, causal=True, w=w)


def test_heads_and_window_are_checked():
    with pytest.raises(ValueError, match=r"H=8.*G=3"):
        ch10.SelfAttention(64, 8, 3)
    with pytest.raises(ValueError, match="causal"):
        ch10.SelfAttention(64, 8, 2, w=4)


@pytest.mark.parametrize("G, w", [(2, None), (1, 3), (4, 2)])
def test_kv_cache_of_one_block(G, w):
    """A decoder block fed 5, then 1, then 3 tokens through a KVCache gives
    the outputs of one call on all 9; the cache counts 9 tokens, keeps the
    keys and values of all (or, with a window, of the last w, in w slots)
    and its bytes are those of the keys plus the values."""
    torch.manual_seed(6)
    block = transformer.DecoderBlock(32, 4, 64, G=G, w=w).double().eval()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    cache = transformer.KVCache(w)
    assert_fed_in_parts_equals_one_call(block, x, cache)
    assert cache.length == 9
    kept = 9 if w is None else w
    assert cache.K.shape == cache.V.shape == (2, G, kept, 8)
    assert sorted(cache.pos.tolist()) == list(range(9 - kept, 9))
    assert cache.nbytes() == 2 * 2 * G * kept * 8 * 8
    assert transformer.KVCache(w).nbytes() == 0


class AnyLayerCache(transformer.KVCache):
    """A cache of w slots, empty ones at position -1, that accepts any layer
    (as a pre-allocated cache might): it lets a test put empty slots before
    a non-causal layer."""

    def check_layer(self, w, causal):
        pass


def test_allowed_positions_by_hand():
    """Position -1 (an empty slot) is never allowed, causal or not."""
    pos_q, pos_k = torch.tensor([5, 6]), torch.tensor([-1, 3, 6, -1, 5])
    expected = {
        (None, False): [[0, 1, 1, 0, 1], [0, 1, 1, 0, 1]],
        (None, True): [[0, 1, 0, 0, 1], [0, 1, 1, 0, 1]],
        (2, True): [[0, 0, 0, 0, 1], [0, 0, 1, 0, 1]],
    }
    for (w, causal), mask in expected.items():
        got = transformer.allowed_positions(pos_q, pos_k, w, causal)
        assert torch.equal(got, torch.tensor(mask, dtype=torch.bool))


@pytest.mark.parametrize("causal", [False, True])
def test_empty_cache_slots_are_never_attended(causal):
    """A layer fed 3, then 2 tokens through a cache of 8 slots gives the
    outputs it gives without a cache, and no weight to an empty slot."""
    torch.manual_seed(7)
    attn = transformer.SelfAttention(32, 4, causal=causal).double()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    cache = AnyLayerCache(8)
    with torch.no_grad():
        full, _ = attn(x)  # the second call's queries see all 5 tokens
        alone, _ = attn(x[:, :3])  # the first call's see the first 3
        first, w1 = attn(x[:, :3], cache=cache)
        second, w2 = attn(x[:, 3:], cache=cache)
    assert_close(first, alone, rtol=0, atol=1e-12)
    assert_close(second, full[:, 3:], rtol=0, atol=1e-12)
    assert (w1[..., :8] == 0).all()  # 8 empty slots, then the 3 tokens
    assert (w2[..., 3:8] == 0).all()  # slots 0-2 filled, 3-7 still empty


@pytest.mark.parametrize(
    "cache_w, layer_w, causal",
    [(4, None, False), (4, None, True), (4, 6, True), (1, 2, True)],
)
def test_a_cache_that_forgets_keys_the_layer_needs_is_refused(
    cache_w, layer_w, causal
):
    """A rolling cache keeps the last w tokens: a layer without a window,
    or with a longer one, refuses it, naming both windows."""
    attn = transformer.SelfAttention(32, 4, causal=causal, w=layer_w)
    cache = transformer.KVCache(cache_w)
    with pytest.raises(
        ValueError, match=rf"cache with window {cache_w}\b.*window {layer_w}\b"
    ):
        attn(torch.zeros(1, 2, 32), cache=cache)
    assert cache.length == 0 and cache.K is None  # refused before storing


def test_a_windowless_gpt_refuses_rolling_caches():
    """KVCache(4) in a windowless model would change its logits."""
    model = small_gpt()
    caches = [transformer.KVCache(4) for _ in model.blocks]
    with pytest.raises(ValueError, match=r"window 4\b.*window None"):
        model(torch.arange(6)[None], caches)


@pytest.mark.parametrize("cache_w", [None, 3, 5])
def test_a_cache_keeping_at_least_the_window_changes_nothing(cache_w):
    """A layer with window 3 and a cache with window 3, 5 or None (growing),
    fed 5, 1 and 3 tokens, gives the outputs of one call on all 9."""
    torch.manual_seed(8)
    block = transformer.DecoderBlock(32, 4, 64, G=2, w=3).double().eval()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    cache = transformer.KVCache(cache_w)
    assert_fed_in_parts_equals_one_call(block, x, cache)


def test_layers_ask_their_cache_with_their_window():
    """The check is the cache's (one interface for every kind of cache):
    each layer calls cache.check_layer(w, causal) before using the cache."""
    calls = []

    class Recording(transformer.KVCache):
        def check_layer(self, w, causal):
            calls.append((w, causal))
            super().check_layer(w, causal)

    model = small_gpt(w=3)
    with torch.no_grad():
        model(torch.arange(4)[None], [Recording(3) for _ in model.blocks])
    attn = transformer.SelfAttention(32, 4)
    with torch.no_grad():
        attn(torch.zeros(1, 2, 32), cache=Recording())
    assert calls == [(3, True), (3, True), (None, False)]


# --- the shared block, the cache, grouped-query attention and the window ----


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


def test_padding_before_a_causal_query_raises():
    """Padding at the front leaves the first query no key once the causal
    mask is applied: the block raises instead of returning a NaN row."""
    block = transformer.DecoderBlock(8, 2, 16)
    x = torch.randn(2, 3, 8)
    front = torch.tensor([[True, True, True], [False, True, True]])
    with pytest.raises(ValueError, match="no key"):
        block(x, padding_mask=front)
    assert not block(x, padding_mask=front.flip(-1)).isnan().any()


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


@pytest.mark.parametrize("G", [4, 2, 1])
def test_work_counts_the_multiply_adds(G):
    """Equation ch10-work equals half the FLOPs (one multiply-add is two)
    that PyTorch's FLOP counter sees in the matrix products of generate,
    with and without the cache."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(G)
    model = ch10.GPT(11, d=32, H=4, layers=3, d_ff=48, G=G).eval()
    sizes = {"L": 3, "d": 32, "G": G, "d_k": 8, "d_ff": 48, "vocab": 11}
    for cached in (False, True):
        with FlopCounterMode(display=False) as counter:
            ch10.generate(model, torch.arange(5), 7, cached=cached)
        flops = counter.get_total_flops()
        assert flops == 2 * ch10.work(7, 5, cached, **sizes)


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


# ------------------------------------------------ the printed source, last
# As in tests/test_ch06_positions.py: the chapter prints what it imports from
# book/gpt.py and book/transformer.py, and the stored output must be the
# module's current source. These fail on any edit of those functions until
# `make outputs`; they come last so that `make mutants` (pytest -x) names the
# behavioural test that catches a planted bug, not this one.

PRINTED = ("GPT", "get_batch", "train", "validation_loss")


def chapter_code_cells():
    """(source, outputs) of every code cell of chapter 10."""
    import json

    from conftest import BOOK

    cells = json.loads((BOOK / "10_inference.ipynb").read_text("utf-8"))
    return [
        ("".join(c["source"]), c.get("outputs", []))
        for c in cells["cells"]
        if c["cell_type"] == "code"
    ]


@pytest.mark.parametrize("name", [*PRINTED, "SelfAttention.forward"])
def test_chapter_prints_the_module_source(name):
    """Each piece is printed once, and the stored output is its source."""
    import inspect

    import gpt

    owner, _, attribute = name.partition(".")
    module = transformer if owner == "SelfAttention" else gpt
    obj = getattr(module, owner)
    obj = getattr(obj, attribute) if attribute else obj
    shown = [
        "".join(
            "".join(o["text"]) for o in outputs if o.get("name") == "stdout"
        )
        for code, outputs in chapter_code_cells()
        if f"inspect.getsource({name})" in code
    ]
    assert len(shown) == 1, name
    assert inspect.getsource(obj) in shown[0], f"{name}: output differs"


@pytest.mark.parametrize("name", PRINTED)
def test_chapter_uses_the_module_and_defines_none_again(name):
    import ast

    import gpt

    assert getattr(ch10, name) is getattr(gpt, name)
    for code, _ in chapter_code_cells():
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                assert node.name != name


def test_sampling_refuses_bad_top_k_and_nan_logits():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0, 2.5]])
    for bad in (2.5, True, False, "2"):
        with pytest.raises(ValueError, match="top_k must be an int"):
            ch10.sample_next(logits, 1.0, top_k=bad)
    nan = torch.tensor([[0.0, float("nan"), 1.0]])
    for temperature in (0, 1.0):
        with pytest.raises(ValueError, match="NaN"):
            ch10.sample_next(nan, temperature)


def test_generate_zero_and_negative_new_tokens():
    torch.manual_seed(0)
    model = ch10.GPT(11, d=16, H=2, layers=1, d_ff=32).eval()
    prompt = torch.arange(5)
    for cached in (False, True):
        tokens, logits = ch10.generate(model, prompt, 0, cached=cached)
        assert torch.equal(tokens, prompt)
        assert logits.shape == (0, 11)
        for bad in (-1, -3):
            with pytest.raises(ValueError, match="n_new must be >= 0"):
                ch10.generate(model, prompt, bad, cached=cached)


def test_generate_refuses_a_non_integer_count_and_an_empty_prompt():
    """n_new of 2.5, "3", None or True, and an empty prompt, are
    ValueErrors that name the problem, not a TypeError or IndexError."""
    torch.manual_seed(0)
    model = ch10.GPT(11, d=16, H=2, layers=1, d_ff=32).eval()
    for cached in (False, True):
        for bad in (2.5, "3", None, True):
            with pytest.raises(ValueError, match="n_new must be >= 0"):
                ch10.generate(model, torch.arange(5), bad, cached=cached)
        with pytest.raises(ValueError, match="empty"):
            ch10.generate(model, torch.arange(0), 3, cached=cached)


def test_sampling_refuses_a_temperature_that_is_not_a_real_number():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0, 2.5]])
    for bad in (None, "1", True, False, 1j):
        with pytest.raises(ValueError, match="temperature must be a real"):
            ch10.sample_next(logits, bad)
    assert ch10.sample_next(logits, 0).item() == 1  # ints are real numbers
