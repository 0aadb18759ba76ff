"""Chapter 11's static cache, fast decoder and batched decoding (book/gpt.py):
on small untrained GPTs and prompts the chapter never prints, each against
the plain model run over the whole sequence without a cache (the
independent reference): `StaticCache` gives the growing cache's logits
(float32 bit for bit); every option set of `Decoder` gives the plain
model's logits in float64; `greedy_batch` gives each row the tokens of its
prompt decoded alone; bad input raises a ValueError naming it."""

import itertools

import pytest
import torch
from torch.testing import assert_close

import gpt
from gpt import BatchCache, Decoder, StaticCache

VOCAB = 13


def small_gpt(G=None, w=None, seed=0, dtype=torch.float64, context=256):
    torch.manual_seed(seed)
    model = gpt.GPT(
        VOCAB, d=24, H=4, layers=2, d_ff=40, G=G, w=w, context=context
    )
    return model.to(dtype).eval()


def prompt(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(VOCAB, (n,), generator=gen)


@torch.no_grad()
def reference(model, tokens, n_new):
    """Greedy without any cache: the model over all tokens at every step."""
    tokens, logits = tokens.clone(), []
    for _ in range(n_new):
        last = model(tokens[None])[0, -1]
        logits.append(last)
        tokens = torch.cat([tokens, last.argmax()[None]])
    return tokens, torch.stack(logits)


@pytest.mark.parametrize("G", [4, 2, 1])
def test_static_cache_equals_growing_and_reference(G):
    model = small_gpt(G=G)
    x = prompt(7, seed=G)
    ref, ref_logits = reference(model, x, 30)
    with torch.no_grad():
        grown, grown_logits = gpt.greedy(model, x, 30, "growing")
        static, static_logits = gpt.greedy(model, x, 30, "static")
    assert torch.equal(static, ref) and torch.equal(grown, ref)
    assert_close(static_logits, ref_logits, rtol=0, atol=1e-12)
    assert_close(static_logits, grown_logits, rtol=0, atol=1e-12)


def test_static_cache_float32_bit_identical_to_growing():
    model = small_gpt(G=2, dtype=torch.float32)
    with torch.no_grad():
        _, grown = gpt.greedy(model, prompt(5, seed=3), 60, "growing")
        _, static = gpt.greedy(model, prompt(5, seed=3), 60, "static")
    assert torch.equal(grown, static)


def test_static_cache_in_chunks_and_crop():
    """Chunks of several tokens, a crop, then more: the plain model's
    logits for the last chunk."""
    model = small_gpt(G=2)
    x = prompt(30, seed=5)
    caches = [StaticCache(30) for _ in model.blocks]
    with torch.no_grad():
        model(x[None, :12], caches)
        model(x[None, 12:20], caches)
        for cache in caches:
            cache.crop(9)
        out = model(x[None, 9:30], caches)  # exactly fills the capacity
        assert_close(out, model(x[None])[:, 9:], rtol=0, atol=1e-12)
    assert caches[0].length == 30 == caches[0].capacity
    assert caches[0].nbytes() == 2 * 1 * 2 * 30 * 6 * 8  # B G slots d_k


@pytest.mark.parametrize(
    "G, w, options",
    [
        (G, w, dict(zip(("tables", "mask", "fused"), flags)))
        for G, w in ((4, None), (1, None), (2, 5))
        for flags in itertools.product((False, True), repeat=3)
        if G == 4 or len(set(flags)) == 1  # all on or all off
    ],
)
def test_decoder_equals_plain_model(G, w, options):
    model = small_gpt(G=G, w=w, seed=G)
    x = prompt(6, seed=7)
    ref, ref_logits = reference(model, x, 25)
    with torch.no_grad():
        out, logits = gpt.greedy(Decoder(model, 31, **options), x, 25)
    assert torch.equal(out, ref)
    assert_close(logits, ref_logits, rtol=0, atol=1e-12)


def test_larger_context_same_weights():
    """Rotary positions have no table: a GPT of another context loads the
    same state dict and gives the same logits."""
    small = small_gpt(context=16)
    large = small_gpt(seed=9, context=4096)
    large.load_state_dict(small.state_dict())  # strict: same names, shapes
    x = prompt(16, seed=2)[None]
    with torch.no_grad():
        assert torch.equal(small(x), large(x))


@pytest.mark.parametrize("G, seed", [(4, 0), (2, 1), (1, 2)])
def test_batch_rows_equal_prompts_alone(G, seed):
    model = small_gpt(G=G, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 16, (4,), generator=gen).tolist()
    prompts = [prompt(n, seed=seed + 10 * i) for i, n in enumerate(lengths)]
    with torch.no_grad():
        outs, logits = gpt.greedy_batch(Decoder(model, 40), prompts, 20)
    assert logits.shape == (4, 20, VOCAB)
    for p, out, row in zip(prompts, outs, logits):
        ref, ref_logits = reference(model, p, 20)
        assert torch.equal(out, ref)
        assert_close(row, ref_logits, rtol=0, atol=1e-12)


def test_batch_cache_positions_per_row():
    cache = BatchCache(10, 3)
    K = torch.randn(3, 2, 4, 5)
    cache.update(K, K)
    cache.crop_rows(torch.tensor([4, 1, 2]))
    assert cache.pos[:, :4].tolist() == [
        [0, 1, 2, 3],
        [0, -1, -1, -1],
        [0, 1, -1, -1],
    ]
    assert cache.next_positions(2).tolist() == [[4, 5], [1, 2], [2, 3]]
    keys, _, pos = cache.update(K[:, :, :1], K[:, :, :1])
    assert pos.tolist() == [
        [0, 1, 2, 3, 4],
        [0, 1, -1, -1, -1],
        [0, 1, 2, -1, -1],
    ]
    assert torch.equal(keys[1, :, 1], K[1, :, 0])  # row 1's new token, slot 1
    assert torch.equal(keys[0, :, 3], K[0, :, 3])  # row 0 kept slot 3


def test_errors_name_the_problem():
    model = small_gpt()
    decoder = Decoder(model, 20)
    with pytest.raises(ValueError, match="prompt 1 of the batch is empty"):
        gpt.greedy_batch(decoder, [prompt(3), prompt(0)], 4)
    with pytest.raises(ValueError, match="no prompt"):
        gpt.greedy_batch(decoder, [], 4)
    with pytest.raises(ValueError, match="the prompt is empty"):
        gpt.greedy(model, prompt(0), 4)
    with pytest.raises(ValueError, match="n_new"):
        gpt.greedy(model, prompt(3), 0)
    with pytest.raises(ValueError, match="exceed the capacity of 20"):
        gpt.greedy(decoder, prompt(3), 19)  # feeds 21
    with pytest.raises(ValueError, match="exceeds the model's context"):
        Decoder(model, 257)
    with pytest.raises(ValueError, match="capacity"):
        StaticCache(0)
    with pytest.raises(ValueError, match="caches must be"):
        gpt.greedy(model, prompt(3), 2, "rolling")
    cache = StaticCache(8)
    with pytest.raises(ValueError, match="seen only 0"):
        cache.crop(1)
    for bad in (torch.zeros(2, 1, 4), [1.0]):  # not (B, G, T, d_k)
        with pytest.raises(ValueError, match=r"K must be \(B, G, T, d_k\)"):
            StaticCache(8).update(bad, bad)
    with pytest.raises(ValueError, match="one shape, dtype and device"):
        StaticCache(8).update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 2, 4))
    cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    for K in (  # another batch, key size or dtype than the cache's buffers
        torch.zeros(2, 2, 1, 4),
        torch.zeros(1, 2, 1, 5),
        torch.zeros(1, 2, 1, 4, dtype=torch.float64),
    ):
        with pytest.raises(ValueError, match="a cache serves one layer"):
            cache.update(K, K)
    with pytest.raises(ValueError, match="9 tokens exceed the capacity of 8"):
        cache.update(torch.zeros(1, 2, 6, 4), torch.zeros(1, 2, 6, 4))
    batch = BatchCache(8, 2)
    with pytest.raises(ValueError, match="cannot crop rows"):
        batch.crop_rows(torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="has 2 rows"):
        batch.update(torch.zeros(3, 1, 1, 2), torch.zeros(3, 1, 1, 2))
