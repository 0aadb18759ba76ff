"""Chapter 12's attention variants, each a layer that `GPT(attention=...)`
puts in place of chapter 10's rotary self-attention (book/gpt.py).

Every variant layer is called as `layer(x, mask=None, cache=None)` with x
(B, T, d) and returns the outputs (B, T, d) and its weights (B, H, T, T_k),
or None when it has no weight matrix (linear attention). Every variant is
causal and takes no mask. `layer.new_cache()` gives the layer's own empty
cache, which `GPT.new_caches()` asks for:

- `MultiHeadLatentAttention` caches a latent per token (`LatentCache`),
  DeepSeek-V2 (arXiv 2405.04434), section 2.1;
- `cross_layer` builds layers that reuse an earlier layer's keys and values
  (`CrossLayerAttention`, `SharedCache`), Brandon et al. 2024 (arXiv
  2405.12981);
- `LinearAttention` keeps a state of fixed size (`StateCache`): linear
  attention (Katharopoulos et al. 2020, sections 3.2-3.4), the delta rule
  (Schlag et al. 2021) and Gated DeltaNet (Yang, Kautz and Hatamizadeh,
  ICLR 2025, arXiv 2412.06464);
- `SparseAttention` attends to the k keys a lightning indexer scores
  highest (`SparseCache`), DeepSeek-V3.2-Exp's report, section 1
  (equations 1 and 2), and the indexer's loss of its continued
  pre-training (`indexer_kl`).
"""

import torch
import torch.nn.functional as F
from torch import nn

from gpt import GPT
from transformer import (
    Cache,
    KVCache,
    RotarySelfAttention,
    allowed_positions,
    attend,
    check_heads,
    check_vectors,
    rotary,
)


def check_no_mask(mask):
    """Raise ValueError if a mask is given: the variants are causal."""
    if mask is not None:
        raise ValueError("the attention variants are causal and take no mask")


def check_cache(cache, kind, layer):
    """Raise ValueError unless cache is a `kind` (the layer's own)."""
    if not isinstance(cache, kind):
        raise ValueError(
            f"{type(layer).__name__} needs a {kind.__name__}, got a "
            f"{type(cache).__name__}: make it with the layer's new_cache()"
        )


def next_positions(cache, T):
    """Positions (T,) of the next T tokens: 0...T-1 without a cache."""
    return torch.arange(T) if cache is None else cache.next_positions(T)


def merge_heads(out):
    """(B, H, T, d_k) -> (B, T, H d_k): the heads side by side."""
    B, H, T, d_k = out.shape
    return out.transpose(1, 2).reshape(B, T, H * d_k)


def held_bytes(tensors):
    """Bytes of the tensors a cache holds (None: nothing yet)."""
    if tensors is None:
        return 0
    return sum(x.nelement() * x.element_size() for x in tensors)


def check_positive_int(value, name):
    """Raise ValueError unless value is an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def check_floats(**tensors):
    """Raise ValueError unless every tensor given (by name) is a floating-
    point torch tensor with finite entries, all of one dtype."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            got = getattr(t, "dtype", type(t).__name__)
            raise ValueError(
                f"{name} must be a floating-point torch tensor, got {got}"
            )
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) > 1:
        got = ", ".join(f"{name} {t.dtype}" for name, t in tensors.items())
        raise ValueError(f"mixed dtypes: {got}; convert them to one")
    for name, t in tensors.items():
        if not torch.isfinite(t).all():
            raise ValueError(f"{name} contains NaN or infinite values")


def check_shape(t, name, **sizes):
    """Raise ValueError unless t has one axis per named size, of that size
    (None: any), e.g. check_shape(V, "V", B=2, H=3, T=9, d_v=None)."""
    fits = t.dim() == len(sizes) and all(
        n is None or n == got for n, got in zip(sizes.values(), t.shape)
    )
    if not fits:
        names = ", ".join(sizes)
        want = ", ".join(
            "any" if n is None else str(n) for n in sizes.values()
        )
        raise ValueError(
            f"{name} must have shape ({names}) = ({want}), got "
            f"{tuple(t.shape)}"
        )


def check_heads_inputs(Q, K, V, gates=None, state=None):
    """Raise ValueError unless the inputs of the linear-attention functions
    fit: Q, K (B, H, T, d_k), V (B, H, T, d_v), the gates (a dict, name:
    (B, H, T)), the decay gate alpha in [0, 1], and the state (a
    dict, name: tensor or None: S (B, H, d_k, d_v), z (B, H, d_k)), all
    floating point, finite, of one dtype. Returns (B, H, T, d_k, d_v)."""
    gates = gates or {}
    state = {n: s for n, s in (state or {}).items() if s is not None}
    check_floats(Q=Q, K=K, V=V, **gates, **state)
    if Q.dim() != 4:
        raise ValueError(
            f"Q must have shape (B, H, T, d_k), got {tuple(Q.shape)}"
        )
    B, H, T, d_k = Q.shape
    check_shape(K, "K", B=B, H=H, T=T, d_k=d_k)
    check_shape(V, "V", B=B, H=H, T=T, d_v=None)
    d_v = V.shape[-1]
    for name, g in gates.items():
        check_shape(g, name, B=B, H=H, T=T)
    alpha = gates.get("alpha")
    if alpha is not None and not ((alpha >= 0) & (alpha <= 1)).all():
        raise ValueError("the decay gate alpha must lie in [0, 1]")
    if "S" in state:
        check_shape(state["S"], "the state S", B=B, H=H, d_k=d_k, d_v=d_v)
    if "z" in state:
        check_shape(state["z"], "the normaliser z", B=B, H=H, d_k=d_k)
    return B, H, T, d_k, d_v


