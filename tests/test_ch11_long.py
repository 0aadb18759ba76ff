"""Chapter 11, past the training length and an 8-bit cache: book/caches.py
against independent references, on sizes and prompts the chapter never
prints (a random float64 GPT with G = 2 key/value heads)."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import caches
from gpt import GPT
from transformer import KVCache, SelfAttention, rotary

VOCAB, T, S, W = 11, 40, 3, 7


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(5)
    net = GPT(VOCAB, d=16, H=4, layers=2, d_ff=32, G=2).double().eval()
    return net.requires_grad_(False)


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(
        VOCAB, (2, T), generator=torch.Generator().manual_seed(3)
    )


def reference(model, tokens, s, w, in_cache):
    """Logits (T, vocab) of one row, every query computed on its own: it
    sees the keys 0..s-1 and i-w < j <= i, rotated at their positions in the
    text, or (in_cache) at their places in the list of kept keys."""
    x = model.embed(tokens)  # (T, d)
    for block in model.blocks:
        attn = block.self_attn
        Q, K, V = SelfAttention.heads(attn, block.norm1(x)[None])  # unrotated
        K = K.repeat_interleave(attn.H // attn.G, dim=1)[0]  # (H, T, d_k)
        V = V.repeat_interleave(attn.H // attn.G, dim=1)[0]
        rows = []
        for i in range(len(tokens)):
            kept = sorted(
                set(range(min(s, i + 1)))
                | set(range(max(0, i - w + 1), i + 1))
            )
            pos = torch.arange(len(kept)) if in_cache else torch.tensor(kept)
            q = rotary(Q[0][:, [i]], pos[-1:])  # (H, 1, d_k)
            k = rotary(K[:, kept], pos)
            weights = (q @ k.transpose(-2, -1) / math.sqrt(attn.d_k)).softmax(
                -1
            )
            rows.append((weights @ V[:, kept])[:, 0].reshape(-1))  # (d,)
        y = x + attn.out_proj(torch.stack(rows))
        x = y + block.linear2(F.relu(block.linear1(block.norm2(y))))
    return model.readout(model.norm(x))


@pytest.mark.parametrize("scheme", ["cache", "absolute"])
@pytest.mark.parametrize("s", [0, 1, S])
def test_sink_cache_equals_reference(model, tokens, scheme, s):
    made = [caches.SinkCache(s, W, scheme) for _ in model.blocks]
    logits = caches.stepwise_logits(model, tokens, made)
    for row in range(len(tokens)):
        expected = reference(model, tokens[row], s, W, scheme == "cache")
        torch.testing.assert_close(logits[row], expected, rtol=0, atol=1e-10)


def test_sink_schemes_differ_only_past_capacity(model, tokens):
    a, b = (
        caches.stepwise_logits(
            model,
            tokens,
            [caches.SinkCache(S, W, scheme) for _ in model.blocks],
        )
        for scheme in ("cache", "absolute")
    )
    torch.testing.assert_close(
        a[:, : S + W], b[:, : S + W], rtol=0, atol=1e-12
    )
    assert (a[:, S + W :] - b[:, S + W :]).abs().amax() > 1e-3


def test_no_sinks_is_the_rolling_cache(model, tokens):
    windowed = GPT(VOCAB, d=16, H=4, layers=2, d_ff=32, G=2, w=W).double()
    windowed.load_state_dict(model.state_dict())
    with torch.no_grad():
        full = windowed(tokens)  # the band mask, one pass
    rolling = caches.stepwise_logits(windowed, tokens, windowed.new_caches())
    sinks = caches.stepwise_logits(
        model, tokens, [caches.SinkCache(0, W) for _ in model.blocks]
    )
    torch.testing.assert_close(sinks, rolling, rtol=0, atol=1e-12)
    torch.testing.assert_close(sinks, full, rtol=0, atol=1e-10)


def test_sink_cache_prefill_within_capacity(model, tokens):
    made = [caches.SinkCache(S, W) for _ in model.blocks]
    with torch.no_grad():
        first = model(tokens[:, : S + W], made)  # one call, no eviction yet
        full = model(tokens[:, : S + W])
    torch.testing.assert_close(first, full, rtol=0, atol=1e-12)
    assert made[0].nbytes() == 2 * 2 * 2 * (S + W) * 4 * 8  # B G slots d_k f64
    with pytest.raises(ValueError, match="one token per call"):
        model(tokens[:, S + W : S + W + 2], made)


def test_sink_cache_crop(model, tokens):
    made = [caches.SinkCache(S, W) for _ in model.blocks]
    caches.stepwise_logits(model, tokens[:, :20], made)
    with pytest.raises(ValueError, match="overwritten"):
        made[0].crop(15)
    kept = [caches.SinkCache(S, W) for _ in model.blocks]
    before = caches.stepwise_logits(model, tokens[:, :20], kept)
    for cache in kept:
        cache.crop(19)  # drop the last token, then feed it again
    again = caches.stepwise_logits(model, tokens[:, 19:20], kept)
    torch.testing.assert_close(again[:, 0], before[:, -1], rtol=0, atol=1e-12)


def test_sink_cache_bad_input(model):
    for args, word in (
        ((-1, 4), "sinks"),
        ((1, 0), "window"),
        ((1, 4, "text"), "scheme"),
    ):
        with pytest.raises(ValueError, match=word):
            caches.SinkCache(*args)
    with pytest.raises(ValueError, match="without a window"):
        caches.SinkCache(1, 4).check_layer(4, True)
    with pytest.raises(ValueError, match="causal"):
        caches.SinkCache(1, 4).check_layer(None, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dim", [-1, -2])
def test_quantize_error_bound(dtype, dim):
    gen = torch.Generator().manual_seed(11)
    x = (
        torch.randn(3, 5, 9, 6, generator=gen)
        * torch.rand(6, generator=gen)
        * 40
    ).to(dtype)
    codes, scale = caches.quantize(x, dim)
    assert codes.dtype == torch.int8 and scale.shape[dim] == 1
    expected = np.abs(x.numpy()).max(axis=dim, keepdims=True) / 127
    np.testing.assert_allclose(scale.numpy(), expected, rtol=1e-6)
    error = (x - caches.dequantize(codes, scale)).abs()
    eps = torch.finfo(dtype).eps * x.abs().amax()
    assert (error <= scale / 2 + eps).all()
    assert codes.abs().amax(dim=dim).eq(127).all()  # the absmax uses 127


def test_quantize_zero_row_and_given_scale():
    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5]])
    codes, scale = caches.quantize(x, dim=-1)
    assert torch.equal(caches.dequantize(codes, scale)[0], x[0])
    assert scale[0].item() == 1 and codes[0].eq(0).all()  # not 0 / 0
    for bad in (0.0, -1.0, torch.tensor([[1.0], [0.0]])):
        with pytest.raises(ValueError, match="scale must be > 0"):
            caches.quantize(x, -1, scale=bad)
    with pytest.raises(ValueError, match=r"beyond 127\.5 scales"):
        caches.quantize(x, -1, scale=0.01)
    codes, _ = caches.quantize(x, -1, scale=0.5)
    assert codes[1].tolist() == [2, -4, 1]


def per_token_reference(x):
    """Each vector of the last axis rounded to 255 levels of its absmax."""
    a = x.numpy()
    scale = np.abs(a).max(axis=-1, keepdims=True) / 127
    scale[scale == 0] = 1
    return np.round(a / scale) * scale


def test_int8_cache_per_token(model):
    gen = torch.Generator().manual_seed(2)
    K, V = (
        torch.randn(2, 3, 13, 8, generator=gen, dtype=torch.float64)
        for _ in "KV"
    )
    cache = caches.Int8Cache("token")
    for a, b in ((0, 5), (5, 6), (6, 13)):  # calls of 5, 1 and 7 tokens
        keys, values, pos = cache.update(K[..., a:b, :], V[..., a:b, :])
    np.testing.assert_allclose(
        keys.numpy(), per_token_reference(K), rtol=0, atol=1e-12
    )
    np.testing.assert_allclose(
        values.numpy(), per_token_reference(V), rtol=0, atol=1e-12
    )
    assert pos.tolist() == list(range(13)) and cache.length == 13
    assert cache.nbytes() == 2 * 3 * 13 * (2 * 8 + 2 * 8)  # codes + f64 scales
    cache.crop(4)
    keys, _, _ = cache.update(K[..., 4:6, :], V[..., 4:6, :])
    np.testing.assert_allclose(
        keys.numpy(), per_token_reference(K[..., :6, :]), atol=1e-12
    )


def test_int8_cache_per_channel():
    gen = torch.Generator().manual_seed(4)
    K = torch.randn(1, 2, 23, 6, generator=gen) * torch.tensor(
        [1, 30, 1, 1, 5, 1.0]
    )
    cache = caches.Int8Cache("channel", group=8)
    for t in range(23):  # one token per call: groups of 8 fill up
        keys, _, _ = cache.update(K[..., [t], :], K[..., [t], :])
    for g in range(2):  # two full groups, one scale per channel each
        block = K[..., 8 * g : 8 * g + 8, :]
        scale = block.abs().amax(dim=-2, keepdim=True) / 127
        assert (
            (keys[..., 8 * g : 8 * g + 8, :] - block)
            .abs()
            .le(scale / 2 + 1e-6)
            .all()
        )
    assert torch.equal(keys[..., 16:, :], K[..., 16:, :])  # the rest: exact
    # per head: key codes 16 x 6, value codes 23 x 6, value scales 23 x 4
    # bytes, key scales 2 groups x 6 x 4, the rest 7 x 6 x 4 (float32)
    assert cache.nbytes() == 2 * (
        16 * 6 + 23 * 6 + 23 * 4 + 2 * 6 * 4 + 7 * 6 * 4
    )
    with pytest.raises(ValueError, match="cannot crop to 12 tokens"):
        cache.crop(12)  # into the second group, quantised with 12..15
    cache.crop(20)  # into the unquantised rest
    assert cache.parts["K_rest"].shape[-2] == 4
    cache.crop(8)  # between groups: the second group and the rest go
    again, _, _ = cache.update(K[..., 8:16, :], K[..., 8:16, :])
    torch.testing.assert_close(again, keys[..., :16, :], rtol=0, atol=0)
    assert (
        cache.parts["K"].shape[-2] == 16
        and cache.parts["K_rest"].shape[-2] == 0
    )


def fed(cache, K, V, calls):
    """Feed K, V (B, G, T, d_k) to cache in calls of the given sizes; the
    keys and values of the last call."""
    start = 0
    for size in calls:
        out = cache.update(
            K[..., start : start + size, :], V[..., start : start + size, :]
        )
        start += size
    return out


@pytest.mark.parametrize("keys", ["token", "channel"])
def test_int8_crop_then_continue_as_if_never_seen(keys):
    """Tokens dropped by crop leave no trace: crop-then-continue gives what a
    cache that never saw them gives, or crop refuses (keys="channel", a cut
    into a quantised group)."""
    gen = torch.Generator().manual_seed(8)
    K, V, dropped = (
        torch.randn(2, 3, 30, 6, generator=gen, dtype=torch.float64)
        * torch.tensor([1, 40, 1, 1, 7, 1.0], dtype=torch.float64)
        for _ in range(3)
    )
    group, refused, cut, kinds = 4, [], [], set()
    for n in range(1, 18):
        for d in (1, 3, 6):  # d tokens dropped, fed with the n kept or after
            whole = (n + d) // group * group  # keys in quantised groups
            if n < whole and n % group:
                cut.append((n, d))
            kinds.add(
                "rest" if n >= whole else "cut" if n % group else "between"
            )
            for calls in ([n + d], [n, d]):
                seen = caches.Int8Cache(keys, group=group)
                fed(
                    seen,
                    torch.cat([K[..., :n, :], dropped[..., :d, :]], dim=-2),
                    torch.cat([V[..., :n, :], dropped[..., :d, :]], dim=-2),
                    calls,
                )
                try:
                    seen.crop(n)
                except ValueError:
                    refused.append((n, d))
                    continue
                never = caches.Int8Cache(keys, group=group)
                fed(never, K, V, [n])
                rest = [1, 12, 30 - n - 13]  # then the same calls to both
                a = fed(seen, K[..., n:, :], V[..., n:, :], rest)
                b = fed(never, K[..., n:, :], V[..., n:, :], rest)
                for x, y in zip(a, b, strict=True):
                    torch.testing.assert_close(x, y, rtol=0, atol=0)
                assert seen.nbytes() == never.nbytes()
    assert kinds == {"rest", "between", "cut"}
    assert refused == (
        [] if keys == "token" else [c for c in cut for _ in "ab"]
    )


def test_int8_crop_in_the_model_as_if_never_seen(model, tokens):
    """The same in the model: a verification call's rejected tokens leave
    no trace in the next logits (group 4, a crop into the rest)."""
    made = [caches.Int8Cache("channel", group=4) for _ in model.blocks]
    never = [caches.Int8Cache("channel", group=4) for _ in model.blocks]
    with torch.no_grad():
        model(tokens[:, :13], made)  # 3 groups and 1 key of the rest
        model(tokens.flip(1)[:, :2], made)  # 2 tokens to reject
        for cache in made:
            cache.crop(13)
        model(tokens[:, :13], never)
        a, b = model(tokens[:, 13:20], made), model(tokens[:, 13:20], never)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_int8_cache_in_the_model_is_close(model, tokens):
    for keys in ("token", "channel"):
        made = [caches.Int8Cache(keys, group=4) for _ in model.blocks]
        logits = caches.stepwise_logits(model, tokens, made)
        exact = caches.stepwise_logits(
            model, tokens, [KVCache() for _ in model.blocks]
        )
        gap = (logits - exact).abs().amax()
        assert 0 < gap < 0.05


def test_int8_and_helpers_bad_input(model, tokens):
    with pytest.raises(ValueError, match="keys must be"):
        caches.Int8Cache("row")
    with pytest.raises(ValueError, match="group size"):
        caches.Int8Cache("channel", group=0)
    with pytest.raises(ValueError, match="one per block"):
        caches.stepwise_logits(model, tokens, [KVCache()])
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        caches.stepwise_logits(model, tokens[0], model.new_caches())
    with pytest.raises(ValueError, match="do not match"):
        caches.position_losses(torch.zeros(2, 5, VOCAB), tokens[:, :4])


def test_position_losses(tokens):
    logits = torch.randn(
        2, T, VOCAB, generator=torch.Generator().manual_seed(0)
    )
    per = caches.position_losses(logits, tokens)
    expected = F.cross_entropy(
        logits.double().transpose(1, 2), tokens, reduction="none"
    ).mean(0)
    torch.testing.assert_close(per, expected, rtol=0, atol=1e-12)


def test_quantize_bad_input():
    x = torch.randn(3, 4, dtype=torch.float64)
    for bad, word in (
        ([[1.0, 2.0]], "floating-point tensor"),
        (torch.ones(3, 4, dtype=torch.long), "floating-point tensor"),
        (torch.zeros(3, 0), "empty along dim"),
        (torch.tensor([[1.0, float("nan")]]), "NaN or infinite"),
        (torch.tensor([[1.0, float("inf")]]), "NaN or infinite"),
    ):
        with pytest.raises(ValueError, match=word):
            caches.quantize(bad, dim=-1)
    for dim in (2, -3, 1.0):
        with pytest.raises(ValueError, match="dim"):
            caches.quantize(x, dim)
    with pytest.raises(ValueError, match="does not broadcast"):
        caches.quantize(x, -1, scale=torch.ones(2, 1))
    codes, scale = caches.quantize(x, -1)
    for bad_codes, bad_scale, word in (
        (codes.float(), scale, "int8 tensor"),
        (codes, scale.long(), "floating-point tensor"),
        (codes, scale[:2], "does not broadcast"),
    ):
        with pytest.raises(ValueError, match=word):
            caches.dequantize(bad_codes, bad_scale)


def test_quantize_refuses_a_scale_that_is_not_finite():
    """An infinite scale codes every value as 0 and dequantizes to 0 * inf,
    NaN; a NaN scale gives NaN: a ValueError naming the scale (issue 47)."""
    x = torch.randn(3, 4, dtype=torch.float64)
    codes, _ = caches.quantize(x, -1)
    for bad in (float("inf"), float("nan")):
        with pytest.raises(
            ValueError, match="the scale holds NaN or infinite"
        ):
            caches.quantize(x, -1, scale=bad)
        scale = torch.full((3, 1), bad, dtype=torch.float64)
        with pytest.raises(
            ValueError, match="the scale holds NaN or infinite"
        ):
            caches.dequantize(codes, scale)


def keys_and_values(B=2, G=3, T=5, d_k=4, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    return tuple(
        torch.randn(B, G, T, d_k, generator=gen, dtype=dtype) for _ in "KV"
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: caches.SinkCache(2, 8),
        lambda: caches.Int8Cache("token"),
        lambda: caches.Int8Cache("channel", group=2),
    ],
    ids=["sink", "int8-token", "int8-channel"],
)
def test_caches_bad_keys(make):
    K, V = keys_and_values()
    for args, word in (
        ((K, V.double()), "mixed dtypes"),
        ((K, V[..., :4, :]), "does not match K"),
        ((K[0], V[0]), r"\(B, G, T, d_k\)"),
        ((K.long(), V), "floating-point tensor"),
        ((K[..., :0], V[..., :0]), "empty batch, head or key axis"),
    ):
        with pytest.raises(ValueError, match=word):
            make().update(*args)
    cache = make()
    cache.update(K, V)
    for args, word in (
        ((K[:1], V[:1]), "batch, heads and key size"),  # another batch
        ((K[:, :2], V[:, :2]), "batch, heads and key size"),
        ((K[..., :2], V[..., :2]), "batch, heads and key size"),
        ((K.double(), V.double()), "holds torch.float32 keys"),
    ):
        with pytest.raises(ValueError, match=word):
            cache.update(*[x[..., :1, :] for x in args])
    assert cache.length == 5  # nothing stored by the refused calls
    keys, _, pos = cache.update(K[..., :0, :], V[..., :0, :])  # T = 0
    held = pos >= 0  # a sink cache returns its empty slots too
    assert cache.length == 5 and held.sum() == 5
    torch.testing.assert_close(keys[..., held, :], K, atol=0.05, rtol=0)


def test_sink_slots_and_int8_order_bad_input():
    cache = caches.SinkCache(2, 4)
    with pytest.raises(ValueError, match="integer tensor"):
        cache.slots(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=">= 0"):
        cache.slots(torch.tensor([3, -1]))
    assert cache.slots(torch.tensor([0, 1, 2, 5, 6])).tolist() == [
        0,
        1,
        2,
        5,
        2,
    ]
    fresh = caches.Int8Cache("channel")
    for read in (fresh.read_keys, fresh.read_values):
        with pytest.raises(ValueError, match="call update"):
            read()
    with pytest.raises(ValueError, match=r"\(B, G, T, d_k\)"):
        fresh.empty(torch.zeros(3, 4))


def test_stepwise_logits_and_losses_bad_input(model, tokens):
    for x, word in (
        (tokens.double(), "integer token ids"),
        (tokens.clamp(max=VOCAB - 2) + 1 - 2 * (tokens == 0), "token -1"),
        (torch.where(tokens == 3, VOCAB, tokens), f"token {VOCAB},"),
        (tokens[:0], "B >= 1"),
    ):
        with pytest.raises(ValueError, match=word):
            caches.stepwise_logits(model, x, model.new_caches())
    empty = caches.stepwise_logits(model, tokens[:, :0], model.new_caches())
    assert empty.shape == (2, 0, VOCAB) and empty.dtype == torch.float64
    logits = torch.zeros(2, 5, VOCAB, dtype=torch.float64)
    y = tokens[:, :5]
    for args, word in (
        ((logits, y.clamp(max=0) + VOCAB), f"token {VOCAB}, outside"),
        ((logits, y - VOCAB), "outside the vocabulary"),
        ((logits, y.double()), "integer token ids"),
        ((logits.long(), y), "floating-point tensor"),
        ((logits[0], y), r"\(B, T, vocab\)"),
        ((logits[:0], y[:0]), "B, vocab >= 1"),
        ((logits.index_fill(-1, torch.tensor([0]), float("inf")), y), "NaN"),
        ((logits * float("nan"), y), "NaN or infinite"),
    ):
        with pytest.raises(ValueError, match=word):
            caches.position_losses(*args)
    assert caches.position_losses(logits[:, :0], y[:, :0]).shape == (0,)
