"""The book's GPT module (book/gpt.py) and the cache interface of
book/transformer.py (`Cache`, implemented by `KVCache`): the stored weights
load into the module's GPT; `crop(n)` leaves the cache a cache built from
scratch on the first n tokens would be, for the keys, values and positions
a query may need and for the model's logits; crop refuses what it cannot
do; `nbytes()` and `capacity` count what the tensors hold; positions per
batch row give each row its own mask."""

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