def check_batch(held, new, what="the cache"):
    """Raise ValueError unless `held` (a tensor a cache or an earlier layer
    holds; None: nothing yet) has as many sequences (axis 0) as `new`, in
    its dtype."""
    if held is None:
        return
    if held.shape[0] != new.shape[0] or held.dtype != new.dtype:
        raise ValueError(
            f"{what} holds {held.shape[0]} sequences of {held.dtype}, this "
            f"call has {new.shape[0]} of {new.dtype}: one cache per batch"
        )


class GrowingCache(Cache):
    """A cache that keeps one row per token of each of its tensors (token
    axis -2) and grows by T rows per update; it keeps every token, so any
    causal layer may use it."""

    def __init__(self):
        self.length, self.tensors = 0, None

    def check_layer(self, w, causal):
        """Every token is kept: any layer may use it."""

    def update(self, *new):
        """Append the tensors of the next T tokens (token axis -2); return
        every token's tensors so far and their positions (T_k,)."""
        if self.tensors is None:
            self.tensors = new
        else:
            check_batch(self.tensors[0], new[0])
            self.tensors = tuple(
                torch.cat([old, x], dim=-2)
                for old, x in zip(self.tensors, new)
            )
        self.length += new[0].shape[-2]
        return (*self.tensors, torch.arange(self.length))

    def nbytes(self):
        """Bytes of every tensor held."""
        return held_bytes(self.tensors)

    def crop(self, n):
        """Keep the first n tokens."""
        self.check_crop(n)
        if self.tensors is not None:
            self.tensors = tuple(x[..., :n, :] for x in self.tensors)
        self.length = n


# Multi-head latent attention (DeepSeek-V2, section 2.1)


class LatentCache(GrowingCache):
    """MLA's cache: per token the latent c_KV (d_c numbers) and the rotary
    key k_R (d_R numbers, shared by the heads), nothing else.
    `update(c, k_R)` takes c (B, T, d_c) and k_R (B, T, d_R)."""


def check_latent(d_c, d_R):
    """Raise ValueError unless d_c >= 1 and d_R is even and >= 2."""
    check_positive_int(d_c, "the latent size d_c")
    if isinstance(d_R, bool) or not isinstance(d_R, int) or d_R < 2 or d_R % 2:
        raise ValueError(
            f"the rotary key size d_R must be an even integer >= 2 (RoPE "
            f"rotates pairs), got {d_R!r}"
        )


