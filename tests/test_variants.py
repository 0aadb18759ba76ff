"""Chapter 12's attention variants (book/variants.py) and GPT's hook for
them (book/gpt.py, `GPT(attention=...)`): every equality the chapter will
assert, on small random float64 models and shapes it never prints, each
against a reference written here (a formula, a loop, autograd, the plain
model) or, for a cache, against the uncached model; and every bad input of
issue 35 item 7."""

import pytest
import torch
from conftest import BOOK
from torch.testing import assert_close

import gpt
import transformer
import variants as v
from transformer import Cache, KVCache

VOCAB, D, H, LAYERS = 13, 24, 3, 2
EXACT = {"rtol": 0, "atol": 1e-10}  # float64: equal up to rounding


def tokens(T, B=2, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(VOCAB, (B, T), generator=gen)


def variant_gpt(attention, layers=LAYERS, seed=0):
    """An untrained float64 GPT whose attention(i) builds layer i."""
    torch.manual_seed(seed)
    model = gpt.GPT(
        VOCAB, d=D, H=H, layers=layers, d_ff=40, attention=attention
    )
    return model.double().eval()


def decode_gap(model, T=13, prefill=5):
    """The largest gap between the uncached logits of T tokens and those
    of a cached decode: a prefill, then one token per call."""
    x = tokens(T)
    with torch.no_grad():
        full = model(x)
        caches = model.new_caches()
        steps = [model(x[:, :prefill], caches)]
        for t in range(prefill, T):
            steps.append(model(x[:, t : t + 1], caches))
    assert all(c.length == T for c in caches)
    return (torch.cat(steps, dim=1) - full).abs().max().item(), caches


VARIANTS = {
    "mla": lambda i: v.MultiHeadLatentAttention(D, H, d_c=10, d_R=4),
    "mla-absorbed": lambda i: v.MultiHeadLatentAttention(
        D, H, d_c=10, d_R=4, absorbed=True
    ),
    "linear": lambda i: v.LinearAttention(D, H),
    "delta": lambda i: v.LinearAttention(D, H, rule="delta"),
    "gated-delta": lambda i: v.LinearAttention(D, H, rule="gated_delta"),
    "gated-delta-fixed": lambda i: v.LinearAttention(
        D, H, rule="gated_delta", decay=0.9
    ),
    "hybrid": lambda i: (
        v.LinearAttention(D, H, rule="gated_delta")
        if i == 0
        else transformer.RotarySelfAttention(D, H, causal=True)
    ),
    "sparse": lambda i: v.SparseAttention(D, H, k=4, H_I=2, d_I=6),
    "sparse-gqa": lambda i: v.SparseAttention(D, H, k=3, G=1),
    "cla": v.cross_layer(D, H, [None, 0]),  # layer 1 reuses layer 0's
}


# --- the hook in GPT --------------------------------------------------------


def test_default_gpt_is_unchanged_by_the_hook():
    """Without `attention`, the blocks hold chapter 10's attention and the
    state dict has the names of the stored weights."""
    torch.manual_seed(0)
    model = gpt.GPT(65, d=64, H=4, layers=2, d_ff=256)
    for block in model.blocks:
        assert type(block.self_attn) is transformer.RotarySelfAttention
    assert all(type(c) is KVCache for c in model.new_caches())
    state = torch.load(BOOK / "data" / "gpt_G4.pt")
    assert list(state) == list(model.state_dict())  # same names, same order


def test_hook_puts_attention_i_in_block_i_and_asks_it_for_caches():
    built = []

    def attention(i):
        built.append(i)
        return VARIANTS["hybrid"](i)

    model = variant_gpt(attention)
    assert built == [0, 1]
    assert isinstance(model.blocks[0].self_attn, v.LinearAttention)
    caches = model.new_caches()
    assert type(caches[0]) is v.StateCache and type(caches[1]) is KVCache
    assert all(isinstance(c, Cache) for c in caches)


def test_return_weights_is_none_for_a_layer_without_weights():
    x = tokens(9)
    _, weights = variant_gpt(VARIANTS["hybrid"])(x, return_weights=True)
    assert isinstance(weights, list) and weights[0] is None
    assert weights[1].shape == (2, H, 9, 9)
    _, stacked = variant_gpt(VARIANTS["mla"])(x, return_weights=True)
    assert stacked.shape == (2, LAYERS, H, 9, 9)  # every layer has weights
    assert_close(stacked.sum(-1), torch.ones(2, LAYERS, H, 9).double())


def test_the_decoder_refuses_a_variant():
    with pytest.raises(ValueError, match="variant"):
        gpt.Decoder(variant_gpt(VARIANTS["mla"]), 20)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_cached_decode_equals_the_uncached_model(name):
    gap, _ = decode_gap(variant_gpt(VARIANTS[name]))
    assert gap < 1e-10


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_a_variant_refuses_a_mask_and_a_foreign_cache(name):
    layer = VARIANTS[name](0)
    x = torch.randn(1, 4, D)
    with pytest.raises(ValueError, match="no mask"):
        layer(x, torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="needs a"):
        layer(x, None, v.SharedCache())


# --- multi-head latent attention --------------------------------------------


@pytest.mark.parametrize("B,T,d,heads,d_c,d_R", [(2, 11, 20, 4, 7, 6)])
def test_mla_absorbed_equals_expanded(B, T, d, heads, d_c, d_R):
    torch.manual_seed(3)
    layer = v.MultiHeadLatentAttention(d, heads, d_c, d_R).double()
    x = torch.randn(B, T, d, dtype=torch.float64)
    expanded, A = layer(x)
    layer.absorbed = True
    absorbed, A_absorbed = layer(x)
    assert_close(absorbed, expanded, **EXACT)
    assert_close(A_absorbed, A, **EXACT)


def test_mla_equals_its_equations():
    """Equations 9-19 written out per head, from the layer's weights."""
    torch.manual_seed(4)
    d, heads, d_c, d_R, T = 12, 2, 5, 4, 7
    layer = v.MultiHeadLatentAttention(d, heads, d_c, d_R).double()
    x = torch.randn(1, T, d, dtype=torch.float64)
    got, _ = layer(x)
    d_h, P = d // heads, torch.arange(T)
    c = x[0] @ layer.down_kv.weight.T + layer.down_kv.bias  # eq. 9
    k_R = transformer.rotary(x[0] @ layer.rope_k.weight.T + layer.rope_k.bias)
    outs = []
    for i in range(heads):
        rows = slice(i * d_h, (i + 1) * d_h)
        k_C = c @ layer.up_k.weight[rows].T  # eq. 10
        v_C = c @ layer.up_v.weight[rows].T  # eq. 11
        q_C = x[0] @ layer.query.weight[rows].T + layer.query.bias[rows]
        r = slice(i * d_R, (i + 1) * d_R)
        q_R = transformer.rotary(
            x[0] @ layer.rope_q.weight[r].T + layer.rope_q.bias[r], P
        )
        scores = (q_C @ k_C.T + q_R @ k_R.T) / (d_h + d_R) ** 0.5
        scores = scores.masked_fill(P[None, :] > P[:, None], float("-inf"))
        outs.append(scores.softmax(-1) @ v_C)  # eq. 18
    want = torch.cat(outs, -1) @ layer.out_proj.weight.T + layer.out_proj.bias
    assert_close(got[0], want, **EXACT)


def test_latent_cache_holds_the_latent_and_the_rotary_key_only():
    model = variant_gpt(VARIANTS["mla"])
    _, caches = decode_gap(model, T=10)
    for cache in caches:
        c, k_R = cache.tensors
        assert c.shape == (2, 10, 10) and k_R.shape == (2, 10, 4)
        assert cache.nbytes() == 2 * 10 * (10 + 4) * 8  # float64
    caches[0].crop(6)
    assert caches[0].length == 6 and caches[0].nbytes() == 2 * 6 * 14 * 8


@pytest.mark.parametrize(
    "d_c,d_R,match",
    [(0, 4, "d_c"), (-3, 4, "d_c"), (2.5, 4, "d_c"), (8, 3, "d_R"),
     (8, 0, "d_R"), (8, 5, "d_R")],
)  # fmt: skip
def test_mla_bad_sizes(d_c, d_R, match):
    with pytest.raises(ValueError, match=match):
        v.MultiHeadLatentAttention(D, H, d_c, d_R)


# --- cross-layer attention --------------------------------------------------


def test_cla_equals_attention_over_the_earlier_layers_keys():
    """Layer 1 of share [None, 0] attends with its own queries to layer
    0's keys and values, computed here from layer 0's weights."""
    model = variant_gpt(v.cross_layer(D, H, [None, 0]))
    x = tokens(8)
    b0, b1 = model.blocks
    with torch.no_grad():
        h = model.embed(x)
        Q, K, V = b0.self_attn.heads(b0.norm1(h))
        causal = torch.ones(8, 8, dtype=torch.bool).tril()
        out = transformer.attend(Q, K, V, causal)[0]
        h = h + b0.self_attn.out_proj(out.transpose(1, 2).reshape(2, 8, D))
        h = h + b0.linear2(torch.relu(b0.linear1(b0.norm2(h))))
        q = b1.self_attn.in_proj(b1.norm1(h)).view(2, 8, H, D // H)
        Q1 = transformer.rotary(q.transpose(1, 2))
        out = transformer.attend(Q1, K, V, causal)[0]
        h = h + b1.self_attn.out_proj(out.transpose(1, 2).reshape(2, 8, D))
        h = h + b1.linear2(torch.relu(b1.linear1(b1.norm2(h))))
        want = model.readout(model.norm(h))
        assert_close(model(x), want, **EXACT)


@pytest.mark.parametrize("share", [[None, 0], [None, 0, None, 2, 2]])
def test_cla_cached_decode_and_bytes(share):
    model = variant_gpt(v.cross_layer(D, H, share, G=1), layers=len(share))
    gap, caches = decode_gap(model)
    assert gap < 1e-10
    for j, cache in zip(share, caches):
        if j is None:
            assert type(cache) is KVCache and cache.nbytes() > 0
        else:
            assert type(cache) is v.SharedCache and cache.nbytes() == 0
    sharing = [
        b.self_attn for b, j in zip(model.blocks, share) if j is not None
    ]
    assert all(a.in_proj.out_features == D for a in sharing)  # queries only


@pytest.mark.parametrize(
    "share,match",
    [([None, 1], "earlier"), ([None, 2, None], "earlier"),
     ([None, 5], "earlier"), ([0], "earlier"), ([None, -1], "earlier"),
     ([None, 0, 1], "itself reuses")],
)  # fmt: skip
def test_cla_refuses_a_layer_that_does_not_come_before(share, match):
    with pytest.raises(ValueError, match=match):
        v.cross_layer(D, H, share)


def test_cla_refuses_a_layer_missing_from_share():
    with pytest.raises(ValueError, match="does not exist"):
        variant_gpt(v.cross_layer(D, H, [None, 0]), layers=3)


# --- linear attention and the delta rules -----------------------------------


def qkv(B=2, heads=3, T=9, d_k=4, d_v=5, seed=5):
    gen = torch.Generator().manual_seed(seed)
    Q, K = (
        torch.randn(B, heads, T, d_k, generator=gen).double() for _ in "qk"
    )
    V = torch.randn(B, heads, T, d_v, generator=gen).double()
    return Q, K, V


def test_linear_attention_parallel_equals_the_sums_and_the_recurrence():
    Q, K, V = qkv()
    phi = v.feature_map("elu+1")
    Q, K = phi(Q), phi(K)
    parallel = v.linear_attention_parallel(Q, K, V)
    want = torch.empty_like(parallel)  # each query's sums over j <= i
    for i in range(Q.shape[2]):
        sims = torch.einsum("bhd,bhjd->bhj", Q[:, :, i], K[:, :, : i + 1])
        want[:, :, i] = (sims[..., None] * V[:, :, : i + 1]).sum(2) / sims.sum(
            -1, keepdim=True
        )
    assert_close(parallel, want, **EXACT)
    first, state = v.linear_attention_recurrent(
        Q[:, :, :4], K[:, :, :4], V[:, :, :4]
    )
    rest, _ = v.linear_attention_recurrent(
        Q[:, :, 4:], K[:, :, 4:], V[:, :, 4:], state
    )
    assert_close(torch.cat([first, rest], 2), parallel, **EXACT)


def test_linear_attention_refuses_features_that_sum_to_zero_or_less():
    """Zero features (phi(q_t) . z_t = 0) would give 0 / 0 = NaN, negative
    ones a sign flip: both forms raise a ValueError naming the sum."""
    Q, K, V = qkv()
    zeros = torch.zeros_like(Q)
    calls = [
        lambda q, k: v.linear_attention_parallel(q, k, V),
        lambda q, k: v.linear_attention_recurrent(q, k, V),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"is <= 0: linear attention"):
            call(zeros, zeros)
        with pytest.raises(ValueError, match=r"is <= 0: linear attention"):
            call(torch.ones_like(Q), -torch.ones_like(K))
        ones = torch.ones_like(Q)
        one_zero = ones.clone()
        one_zero[1, 2, 6] = 0  # one query's features all 0: only it fails
        with pytest.raises(ValueError, match=r"is <= 0: linear attention"):
            call(one_zero, ones)


def reference_gated_delta(Q, K, V, beta, alpha):
    """Gated DeltaNet as its paper writes it, S (d_v, d_k) per head:
    S_t = S_{t-1} alpha_t (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,
    o_t = S_t q_t; one batch row and head at a time."""
    B, heads, T, d_k = Q.shape
    out = torch.empty(B, heads, T, V.shape[-1], dtype=Q.dtype)
    for b in range(B):
        for h in range(heads):
            S = torch.zeros(V.shape[-1], d_k, dtype=Q.dtype)
            for t in range(T):
                k, a, bt = K[b, h, t], alpha[b, h, t], beta[b, h, t]
                S = S @ (a * (torch.eye(d_k) - bt * torch.outer(k, k)))
                S = S + bt * torch.outer(V[b, h, t], k)
                out[b, h, t] = S @ Q[b, h, t]
    return out


@pytest.mark.parametrize("gated", [False, True])
def test_delta_rule_recurrent_equals_parallel_and_the_reference(gated):
    Q, K, V = qkv(T=11)
    Q, K = (
        torch.nn.functional.normalize(Q, dim=-1),
        torch.nn.functional.normalize(K, dim=-1),
    )
    gen = torch.Generator().manual_seed(6)
    beta = torch.rand(2, 3, 11, generator=gen).double()
    alpha = (
        0.5 + 0.5 * torch.rand(2, 3, 11, generator=gen).double()
        if gated
        else None
    )
    first, S = v.delta_rule_recurrent(
        Q[:, :, :6],
        K[:, :, :6],
        V[:, :, :6],
        beta[..., :6],
        None if alpha is None else alpha[..., :6],
    )
    rest, _ = v.delta_rule_recurrent(
        Q[:, :, 6:],
        K[:, :, 6:],
        V[:, :, 6:],
        beta[..., 6:],
        None if alpha is None else alpha[..., 6:],
        S,
    )
    recurrent = torch.cat([first, rest], 2)
    assert_close(
        recurrent, v.delta_rule_parallel(Q, K, V, beta, alpha), **EXACT
    )
    ones = torch.ones_like(beta)
    want = reference_gated_delta(
        Q, K, V, beta, ones if alpha is None else alpha
    )
    assert_close(recurrent, want, **EXACT)


def test_a_decay_of_0_empties_the_state_in_both_forms():
    """alpha = [.5, .5, 0, .5, .5, .5]: the state after token 3 forgets
    tokens 1 and 2. The recurrence stays finite; the parallel form took
    log 0 - log 0 = NaN for every pair that the zero separates."""
    Q, K, V = qkv(B=1, heads=1, T=6)
    Q = torch.nn.functional.normalize(Q, dim=-1)
    K = torch.nn.functional.normalize(K, dim=-1)
    beta = torch.full((1, 1, 6), 0.5, dtype=torch.float64)
    alpha = torch.tensor([[[0.5, 0.5, 0.0, 0.5, 0.5, 0.5]]]).double()
    recurrent, _ = v.delta_rule_recurrent(Q, K, V, beta, alpha)
    parallel = v.delta_rule_parallel(Q, K, V, beta, alpha)
    assert torch.isfinite(parallel).all()
    assert_close(parallel, recurrent, **EXACT)
    after, _ = v.delta_rule_recurrent(  # tokens 3 to 6 alone, from S = 0
        Q[:, :, 2:], K[:, :, 2:], V[:, :, 2:], beta[..., 2:], alpha[..., 2:]
    )
    assert_close(parallel[:, :, 2:], after, **EXACT)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_delta_rule_parallel_equals_the_recurrence_with_zero_decays(dtype):
    """Zeros first, last, side by side and alone, in some heads only."""
    Q, K, V = (t.to(dtype) for t in qkv(T=11))
    Q = torch.nn.functional.normalize(Q, dim=-1)
    K = torch.nn.functional.normalize(K, dim=-1)
    gen = torch.Generator().manual_seed(7)
    beta = torch.rand(2, 3, 11, generator=gen).to(dtype)
    alpha = (0.5 + 0.5 * torch.rand(2, 3, 11, generator=gen)).to(dtype)
    alpha[0, 0, 0] = alpha[0, 1, 4] = alpha[0, 1, 10] = 0
    alpha[1, 2, 5:7] = alpha[1, 0, 3] = alpha[1, 0, 8] = 0
    recurrent, _ = v.delta_rule_recurrent(Q, K, V, beta, alpha)
    parallel = v.delta_rule_parallel(Q, K, V, beta, alpha)
    atol = 1e-10 if dtype == torch.float64 else 1e-5
    assert_close(parallel, recurrent, rtol=0, atol=atol)


def test_a_gate_that_underflows_to_0_gives_the_cached_outputs():
    """float32's sigmoid is exactly 0 below about -89: a Gated DeltaNet
    layer whose decay gate sits there, uncached (parallel) and cached
    (recurrent)."""
    torch.manual_seed(14)
    layer = v.LinearAttention(D, H, rule="gated_delta")
    with torch.no_grad():
        layer.alpha_proj.bias[0] = -200.0  # head 0: alpha_t = 0
    x = torch.randn(2, 7, D)
    assert (layer.gates(x)[1][:, 0] == 0).all()
    with torch.no_grad():
        uncached, _ = layer(x)
        cache = layer.new_cache()
        cached = torch.cat(
            [layer(x[:, :3], cache=cache)[0]]
            + [layer(x[:, t : t + 1], cache=cache)[0] for t in range(3, 7)],
            dim=1,
        )
    assert torch.isfinite(uncached).all()
    assert_close(uncached, cached, rtol=0, atol=1e-5)


@pytest.mark.parametrize("rule", ["linear", "delta", "gated_delta"])
def test_state_cache_has_a_fixed_size(rule):
    model = variant_gpt(lambda i: v.LinearAttention(D, H, rule=rule))
    sizes = []
    for T in (6, 15):
        _, caches = decode_gap(model, T=T, prefill=3)
        sizes.append([c.nbytes() for c in caches])
    d_k = D // H
    z = 0 if rule != "linear" else H * d_k
    assert sizes[0] == sizes[1] == [2 * (H * d_k * d_k + z) * 8] * LAYERS
    cache = caches[0]
    cache.crop(15)  # keeping every token is possible
    with pytest.raises(ValueError, match="cannot forget"):
        cache.crop(14)


@pytest.mark.parametrize("name", ["elu", "softmax", "", None])
def test_invalid_feature_map(name):
    with pytest.raises(ValueError, match="feature map"):
        v.LinearAttention(D, H, phi=name)


@pytest.mark.parametrize("decay", [0, 0.0, -0.5, 1.5, 2, float("nan"), True])
def test_fixed_decay_outside_0_1(decay):
    with pytest.raises(ValueError, match="decay"):
        v.LinearAttention(D, H, rule="gated_delta", decay=decay)


def test_fixed_decay_bounds_and_rules():
    v.LinearAttention(D, H, rule="gated_delta", decay=1.0)  # allowed
    v.LinearAttention(D, H, rule="gated_delta", decay=1e-3)
    with pytest.raises(ValueError, match="gated_delta"):
        v.LinearAttention(D, H, rule="delta", decay=0.5)
    with pytest.raises(ValueError, match="rule"):
        v.LinearAttention(D, H, rule="mamba")


# --- sparse top-k attention -------------------------------------------------


def test_sparse_with_k_at_least_T_is_causal_attention_exactly():
    torch.manual_seed(7)
    T = 10
    sparse = v.SparseAttention(D, H, k=T).double()
    dense = transformer.RotarySelfAttention(D, H, causal=True).double()
    dense.load_state_dict(
        {n: p for n, p in sparse.state_dict().items() if "index" not in n}
    )
    x = torch.randn(2, T, D, dtype=torch.float64)
    for k in (T, T + 3):
        sparse.k = k
        assert torch.equal(sparse(x)[0], dense(x)[0])
        assert torch.equal(sparse(x)[1], dense(x)[1])


def brute_force_top_k(scores, k):
    """For each query t, its k best keys s <= t: sorted by (-score, s)."""
    B, T, T_k = scores.shape
    chosen = torch.zeros(B, T, T_k, dtype=torch.bool)
    for b in range(B):
        for t in range(T):
            ranked = sorted(range(t + 1), key=lambda s: (-scores[b, t, s], s))
            chosen[b, t, ranked[:k]] = True
    return chosen


@pytest.mark.parametrize("k", [1, 3, 7, 20])
def test_top_k_mask_equals_brute_force_with_ties_to_the_earlier_key(k):
    gen = torch.Generator().manual_seed(8)
    T = 17
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    real = torch.randn(2, T, T, generator=gen).double()
    tied = torch.randint(3, (2, T, T), generator=gen).double()  # many ties
    for scores in (real, tied):
        assert torch.equal(
            v.top_k_mask(scores, causal, k), brute_force_top_k(scores, k)
        )
    flat = torch.zeros(1, T, T, dtype=torch.float64)  # all tied: the first k
    assert torch.equal(
        v.top_k_mask(flat, causal, k)[0], causal & (torch.arange(T) < k)
    )


def test_indexer_scores_equal_the_sum_over_heads():
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(2, 5, 3, 4, generator=gen).double()
    w = torch.randn(2, 5, 3, generator=gen).double()
    k = torch.randn(2, 6, 4, generator=gen).double()
    want = torch.zeros(2, 5, 6, dtype=torch.float64)
    for b in range(2):
        for t in range(5):
            for s in range(6):
                for j in range(3):
                    want[b, t, s] += w[b, t, j] * max(q[b, t, j] @ k[b, s], 0)
    assert_close(v.indexer_scores(q, w, k), want, **EXACT)


def test_sparse_chooses_the_top_k_of_its_indexer():
    torch.manual_seed(10)
    layer = v.SparseAttention(D, H, k=3).double()
    _, weights = layer(torch.randn(2, 12, D, dtype=torch.float64))
    scores, _, chosen = layer.index
    assert torch.equal(chosen, brute_force_top_k(scores, 3))
    assert torch.equal(weights > 0, chosen[:, None].expand_as(weights))


def test_sparse_cache_counts_the_indexer_keys():
    model = variant_gpt(VARIANTS["sparse"])
    _, caches = decode_gap(model, T=11)
    d_k = D // H
    for cache in caches:
        *_, k_I = cache.tensors
        assert k_I.shape == (2, 11, 6)
        assert cache.nbytes() == 2 * 11 * (2 * H * d_k + 6) * 8


def test_indexer_kl_equals_a_direct_computation():
    gen = torch.Generator().manual_seed(11)
    B, heads, T = 2, 3, 6
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    weights = torch.rand(B, heads, T, T, generator=gen).double() * causal
    weights = weights / weights.sum(-1, keepdim=True)
    scores = torch.randn(B, T, T, generator=gen).double().requires_grad_()
    for allowed in (causal, v.top_k_mask(scores.detach(), causal, 2)):
        want = 0.0
        for b in range(B):
            for t in range(T):
                keys = [
                    s
                    for s in range(T)
                    if allowed[..., t, s].flatten()[
                        b if allowed.dim() == 3 else 0
                    ]
                ]
                p = torch.stack([weights[b, :, t, s].sum() for s in keys])
                p = p / p.sum()
                q = torch.softmax(
                    torch.stack([scores[b, t, s] for s in keys]), 0
                )
                want = want + (p * (p / q).log()).sum()
        got = v.indexer_kl(weights, scores, allowed)
        assert_close(got, want, **EXACT)
        (g,) = torch.autograd.grad(got, scores)
        (g_want,) = torch.autograd.grad(want, scores)
        assert_close(g, g_want, **EXACT)  # the same gradient to the indexer


@pytest.mark.parametrize("k", [0, -2, 1.5, True, None])
def test_sparse_k_below_1(k):
    with pytest.raises(ValueError, match="k must"):
        v.SparseAttention(D, H, k=k)
    with pytest.raises(ValueError, match="k must"):
        v.top_k_mask(
            torch.zeros(1, 2, 2), torch.ones(2, 2, dtype=torch.bool), k
        )


def test_the_feature_map_is_elu_plus_one():
    x = torch.linspace(-4, 4, 81, dtype=torch.float64)
    want = torch.where(x > 0, x + 1, x.exp())  # elu(x) + 1, always > 0
    assert_close(v.feature_map("elu+1")(x), want, **EXACT)


@pytest.mark.parametrize("decay", [None, 0.8])
def test_gated_deltanet_layer_equals_the_reference(decay):
    """The layer's L2-normalised queries and keys, sigmoid gates per head
    and output projection, recomputed here from its weights."""
    torch.manual_seed(12)
    layer = v.LinearAttention(D, H, "gated_delta", decay=decay).double()
    x = torch.randn(2, 9, D, dtype=torch.float64)
    q, k, val = (x @ layer.in_proj.weight.T + layer.in_proj.bias).chunk(3, -1)
    Q, K, V = (t.view(2, 9, H, D // H).transpose(1, 2) for t in (q, k, val))
    Q, K = Q / Q.norm(dim=-1, keepdim=True), K / K.norm(dim=-1, keepdim=True)
    beta = torch.sigmoid(x @ layer.beta_proj.weight.T + layer.beta_proj.bias)
    if decay is None:
        alpha = x @ layer.alpha_proj.weight.T + layer.alpha_proj.bias
        alpha = torch.sigmoid(alpha)
    else:
        alpha = torch.full_like(beta, decay)
    out = reference_gated_delta(
        Q, K, V, beta.transpose(1, 2), alpha.transpose(1, 2)
    )
    want = layer.out_proj(out.transpose(1, 2).reshape(2, 9, D))
    got, weights = layer(x)
    assert weights is None  # no weight matrix
    assert_close(got, want, **EXACT)


def test_a_detached_indexer_passes_no_gradient_to_its_input():
    torch.manual_seed(13)
    layer = v.SparseAttention(D, H, k=2).double()
    x = torch.randn(1, 7, D, dtype=torch.float64, requires_grad=True)
    for detach in (False, True):
        layer.detach_indexer = detach
        _, weights = layer(x)
        scores, allowed, _ = layer.index
        loss = v.indexer_kl(weights, scores, allowed)
        (grad,) = torch.autograd.grad(loss, x, allow_unused=True)
        assert (grad is None) == detach


# --- gpt.train's extra_loss and chapter 12's trained models -----------------


def train_reference(model, data, steps, B, T, lr, seed):
    """gpt.train as it was before extra_loss: chapter 10's stored weights
    were trained by this loop."""
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * (1 - step / steps)
        x, y = gpt.get_batch(data, B, T, gen)
        loss = torch.nn.functional.cross_entropy(
            model(x).flatten(0, 1), y.flatten()
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def small_trainee(attention=None, seed=0):
    torch.manual_seed(seed)
    return gpt.GPT(VOCAB, d=16, H=2, layers=2, d_ff=24, attention=attention)


TRAIN = {"steps": 3, "B": 2, "T": 8, "lr": 0.01, "seed": 5}
DATA = torch.arange(200) % VOCAB


def test_train_without_extra_loss_equals_the_old_loop_bit_for_bit():
    model, reference = small_trainee(), small_trainee()
    losses = gpt.train(model, DATA, **TRAIN)
    assert losses == train_reference(reference, DATA, **TRAIN)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_a_constant_extra_loss_changes_nothing_and_is_not_logged():
    """The returned losses are the cross-entropy alone, and extra_loss is
    called once per step with that step's weights (B, layers, H, T, T)."""
    model, reference = small_trainee(), small_trainee()
    calls = []

    def extra(step, weights):
        calls.append((step, tuple(weights.shape)))
        return torch.tensor(5.0)

    losses = gpt.train(model, DATA, **TRAIN, extra_loss=extra)
    assert losses == train_reference(reference, DATA, **TRAIN)
    assert calls == [(s, (2, 2, 2, 8, 8)) for s in range(TRAIN["steps"])]


def sparse_trainee():
    return small_trainee(lambda i: v.SparseAttention(16, 2, k=3, d_I=4))


def indexer_loss(layers):
    """extra_loss: the sparse layers' indexer KL, summed."""

    def kl(step, weights):
        return sum(
            v.indexer_kl(weights[:, i], layer.index[0], layer.index[2])
            for i, layer in enumerate(layers)
        )

    return kl


def recorder(grads):
    """A tensor hook that appends the size of each gradient to grads."""
    return lambda g: grads.append(g.abs().sum().item())


def test_the_extra_losss_gradient_reaches_the_indexer():
    """Top-k passes no gradient: without extra_loss no gradient reaches
    the indexer; the indexer's KL through extra_loss gives it a nonzero
    one at every step."""
    for with_kl in (False, True):
        model = sparse_trainee()
        layers = [b.self_attn for b in model.blocks]
        grads = []
        for layer in layers:
            layer.detach_indexer = True
            for p in (layer.index_q.weight, layer.index_k.weight):
                p.register_hook(recorder(grads))
        kl = indexer_loss(layers) if with_kl else None
        gpt.train(model, DATA, **TRAIN, extra_loss=kl)
        if with_kl:
            assert len(grads) == 4 * TRAIN["steps"] and min(grads) > 0
        else:
            assert grads == []


def test_build_variant_seeds_and_sizes():
    """A variant without its own attention is GPT with its keyword
    arguments (they override `sizes`), built after seeding its seed."""
    sizes = {"d": 16, "H": 4, "d_ff": 24}
    for name, (seed, kwargs) in v.VARIANTS.items():
        model, got = v.build_variant(name, VOCAB, **sizes)
        assert got == seed
        if "attention" in kwargs:
            continue
        torch.manual_seed(seed)
        direct = gpt.GPT(VOCAB, **{**sizes, **kwargs})
        assert list(model.state_dict()) == list(direct.state_dict())
        for p, q in zip(model.parameters(), direct.parameters()):
            assert torch.equal(p, q)
    with pytest.raises(ValueError, match="unknown variant"):
        v.build_variant("mha", VOCAB)


def test_seeds_1_and_2_of_the_paired_variants():
    """gqa_seed1 is gqa built and trained from seed 1, and so on for every
    variant chapter 12 pairs with MHA; the window model of a seed starts
    from MHA's initial weights of that seed (same shapes, same order)."""
    for name in v.PAIRED:
        for seed in (1, 2):
            assert v.VARIANTS[f"{name}_seed{seed}"] == (
                seed,
                v.VARIANTS[name][1],
            )
    for seed in (1, 2):
        window = v.build_variant(f"window_seed{seed}", VOCAB)[0].state_dict()
        mha = v.build_variant(f"mha_seed{seed}", VOCAB)[0].state_dict()
        assert list(window) == list(mha)
        assert all(torch.equal(window[k], mha[k]) for k in mha)


def test_the_variants_are_what_chapter_12_says():
    vocab = 65

    def count(model):
        return sum(p.numel() for p in model.parameters())

    def build(name):
        return v.build_variant(name, vocab)[0]

    mha = count(gpt.GPT(vocab))
    wide = count(build("mqa_wide"))
    for d_ff in range(200, 400):  # no other width comes as close
        other = count(gpt.GPT(vocab, G=1, d_ff=d_ff))
        assert d_ff == v.MQA_WIDE_D_FF or abs(other - mha) > abs(wide - mha)
    assert [b.self_attn.G for b in build("gqa").blocks] == [2, 2]
    assert build("window").w == 32
    hybrid = [type(b.self_attn) for b in build("hybrid").blocks]
    assert hybrid == [v.LinearAttention, transformer.RotarySelfAttention]
    assert build("hybrid").blocks[0].self_attn.rule == "gated_delta"
    assert [b.self_attn.source for b in build("cla").blocks] == [None, 0]
    mla = build("mla").blocks[1].self_attn
    assert (mla.d_c, mla.d_R) == (v.D_C, v.D_R) == (16, 8)
    assert [b.self_attn.k for b in build("sparse").blocks] == [32, 32]


def test_gpt_refuses_g_or_w_with_a_variant():
    for extra in ({"G": 1}, {"w": 8}):
        with pytest.raises(
            ValueError, match="G, w and backend set chapter 10's"
        ):
            gpt.GPT(VOCAB, d=D, H=H, attention=VARIANTS["mla"], **extra)


def test_a_feature_map_only_for_linear_attention():
    with pytest.raises(ValueError, match='phi belongs to rule="linear"'):
        v.LinearAttention(D, H, rule="delta", phi="relu")


# --- bad input (issue 47 item 7) and empty query sequences ------------------


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_a_variant_gives_an_empty_result_for_no_query(name):
    """As SDPA: no query, no output; in a cached call too, which leaves
    the cache's length as it was."""
    model = variant_gpt(VARIANTS[name])
    x = tokens(5)
    with torch.no_grad():
        assert model(x[:, :0]).shape == (2, 0, VOCAB)
        caches = model.new_caches()
        model(x, caches)
        assert model(x[:, :0], caches).shape == (2, 0, VOCAB)
        assert model(x[:, :0]).shape == (2, 0, VOCAB)
    assert all(c.length == 5 for c in caches)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_a_variant_refuses_a_bad_x(name):
    layer = VARIANTS[name](0).double()
    for x in (torch.randn(2, 4, D + 1).double(), torch.randn(4, D).double()):
        with pytest.raises(
            ValueError, match=r"x must have shape \(B, T, 24\)"
        ):
            layer(x)
    for x in (torch.randn(2, 4, D), torch.ones(2, 4, D, dtype=torch.long)):
        with pytest.raises(ValueError, match="mixed dtypes: x is"):
            layer(x)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_a_cache_refuses_another_batch(name):
    layer = VARIANTS[name](0).double()
    cache = layer.new_cache()
    layer(torch.randn(2, 4, D).double(), cache=cache)
    with pytest.raises(ValueError, match="one cache per batch"):
        layer(torch.randn(3, 1, D).double(), cache=cache)


def test_cla_refuses_a_layer_before_its_source_or_another_batch():
    layers = v.cross_layer(D, H, [None, 0])
    first, second = layers(0).double(), layers(1).double()
    x = torch.randn(2, 4, D).double()
    with pytest.raises(ValueError, match="layer 0 has not run yet"):
        second(x)
    first(x)
    with pytest.raises(ValueError, match="layer 0's keys holds 2"):
        second(torch.randn(3, 4, D).double())
    for i in ("0", 1.5, True):
        with pytest.raises(ValueError, match="does not exist"):
            layers(i)


def gated_inputs(T=7):
    """Q, K, V (2, 3, T, 4 or 5), beta and alpha (2, 3, T), float64."""
    Q, K, V = qkv(T=T)
    gen = torch.Generator().manual_seed(15)
    beta, alpha = torch.rand(2, 2, 3, T, generator=gen).double()
    return Q, K, V, beta, alpha


def test_the_recurrences_give_an_empty_result_for_no_token():
    Q, K, V, beta, alpha = (t[:, :, :0] for t in gated_inputs())
    out, S = v.delta_rule_recurrent(Q, K, V, beta, alpha)
    assert out.shape == (2, 3, 0, 5) and torch.equal(
        S, torch.zeros(2, 3, 4, 5)
    )
    assert v.delta_rule_parallel(Q, K, V, beta, alpha).shape == (2, 3, 0, 5)
    out, (S, z) = v.linear_attention_recurrent(Q, K, V)
    assert out.shape == (2, 3, 0, 5) and not z.any()
    assert v.linear_attention_parallel(Q, K, V).shape == (2, 3, 0, 5)


def delta_calls(Q, K, V, beta, alpha, S=None, z=None):
    """The four functions of the linear-attention section on these inputs."""
    state = None if S is None else (S, z)
    return [
        lambda: v.delta_rule_recurrent(Q, K, V, beta, alpha, S),
        lambda: v.delta_rule_parallel(Q, K, V, beta, alpha),
        lambda: v.linear_attention_recurrent(Q, K, V, state),
        lambda: v.linear_attention_parallel(Q, K, V),
    ]


def bad_recurrence_inputs():
    """(what is changed, the message's start): for every function."""
    Q, K, V, _, _ = gated_inputs()
    nan = Q.clone()
    nan[0, 0, 0, 0] = float("nan")
    return [
        ({"Q": Q.float()}, "mixed dtypes"),
        ({"Q": Q.long()}, "Q must be a floating-point"),
        ({"K": K.numpy()}, "K must be a floating-point"),
        ({"Q": nan}, "Q contains NaN"),
        ({"Q": Q[0]}, r"Q must have shape \(B, H, T, d_k\)"),
        ({"K": K[:, :, :-1]}, r"K must have shape \(B, H, T, d_k\)"),
        ({"K": K[..., :3]}, r"K must have shape \(B, H, T, d_k\)"),
        ({"V": V[:1]}, r"V must have shape \(B, H, T, d_v\)"),
    ]


@pytest.mark.parametrize("change, message", bad_recurrence_inputs())
def test_the_recurrences_refuse_bad_tensors(change, message):
    Q, K, V, beta, alpha = gated_inputs()
    args = {"Q": Q, "K": K, "V": V, **change}
    for call in delta_calls(args["Q"], args["K"], args["V"], beta, alpha):
        with pytest.raises(ValueError, match=message):
            call()


def test_the_delta_rules_refuse_bad_gates_and_states():
    Q, K, V, beta, alpha = gated_inputs()
    for function in (v.delta_rule_recurrent, v.delta_rule_parallel):
        with pytest.raises(ValueError, match="beta must have shape"):
            function(Q, K, V, beta[..., :-1], alpha)
        with pytest.raises(ValueError, match="alpha must have shape"):
            function(Q, K, V, beta, alpha[0])
        with pytest.raises(ValueError, match="mixed dtypes"):
            function(Q, K, V, beta.float(), alpha)
        with pytest.raises(ValueError, match="beta must be a floating"):
            function(Q, K, V, None, alpha)
        for bad in (-0.1, 1.5):
            with pytest.raises(ValueError, match="alpha must lie in"):
                function(Q, K, V, beta, alpha.clone().fill_(bad))
        with pytest.raises(ValueError, match="alpha contains NaN"):
            function(Q, K, V, beta, alpha.clone().fill_(float("nan")))
    with pytest.raises(ValueError, match="the state S must have shape"):
        v.delta_rule_recurrent(
            Q, K, V, beta, alpha, torch.zeros(2, 3, 4, 4).double()
        )
    S, z = torch.zeros(2, 3, 4, 5).double(), torch.zeros(2, 3, 4).double()
    with pytest.raises(ValueError, match="the state S must have shape"):
        v.linear_attention_recurrent(Q, K, V, (S[:1], z))
    with pytest.raises(ValueError, match="the normaliser z must have shape"):
        v.linear_attention_recurrent(Q, K, V, (S, z[..., :3]))
    with pytest.raises(ValueError, match="a tuple"):
        v.linear_attention_recurrent(Q, K, V, S)


def indexer_inputs():
    gen = torch.Generator().manual_seed(16)
    q = torch.randn(2, 5, 3, 4, generator=gen).double()
    w = torch.randn(2, 5, 3, generator=gen).double()
    k = torch.randn(2, 6, 4, generator=gen).double()
    return q, w, k


def test_the_indexer_refuses_bad_tensors():
    q, w, k = indexer_inputs()
    assert v.indexer_scores(q[:, :0], w[:, :0], k).shape == (2, 0, 6)
    for args, message in [
        ((q.float(), w, k), "mixed dtypes"),
        ((q[0], w, k), r"q_I must have shape \(B, T, H_I, d_I\)"),
        ((q, w[..., :2], k), r"w_I must have shape \(B, T, H_I\)"),
        ((q, w, k[..., :3]), r"k_I must have shape \(B, T_k, d_I\)"),
        ((q, w, k[:1]), r"k_I must have shape \(B, T_k, d_I\)"),
        ((q, w, k[:, :0]), "at least one key"),
    ]:
        with pytest.raises(ValueError, match=message):
            v.indexer_scores(*args)


def test_top_k_and_the_kl_refuse_bad_masks_and_scores():
    T = 5
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    scores = torch.randn(2, T, T, dtype=torch.float64)
    weights = torch.softmax(scores.masked_fill(~causal, -torch.inf), -1)
    weights = weights[:, None].expand(2, 3, T, T)
    assert v.top_k_mask(scores[:, :0], causal[:0], 2).shape == (2, 0, T)
    assert v.indexer_kl(weights[:, :, :0], scores[:, :0], causal[:0]) == 0
    nan, inf, minus_inf = scores.clone(), scores.clone(), scores.clone()
    nan[0, 0, 0] = float("nan")
    inf[0, 1, 1] = float("inf")  # the KL would be NaN, top-k keep it silently
    minus_inf[0, 1, 1] = float("-inf")  # the KL would be inf
    for s, allowed, message in [
        (scores, causal.double(), "allowed must be a boolean"),
        (scores, causal[:-1], r"allowed must have shape \(T, T_k\)"),
        (scores, causal[None].expand(3, T, T), "allowed must have shape"),
        (scores[0], causal, r"scores must have shape \(B, T, T_k\)"),
        (scores[..., :0], causal[:, :0], "scores must have shape"),
        (nan, causal, "scores contain NaN"),
        (inf, causal, "scores contain NaN or an infinity"),
        (minus_inf, causal, "scores contain NaN or an infinity"),
        (scores.long(), causal, "scores must be a floating-point"),
    ]:
        with pytest.raises(ValueError, match=message):
            v.top_k_mask(s, allowed, 2)
        with pytest.raises(ValueError, match=message):
            v.indexer_kl(weights, s, allowed)
    with pytest.raises(ValueError, match=r"weights must have shape"):
        v.indexer_kl(weights[:, :, :-1], scores, causal)
    with pytest.raises(ValueError, match="mixed dtypes"):
        v.indexer_kl(weights.float(), scores, causal)
    no_key = causal.clone()
    no_key[3] = False  # query 3 may see no key: p_3 would be 0 / 0
    with pytest.raises(ValueError, match="no weight on its allowed keys"):
        v.indexer_kl(weights, scores, no_key)


def test_indexer_kl_refuses_weights_not_a_tensor_or_negative():
    """The weights are checked before they are used: NumPy, None or a list
    is named as not a tensor (no AttributeError from .detach()); negative
    weights whose rows still sum above 0 are refused, where xlogy would
    return NaN."""
    T = 4
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(1, T, T, dtype=torch.float64, generator=gen)
    weights = torch.softmax(scores.masked_fill(~causal, -torch.inf), -1)
    weights = weights[:, None].expand(1, 2, T, T).contiguous()
    for bad in (weights.numpy(), None, weights.tolist()):
        with pytest.raises(ValueError, match="must be a floating-point torch"):
            v.indexer_kl(bad, scores, causal)
    negative = weights.clone()
    negative[0, 0, 3, 0] = -0.1  # query 3's weights still sum to 1.9 > 0
    with pytest.raises(ValueError, match="weights must be >= 0"):
        v.indexer_kl(negative, scores, causal)


def test_build_variant_refuses_a_bad_vocabulary_or_size():
    for vocab in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="vocab must be"):
            v.build_variant("gqa", vocab)
    with pytest.raises(ValueError, match=r"unknown sizes \['width'\]"):
        v.build_variant("gqa", VOCAB, width=32)
