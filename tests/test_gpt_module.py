"""The book's GPT module (book/gpt.py) and the cache interface of
book/transformer.py (`Cache`, implemented by `KVCache`): the stored weights
load into the module's GPT; `crop(n)` leaves the cache a cache built from
scratch on the first n tokens would be, for the keys, values and positions
a query may need and for the model's logits; crop refuses what it cannot
do; `nbytes()` and `capacity` count what the tensors hold; positions per
batch row give each row its own mask."""

import warnings

import pytest
import torch
from conftest import BOOK
from torch.testing import assert_close

import gpt
import transformer
from transformer import Cache, KVCache

VOCAB = 11


def small_gpt(G=None, w=None, seed=0):
    """An untrained float64 GPT of the module (vocab 11)."""
    torch.manual_seed(seed)
    model = gpt.GPT(VOCAB, d=32, H=4, layers=2, d_ff=64, G=G, w=w)
    return model.double().eval()


def tokens(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(VOCAB, (2, n), generator=gen)  # two rows


def fed(model, x, chunks, caches):
    """Feed x (B, T) through the caches in calls of the given lengths."""
    start = 0
    with torch.no_grad():
        for size in chunks:
            model(x[:, start : start + size], caches)
            start += size
    assert start == x.shape[1]
    return caches


def kept(cache):
    """{position: (keys, values)} of the slots a cache holds, each
    (B, G, d_k); empty slots (position -1) left out."""
    return {
        p: (cache.K[..., s, :], cache.V[..., s, :])
        for s, p in enumerate(cache.pos.tolist())
        if p >= 0
    }


# --- the module -------------------------------------------------------------


@pytest.mark.parametrize("G", [4, 1])
def test_stored_weights_load_into_the_module_gpt(G):
    """data/gpt_G4.pt and gpt_G1.pt (state dicts) load with strict names."""
    model = gpt.GPT(65, d=64, H=4, layers=2, d_ff=256, G=G)
    state = torch.load(BOOK / "data" / f"gpt_G{G}.pt")
    assert model.load_state_dict(state) is not None  # strict: names match
    assert set(state) == set(model.state_dict())


def test_new_caches_implement_the_interface():
    for w, capacity in ((None, None), (3, 3)):
        caches = small_gpt(w=w).new_caches()
        assert len(caches) == 2
        assert all(isinstance(c, Cache) for c in caches)
        assert all(c.capacity == capacity and c.length == 0 for c in caches)


# --- the interface ----------------------------------------------------------


def test_the_interface_is_abstract():
    """A cache that leaves out a method of the interface cannot be built."""
    assert Cache.__abstractmethods__ == {
        "check_layer",
        "update",
        "nbytes",
        "crop",
    }
    with pytest.raises(TypeError):
        Cache()

    class NoCrop(Cache):
        def check_layer(self, w, causal):
            pass

        def update(self, K, V):
            return K, V, self.next_positions(K.shape[-2])

        def nbytes(self):
            return 0

    with pytest.raises(TypeError, match="crop"):
        NoCrop()


def test_next_positions_follow_the_length():
    cache = KVCache()
    assert torch.equal(cache.next_positions(3), torch.arange(3))
    cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    assert torch.equal(cache.next_positions(2), torch.tensor([3, 4]))


@pytest.mark.parametrize(
    "w, spare, capacity", [(None, 0, None), (4, 0, 4), (4, 3, 7), (1, 2, 3)]
)
def test_capacity_and_nbytes(w, spare, capacity):
    """capacity: None for the growing cache, else w + spare slots, all
    allocated at the first update; nbytes: the keys' and values' elements
    times their size, before and after a crop."""
    cache = KVCache(w, spare)
    assert cache.capacity == capacity and cache.nbytes() == 0
    K = torch.randn(2, 3, 10, 8, dtype=torch.float64)
    V = torch.randn(2, 3, 10, 8, dtype=torch.float64)
    for a, b in ((0, 6), (6, 7), (7, 10)):
        cache.update(K[..., a:b, :], V[..., a:b, :])
        slots = b if capacity is None else capacity
        assert cache.K.shape == cache.V.shape == (2, 3, slots, 8)
        expected = cache.K.nelement() * cache.K.element_size() * 2
        assert cache.nbytes() == expected == 2 * 2 * 3 * slots * 8 * 8
    n = 10 - spare if w is not None else 4
    cache.crop(n)
    slots = n if capacity is None else capacity
    assert cache.nbytes() == 2 * 2 * 3 * slots * 8 * 8
    assert cache.nbytes() == cache.V.nelement() * cache.V.element_size() * 2


def test_bad_spare_slots():
    for spare in (-1, 1.0, True, "2"):
        with pytest.raises(ValueError, match="spare"):
            KVCache(4, spare)
    with pytest.raises(ValueError, match="spare slots need a window"):
        KVCache(None, 2)


# --- crop against a cache built from scratch --------------------------------


@pytest.mark.parametrize(
    "G, w, spare, m, n, chunks",
    [
        (None, None, 0, 12, 7, (5, 1, 6)),
        (2, None, 0, 12, 12, (12,)),
        (1, None, 0, 9, 0, (4, 5)),
        (2, 3, 2, 12, 10, (5, 1, 6)),  # rolling, cropped back 2 = spare
        (4, 3, 4, 12, 9, (12,)),  # one long call, then back 3 of 4
        (2, 4, 0, 4, 1, (2, 2)),  # not yet wrapped: any n
        (2, 3, 0, 12, 12, (3, 9)),  # no spare: crop to length only
    ],
)
def test_crop_equals_a_cache_of_the_first_n_tokens(G, w, spare, m, n, chunks):
    """Feed m tokens, crop to n: each layer's cache holds what a cache fed
    the first n tokens holds (every slot of a growing cache; for a rolling
    one the last w before n, the keys any later query may see), keys and
    values equal within rounding, and the model then gives the logits of
    that cache and of the model without a cache, for 5 more tokens."""
    model = small_gpt(G, w)
    x = tokens(m + 5)
    new = lambda: [KVCache(w, spare) for _ in model.blocks]  # noqa: E731
    cropped = fed(model, x[:, :m], chunks, new())
    for cache in cropped:
        cache.crop(n)
    scratch = fed(model, x[:, :n], (n,) if n else (), new())
    for ours, ref in zip(cropped, scratch):
        assert ours.length == ref.length == n
        if n == 0:  # nothing fed to the reference: it holds no tensors
            assert ref.K is None and ours.nbytes() == 0
            continue
        if w is None:
            assert torch.equal(ours.pos, torch.arange(n))
            assert_close(ours.K, ref.K, rtol=0, atol=1e-12)
            assert_close(ours.V, ref.V, rtol=0, atol=1e-12)
            continue
        held, expected = kept(ours), kept(ref)
        assert set(held) <= set(range(n))  # nothing at or after n
        needed = range(max(0, n - w), n)
        assert set(needed) <= set(held) and set(needed) <= set(expected)
        for p in needed:
            assert_close(held[p], expected[p], rtol=0, atol=1e-12)
    with torch.no_grad():
        logits = model(x[:, n : n + 5], cropped)
        reference = model(x[:, n : n + 5], scratch)
        plain = model(x[:, : n + 5])[:, n:]
    assert_close(logits, reference, rtol=0, atol=1e-12)
    assert_close(logits, plain, rtol=0, atol=1e-12)
    assert all(c.length == n + 5 for c in cropped)


def test_greedy_text_with_a_crop_in_the_middle():
    """A speculative decoder's pattern: feed 4 wrong tokens, crop them off,
    go on with the right one; the greedy text is that of the model without
    a cache, for a growing and for a rolling cache with 4 spare slots."""
    for w, spare in ((None, 0), (3, 4)):
        model = small_gpt(G=2, w=w)
        plain, _ = generate_plain(model, torch.tensor([1, 2, 3]), 20)
        caches = [KVCache(w, spare) for _ in model.blocks]
        out = [1, 2, 3]
        with torch.no_grad():
            logits = model(torch.tensor([out]), caches)[:, -1]
            for _ in range(20):
                token = int(logits.argmax())
                n = caches[0].length
                model(torch.tensor([[5, 6, 7, 8]]), caches)  # rejected
                for cache in caches:
                    cache.crop(n)
                out.append(token)
                logits = model(torch.tensor([[token]]), caches)[:, -1]
        assert out == plain.tolist()


def generate_plain(model, prompt, n_new):
    """Greedy decoding without a cache (an independent reference)."""
    x = prompt[None]
    with torch.no_grad():
        for _ in range(n_new):
            nxt = model(x)[:, -1].argmax(-1, keepdim=True)
            x = torch.cat([x, nxt], dim=1)
    return x[0], None


# --- crop refuses what it cannot do -----------------------------------------


@pytest.mark.parametrize("w", [None, 3])
def test_crop_beyond_the_length_or_below_zero_raises(w):
    cache = KVCache(w)
    cache.update(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))
    with pytest.raises(ValueError, match=r"cannot crop to 3 tokens.*only 2"):
        cache.crop(3)
    for n in (-1, 1.0, True, None):
        with pytest.raises(ValueError, match="integer n >= 0"):
            cache.crop(n)
    assert cache.length == 2  # unchanged by a refused crop
    with pytest.raises(ValueError, match="only 0"):
        KVCache(w).crop(1)
    KVCache(w).crop(0)  # an empty cache crops to 0