class MultiHeadLatentAttention(nn.Module):
    """Multi-head latent attention, DeepSeek-V2 section 2.1, equations
    9-19. Keys and values are rebuilt from a latent c_KV = W_DKV h (d_c
    per token, eq. 9) by W_UK and W_UV (eqs. 10-11); a rotary key k_R =
    RoPE(W_KR h) of size d_R is shared by the heads (eq. 15) and joined to
    each head's key (eq. 17), a rotary query part to each query (eqs. 14,
    16); the scale is sqrt(d_h + d_R) (eq. 18). Four departures from
    DeepSeek-V2: queries come from h directly (the compression of queries,
    eqs. 12-13, only saves activation memory in training); no RMSNorm
    after the latent and no extra scaling factor on it (section 3.1.2 adds
    both); and W_DKV, W_KR, W_O and the query projections have biases
    (DeepSeek's have none).

    RoPE is never applied to the rebuilt keys: a rotation between W_UK and
    the query would depend on the key's position, so W_UK could not be
    folded into the query (section 2.1.3). With `absorbed=True` it is:
    W_UK folded into each head's query and W_UV into the output
    projection, so that the keys and values are never rebuilt.
    """

    def __init__(self, d, H, d_c, d_R, absorbed=False):
        super().__init__()
        check_heads(d, H)
        check_latent(d_c, d_R)
        self.H, self.d_h, self.d_c, self.d_R = H, d // H, d_c, d_R
        self.absorbed = absorbed
        self.down_kv = nn.Linear(d, d_c)  # W_DKV, eq. 9
        self.up_k = nn.Linear(d_c, d, bias=False)  # W_UK, eq. 10
        self.up_v = nn.Linear(d_c, d, bias=False)  # W_UV, eq. 11
        self.query = nn.Linear(d, d)  # the content queries q_C
        self.rope_q = nn.Linear(d, H * d_R)  # W_QR, eq. 14
        self.rope_k = nn.Linear(d, d_R)  # W_KR, eq. 15
        self.out_proj = nn.Linear(d, d)  # W_O, eq. 19

    def new_cache(self):
        return LatentCache()

    def forward(self, x, mask=None, cache=None):
        check_no_mask(mask)
        check_vectors("x", x, self.out_proj.weight, type(self).__name__)
        B, T, _ = x.shape
        H, d_h, d_R = self.H, self.d_h, self.d_R
        pos_q = next_positions(cache, T)
        c = self.down_kv(x)  # (B, T, d_c)
        k_R = rotary(self.rope_k(x), pos_q)  # (B, T, d_R)
        pos_k = pos_q
        if cache is not None:
            check_cache(cache, LatentCache, self)
            c, k_R, pos_k = cache.update(c, k_R)  # every token's so far
        q_C = self.query(x).view(B, T, H, d_h).transpose(1, 2)
        q_R = rotary(self.rope_q(x).view(B, T, H, d_R).transpose(1, 2), pos_q)
        mask = allowed_positions(pos_q, pos_k)  # causal: (T, T_k)
        if self.absorbed:
            out, weights = self.attend_absorbed(q_C, q_R, c, k_R, mask)
        else:
            out, weights = self.attend_expanded(q_C, q_R, c, k_R, mask)
        return out, weights

    def attend_expanded(self, q_C, q_R, c, k_R, mask):
        """Keys and values rebuilt from c (B, T_k, d_c), eqs. 10-11, 16-19."""
        B, H, _, d_h = q_C.shape
        T_k = c.shape[1]
        k_C = self.up_k(c).view(B, T_k, H, d_h).transpose(1, 2)
        v_C = self.up_v(c).view(B, T_k, H, d_h).transpose(1, 2)
        Q = torch.cat([q_C, q_R], dim=-1)  # eq. 16
        K = torch.cat([k_C, k_R[:, None].expand(B, H, T_k, -1)], dim=-1)
        out, weights = attend(Q, K, v_C, mask)  # scale sqrt(d_h + d_R)
        return self.out_proj(merge_heads(out)), weights

    def attend_absorbed(self, q_C, q_R, c, k_R, mask):
        """The same from c without rebuilding keys or values: each head's
        query q_C becomes q_C W_UK (d_c numbers, with that head's slice of
        W_UK), and W_UV followed by that head's slice of the output
        projection maps its weighted latents to the output (W_O below is
        out_proj's weight, in DeepSeek's column form)."""
        H, d_h, d_c = self.H, self.d_h, self.d_c
        W_UK = self.up_k.weight.view(H, d_h, d_c)
        W_UV = self.up_v.weight.view(H, d_h, d_c)
        W_O = self.out_proj.weight.view(-1, H, d_h)  # (d, H, d_h)
        q_c = q_C @ W_UK  # (B, H, T, d_c): W_UK folded into the query
        scores = q_c @ c[:, None].transpose(-2, -1)  # (B, H, T, T_k)
        scores = scores + q_R @ k_R[:, None].transpose(-2, -1)
        scores = scores / (self.d_h + self.d_R) ** 0.5
        weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        o_c = weights @ c[:, None]  # (B, H, T, d_c): weighted latents
        W_OV = torch.einsum("ehk,hkc->hec", W_O, W_UV)  # (H, d, d_c)
        out = torch.einsum("bhtc,hec->bte", o_c, W_OV)
        return out + self.out_proj.bias, weights


# Cross-layer attention (Brandon et al. 2024)


class SharedCache(Cache):
    """The cache of a layer that reuses an earlier layer's keys and values:
    it counts the tokens seen and holds nothing (nbytes 0).
    `update(T)` counts T more tokens."""

    def __init__(self):
        self.length = 0

    def check_layer(self, w, causal):
        """It keeps nothing of its own: the earlier layer's cache does."""

    def update(self, T):
        self.length += T

    def nbytes(self):
        return 0

    def crop(self, n):
        self.check_crop(n)
        self.length = n


