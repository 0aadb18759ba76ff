"""book/flex.py: chapter 16's masks and score changes as FlexAttention's
mask_mod and score_mod, each run eagerly in float64 and checked against
the book's own implementation or SDPA with an explicit mask built here;
the blocks counted by hand against a BlockMask and against a count over
the dense mask; the fixed-shape decoding step against chapter 11's
Decoder. Shapes the chapter never prints."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import BOOK  # noqa: F401  (puts book/ on sys.path)
from torch.nn.attention.flex_attention import and_masks
from torch.testing import assert_close

import caches
import flash
import flex
import gpt
import seq2seq
from transformer import allowed_positions

TOL = {"atol": 1e-12, "rtol": 0}


def qkv(B=2, H=3, T=37, S=None, d=8, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    S = T if S is None else S

    def draw(n):
        return scale * torch.randn(
            B, H, n, d, generator=gen, dtype=torch.float64
        )

    return draw(T), draw(S), draw(S)


def sdpa(Q, K, V, allowed):
    """SDPA with a boolean mask, True where a query may see a key."""
    return F.scaled_dot_product_attention(Q, K, V, attn_mask=allowed)


def tril(T_q, T_k, diagonal=0):
    return torch.ones(T_q, T_k, dtype=torch.bool).tril(diagonal)


# --- each mask equals the book's own or SDPA's ---------------------------------


@pytest.mark.parametrize("T", [1, 37, 130])
def test_causal_is_sdpa_and_chapter_13s(T):
    Q, K, V = qkv(T=T)
    ours = flex.attend(Q, K, V, flex.causal)
    assert_close(
        ours, F.scaled_dot_product_attention(Q, K, V, is_causal=True), **TOL
    )
    assert_close(ours, flash.flash_attention(Q, K, V, causal=True), **TOL)


@pytest.mark.parametrize(("T_q", "T_k"), [(23, 50), (1, 9), (40, 40)])
def test_bottom_right_is_chapter_13s(T_q, T_k):
    Q, K, V = qkv(T=T_q, S=T_k, seed=1)
    ours = flex.attend(Q, K, V, flex.bottom_right(T_k - T_q))
    assert_close(
        ours, flash.flash_attention(Q, K, V, causal="bottom-right"), **TOL
    )
    assert_close(ours, sdpa(Q, K, V, tril(T_q, T_k, T_k - T_q)), **TOL)


@pytest.mark.parametrize("w", [1, 5, 37, 100])
def test_sliding_window_is_chapter_10s_mask(w):
    Q, K, V = qkv(seed=2)
    pos = torch.arange(37)
    allowed = allowed_positions(pos, pos, w)  # chapter 10's mask
    assert_close(
        flex.attend(Q, K, V, flex.sliding_window(w)),
        sdpa(Q, K, V, allowed),
        **TOL,
    )


def test_padding_masks_the_keys_of_each_row():
    Q, K, V = qkv(B=3, seed=3)
    lengths = [37, 20, 1]
    real = torch.arange(37) < torch.tensor(lengths)[:, None]  # (B, T_k)
    ours = flex.attend(Q, K, V, flex.padding(lengths))
    assert_close(ours, sdpa(Q, K, V, real[:, None, None, :]), **TOL)
    # a padded key changes nothing: replace it, the outputs stay
    K2, V2 = K.clone(), V.clone()
    K2[1, :, 20:], V2[1, :, 20:] = 9.0, -9.0
    assert_close(flex.attend(Q, K2, V2, flex.padding(lengths)), ours, **TOL)


@pytest.mark.parametrize(("s", "w"), [(3, 6), (0, 4), (2, 1), (5, 40)])
def test_sinks_are_what_chapter_11s_sink_cache_holds(s, w):
    """Query i attends to what a SinkCache holds after token i, step by step."""
    T = 29
    Q, K, V = qkv(T=T, seed=4)
    cache = caches.SinkCache(s, w, scheme="absolute")  # no rotation of keys
    rows = []
    for i in range(T):
        keys, values, pos = cache.update(
            K[..., i : i + 1, :], V[..., i : i + 1, :]
        )
        seen = allowed_positions(torch.tensor([i]), pos)  # (1, slots)
        rows.append(sdpa(Q[..., i : i + 1, :], keys, values, seen))
    reference = torch.cat(rows, dim=-2)
    assert_close(flex.attend(Q, K, V, flex.sinks(s, w)), reference, **TOL)


@pytest.mark.parametrize("P", [0, 1, 9, 37])
def test_prefix_lm_sees_the_whole_prefix(P):
    Q, K, V = qkv(seed=5)
    allowed = tril(37, 37)
    allowed[:, :P] = True
    assert_close(
        flex.attend(Q, K, V, flex.prefix_lm(P)), sdpa(Q, K, V, allowed), **TOL
    )


@pytest.mark.parametrize("lengths", [[5, 12, 1, 19], [37], [1] * 37])
def test_documents_are_each_document_alone(lengths):
    """Packed documents: each one's outputs are causal attention over it
    alone."""
    Q, K, V = qkv(seed=6)
    parts, start = [], 0
    for n in lengths:
        q, k, v = (t[..., start : start + n, :] for t in (Q, K, V))
        parts.append(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        start += n
    ours = flex.attend(Q, K, V, flex.documents(lengths))
    assert_close(ours, torch.cat(parts, dim=-2), **TOL)


@pytest.mark.parametrize("H", [3, 4, 6])
def test_alibi_is_chapter_14s_bias(H):
    """The paper's -m_h (i - j) under a causal mask, and the symmetric
    -m_h |i - j| with every key, against seq2seq.attend_biased."""
    Q, K, V = qkv(H=H, T=31, seed=7)
    pos = torch.arange(31)
    bias = seq2seq.alibi_bias(H, pos, pos)  # (H, T, T): -m_h |i - j|
    causal, _ = seq2seq.attend_biased(Q, K, V, tril(31, 31), bias)
    both, _ = seq2seq.attend_biased(Q, K, V, None, bias)
    assert_close(
        flex.attend(Q, K, V, flex.causal, flex.alibi(H)), causal, **TOL
    )
    symmetric = flex.alibi(H, symmetric=True)
    assert_close(flex.attend(Q, K, V, None, symmetric), both, **TOL)
    # without its causal mask, the paper's bias rewards the later keys
    paper = flex.attend(Q, K, V, None, flex.alibi(H))
    assert (paper - both).abs().max() > 1e-3


@pytest.mark.parametrize("cap", [0.5, 3.0, 50.0])
def test_soft_cap_is_tanh_of_the_scores(cap):
    Q, K, V = qkv(scale=3.0, seed=8)  # scores far beyond the smaller caps
    scores = Q @ K.transpose(-2, -1) / math.sqrt(8)
    capped = cap * torch.tanh(scores / cap)
    capped = capped.masked_fill(~tril(37, 37), float("-inf"))
    reference = capped.softmax(dim=-1) @ V
    ours = flex.attend(Q, K, V, flex.causal, flex.soft_cap(cap))
    assert_close(ours, reference, **TOL)


def test_a_query_without_keys_gets_zeros():
    """FlexAttention's choice for a fully masked row (chapter 4's NaN)."""
    Q, K, V = qkv(T=5, seed=9)
    out = flex.attend(Q, K, V, flex.padding([0, 5]))
    assert torch.equal(out[0], torch.zeros_like(out[0]))


# --- eager: PyTorch's private switch against the public path --------------------


def test_eager_is_the_public_path():
    """flex.eager's private switch gives the public path's output exactly,
    on every mask and score change of book/flex.py (forward only)."""
    Q, K, V = qkv(T=200, d=16)
    hooks = {
        "causal": (flex.causal, None),
        "bottom-right": (flex.bottom_right(0), None),
        "window": (flex.sliding_window(64), None),
        "padding": (flex.padding([200, 130]), None),
        "sinks": (flex.sinks(4, 64), None),
        "prefix": (flex.prefix_lm(50), None),
        "documents": (flex.documents([50, 30, 120]), None),
        "ALiBi": (flex.causal, flex.alibi(3)),
        "symmetric ALiBi": (None, flex.alibi(3, symmetric=True)),
        "soft-cap": (flex.causal, flex.soft_cap(2)),
    }
    for name, (mask_mod, score_mod) in hooks.items():
        mask = (
            None
            if mask_mod is None
            else flex.block_mask(mask_mod, 200, 200, 2)
        )
        ours = flex.eager(Q, K, V, score_mod, mask)
        assert torch.equal(ours, flex.public(Q, K, V, score_mod, mask)), name


@pytest.mark.parametrize("before", [False, True])
def test_eager_restores_the_switch(before, monkeypatch):
    """The switch is set during the call only, and restored even when the
    call fails."""
    module = flex.flex_module
    monkeypatch.setattr(
        module, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", before
    )
    Q, K, V = qkv(T=5)
    flex.eager(Q, K, V, None, None)
    assert module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG is before
    with pytest.raises(ValueError, match="embedding dimension"):
        flex.eager(Q, K[..., :3], V, None, None)  # PyTorch's own check
    assert module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG is before


def test_eager_does_not_trace(monkeypatch):
    """With the switch, FlexAttention calls no torch.compile."""

    def refuse(*args, **kwargs):
        raise AssertionError("torch.compile called")

    monkeypatch.setattr(torch, "compile", refuse)
    Q, K, V = qkv(T=5)
    flex.eager(Q, K, V, flex.alibi(3), flex.block_mask(flex.causal, 5, 5))


# --- blocks --------------------------------------------------------------------


def dense_count(allowed, block):
    """(computed, full) blocks of a (T_q, T_k) boolean mask, by looping."""
    T_q, T_k = allowed.shape
    computed = full = 0
    for i0 in range(0, T_q, block):
        for j0 in range(0, T_k, block):
            tile = allowed[i0 : i0 + block, j0 : j0 + block]
            if tile.any():
                computed += 1
                full += bool(tile.all()) and tile.shape == (block, block)
    return computed, full


def bands(T_q, T_k):
    """(mask_mod, first, last) of each band mask for T_q x T_k scores."""
    starts = [s for s in (0, 40, 41, 200, 260) if s < T_k]  # documents
    ends = [*starts[1:], T_k]
    lengths = [b - a for a, b in zip(starts, ends)]
    doc_start = [max(s for s in starts if s <= i) for i in range(T_q)]
    return {
        "causal": (flex.causal, lambda i: 0, lambda i: i),
        "bottom-right": (
            flex.bottom_right(T_k - T_q),
            lambda i: 0,
            lambda i: i + T_k - T_q,
        ),
        "window 100": (
            flex.sliding_window(100),
            lambda i: max(0, i - 99),
            lambda i: i,
        ),
        "prefix 150": (
            flex.prefix_lm(150),
            lambda i: 0,
            lambda i: max(i, 149),
        ),
        "padding 170": (flex.padding([170]), lambda i: 0, lambda i: 169),
        "documents": (
            flex.documents(lengths) if T_q == T_k else None,
            lambda i: doc_start[i],
            lambda i: i,
        ),
    }


@pytest.mark.parametrize("T", [1, 100, 128, 129, 200, 300, 385])
@pytest.mark.parametrize("block", [128, 64])
def test_blocks_by_hand_are_the_block_masks(T, block):
    for name, (mask_mod, first, last) in bands(T, T).items():
        mask = flex.block_mask(mask_mod, T, T, block=block)
        by_hand = flex.band_blocks(T, T, first, last, block)
        assert flex.block_counts(mask) == by_hand, name
        allowed = flex.dense_mask(mask_mod, T, T)[0, 0]
        assert dense_count(allowed, block) == by_hand, name


@pytest.mark.parametrize(("T_q", "T_k"), [(100, 300), (129, 257), (1, 385)])
def test_bottom_right_blocks(T_q, T_k):
    mask_mod, first, last = bands(T_q, T_k)["bottom-right"]
    mask = flex.block_mask(mask_mod, T_q, T_k)
    assert flex.block_counts(mask) == flex.band_blocks(T_q, T_k, first, last)


@pytest.mark.parametrize("T", [200, 256, 300])
def test_sink_blocks_are_the_dense_count(T):
    mask_mod = flex.sinks(4, 64)
    mask = flex.block_mask(mask_mod, T, T, block=64)
    allowed = flex.dense_mask(mask_mod, T, T)[0, 0]
    assert flex.block_counts(mask) == dense_count(allowed, 64)


def test_blocks_of_a_batch_add_up():
    mask = flex.block_mask(flex.padding([300, 1]), 300, 300, B=2)
    one = flex.band_blocks(300, 300, lambda i: 0, lambda i: 299)
    other = flex.band_blocks(300, 300, lambda i: 0, lambda i: 0)
    assert flex.block_counts(mask) == (one[0] + other[0], one[1] + other[1])
    assert flex.skipped(mask) == pytest.approx(100 * (1 - (9 + 3) / 18))


@pytest.mark.parametrize("T", [128, 256, 1024])
def test_skipped_is_sparsity_when_the_blocks_fit(T):
    mask = flex.block_mask(flex.causal, T, T)
    n = T // 128
    assert flex.skipped(mask) == pytest.approx(
        100 * (1 - n * (n + 1) / 2 / n**2)
    )
    assert mask.sparsity() == pytest.approx(flex.skipped(mask))


@pytest.mark.parametrize("T", [129, 200, 300])
def test_sparsity_is_wrong_when_they_do_not(T):
    mask = flex.block_mask(flex.causal, T, T)
    n = math.ceil(T / 128)
    assert flex.skipped(mask) == pytest.approx(
        100 * (1 - (n * (n + 1) / 2) / n**2)
    )
    computed = n * (n + 1) // 2
    assert mask.sparsity() == pytest.approx(
        100 * (1 - computed * 128**2 / T**2)
    )
    assert mask.sparsity() < flex.skipped(mask)


@pytest.mark.parametrize("T", [129, 300, 640])
@pytest.mark.parametrize("name", ["sinks", "causal"])  # causal: full tiles
def test_tile_kinds_are_the_dense_tiles(T, name):
    mask_mod = flex.sinks(3, 150) if name == "sinks" else flex.causal
    kinds = flex.tile_kinds(flex.block_mask(mask_mod, T, T))
    allowed = flex.dense_mask(mask_mod, T, T)[0, 0]
    n = math.ceil(T / 128)
    assert kinds.shape == (n, n)
    for r in range(n):
        for c in range(n):
            tile = allowed[128 * r : 128 * r + 128, 128 * c : 128 * c + 128]
            whole = tile.shape == (128, 128)
            expected = 2 if whole and tile.all() else int(bool(tile.any()))
            assert kinds[r, c] == expected, (r, c)


def test_dense_mask_has_a_mask_per_row():
    allowed = flex.dense_mask(flex.padding([3, 5]), 4, 6, B=2)
    assert allowed.shape == (2, 1, 4, 6)
    assert allowed[0, 0].sum(dim=-1).tolist() == [3] * 4
    assert allowed[1, 0].sum(dim=-1).tolist() == [5] * 4
    assert torch.equal(flex.dense_mask(flex.causal, 3, 5)[0, 0], tril(3, 5))


def test_grid_counts_partial_blocks():
    assert flex.grid(200, 200) == 4
    assert flex.grid(128, 129) == 2
    assert flex.grid(1, 1, block=1) == 1


# --- a decoding step of fixed shape ---------------------------------------------


@pytest.fixture(scope="module", params=[1, 2])
def decoder(request):
    torch.manual_seed(0)
    model = gpt.GPT(
        13, d=16, H=2, layers=2, d_ff=32, G=request.param, context=64
    )
    return gpt.Decoder(model.double().eval(), capacity=40)


def test_fixed_step_decodes_the_decoders_tokens(decoder):
    prompt = torch.tensor([3, 1, 4, 1, 5, 9, 2])
    with torch.no_grad():
        tokens, logits = gpt.greedy(decoder, prompt, 30)
        ours, our_logits = flex.greedy_fixed(decoder, prompt, 30)
    assert torch.equal(ours, tokens)
    assert_close(our_logits, logits, atol=1e-10, rtol=0)


def test_fixed_step_keeps_its_shapes(decoder):
    K_buf, V_buf = flex.new_buffers(decoder)
    assert K_buf.shape == (2, 1, decoder.G, 40, decoder.d_k)
    with torch.no_grad():
        for t in (0, 1, 39):
            logits = flex.fixed_step(
                decoder,
                torch.tensor([[t % 13]]),
                torch.tensor(t),
                K_buf,
                V_buf,
            )
            assert logits.shape == (1, 13)
    assert K_buf[:, :, :, 2:39].abs().sum() == 0  # slots never written stay 0
    assert K_buf[:, :, :, 39].abs().sum() > 0


def test_one_token_prompt(decoder):
    prompt = torch.tensor([7])
    with torch.no_grad():
        tokens, _ = gpt.greedy(decoder, prompt, 5)
        ours, logits = flex.greedy_fixed(decoder, prompt, 5)
    assert torch.equal(ours, tokens)
    assert logits.shape == (5, 13)


# --- bad input -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: flex.sliding_window(0), "window"),
        (lambda: flex.sliding_window(2.0), "window"),
        (lambda: flex.sinks(-1, 3), "sinks"),
        (lambda: flex.sinks(1, 0), "window"),
        (lambda: flex.bottom_right(-1), "offset"),
        (lambda: flex.bottom_right(True), "offset"),
        (lambda: flex.prefix_lm(-2), "prefix"),
        (lambda: flex.padding([]), "lengths"),
        (lambda: flex.padding([1.5]), "lengths"),
        (lambda: flex.padding(torch.tensor([-1])), "length"),
        (lambda: flex.documents([3, 0]), "length"),
        (lambda: flex.soft_cap(0), "cap"),
        (lambda: flex.soft_cap(math.inf), "cap"),
        (lambda: flex.soft_cap(True), "cap"),
        (lambda: flex.alibi(0), "H"),
        (lambda: flex.alibi(2, symmetric=1), "symmetric"),
        (lambda: flex.block_mask(flex.causal, 0, 4), "T_q"),
        (lambda: flex.block_mask("causal", 4, 4), "mask_mod"),
        (lambda: flex.band_blocks(4, 4, min, max, block=0), "block"),
        (lambda: flex.block_counts(None), "BlockMask"),
        (lambda: flex.tile_kinds("mask"), "BlockMask"),
        (lambda: flex.block_mask(flex.padding([3]), 4, 4, B=2), "B = 2"),
        (lambda: flex.block_mask(flex.padding([3, 4]), 4, 4), "B = None"),
        (lambda: flex.block_mask(flex.documents([2, 1]), 4, 4), "3 tokens"),
        (lambda: flex.block_mask(flex.documents([4]), 4, 5), "T_k = 5"),
        (lambda: flex.grid(10, 10, 0), "block"),
        (lambda: flex.grid(-10, 10), "T_q"),
        (lambda: flex.grid(10, 2.5), "T_k"),
        (lambda: flex.dense_mask(flex.causal, -1, 5), "T_q"),
        (lambda: flex.dense_mask(flex.causal, 4, 4, B=0), "B"),
        (lambda: flex.dense_mask(None, 4, 4), "mask_mod"),
        (lambda: flex.band_blocks(4, 4, None, None), "first and last"),
    ],
)
def test_bad_arguments_are_named(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_tensors_are_named():
    Q, K, V = qkv(T=4)
    with pytest.raises(ValueError, match="requires a gradient"):
        flex.attend(Q.requires_grad_(), K, V)
    Q, K, V = qkv(T=4)
    with (
        pytest.raises(ValueError, match="requires a gradient"),
        torch.no_grad(),
    ):
        flex.attend(Q, K, V.requires_grad_())
    Q, K, V = qkv(T=4)
    with pytest.raises(ValueError, match="B, H, T, d"):
        flex.attend(Q[0], K[0], V[0])
    with pytest.raises(ValueError, match="mixed dtypes"):
        flex.attend(Q.float(), K, V)
    with pytest.raises(ValueError, match="floating point"):
        flex.attend(Q.long(), K.long(), V.long())
    with pytest.raises(ValueError, match="batch and heads"):
        flex.attend(Q, K[:1], V[:1])
    with pytest.raises(ValueError, match="d_k"):
        flex.attend(Q, K[..., :3], V)
    with pytest.raises(ValueError, match="one value per key"):
        flex.attend(Q, K, V[..., :2, :])
    with pytest.raises(ValueError, match="score_mod"):
        flex.attend(Q, K, V, score_mod="alibi")
    for name, bad in (("Q", Q), ("K", K), ("V", V)):
        for value in (math.nan, math.inf, -math.inf):
            broken = bad.clone()
            broken[0, 0, 1, 2] = value
            args = [broken if t is bad else t for t in (Q, K, V)]
            with pytest.raises(ValueError, match=f"^{name} holds NaN"):
                flex.attend(*args)


def test_a_score_mod_for_fewer_heads_is_named():
    """alibi(2) reads its slopes by head: with 4 heads FlexAttention raised
    IndexError; attend names the score_mod (fresh review, round 4)."""
    Q, K, V = qkv(B=1, H=4, T=8)
    with pytest.raises(ValueError, match="mask_mod or score_mod indexes"):
        flex.attend(Q, K, V, flex.causal, flex.alibi(2))
    table = torch.ones(2, dtype=torch.bool)  # a mask_mod for 2 heads of 4
    with pytest.raises(ValueError, match="mask_mod or score_mod indexes"):
        flex.attend(Q, K, V, lambda b, h, q, kv: table[h] & (kv <= q))


def test_attend_names_masks_that_do_not_fit():
    """Documents that do not cover T and padding lengths that are not one
    per batch row: a ValueError, not FlexAttention's IndexError."""
    Q, K, V = qkv(B=2, T=40)
    with pytest.raises(ValueError, match="30 tokens, but T_q = 40"):
        flex.attend(Q, K, V, flex.documents([10, 20]))
    with pytest.raises(ValueError, match="1 lengths, one per batch row"):
        flex.attend(Q, K, V, flex.padding([5]))
    both = and_masks(flex.causal, flex.documents([10, 20]))  # no `tokens`
    with pytest.raises(ValueError, match="out of range"):
        flex.attend(Q, K, V, both)


def test_greedy_fixed_refuses(decoder):
    with pytest.raises(ValueError, match="capacity"):
        flex.greedy_fixed(decoder, torch.tensor([1, 2]), 39)
    with pytest.raises(ValueError, match="Decoder"):
        flex.greedy_fixed("gpt", torch.tensor([1]), 3)
    with pytest.raises(ValueError, match="Decoder"):
        flex.new_buffers(None)
    with pytest.raises(ValueError, match="n_new"):
        flex.greedy_fixed(decoder, torch.tensor([1]), 0)