@pytest.mark.parametrize("w, spare", [(3, 0), (3, 2), (1, 1), (4, 5)])
def test_crop_into_overwritten_slots_raises(w, spare):
    """A rolling cache of w + spare slots that has seen L tokens can crop to
    L - spare or more, not less: the w tokens before a lower n are gone."""
    L = 3 * (w + spare) + 2
    cache = KVCache(w, spare)
    cache.update(torch.zeros(1, 1, L, 4), torch.zeros(1, 1, L, 4))
    with pytest.raises(
        ValueError,
        match=rf"cannot crop to {L - spare - 1} tokens: this rolling cache "
        rf"of {w + spare} slots for window {w} has overwritten tokens.*"
        rf"crop to {L - spare} or more",
    ):
        cache.crop(L - spare - 1)
    assert cache.length == L
    cache.crop(L - spare)
    assert cache.length == L - spare
    assert sorted(p for p in cache.pos.tolist() if p >= 0) == list(
        range(L - w - spare, L - spare)
    )


# --- positions per batch row ------------------------------------------------


def test_allowed_positions_per_row_is_each_rows_mask():
    """Positions (B, T) give (B, 1, T_q, T_k): row b's mask is the one its
    own positions give, for every window and causal setting."""
    pos_q = torch.tensor([[4, 5], [1, 2], [6, 7]])
    pos_k = torch.tensor([[-1, 3, 4, 5], [0, 1, 2, -1], [5, 6, 7, 4]])
    for w, causal in ((None, False), (None, True), (2, True)):
        got = transformer.allowed_positions(pos_q, pos_k, w, causal)
        assert got.shape == (3, 1, 2, 4)
        for b in range(3):
            alone = transformer.allowed_positions(
                pos_q[b], pos_k[b], w, causal
            )
            assert torch.equal(got[b, 0], alone)
    row = transformer.allowed_positions(pos_q, pos_k, 2, True)[1, 0]
    assert row.tolist() == [
        [True, True, False, False],
        [False, True, True, False],
    ]