class CrossLayerAttention(RotarySelfAttention):
    """Causal rotary self-attention that shares keys and values across
    layers (cross-layer attention). With `source=None` the layer computes
    its keys and values and leaves them, with their positions, in `store`
    under its index `layer`; with `source=j`, it computes only queries (no
    key or value projection) and attends to layer j's keys and values of
    the same call. The layers of one model share one `store` (a dict):
    build them with `cross_layer`."""

    def __init__(self, d, H, G=None, layer=0, source=None, store=None):
        super().__init__(d, H, G, causal=True)
        check_source(layer, source)
        self.layer, self.source = layer, source
        self.store = {} if store is None else store
        if source is not None:
            self.in_proj = nn.Linear(d, d)  # W_Q and b_Q only

    def new_cache(self):
        return KVCache() if self.source is None else SharedCache()

    def forward(self, x, mask=None, cache=None):
        check_no_mask(mask)
        check_vectors("x", x, self.out_proj.weight, type(self).__name__)
        B, T, _ = x.shape
        pos_q = next_positions(cache, T)
        if self.source is None:
            Q, K, V = self.heads(x, pos_q)
            pos_k = pos_q
            if cache is not None:
                check_cache(cache, KVCache, self)
                check_batch(cache.K, x)
                K, V, pos_k = cache.update(K, V)
            self.store[self.layer] = K, V, pos_k  # for the layers sharing
        else:
            q = self.in_proj(x).view(B, T, self.H, self.d_k).transpose(1, 2)
            Q = rotary(q, pos_q)
            if self.source not in self.store:
                raise ValueError(
                    f"layer {self.source} has not run yet: run the layers "
                    f"in order"
                )
            K, V, pos_k = self.store[self.source]  # from this same call
            check_batch(K, x, f"layer {self.source}'s keys")
            if cache is not None:
                check_cache(cache, SharedCache, self)
                cache.update(T)
            seen = T if cache is None else cache.length  # tokens so far
            ends = int(pos_k.max()) + 1 if pos_k.numel() else 0
            if ends != seen:
                raise ValueError(
                    f"layer {self.source}'s keys end at position "
                    f"{ends - 1}, this layer's queries at {seen - 1}: run "
                    f"the layers in order"
                )
        mask = allowed_positions(pos_q, pos_k)
        if self.G != self.H:  # each key/value head serves H / G query heads
            K = K.repeat_interleave(self.H // self.G, dim=1)
            V = V.repeat_interleave(self.H // self.G, dim=1)
        out, weights = attend(Q, K, V, mask)
        return self.out_proj(merge_heads(out)), weights


def check_source(layer, source):
    """Raise ValueError unless source is None or an earlier layer."""
    if source is None:
        return
    if (
        isinstance(source, bool)
        or not isinstance(source, int)
        or not 0 <= source < layer
    ):
        raise ValueError(
            f"layer {layer} cannot reuse the keys and values of layer "
            f"{source!r}: it must be an earlier layer, 0 <= j < {layer}"
        )


def cross_layer(d, H, share, G=None):
    """`attention` for GPT: layer i reuses the keys and values of layer
    share[i], an earlier layer that computes its own, or computes its own
    if share[i] is None. [None, 0, None, 2] is CLA with a sharing factor
    of 2: layers 1 and 3 reuse layers 0 and 2."""
    share = list(share)
    for i, j in enumerate(share):
        check_source(i, j)
        if j is not None and share[j] is not None:
            raise ValueError(
                f"layer {i} reuses layer {j}, which itself reuses layer "
                f"{share[j]}: name layer {share[j]}"
            )
    store = {}  # keys and values of the current call, by layer

    def attention(i):
        if (
            isinstance(i, bool)
            or not isinstance(i, int)
            or not 0 <= i < len(share)
        ):
            raise ValueError(
                f"layer {i} does not exist in share, which has "
                f"{len(share)} layers"
            )
        return CrossLayerAttention(d, H, G, i, share[i], store)

    return attention


# Linear attention, the delta rule and Gated DeltaNet


FEATURE_MAPS = {"elu+1": lambda x: F.elu(x) + 1}  # Katharopoulos et al. 3.2


def feature_map(name):
    """The feature map phi called `name`; ValueError for an unknown name."""
    if name not in FEATURE_MAPS:
        raise ValueError(
            f"unknown feature map {name!r}: choose one of "
            f"{sorted(FEATURE_MAPS)}"
        )
    return FEATURE_MAPS[name]


def linear_attention_parallel(Q, K, V):
    """Causal linear attention of features Q, K = phi(queries), phi(keys)
    (B, H, T, d_k) and values V (B, H, T, d_v), all tokens at once
    (Katharopoulos et al. section 3.3): the masked phi(Q) phi(K)^T V,
    divided row by row by the masked phi(Q) phi(K)^T 1. (B, H, T, d_v).
    The features must make every such sum positive (phi > 0, as elu + 1):
    ValueError for a sum <= 0, which would give NaN or a sign flip."""
    check_heads_inputs(Q, K, V)
    A = (Q @ K.transpose(-2, -1)).tril()  # (B, H, T, T), key j <= query i
    denominators = A.sum(dim=-1, keepdim=True)
    check_denominators(denominators)
    return (A @ V) / denominators


def check_denominators(denominators):
    """Raise ValueError unless every phi(q_t) . z_t is positive."""
    if (denominators <= 0).any():
        raise ValueError(
            "a query's features phi(q_t) . z_t, summed over its allowed keys, "
            "is <= 0: linear attention needs positive features (elu + 1)"
        )


def linear_attention_recurrent(Q, K, V, state=None):
    """The same one token at a time (section 3.4): per head a state S
    (d_k, d_v) += phi(k) v^T and a normaliser z (d_k) += phi(k); the output
    is phi(q)^T S / phi(q)^T z, which must be positive (ValueError
    otherwise, as the parallel form). `state` (S, z) continues an earlier
    call; returns the outputs (B, H, T, d_v) and the new (S, z)."""
    if state is not None and (not isinstance(state, tuple) or len(state) != 2):
        raise ValueError("state must be None or a tuple (S, z)")
    S, z = (None, None) if state is None else state
    B, H, T, d_k, d_v = check_heads_inputs(Q, K, V, state={"S": S, "z": z})
    if state is None:
        S, z = Q.new_zeros(B, H, d_k, d_v), Q.new_zeros(B, H, d_k)
    outputs = []
    for t in range(T):
        q, k, v = Q[:, :, t], K[:, :, t], V[:, :, t]  # (B, H, d)
        S = S + k[..., :, None] * v[..., None, :]  # + phi(k_t) v_t^T
        z = z + k
        numerator = (q[..., None, :] @ S)[..., 0, :]  # (B, H, d_v)
        denominator = (q * z).sum(dim=-1, keepdim=True)
        check_denominators(denominator)
        outputs.append(numerator / denominator)
    if T == 0:  # no token: no output, the state unchanged
        return Q.new_zeros(B, H, 0, d_v), (S, z)
    return torch.stack(outputs, dim=2), (S, z)


def delta_rule_recurrent(Q, K, V, beta, alpha=None, S=None):
    """The gated delta rule one token at a time: per head a state S
    (d_k, d_v), S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1}
    + beta_t k_t v_t^T, output o_t = S_t^T q_t. Q, K (B, H, T, d_k) (L2-
    normalised for Gated DeltaNet), V (B, H, T, d_v), the update gate beta
    and the decay gate alpha (B, H, T); alpha None: 1, the delta rule of
    Schlag et al. 2021. No normaliser z. `S` continues an earlier call;
    returns the outputs (B, H, T, d_v) and the new S."""
    gates = {"beta": beta} if alpha is None else {"beta": beta, "alpha": alpha}
    B, H, T, d_k, d_v = check_heads_inputs(Q, K, V, gates, {"S": S})
    if S is None:
        S = Q.new_zeros(B, H, d_k, d_v)
    outputs = []
    for t in range(T):
        k, v = K[:, :, t, :, None], V[:, :, t, None, :]  # column, row
        b = beta[:, :, t, None, None]
        a = 1.0 if alpha is None else alpha[:, :, t, None, None]
        erased = S - b * k @ (k.transpose(-2, -1) @ S)  # (I - b k k^T) S
        S = a * erased + b * k @ v  # decay, then write
        outputs.append((Q[:, :, t, None, :] @ S)[..., 0, :])
    if T == 0:  # no token: no output, the state unchanged
        return Q.new_zeros(B, H, 0, d_v), S
    return torch.stack(outputs, dim=2), S


def delta_rule_parallel(Q, K, V, beta, alpha=None):
    """The outputs of `delta_rule_recurrent` (from S = 0) for all tokens at
    once, without a loop (the WY form of Yang et al. 2024, with decay).
    With gamma_t = alpha_1 ... alpha_t, the state is S_t = sum_{i<=t}
    (gamma_t / gamma_i) k_i u_i^T, where the written values u (B, H, T,
    d_v) solve u_i = beta_i (v_i - sum_{j<i} (gamma_i / gamma_j)
    (k_i . k_j) u_j), a triangular system; o_t = sum_{i<=t} (gamma_t /
    gamma_i) (q_t . k_i) u_i. A decay of exactly 0 (a sigmoid that
    underflowed) makes gamma_i / gamma_j = 0 for every j before it and i
    from it on: such pairs are found by counting the zeros, since
    log 0 - log 0 would be NaN."""
    gates = {"beta": beta} if alpha is None else {"beta": beta, "alpha": alpha}
    T = check_heads_inputs(Q, K, V, gates)[2]
    alpha = torch.ones_like(beta) if alpha is None else alpha
    zero = alpha == 0  # (B, H, T)
    log_gamma = alpha.masked_fill(zero, 1.0).log().cumsum(dim=-1)  # no 0s
    zeros = zero.cumsum(dim=-1)  # decays of 0 among alpha_1 ... alpha_t
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    no_zero = zeros[..., :, None] == zeros[..., None, :]  # none in (j, i]
    kept = causal & no_zero
    gaps = log_gamma[..., :, None] - log_gamma[..., None, :]
    decay = gaps.masked_fill(~kept, float("-inf")).exp()  # gamma_i/gamma_j
    earlier = (K @ K.transpose(-2, -1) * decay).tril(-1)  # j < i only
    system = torch.eye(T, dtype=Q.dtype) + beta[..., None] * earlier
    u = torch.linalg.solve_triangular(system, beta[..., None] * V, upper=False)
    return (Q @ K.transpose(-2, -1) * decay) @ u


def check_decay(decay):
    """Raise ValueError unless decay is None or a number in (0, 1]."""
    if decay is None:
        return
    if (
        isinstance(decay, bool)
        or not isinstance(decay, (int, float))
        or not 0 < decay <= 1
    ):
        raise ValueError(f"a fixed decay must lie in (0, 1], got {decay!r}")


class StateCache(Cache):
    """The state of a linear-attention layer: a fixed size whatever the
    number of tokens. `state` is None or a tuple of tensors, (S, z) for
    linear attention, (S,) for the delta rules; `update(state, T)` stores
    the state after T more tokens. A recurrence cannot be undone: crop(n)
    accepts only n = length."""

    def __init__(self):
        self.length, self.state = 0, None

    def check_layer(self, w, causal):
        """A recurrence sees every earlier token: any causal layer."""

    def update(self, state, T):
        self.state = state
        self.length += T

    def nbytes(self):
        return held_bytes(self.state)

    def crop(self, n):
        self.check_crop(n)
        if n != self.length:
            raise ValueError(
                f"cannot crop to {n} tokens: the state of {self.length} "
                f"tokens cannot forget the last ones"
            )


class LinearAttention(nn.Module):
    """A causal attention layer with a state of fixed size.

    rule="linear": linear attention with feature map phi (Katharopoulos et
    al. 2020); "delta": the delta rule with an update gate beta_t =
    sigmoid(W_beta x_t) per head (Schlag et al. 2021); "gated_delta": Gated
    DeltaNet (Yang, Kautz and Hatamizadeh 2025), the delta rule with a
    decay gate alpha_t = sigmoid(W_alpha x_t) per head, or a fixed `decay`
    in (0, 1]. The delta rules use L2-normalised queries and keys and no
    normaliser z. Left out of Gated DeltaNet: its short convolutions and
    output gate and norm, and the SiLU on queries, keys and values; its
    decay gate is a sigmoid, not the Mamba2-style gate of its released code. Without a
    cache the layer computes all tokens at once (the parallel forms); with
    one, token by token (the recurrent forms).
    It has no weight matrix: its weights are None.
    """

    RULES = ("linear", "delta", "gated_delta")

    def __init__(self, d, H, rule="linear", phi="elu+1", decay=None):
        super().__init__()
        check_heads(d, H)
        if rule not in self.RULES:
            raise ValueError(f"rule must be one of {self.RULES}, got {rule!r}")
        check_decay(decay)
        if phi != "elu+1" and rule != "linear":
            raise ValueError(
                f'a feature map phi belongs to rule="linear", not {rule!r}'
            )
        if decay is not None and rule != "gated_delta":
            raise ValueError('a fixed decay needs rule="gated_delta"')
        self.H, self.d_k, self.rule, self.decay = H, d // H, rule, decay
        self.phi = feature_map(phi)
        self.in_proj = nn.Linear(d, 3 * d)  # queries, keys, values
        if rule != "linear":
            self.beta_proj = nn.Linear(d, H)  # the update gate
        if rule == "gated_delta" and decay is None:
            self.alpha_proj = nn.Linear(d, H)  # the decay gate
        self.out_proj = nn.Linear(d, d)

    def new_cache(self):
        return StateCache()

    def gates(self, x):
        """beta and alpha (B, H, T) of x (B, T, d); alpha None for "delta"."""
        beta = torch.sigmoid(self.beta_proj(x)).transpose(1, 2)
        if self.rule == "delta":
            return beta, None
        if self.decay is not None:
            return beta, torch.full_like(beta, self.decay)
        return beta, torch.sigmoid(self.alpha_proj(x)).transpose(1, 2)

    def forward(self, x, mask=None, cache=None):
        check_no_mask(mask)
        check_vectors("x", x, self.out_proj.weight, type(self).__name__)
        B, T, _ = x.shape
        qkv = self.in_proj(x).view(B, T, 3, self.H, self.d_k)
        Q, K, V = qkv.permute(2, 0, 3, 1, 4)  # each (B, H, T, d_k)
        state = None
        if cache is not None:
            check_cache(cache, StateCache, self)
            state = cache.state
            check_batch(None if state is None else state[0], x)
        if self.rule == "linear":
            Q, K = self.phi(Q), self.phi(K)
            if cache is None:
                out = linear_attention_parallel(Q, K, V)
            else:
                out, state = linear_attention_recurrent(Q, K, V, state)
        else:
            Q, K = F.normalize(Q, dim=-1), F.normalize(K, dim=-1)
            beta, alpha = self.gates(x)
            if cache is None:
                out = delta_rule_parallel(Q, K, V, beta, alpha)
            else:
                S = None if state is None else state[0]
                out, S = delta_rule_recurrent(Q, K, V, beta, alpha, S)
                state = (S,)
        if cache is not None:
            cache.update(state, T)
        return self.out_proj(merge_heads(out)), None


# Sparse top-k attention (DeepSeek-V3.2-Exp)


class SparseCache(GrowingCache):
    """The sparse layer's cache: keys and values (B, G, T, d_k) and the
    indexer's keys (B, T, d_I), counted in nbytes.
    `update(K, V, K_I)` returns (keys, values, indexer keys, positions)."""


def indexer_scores(q_I, w_I, k_I):
    """The lightning indexer's scores I[t, s] = sum_j w[t, j] ReLU(q[t, j]
    . k[s]) (DeepSeek-V3.2-Exp, equation 1, in the report's letters: s the
    key, j the head; chapter 12 writes I_{t,j} and omega_{t,h}): queries
    q_I (B, T, H_I, d_I) and weights w_I (B, T, H_I) of H_I indexer heads,
    keys k_I (B, T_k, d_I) shared by them. Returns (B, T, T_k)."""
    check_floats(q_I=q_I, w_I=w_I, k_I=k_I)
    if q_I.dim() != 4:
        raise ValueError(
            f"q_I must have shape (B, T, H_I, d_I), got {tuple(q_I.shape)}"
        )
    B, T, H_I, d_I = q_I.shape
    check_shape(w_I, "w_I", B=B, T=T, H_I=H_I)
    check_shape(k_I, "k_I", B=B, T_k=None, d_I=d_I)
    if k_I.shape[1] == 0 and T > 0:
        raise ValueError("the indexer needs at least one key: k_I has none")
    dots = torch.einsum("btjd,bsd->btjs", q_I, k_I)  # (B, T, H_I, T_k)
    return torch.einsum("btj,btjs->bts", w_I, F.relu(dots))


def check_allowed(scores, allowed):
    """Raise ValueError unless scores is a floating-point (B, T, T_k)
    tensor of finite numbers (no NaN, no infinity), with at least one key
    if it has a query, and allowed a boolean mask of shape (T, T_k) or
    (B, T, T_k)."""
    if not isinstance(scores, torch.Tensor) or not scores.is_floating_point():
        raise ValueError("scores must be a floating-point torch tensor")
    if scores.dim() != 3 or (scores.shape[-1] == 0 and scores.shape[1] > 0):
        raise ValueError(
            f"scores must have shape (B, T, T_k) with T_k >= 1 keys, got "
            f"{tuple(scores.shape)}"
        )
    if not scores.isfinite().all():
        raise ValueError("scores contain NaN or an infinity")
    if not isinstance(allowed, torch.Tensor) or allowed.dtype != torch.bool:
        raise ValueError("allowed must be a boolean torch tensor")
    if tuple(allowed.shape) not in (scores.shape[1:], scores.shape):
        raise ValueError(
            f"allowed must have shape (T, T_k) = {tuple(scores.shape[1:])} "
            f"or (B, T, T_k) = {tuple(scores.shape)}, got "
            f"{tuple(allowed.shape)}"
        )


def top_k_mask(scores, allowed, k):
    """True where a query keeps a key: the k highest scores (B, T, T_k)
    among its allowed keys (all of them if it has fewer than k). Ties go
    to the earlier key (the smaller index): a stable descending sort."""
    check_positive_int(k, "k")
    check_allowed(scores, allowed)
    scores = scores.masked_fill(~allowed, float("-inf"))
    order = scores.argsort(dim=-1, descending=True, stable=True)
    chosen = torch.zeros(scores.shape, dtype=torch.bool)
    chosen = chosen.scatter(-1, order[..., :k], True)
    return chosen & allowed


def indexer_kl(weights, scores, allowed):
    """The indexer's loss in DeepSeek-V3.2-Exp's continued pre-training:
    the sum over queries t (and batch rows) of KL(p_t || softmax(I_t)),
    where p_t is the main attention's weights (B, H, T, T_k) summed over
    heads and L1-normalised, over the `allowed` keys (B, T, T_k) or (T,
    T_k): all causal keys in the dense warm-up, the selected ones in
    sparse training. The target p is detached: the loss trains only what the scores
    (B, T, T_k) depend on, the indexer alone when its input is detached."""
    check_allowed(scores, allowed)
    check_floats(weights=weights)
    if (weights < 0).any():
        raise ValueError("weights must be >= 0: they are attention weights")
    B, T, T_k = scores.shape
    check_shape(weights, "weights", B=B, H=None, T=T, T_k=T_k)
    if weights.dtype != scores.dtype:
        raise ValueError(
            f"mixed dtypes: weights {weights.dtype}, scores {scores.dtype}"
        )
    p = weights.detach().sum(dim=1) * allowed
    if not (p.sum(dim=-1) > 0).all():
        raise ValueError(
            "a query has no weight on its allowed keys: p_t cannot be "
            "normalised"
        )
    p = p / p.sum(dim=-1, keepdim=True)
    log_q = scores.masked_fill(~allowed, float("-inf")).log_softmax(dim=-1)
    log_q = log_q.masked_fill(~allowed, 0.0)  # p is 0 there
    return (torch.xlogy(p, p) - p * log_q).sum()


class SparseAttention(RotarySelfAttention):
    """Causal rotary self-attention in which each query attends only to the
    k keys that a lightning indexer scores highest (DeepSeek Sparse
    Attention). The indexer has H_I heads of size d_I (rotated by position
    like the queries and keys), a weight per head and query, and one key
    per token. With k >= T_k (every key it may attend to) it is causal
    attention. After each call,
    `self.index` holds (scores, allowed, chosen) for `indexer_kl`; with
    `detach_indexer`, the indexer reads a detached input, so that only its
    own loss trains it (the report's sparse stage)."""

    def __init__(self, d, H, k, G=None, H_I=2, d_I=16):
        super().__init__(d, H, G, causal=True)
        check_positive_int(k, "k")
        check_positive_int(H_I, "the indexer heads H_I")
        if (
            isinstance(d_I, bool)
            or not isinstance(d_I, int)
            or d_I < 2
            or d_I % 2
        ):
            raise ValueError(
                f"the indexer size d_I must be an even integer >= 2 (it is "
                f"rotated by position), got {d_I!r}"
            )
        self.k, self.H_I, self.d_I = k, H_I, d_I
        self.detach_indexer, self.index = False, None
        self.index_q = nn.Linear(d, H_I * d_I)
        self.index_w = nn.Linear(d, H_I)
        self.index_k = nn.Linear(d, d_I)

    def new_cache(self):
        return SparseCache()

    def forward(self, x, mask=None, cache=None):
        check_no_mask(mask)
        check_vectors("x", x, self.out_proj.weight, type(self).__name__)
        B, T, _ = x.shape
        pos_q = next_positions(cache, T)
        Q, K, V = self.heads(x, pos_q)
        h = x.detach() if self.detach_indexer else x
        q_I = self.index_q(h).view(B, T, self.H_I, self.d_I).transpose(1, 2)
        q_I = rotary(q_I, pos_q).transpose(1, 2)  # (B, T, H_I, d_I)
        k_I = rotary(self.index_k(h), pos_q)  # (B, T, d_I)
        pos_k = pos_q
        if cache is not None:
            check_cache(cache, SparseCache, self)
            K, V, k_I, pos_k = cache.update(K, V, k_I)
        allowed = allowed_positions(pos_q, pos_k)  # causal (T, T_k)
        scores = indexer_scores(q_I, self.index_w(h), k_I)
        chosen = top_k_mask(scores, allowed, self.k)  # (B, T, T_k)
        self.index = scores, allowed, chosen
        if self.G != self.H:  # each key/value head serves H / G query heads
            K = K.repeat_interleave(self.H // self.G, dim=1)
            V = V.repeat_interleave(self.H // self.G, dim=1)
        out, weights = attend(Q, K, V, chosen[:, None])
        return self.out_proj(merge_heads(out)), weights


# Chapter 12's trained models: one place for their definitions


D_C, D_R = 16, 8  # MLA's latent and rotary key (see VARIANTS)
K_SPARSE = 32  # keys per query of the sparse model
MQA_WIDE_D_FF = 304  # the feed-forward width that matches MHA's parameters


def mla(d, H):
    return lambda i: MultiHeadLatentAttention(d, H, D_C, D_R)


def hybrid(d, H):
    """Layer 0 Gated DeltaNet, every later layer chapter 10's attention."""
    return lambda i: (
        LinearAttention(d, H, rule="gated_delta")
        if i == 0
        else RotarySelfAttention(d, H, causal=True)
    )


def sparse(d, H):
    return lambda i: SparseAttention(d, H, K_SPARSE)


def cla(d, H):
    return cross_layer(d, H, [None, 0])


# name: (seed, GPT's keyword arguments; "attention" is a function of d and
# H that gives GPT's `attention`). Chapter 10's gpt_G4.pt (MHA, G = H = 4)
# and gpt_G1.pt (MQA) are the seed-0 models of mha and mqa.
#
# - mla: d_c = 16, d_R = 8. DeepSeek-V2 pairs heads of d_h = 128 with a
#   rotary key of d_R = 64, half a head, and a latent of d_c = 512, four
#   heads (its section 3.1.2). Half of one of this model's heads (d_h = 16) gives
#   d_R = 8; four heads would give d_c = 64 = d, a latent as wide as the
#   model, which compresses nothing. d_c = 16 = d / 4 instead: 24 numbers
#   per token and layer, against MHA's 2 d = 128 and MQA's 32.
# - hybrid: Qwen3-Next puts one full-attention layer after every three
#   Gated DeltaNet layers (3:1). Two layers cannot keep that ratio: one of
#   each (1:1), the linear layer first, as in Qwen3-Next's groups.
# - sparse: k = 32 keys per query, a quarter of the training length T =
#   128, so that the model is sparse in training too, after 100 dense
#   warm-up steps (a query before position 32 has at most 32 keys anyway).
# - mqa_wide: MQA (G = 1) with the feed-forward width raised from 256 to
#   304, the width whose parameter count is closest to MHA's.
VARIANTS = {
    "mha_seed1": (1, {"G": 4}),
    "mha_seed2": (2, {"G": 4}),
    "mqa_seed1": (1, {"G": 1}),
    "gqa": (0, {"G": 2}),
    "window": (0, {"G": 4, "w": 32}),
    "mla": (0, {"attention": mla}),
    "hybrid": (0, {"attention": hybrid}),
    "sparse": (0, {"attention": sparse}),
    "cla": (0, {"attention": cla}),
    "mqa_wide": (0, {"G": 1, "d_ff": MQA_WIDE_D_FF}),
}
# Seeds 1 and 2 of the variants whose loss chapter 12 compares with MHA's:
# the same model from another seed (initial weights and batches), named as
# mha_seed1, so that each pairs with MHA's run of the same seed.
PAIRED = ("gqa", "window", "mla", "hybrid")
VARIANTS.update(
    {
        f"{name}_seed{seed}": (seed, VARIANTS[name][1])
        for name in PAIRED
        for seed in (1, 2)
    }
)


def build_variant(name, vocab, **sizes):
    """A freshly initialised GPT of chapter 12's variant `name` (a key of
    VARIANTS), with torch's generator seeded by the variant's seed first;
    `sizes` (d, H, layers, d_ff) default to chapter 10's. Returns the model
    and the seed (training's batches use it too)."""
    if name not in VARIANTS:
        raise ValueError(
            f"unknown variant {name!r}: choose one of {sorted(VARIANTS)}"
        )
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"vocab must be an integer >= 1, got {vocab!r}")
    if not set(sizes) <= {"d", "H", "layers", "d_ff"}:
        unknown = sorted(set(sizes) - {"d", "H", "layers", "d_ff"})
        raise ValueError(
            f"unknown sizes {unknown}: build_variant takes d, H, layers, d_ff"
        )
    seed, kwargs = VARIANTS[name]
    kwargs = {"d": 64, "H": 4, "layers": 2, "d_ff": 256, **sizes, **kwargs}
    if "attention" in kwargs:  # a function of d and H: GPT's attention
        kwargs["attention"] = kwargs["attention"](kwargs["d"], kwargs["H"])
    torch.manual_seed(seed)
    return GPT(vocab, **kwargs), seed