# --- bad input gets a ValueError that names it (issue 47) --------------------
# Every check of transformer.py and gpt.py reads shapes, dtypes and Python
# numbers only (a token id out of range is named when the lookup fails), so
# that a model's step runs no extra tensor operation: chapter 11 counts them.

import torch.nn.functional as F  # noqa: E402

from gpt import GPT, Decoder, StaticCache  # noqa: E402

f32 = torch.float32
f64 = torch.float64


def ones(*shape, dtype=f32):
    return torch.ones(*shape, dtype=dtype)


@pytest.mark.parametrize(
    "Q, K, V, mask, message",
    [
        (
            ones(2, 3, 4),
            ones(2, 3, 4, dtype=f64),
            ones(2, 3, 4),
            None,
            "one dtype",
        ),
        (ones(2, 3, 4), ones(2, 3, 5), ones(2, 3, 4), None, "d_k: Q has 4"),
        (ones(2, 3, 4), ones(2, 3, 4), ones(2, 2, 4), None, "K has 3 rows, V"),
        (
            ones(2, 3, 4),
            ones(2, 0, 4),
            ones(2, 0, 4),
            None,
            "at least one key",
        ),
        (ones(2, 3, 4), ones(3, 3, 4), ones(3, 3, 4), None, "batch axes"),
        (ones(4), ones(3, 4), ones(3, 4), None, "Q must have shape"),
        ([[1.0]], ones(1, 1), ones(1, 1), None, "floating-point torch tensor"),
        (ones(2, 3, 4).long(), ones(2, 3, 4), ones(2, 3, 4), None, "floating"),
        (ones(2, 3, 4), ones(2, 3, 4), ones(2, 3, 4), ones(2, 2), "boolean"),
        (
            ones(2, 3, 4),
            ones(2, 3, 4),
            ones(2, 3, 4),
            torch.ones(2, 2, dtype=torch.bool),
            r"mask of shape \(2, 2\) does not broadcast",
        ),
        (  # broadcasts, but to (2, 3, 3), larger than the scores (3, 3)
            ones(3, 4),
            ones(3, 4),
            ones(3, 4),
            torch.ones(2, 3, 3, dtype=torch.bool),
            r"mask of shape \(2, 3, 3\) does not broadcast",
        ),
    ],
)
def test_attend_names_bad_inputs(Q, K, V, mask, message):
    with pytest.raises(ValueError, match=message):
        transformer.attend(Q, K, V, mask)


@pytest.mark.parametrize("rows_checked", [False, True])
def test_attend_refuses_a_mask_on_another_device(rows_checked):
    """A mask on another device than Q was a RuntimeError (from the row
    check or masked_fill; fresh review of issue 47, round 2)."""
    mask = torch.ones(3, 3, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match=r"^mask is on meta, Q on cpu$"):
        transformer.attend(
            ones(3, 4), ones(3, 4), ones(3, 4), mask, rows_checked
        )


def test_self_attention_refuses_a_mask_on_another_device():
    """Causal, so that the layer's own check (check_call) is what raises:
    without it, `mask & allowed` would mix devices before `attend` checks."""
    layer = transformer.SelfAttention(8, 2, causal=True)
    mask = torch.ones(5, 5, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match=r"^mask is on meta, Q on cpu$"):
        layer(ones(2, 5, 8), mask)


def test_attend_refuses_d_k_zero_and_a_query_without_key():
    """d_k = 0 (scores / sqrt(0): NaN) and a query whose every key is masked
    (a softmax of -inf only: NaN) are ValueErrors naming them (issue 47), as
    transformer's layers refuse a query without key (check_rows)."""
    with pytest.raises(ValueError, match="got d_k = 0"):
        transformer.attend(ones(2, 3, 0), ones(2, 4, 0), ones(2, 4, 5))
    mask = torch.ones(2, 3, 4, dtype=torch.bool)
    mask[1, 2] = False  # query 2 of sequence 1 sees no key
    with pytest.raises(ValueError, match=r"the mask's row \(1, 2\) is all"):
        transformer.attend(ones(2, 3, 4), ones(2, 4, 4), ones(2, 4, 5), mask)
    mask[1, 2, 3] = True  # one key is enough: a finite result
    out, weights = transformer.attend(
        ones(2, 3, 4), ones(2, 4, 4), ones(2, 4, 5), mask
    )
    assert out.isfinite().all() and weights[1, 2].tolist() == [0, 0, 0, 1]


@pytest.mark.parametrize("T_k", [3, 0])
def test_no_query_gives_an_empty_result_as_torch(T_k):
    """T_q = 0: outputs (..., 0, d_v) and weights (..., 0, T_k), as
    F.scaled_dot_product_attention returns; a self-attention layer, a block
    and the GPT give (B, 0, d) and (B, 0, vocab), cached or not."""
    Q, K, V = ones(2, 0, 4), ones(2, T_k, 4), ones(2, T_k, 5)
    out, weights = transformer.attend(Q, K, V)
    assert out.shape == F.scaled_dot_product_attention(Q, K, V).shape
    assert out.shape == (2, 0, 5) and weights.shape == (2, 0, T_k)
    x = torch.zeros(2, 0, 32, dtype=f64)
    for backend in ("attend", "sdpa"):
        layer = transformer.SelfAttention(32, 4, causal=True, backend=backend)
        assert layer.double()(x)[0].shape == (2, 0, 32)
        assert layer(x, cache=KVCache())[0].shape == (2, 0, 32)
    block = transformer.EncoderBlock(32, 4, 64).double()
    assert block(x).shape == (2, 0, 32)
    model = small_gpt()
    empty = torch.zeros(2, 0, dtype=torch.long)
    assert model(empty).shape == (2, 0, VOCAB)
    caches = model.new_caches()
    model(tokens(3), caches)
    assert model(empty, caches).shape == (2, 0, VOCAB)
    assert caches[0].length == 3


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: transformer.check_heads(4.0, 2), "d must be an integer"),
        (lambda: transformer.check_heads(4, "2"), "H must be an integer"),
        (lambda: transformer.check_groups(4, 2.0), "G must be an integer"),
        (lambda: transformer.check_groups(4, 0), "G=0"),
        (lambda: transformer.SelfAttention(8, 2, causal="yes"), "causal"),
        (lambda: transformer.EncoderBlock(8, 2, 16.0), "d_ff"),
        (lambda: transformer.EncoderBlock(8, 2, 0), "d_ff"),
        (lambda: transformer.sinusoidal_encoding(3.5, 4), "T must be"),
        (lambda: transformer.frequencies(5), "even size"),
        (lambda: transformer.frequencies(0), "even size"),
        (lambda: transformer.frequencies(4, torch.long), "floating-point"),
        (lambda: KVCache().next_positions(-1), "T must be"),
        (lambda: KVCache(3).check_layer("3", True), "window"),
        (lambda: KVCache(3).check_layer(3, 1), "causal"),
        (lambda: transformer.rotary(ones(3, 4), [0, 1, 2]), r"\(3,\) tensor"),
        (
            lambda: transformer.rotary(ones(3, 4).long()),
            "x must be a floating-point tensor",
        ),
        (lambda: transformer.rotary([[1.0, 2.0]]), "floating-point"),
        (
            lambda: transformer.allowed_positions([0, 1], torch.arange(2)),
            "pos_q must be a",
        ),
        (
            lambda: transformer.allowed_positions(
                torch.tensor(1), torch.arange(2)
            ),
            "pos_q must be a",
        ),
        (
            lambda: transformer.allowed_positions(
                torch.arange(3), torch.zeros(2, 3, dtype=torch.long)
            ),
            "one B",
        ),
        (
            lambda: transformer.allowed_positions(
                torch.zeros(2, 3, dtype=torch.long),
                torch.zeros(3, 3, dtype=torch.long),
            ),
            "one B",
        ),
        (
            lambda: transformer.allowed_positions(
                torch.arange(3), torch.arange(3), w=0
            ),
            "window",
        ),
        (lambda: transformer.combine_masks([[1.0]], None, None), "x must"),
        (lambda: transformer.check_rows([[True]]), "must be boolean"),
        (lambda: transformer.check_rows(ones(2, 2)), "must be boolean"),
    ],
)
def test_transformer_functions_name_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def filled(cache, K):
    """The cache after one update with K as keys and values."""
    cache.update(K, K)
    return cache


@pytest.mark.parametrize("w", [None, 3])
@pytest.mark.parametrize(
    "first, K, V, message",
    [
        (None, ones(1, 2, 3, 4), ones(1, 2, 2, 4), "one shape, dtype"),
        (None, ones(1, 2, 3, 4), ones(1, 2, 3, 4, dtype=f64), "one shape"),
        (None, ones(1, 2, 3, 4), ones(1, 2, 3, 6), "one shape"),
        (None, ones(2, 3, 4), ones(2, 3, 4), r"K must be \(B, G, T, d_k\)"),
        (ones(1, 2, 3, 4), ones(2, 2, 1, 4), ones(2, 2, 1, 4), "B=1, G=2"),
        (ones(1, 2, 3, 4), ones(1, 1, 1, 4), ones(1, 1, 1, 4), "one layer"),
        (ones(1, 2, 3, 4), ones(1, 2, 1, 2), ones(1, 2, 1, 2), "d_k=4"),
        (
            ones(1, 2, 3, 4),
            ones(1, 2, 1, 4, dtype=f64),
            ones(1, 2, 1, 4, dtype=f64),
            "of torch.float32, got",
        ),
    ],
)
def test_kvcache_refuses_keys_that_do_not_fit(w, first, K, V, message):
    """Issue 47: a float64 call after float32 ones was promoted silently, a
    value of another shape was stored, and another batch or layer raised a
    RuntimeError."""
    cache = KVCache(w) if first is None else filled(KVCache(w), first)
    with pytest.raises(ValueError, match=message):
        cache.update(K, V)


@pytest.mark.parametrize(
    "x, mask, cache, message",
    [
        (ones(5, 8), None, None, r"x must have shape \(B, T, 8\)"),
        (ones(2, 5, 6), None, None, r"x must have shape \(B, T, 8\)"),
        (ones(2, 5, 8, dtype=f64), None, None, "the layer torch.float32"),
        (ones(2, 5, 8).long(), None, None, "the layer torch.float32"),
        ([[[1.0] * 8]], None, None, "x must have shape"),
        (ones(2, 5, 8), ones(5, 5), None, "boolean tensor"),
        (
            ones(2, 5, 8),
            torch.ones(5, 4, dtype=torch.bool),
            None,
            "does not broadcast",
        ),
        (ones(2, 5, 8), None, [], "cache must be a Cache"),
        (
            ones(2, 5, 8),
            torch.ones(5, 5, dtype=torch.bool),
            KVCache(),
            "cached call takes no mask",
        ),
    ],
)
def test_self_attention_names_bad_input(x, mask, cache, message):
    layer = transformer.SelfAttention(8, 2, causal=True)
    with pytest.raises(ValueError, match=message):
        layer(x, mask, cache)


def test_a_cache_serves_one_layer_of_one_batch():
    layer = transformer.SelfAttention(8, 2, causal=True)
    cache = KVCache()
    layer(ones(1, 3, 8), cache=cache)
    with pytest.raises(ValueError, match="B=1, G=2, d_k=4"):
        layer(ones(2, 1, 8), cache=cache)  # another batch
    other = transformer.SelfAttention(8, 4, G=1, causal=True)
    with pytest.raises(ValueError, match="one layer of one batch"):
        other(ones(1, 1, 8), cache=cache)  # another layer's keys
    with pytest.raises(ValueError, match=r"of torch\.float32, got"):
        layer.double()(ones(1, 1, 8, dtype=f64), cache=cache)


@pytest.mark.parametrize(
    "x, kwargs, message",
    [
        (ones(2, 5, 6), {}, r"x must have shape \(B, T, 8\)"),
        (ones(2, 5, 8, dtype=f64), {}, "the layer torch.float32"),
        (ones(2, 5, 8), {"mask": [[True] * 5] * 5}, "mask must be a tensor"),
        (ones(2, 5, 8), {"padding_mask": [[True] * 5] * 2}, "padding_mask"),
    ],
)
def test_block_names_bad_input(x, kwargs, message):
    block = transformer.EncoderBlock(8, 2, 16)
    with pytest.raises(ValueError, match=message):
        block(x, **kwargs)


# --- gpt.py: tokens outside the vocabulary, caches out of order --------------


@pytest.mark.parametrize(
    "bad, message",
    [
        (
            torch.tensor([[1, 11]]),
            "token id 11 is outside the vocabulary 0 ... 10",
        ),
        (torch.tensor([[-1, 2]]), "token id -1 is outside the vocabulary"),
        (torch.tensor([[1.0, 2.0]]), "int64 or int32 token ids"),
        (torch.tensor([[True, False]]), "int64 or int32 token ids"),
        (torch.tensor([1, 2]), r"tokens must be \(B, T\)"),
        ([[1, 2]], r"tokens must be \(B, T\)"),
    ],
)
def test_gpt_and_decoder_name_a_bad_token(bad, message):
    """Issue 47: a token id outside the vocabulary raised an IndexError,
    a float or bool id a RuntimeError."""
    model = small_gpt()
    with pytest.raises(ValueError, match=message):
        model(bad)
    decoder = Decoder(model, 8)
    with pytest.raises(ValueError, match=message):
        decoder.step(bad, decoder.new_caches())


def test_generation_names_a_bad_token():
    model = small_gpt()
    decoder = Decoder(model, 12)
    for prompt in (torch.tensor([1, 11]), torch.tensor([-2])):
        for m in (model, decoder):
            with pytest.raises(ValueError, match="outside the vocabulary"):
                gpt.greedy(m, prompt, 2)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            gpt.greedy_batch(decoder, [torch.tensor([1, 2]), prompt], 2)
    with pytest.raises(ValueError, match="integer token ids"):
        gpt.greedy(model, torch.tensor([True, False]), 2)
    with pytest.raises(ValueError, match="a GPT or a Decoder"):
        gpt.greedy("model", torch.tensor([1]), 2)


def test_gpt_caches_must_be_one_per_block_in_step():
    """Issue 47: too few caches raised an IndexError; one cache shared by
    two blocks, or caches at different lengths (a block skipped or run
    twice), gave other logits without an error."""
    model = small_gpt()
    x = tokens(4)
    with pytest.raises(ValueError, match="list of 2 caches"):
        model(x, model.new_caches()[:1])
    with pytest.raises(ValueError, match="list of 2 caches"):
        model(x, KVCache())
    with pytest.raises(ValueError, match="Cache objects"):
        model(x, [1, 2])
    shared = KVCache()
    with pytest.raises(ValueError, match="its own cache"):
        model(x, [shared, shared])
    caches = model.new_caches()
    with torch.no_grad():
        model(x, caches)
    caches[1].crop(2)
    with pytest.raises(ValueError, match=r"hold \[4, 2\] tokens"):
        model(x[:, :1], caches)
    caches = model.new_caches()
    with torch.no_grad():
        model(x, caches)
    with pytest.raises(ValueError, match="hold 2 rows, the tokens 1"):
        model(x[:1, :1], caches)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"vocab": 0}, "vocab must be"),
        ({"layers": 0}, "layers must be"),
        ({"context": 0}, "context must be"),
        ({"context": 8.0}, "context must be"),
        ({"d_ff": 0}, "d_ff must be"),
    ],
)
def test_gpt_sizes_are_checked(kwargs, message):
    sizes = {"vocab": VOCAB, "d": 32, "H": 4, "layers": 2, "d_ff": 64}
    with pytest.raises(ValueError, match=message):
        GPT(**(sizes | kwargs))


def test_decoder_caches_must_be_its_own_in_step():
    model = small_gpt()
    decoder = Decoder(model, 8)
    x = tokens(3)
    with pytest.raises(ValueError, match="static caches"):
        decoder.step(x, model.new_caches())
    with pytest.raises(ValueError, match="list of 2 caches"):
        decoder.step(x, decoder.new_caches()[:1])
    with pytest.raises(ValueError, match="hold 3 rows, the tokens 2"):
        decoder.step(x, decoder.new_caches(3))
    caches = decoder.new_caches()
    decoder.step(x[:1], caches)
    with pytest.raises(ValueError, match="one decoder and one batch"):
        decoder.step(x[:, :1], caches)  # two rows into one
    caches[1].crop(1)
    with pytest.raises(ValueError, match="every layer's cache"):
        decoder.step(x[:1, :1], caches)
    caches = decoder.new_caches()
    decoder.step(x[:1], caches)
    narrow = Decoder(small_gpt(G=1), 8)  # keys of one head, not four
    with pytest.raises(ValueError, match="one decoder and one batch"):
        narrow.step(x[:1, :1], caches)
    wide = [StaticCache(12) for _ in range(2)]  # more slots than its tables
    with pytest.raises(ValueError, match="12 slots"):
        decoder.step(x[:1], wide)
    for capacity in (0, 5.0, True):
        with pytest.raises(ValueError, match="capacity"):
            Decoder(model, capacity)


def test_batch_cache_refuses_keys_that_do_not_fit():
    cache = gpt.BatchCache(10, 1)
    K = ones(1, 2, 3, 4)
    with pytest.raises(ValueError, match="one shape, dtype"):
        cache.update(K, ones(1, 2, 2, 4))
    cache.update(K, K)
    with pytest.raises(ValueError, match=r"of torch\.float32, got"):
        cache.update(K.double(), K.double())
    with pytest.raises(ValueError, match="B=1, G=2, d_k=4"):
        cache.update(ones(1, 1, 1, 4), ones(1, 1, 1, 4))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m, d: gpt.get_batch(d, 2, 100, None), "need 101 tokens"),
        (lambda m, d: gpt.get_batch(d, 0, 4, None), "B must be"),
        (lambda m, d: gpt.get_batch(d.view(10, 10), 2, 4, None), "1-d"),
        (lambda m, d: gpt.get_batch(d.float(), 2, 4, None), "token ids"),
        (lambda m, d: gpt.get_batch(d, 2, 4, 0), "torch.Generator"),
        (lambda m, d: gpt.train(m, d, -1, B=2, T=4), "steps must be"),
        (lambda m, d: gpt.train(m, d, 1, B=2, T=0), "T must be"),
        (lambda m, d: gpt.train(m, d, 1, B=2, T=4, lr=0), "lr must be"),
        (lambda m, d: gpt.train(m, d, 1, B=2, T=200), "need 201 tokens"),
        (lambda m, d: gpt.train(m, d + 5, 1, B=2, T=4), "outside the vocab"),
        (lambda m, d: gpt.validation_loss(m, X, X[:, :5]), "one non-empty"),
        (lambda m, d: gpt.validation_loss(m, X[:0], X[:0]), "one non-empty"),
        (lambda m, d: gpt.validation_loss(m, X, X + VOCAB), "a target in y"),
        (lambda m, d: gpt.validation_loss(m, X, X, rows=0), "rows must be"),
        (lambda m, d: gpt.validation_loss(m, X[0], X[0]), r"\(N, T\)"),
        (lambda m, d: gpt.validation_loss(m, X.float(), X), "token ids"),
    ],
)
def test_training_functions_name_bad_input(call, message):
    """Issue 47: a data set too short for T raised a RuntimeError, a target
    outside the vocabulary an IndexError, no rows a ZeroDivisionError; a
    negative number of steps or T = 0 trained silently (NaN losses)."""
    data = torch.arange(100) % VOCAB
    with pytest.raises(ValueError, match=message):
        call(small_gpt(), data)


X = torch.arange(24).view(4, 6) % VOCAB  # validation_loss's x and y


@pytest.mark.parametrize(
    "make",
    [
        lambda: transformer.SelfAttention(8, 2, causal=True),
        lambda: transformer.SelfAttention(8, 2, causal=True, w=2),
        lambda: transformer.RotarySelfAttention(8, 2, causal=True),
        lambda: transformer.DecoderBlock(8, 2, 16),
    ],
)
def test_causal_layers_build_their_mask_on_the_inputs_device(make):
    """A causal layer built its mask (and rotary angles) on the CPU, so on
    any other device its inputs met 'mask is on cpu, Q on meta' (fresh
    review of issue 47, round 4, F1). On meta (shapes, no values: the
    book runs on the CPU) the layer now reaches attend, which refuses meta
    by name (F3)."""
    layer = make().to("meta")
    x = torch.ones(2, 5, 8, device="meta")
    with pytest.raises(ValueError, match=r"^Q is on meta: attention needs"):
        layer(x)


def test_attend_refuses_meta_tensors():
    """attend returned meta tensors for Q, K, V on meta (F3)."""
    Q = torch.ones(2, 3, 4, device="meta")
    with pytest.raises(ValueError, match=r"^Q is on meta: attention needs"):
        transformer.attend(Q, Q, Q)
    with pytest.raises(ValueError, match=r"^Q is on meta: attention needs"):
        transformer.attend(Q, Q, Q, rows_checked=True)  # a layer's own call


@pytest.mark.parametrize("backend", ["flash", "sdpa"])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_backends_refuse_meta_by_name(backend, causal):
    """On meta, the flash and sdpa backends compared x's positions with a
    CPU arange: NotImplementedError from aten::equal (fresh review of
    issue 47's input checks, item 7). They refuse meta by name, as attend."""
    layer = transformer.SelfAttention(8, 2, causal=causal, backend=backend)
    x = torch.ones(2, 5, 8, device="meta")
    with pytest.raises(ValueError, match=r"^Q is on meta: attention needs"):
        layer.to("meta")(x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_attend_backend_causal_or_cached_passes_non_finite_x_through(bad):
    """With the default `attend` backend: attend's docstring said
    rows_checked=True skips the value checks because Q, K and V come from
    the layer's projections; a causal or cached layer given NaN x returned
    NaN without an error (item 5). A check per call would add ATen
    operations to chapter 10's count (196), so the docstring says so; a
    non-causal uncached call refuses it. (The other backends differ: sdpa
    passes non-finite x through causal or not; flash refuses it.)"""
    x = torch.randn(1, 3, 8, generator=torch.Generator().manual_seed(0))
    x[0, 1, 2] = bad
    with pytest.raises(ValueError, match=r"^Q contains NaN or infinite"):
        transformer.SelfAttention(8, 2)(x)
    causal = transformer.SelfAttention(8, 2, causal=True)
    for out, _ in (
        causal(x),
        transformer.SelfAttention(8, 2)(x, cache=KVCache()),
    ):
        assert not out.isfinite().all()  # no error: NaN or inf passed on
    assert "returns NaN or infinite outputs without an error" in " ".join(
        transformer.attend.__doc__.split()
    )


@pytest.mark.parametrize(
    "make, named",
    [
        (lambda t: t.to(torch.float8_e4m3fn), r"torch\.float8_e4m3fn"),
        (lambda t: t.to_sparse(), r"torch\.sparse_coo"),
    ],
)
def test_attend_refuses_float8_and_sparse(make, named):
    """They passed is_floating_point() and raised NotImplementedError (F4)."""
    Q, K, V = (make(ones(3, 4)) for _ in range(3))
    with pytest.raises(ValueError, match=rf"^Q is .*{named}.*strided layout"):
        transformer.attend(Q, K, V)


def test_attend_refuses_float16_scores_that_overflow():
    """Finite float16 Q and K whose scores overflow (300 * 300 * 8 = 720,000
    > 65,504) gave NaN outputs without an error (issue 47, s6 item 1); a
    masked-out overflow is no error. A layer's own call skips the check."""
    Q = torch.full((1, 2, 8), 300.0, dtype=torch.float16)
    V = torch.ones(1, 2, 8, dtype=torch.float16)
    with pytest.raises(
        ValueError, match=r"^a score .* overflowed torch\.float16"
    ):
        transformer.attend(Q, Q, V)
    small = Q.clone()
    small[0, 0] = 1.0  # only query 1's score of key 1 overflows
    with pytest.raises(ValueError, match=r"overflowed torch\.float16"):
        transformer.attend(small, small, V)
    hide = torch.tensor([[True, True], [True, False]])  # hides that score
    out, _ = transformer.attend(small, small, V, hide)
    assert out.isfinite().all()
    out, _ = transformer.attend(Q, Q, V, rows_checked=True)
    assert not out.isfinite().all()  # a layer's call: no check, NaN


@pytest.mark.parametrize("name", ["Q", "K", "V"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_attend_refuses_non_finite_q_k_v(name, bad):
    """A NaN or an infinity in Q, K or V gave NaN or infinite outputs
    without an error (F5; chapter 3's function refuses them). A layer's own call
    (rows_checked=True) skips the check: chapters 10-12 count its ATen
    operations."""
    gen = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(2, 3, 4, generator=gen) for n in "QKV"}
    tensors[name][1, 2, 3] = bad
    mask = torch.ones(3, 3, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match=f"^{name} contains NaN or infinite"):
        transformer.attend(*tensors.values(), mask)


def test_combine_masks_refuses_masks_on_another_device():
    """A mask or padding mask on another device than x was a RuntimeError
    from `allowed & mask` (F2)."""
    x = ones(2, 3, 8)
    mask = torch.ones(3, 3, dtype=torch.bool, device="meta")
    padding = torch.ones(2, 3, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match=r"^mask is on meta, x on cpu$"):
        transformer.combine_masks(x, mask, None)
    with pytest.raises(
        ValueError, match=r"^padding_mask is on meta, x on cpu"
    ):
        transformer.combine_masks(x, None, padding)
    with pytest.raises(ValueError, match=r"^mask is on meta, x on cpu$"):
        transformer.EncoderBlock(8, 2, 16)(x, mask)


def test_rotary_refuses_positions_on_another_device():
    """Positions on another device than x were a RuntimeError (F2)."""
    positions = torch.arange(3, device="meta")
    with pytest.raises(ValueError, match=r"^positions are on meta, x on cpu"):
        transformer.rotary(ones(2, 3, 4), positions)
    x = torch.ones(2, 3, 4, device="meta")  # default positions: x's device
    assert transformer.rotary(x).shape == (2, 3, 4)


# --- issue 47, s6: sparse or nested masks and x, float8 dtypes -------------


def nested(t):
    """t's rows as a nested tensor (torch warns: a prototype API)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor(list(t))


NOT_DENSE = [
    (lambda t: t.to_sparse(), r"torch\.sparse_coo"),
    (lambda t: t.to_sparse_csr(), r"torch\.sparse_csr"),
    (nested, "a nested tensor"),
]


@pytest.mark.parametrize("make, named", NOT_DENSE)
def test_masks_and_x_must_be_dense(make, named):
    """A sparse or nested mask, padding mask or x passed the checks and then
    raised NotImplementedError or RuntimeError ('NestedTensorImpl doesn't
    support sizes') (issue 47, s6 item 2)."""
    x, Q = ones(2, 3, 8), ones(2, 3, 4)
    mask = torch.ones(3, 3, dtype=torch.bool)
    padding = torch.ones(2, 3, dtype=torch.bool)
    positions = torch.arange(3)[None]  # (1, T): CSR and nested need rows
    calls = [
        ("mask", lambda: transformer.attend(Q, Q, Q, make(mask))),
        ("mask", lambda: transformer.combine_masks(x, make(mask), None)),
        (
            "padding_mask",
            lambda: transformer.combine_masks(x, None, make(padding)),
        ),
        ("mask", lambda: transformer.SelfAttention(8, 2)(x, make(mask))),
        ("x", lambda: transformer.SelfAttention(8, 2, causal=True)(make(x))),
        ("x", lambda: transformer.EncoderBlock(8, 2, 16)(make(x))),
        ("x", lambda: transformer.rotary(make(Q))),
        ("positions", lambda: transformer.rotary(Q, make(positions))),
    ]
    for name, call in calls:
        with pytest.raises(
            ValueError,
            match=rf"^{name} must be a dense \(strided\) tensor, got {named}$",
        ):
            call()


def test_one_dimensional_sparse_positions_are_refused():
    """A 1-D sparse COO positions tensor raised NotImplementedError
    (aten::cos on SparseCPU) from rotary."""
    with pytest.raises(ValueError, match=r"^positions must be a dense"):
        transformer.rotary(ones(2, 3, 4), torch.arange(3).to_sparse())


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_position_functions_refuse_float8(dtype):
    """frequencies, sinusoidal_encoding and rotary took a float8 dtype and
    raised NotImplementedError ('arange_cpu' not implemented) (issue 47, s6
    item 3)."""
    named = r"float16, bfloat16, float32 or float64\), got torch\.float8"
    with pytest.raises(ValueError, match=rf"^dtype must be .*{named}"):
        transformer.frequencies(8, dtype)
    with pytest.raises(ValueError, match=rf"^dtype must be .*{named}"):
        transformer.sinusoidal_encoding(3, 8, dtype)
    with pytest.raises(ValueError, match=rf"^x's dtype must be .*{named}"):
        transformer.rotary(ones(3, 8).to(dtype))


def test_one_input_check_for_every_layer():
    """transformer.check_input, seq2seq.check_vectors and variants.check_x
    repeated one check (issue 47, s6 item 4): one function now, and a
    variant's layer refuses x on another device by name like the others
    (it raised a RuntimeError from its first product)."""
    import seq2seq
    import variants

    assert seq2seq.check_vectors is transformer.check_vectors
    assert variants.check_vectors is transformer.check_vectors
    assert not hasattr(variants, "check_x") and not hasattr(
        transformer, "check_input"
    )
    x = torch.ones(2, 3, 8, device="meta")
    layers = [
        transformer.SelfAttention(8, 2),
        transformer.EncoderBlock(8, 2, 16),
        seq2seq.AlibiSelfAttention(8, 2),
        variants.LinearAttention(8, 2),
        variants.MultiHeadLatentAttention(8, 2, 4, 2),
    ]
    for layer in layers:
        with pytest.raises(
            ValueError, match=r"^x is on meta, the layer's weights on cpu$"
        ):
            layer(x)
