"""The book's Transformer block, shared by the chapters that build on it.

Chapter 6 builds multi-head self-attention, sinusoidal and rotary positions
and a pre-norm encoder block; it imports that code from here and prints it.
Chapter 10 extends it with what a text generator needs, each extension off
by default so that chapter 6's classes are unchanged:

- `G` key/value heads shared by groups of the `H` query heads (grouped-query
  attention; `G = 1` is multi-query attention, `G = H` chapter 6's);
- `causal=True`: query i attends to keys j <= i only, and with a window
  `w`, to the last w of them (j > i - w, sliding-window attention);
- a key/value cache: keys and values of earlier tokens kept between
  calls, so that a generator feeds one new token per step. `Cache` is the
  interface every cache implements (what a layer asks of it, in one
  place); `KVCache` grows, or with a window is a rolling cache of w
  slots (w + spare with spare slots).
  A layer asks its cache `cache.check_layer(w, causal)` before using it,
  and never attends to an empty slot (position -1), causal or not.

Masks are boolean, True where a query may attend to a key.
"""

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from attention import (
    FLOAT_DTYPES,
    check_mask,
    check_qkv_shapes,
    check_qkv_tensors,
    check_scores_finite,
)
from flash import flash_attention


def attend(Q, K, V, mask=None, rows_checked=False):
    """softmax(Q K^T / sqrt(d_k)) V on the last two axes; (outputs, weights).

    A query the mask lets see no key is a ValueError (chapter 3's function
    gives it zeros): its softmax is undefined. So is a NaN or an infinity
    in Q, K or V: in Q or K it can make weights NaN, in V it makes outputs
    NaN or infinite; and so is a product Q K^T that overflows its dtype
    before the division by sqrt(d_k) (float16 stops at 65504: entries 300
    with d_k = 8 give 720,000, entries 100 give 80,000). rows_checked=True
    skips these value checks (operations on every step) for a causal or
    cached layer's own call, with a mask it built from positions: such a
    layer given a NaN or an infinity in x, or scores that overflow, returns
    NaN or infinite outputs without an error (chapter 10 counts a step's
    operations)."""
    check_qkv(Q, K, V, mask)  # ValueError naming a shape, dtype or mask
    if not rows_checked:
        check_finite(Q=Q, K=K, V=V)  # ValueError naming NaN or infinity
    scores = Q @ K.transpose(-2, -1) / Q.shape[-1] ** 0.5  # (..., T_q, T_k)
    if not rows_checked:
        check_scores_finite(scores, mask)  # ValueError: a score overflowed
    if mask is not None:
        if not rows_checked:
            check_rows(mask)  # ValueError naming a query that sees no key
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(dim=-1)  # each row sums to 1
    return weights @ V, weights


def shape_of(x):
    """A tensor's shape and dtype, or the type of anything else, for errors."""
    if isinstance(x, torch.Tensor):
        return f"{tuple(x.shape)} {x.dtype}"
    return type(x).__name__


def check_count(name, n, low=1):
    """Raise ValueError unless n is an integer >= low."""
    if isinstance(n, bool) or not isinstance(n, int) or n < low:
        raise ValueError(
            f"{name} must be an integer >= {low}, got {name}={n!r}"
        )


def check_qkv(Q, K, V, mask=None):
    """Raise ValueError unless Q (..., T_q, d_k), K (..., T_k, d_k) and
    V (..., T_k, d_v) are floating-point tensors of one dtype and device
    (attention.check_qkv_tensors) whose leading axes broadcast, with
    d_k >= 1 and a key for any query (attention.check_qkv_shapes), and
    mask is None or a boolean tensor that broadcasts to the scores
    (..., T_q, T_k), and Q, K and V hold values (not on meta). Shapes
    only, never values: no tensor operation is added to a step."""
    check_qkv_tensors(Q, K, V)  # sparse Q, K or V: a named ValueError
    for name, t in (("Q", Q), ("K", K), ("V", V), ("mask", mask)):
        check_dense(name, t)  # nested ones, or a sparse or nested mask
    batch = check_qkv_shapes(Q, K, V)  # d_k >= 1, keys, batch axes
    if mask is not None:
        check_mask(mask, (*batch, Q.shape[-2], K.shape[-2]), Q.device)
    if Q.device.type == "meta":  # shapes without values (K, V: Q's device)
        raise ValueError("Q is on meta: attention needs values")


def check_finite(**tensors):
    """Raise ValueError naming the first tensor that holds a NaN or an
    infinity (in Q, K or a bias it can make weights NaN; in V, outputs NaN
    or infinite): one reduction per tensor."""
    for name, t in tensors.items():
        if not torch.isfinite(t).all():
            raise ValueError(f"{name} contains NaN or infinite values")


def check_heads(d, H):
    """Raise ValueError unless H >= 1 heads divide the model size d."""
    check_count("d", d)
    check_count("H", H)
    if d % H != 0:
        raise ValueError(f"d={d} is not divisible into H={H} heads")


def check_groups(H, G):
    """Raise ValueError unless G >= 1 key/value heads divide H query heads."""
    check_count("G", G)
    if H % G != 0:
        raise ValueError(
            f"H={H} query heads cannot be split into G={G} equal groups: "
            f"G must divide H"
        )


def check_window(w):
    """Raise ValueError unless the window w is None or a positive integer."""
    if w is not None and (
        isinstance(w, bool) or not isinstance(w, int) or w < 1
    ):
        raise ValueError(f"the window w must be a positive integer, got {w!r}")


def check_causal(causal, w):
    """Raise ValueError unless causal is a bool, and True if there is a
    window w."""
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    check_window(w)
    if w is not None and not causal:
        raise ValueError("a window w needs causal=True")


def allowed_positions(pos_q, pos_k, w=None, causal=True):
    """Mask from absolute positions: True where the query at i may see j.

    Positions (T_q,) and (T_k,), shared by every row, give a (T_q, T_k)
    mask; positions per batch row, (B, T_q) and (B, T_k), give (B, 1, T_q,
    T_k), one mask per row for all its heads. A key position of -1 marks an
    empty cache slot, never attended, causal or not. With causal=True, the
    query at position i may attend to the key at position j if j <= i and,
    with a window w, j > i - w.
    """
    check_positions(pos_q, pos_k, w)
    i, j = pos_q[..., :, None], pos_k[..., None, :]
    allowed = (j >= 0).expand(*pos_q.shape, -1)  # every key but empty slots
    if causal:
        allowed = allowed & (j <= i)
    if w is not None:
        allowed = allowed & (j > i - w)
    return allowed if pos_q.dim() == 1 else allowed[:, None]


def check_positions(pos_q, pos_k, w):
    """Raise ValueError unless the positions are (T_q,) and (T_k,), or
    (B, T_q) and (B, T_k) with one B, and w a window or None."""
    for name, pos in (("pos_q", pos_q), ("pos_k", pos_k)):
        if not isinstance(pos, torch.Tensor) or pos.dim() not in (1, 2):
            raise ValueError(
                f"{name} must be a (T,) or (B, T) tensor, got {shape_of(pos)}"
            )
    if pos_q.dim() != pos_k.dim() or pos_q.shape[:-1] != pos_k.shape[:-1]:
        raise ValueError(
            f"pos_q {tuple(pos_q.shape)} and pos_k {tuple(pos_k.shape)} must "
            f"be (T_q,) and (T_k,), or (B, T_q) and (B, T_k) with one B"
        )
    check_window(w)


class Cache(ABC):
    """The interface of a key/value cache for one attention layer: what
    `SelfAttention.forward` asks of it, and what a generator may ask.

    - `length`: the tokens seen so far (an attribute);
    - `capacity`: the token slots it can hold, None if it grows unbounded;
    - `check_layer(w, causal)`: raise ValueError unless it keeps every key
      that such a layer may attend to;
    - `next_positions(T)`: the positions of the next T tokens, (T,) shared
      by every row, or (B, T) for a cache whose rows have their own (a rotary
      `SelfAttention` cannot take those: `rotary` needs (T,); chapter 11's
      `Decoder.rotate` can);
    - `update(K, V)`: store the keys and values (B, G, T, d_k) of the next T
      tokens; return the keys, values and key positions that these tokens'
      queries may need, positions shaped as next_positions gives them, -1
      for an empty slot;
    - `nbytes()`: the bytes of the keys and values it holds now;
    - `crop(n)`: keep only the first n tokens (drop rejected draft tokens);
      ValueError if n < 0, n > length, or if tokens it must keep are gone.
    """

    length = 0  # tokens seen so far
    capacity = None  # token slots; None: grows without bound

    @abstractmethod
    def check_layer(self, w, causal):
        """Raise ValueError unless every key such a layer may see is kept."""

    def next_positions(self, T):
        """Positions of the next T tokens: (T,), the same for every row."""
        check_count("T", T, 0)
        return torch.arange(self.length, self.length + T)

    @abstractmethod
    def update(self, K, V):
        """Store K, V (B, G, T, d_k); (keys, values, positions) to attend."""

    @abstractmethod
    def nbytes(self):
        """Bytes of the keys and values held now."""

    @abstractmethod
    def crop(self, n):
        """Keep only the first n tokens; ValueError if that is impossible."""

    def check_crop(self, n):
        """Raise ValueError unless 0 <= n <= length (an integer)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"crop(n) needs an integer n >= 0, got {n!r}")
        if n > self.length:
            raise ValueError(
                f"cannot crop to {n} tokens: the cache has seen only "
                f"{self.length}"
            )


class KVCache(Cache):
    """Keys and values of the tokens seen so far, for one attention layer.

    Without a window the cache grows by one row per token. With a window w
    it is a rolling buffer of w + spare slots: the token at position p is
    written to slot p % (w + spare), over the token at p - w - spare, which
    no later query may see. Spare slots let `crop` drop up to `spare` of
    the latest tokens: it keeps the w tokens before the new next one, one
    more than that token's query needs (j > n - w).
    """

    def __init__(self, w=None, spare=0):
        check_window(w)
        if isinstance(spare, bool) or not isinstance(spare, int) or spare < 0:
            raise ValueError(f"spare must be an integer >= 0, got {spare!r}")
        if w is None and spare:
            raise ValueError("spare slots need a window w: a growing cache")
        self.w, self.length = w, 0  # length: tokens seen so far
        self.capacity = None if w is None else w + spare  # token slots
        self.K = self.V = self.pos = None

    def check_layer(self, w, causal):
        """Raise ValueError unless this cache keeps every key that a layer
        (causal or not, with window w or None) may attend to.

        A growing cache (window None) keeps every key. A rolling cache for
        window w keeps the last w at least: enough for a causal layer whose
        window is at most w, too few for any other.
        """
        check_causal(causal, w)
        if self.w is None:
            return
        if not causal or w is None or w > self.w:
            kind = "causal" if causal else "non-causal"
            fits = "None" if w is None or not causal else f"None or >= {w}"
            raise ValueError(
                f"a cache with window {self.w} keeps only the last {self.w} "
                f"tokens, too few for a {kind} layer with window {w}: give "
                f"it a cache with window {fits}"
            )

    def update(self, K, V):
        """Add the keys and values (B, G, T, d_k) of the next T tokens.

        Returns the keys, values and positions a query of these tokens may
        need: everything cached before them followed by them.
        """
        check_keys_values(K, V, self.K)
        T = K.shape[-2]
        pos = self.next_positions(T)
        if self.K is None:
            self.start(K)
        keys = torch.cat([self.K, K], dim=-2)
        values = torch.cat([self.V, V], dim=-2)
        positions = torch.cat([self.pos, pos])
        if self.w is None:
            self.K, self.V, self.pos = keys, values, positions
        else:
            keep = min(T, self.capacity)  # only the last slots can be seen
            slots = pos[-keep:] % self.capacity
            self.K[..., slots, :] = K[..., -keep:, :]
            self.V[..., slots, :] = V[..., -keep:, :]
            self.pos[slots] = pos[-keep:]
        self.length += T
        return keys, values, positions

    def start(self, K):
        """Empty tensors shaped like K: no slots, or `capacity` empty (-1)."""
        B, G, _, d_k = K.shape
        n = 0 if self.capacity is None else self.capacity
        self.K = K.new_zeros(B, G, n, d_k)
        self.V = K.new_zeros(B, G, n, d_k)
        self.pos = torch.full((n,), -1, dtype=torch.long)

    def nbytes(self):
        """Bytes held by the cached keys and values."""
        if self.K is None:
            return 0
        return self.K.nelement() * self.K.element_size() * 2

    def crop(self, n):
        """Keep the first n tokens: a growing cache truncates; a rolling one
        empties the slots of tokens n and later, and needs the w tokens
        before n (all of them if n < w) still in their slots: one more than
        the next query, at n, attends to."""
        self.check_crop(n)
        if self.w is not None:
            oldest = max(0, self.length - self.capacity)  # earlier: gone
            if max(0, n - self.w) < oldest:
                raise ValueError(
                    f"cannot crop to {n} tokens: this rolling cache of "
                    f"{self.capacity} slots for window {self.w} has "
                    f"overwritten tokens before {oldest}; it can crop to "
                    f"{oldest + self.w} or more (more spare slots: further)"
                )
            if self.pos is not None:
                self.pos[self.pos >= n] = -1  # their slots are empty again
        elif self.K is not None:
            self.K, self.V = self.K[..., :n, :], self.V[..., :n, :]
            self.pos = self.pos[:n]
        self.length = n


def check_keys_values(K, V, held=None):
    """Raise ValueError unless K and V are (B, G, T, d_k) tensors of one
    shape, dtype and device that fit the keys `held` (B, G, slots, d_k) a
    cache already holds: a cache serves one layer of one batch."""
    for name, t in (("K", K), ("V", V)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(
                f"{name} must be (B, G, T, d_k), got {shape_of(t)}"
            )
    if K.shape != V.shape or K.dtype != V.dtype or K.device != V.device:
        raise ValueError(
            f"keys and values must have one shape, dtype and device: K "
            f"{shape_of(K)}, V {shape_of(V)}"
        )
    fits = held is None or (
        (K.shape[:2], K.shape[-1]) == (held.shape[:2], held.shape[-1])
        and (K.dtype, K.device) == (held.dtype, held.device)
    )
    if not fits:
        B, G, _, d_k = held.shape
        raise ValueError(
            f"this cache holds keys (B={B}, G={G}, d_k={d_k}) of "
            f"{held.dtype}, got (B={K.shape[0]}, G={K.shape[1]}, "
            f"d_k={K.shape[-1]}) of {K.dtype}: a cache serves one layer of "
            f"one batch (new_caches() for another)"
        )


class SelfAttention(nn.Module):
    """Multi-head self-attention in chapter 5's batched form, with biases.

    G key/value heads (default H) serve groups of H / G query heads; with
    causal=True, query i sees keys j <= i, and with a window w, j > i - w.
    backend "attend" (default) computes the weights and returns them;
    "flash" attends in tiles (book/flash.py's flash_attention) and "sdpa"
    through PyTorch's F.scaled_dot_product_attention: both return None
    for the weights they never store.
    """

    def __init__(self, d, H, G=None, causal=False, w=None, backend="attend"):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(
                f"backend must be one of {BACKENDS}, got {backend!r}"
            )
        check_heads(d, H)
        G = H if G is None else G
        check_groups(H, G)
        check_causal(causal, w)
        self.H, self.G, self.d_k = H, G, d // H
        self.causal, self.w, self.backend = causal, w, backend
        # W_QKV and b_QKV: d + 2 G d_k outputs, 3 d when G = H
        self.in_proj = nn.Linear(d, d + 2 * G * self.d_k)
        self.out_proj = nn.Linear(d, d)  # W_O and b_O

    def heads(self, x, positions=None):
        """Queries (B, H, T, d_k), keys and values (B, G, T, d_k) of x.

        `positions` are those of x's tokens (used by rotary heads).
        """
        B, T, _ = x.shape
        q, kv = self.in_proj(x).split(
            [self.H * self.d_k, 2 * self.G * self.d_k], dim=-1
        )
        Q = q.view(B, T, self.H, self.d_k).transpose(1, 2)
        K, V = kv.view(B, T, 2, self.G, self.d_k).permute(2, 0, 3, 1, 4)
        return Q, K, V

    def forward(self, x, mask=None, cache=None):
        check_call(self, x, mask, cache)  # ValueError: shapes, dtypes, mask
        T = x.shape[1]
        pos_q = (
            torch.arange(T, device=x.device)  # the mask: on x's device
            if cache is None
            else cache.next_positions(T)
        )
        Q, K, V = self.heads(x, pos_q)
        pos_k = pos_q
        if cache is not None:
            cache.check_layer(self.w, self.causal)  # it keeps what we need
            K, V, pos_k = cache.update(K, V)  # earlier tokens' keys, values
        if self.G != self.H:  # each key/value head serves H / G query heads
            K = K.repeat_interleave(self.H // self.G, dim=1)
            V = V.repeat_interleave(self.H // self.G, dim=1)
        if self.backend != "attend":  # no weights: flash or sdpa
            return self.attend_fused(Q, K, V, mask, pos_q, pos_k), None
        built = self.causal or cache is not None
        if built:  # order, window, empty slots: each query sees itself
            allowed = allowed_positions(pos_q, pos_k, self.w, self.causal)
            mask = allowed if mask is None else check_rows(mask & allowed)
        out, weights = attend(Q, K, V, mask, rows_checked=built)  # (B,H,T,d_k)
        B, H, T, d_k = out.shape
        out = out.transpose(1, 2).reshape(B, T, H * d_k)  # merge the heads
        return self.out_proj(out), weights

    def attend_fused(self, Q, K, V, mask, pos_q, pos_k):
        """The "flash" and "sdpa" backends: flash_attention (tiles of
        weights it never stores) or F.scaled_dot_product_attention, for the
        masks both know: none, or causal over every key kept in order (no
        window, no empty slot). Non-finite values: flash refuses them in its
        own checks; sdpa passes them through (NaN or infinite outputs)."""
        if self.w is not None or mask is not None:
            raise ValueError(
                f"the {self.backend} backend takes no mask and no window w: "
                f"no mask at all, or causal=True (else backend 'attend')"
            )
        if Q.device.type == "meta":  # torch.equal below needs values
            raise ValueError("Q is on meta: attention needs values")
        T_k, on = pos_k.shape[-1], pos_k.device  # x's device, or the cache's
        in_order = pos_q.dim() == 1 and torch.equal(
            pos_k, torch.arange(T_k, device=on)
        )
        if not (in_order and torch.equal(pos_q, pos_k[T_k - len(pos_q) :])):
            raise ValueError(
                f"the {self.backend} backend needs every earlier key, in "
                f"order: a KVCache without a window, positions shared by rows"
            )
        # the last query sees every key: a cached prefill's queries come last
        if self.backend == "flash":
            out = flash_attention(Q, K, V, self.causal and "bottom-right")
        else:
            below = T_k - len(pos_q)  # the diagonal's offset (bottom-right)
            allowed = torch.ones(len(pos_q), T_k, dtype=torch.bool, device=on)
            allowed = allowed.tril(below)
            out = F.scaled_dot_product_attention(
                Q, K, V, allowed if self.causal else None
            )
        B, H, T, d_k = out.shape
        out = out.transpose(1, 2).reshape(B, T, H * d_k)  # merge the heads
        return self.out_proj(out)


BACKENDS = ("attend", "flash", "sdpa")  # SelfAttention's: weights or not


def check_call(layer, x, mask, cache):
    """Raise ValueError unless a SelfAttention layer can take x (B, T, d)
    of its size, dtype and device, with mask None or a boolean (..., T, T)
    that broadcasts to the scores, or cache a Cache (and then no mask)."""
    check_vectors("x", x, layer.in_proj.weight, type(layer).__name__)
    if cache is not None:
        if not isinstance(cache, Cache):
            raise ValueError(
                f"cache must be a Cache (KVCache(), model.new_caches()),"
                f" got {type(cache).__name__}"
            )
        if mask is not None:
            raise ValueError("a cached call takes no mask")
    elif mask is not None:
        B, T, _ = x.shape
        check_dense("mask", mask)
        check_mask(mask, (B, layer.H, T, T), x.device)


def check_vectors(name, x, weight=None, layer="the layer"):
    """Raise ValueError unless x is a dense float (B, T, d) tensor; given
    the weight (..., d) it meets first, of that size d, dtype and device.
    `layer` names the layer in the errors. Attributes only, no tensor
    operation: every layer and block checks its x with this one function."""
    check_dense(name, x)  # sparse and nested tensors have no usable shape
    is_tensor = isinstance(x, torch.Tensor)
    if weight is None:
        if not is_tensor or not x.is_floating_point() or x.dim() != 3:
            raise ValueError(
                f"{name} must be a float tensor (B, T, d), got {shape_of(x)}"
            )
        return
    d = weight.shape[-1]
    if not is_tensor or x.dim() != 3:
        raise ValueError(
            f"{name} must have shape (B, T, {d}), the input {layer} takes, "
            f"got {shape_of(x)}"
        )
    if x.shape[-1] != d:
        raise ValueError(
            f"{name} has {x.shape[-1]} features: {name} must have shape "
            f"(B, T, {d}), the input {layer} takes, got {shape_of(x)}"
        )
    if x.dtype != weight.dtype:
        raise ValueError(
            f"mixed dtypes: {name} is {x.dtype}, the layer {weight.dtype}: "
            f"convert one to the other ({name}.double(), model.double())"
        )
    if x.device != weight.device:
        raise ValueError(
            f"{name} is on {x.device}, the layer's weights on {weight.device}"
        )


def check_dense(name, t):
    """Raise ValueError if t is a sparse or nested tensor (torch operations
    on it fail or are missing): an attribute check, no tensor operation."""
    if isinstance(t, torch.Tensor) and (
        t.is_nested or t.layout != torch.strided
    ):
        got = "a nested tensor" if t.is_nested else t.layout
        raise ValueError(f"{name} must be a dense (strided) tensor, got {got}")


def frequencies(d, dtype=torch.float64):
    """The d/2 frequencies omega_i = 10000^(-2i/d) of equation pos-sinusoid."""
    check_pairs(d, dtype)
    return 10000.0 ** (-torch.arange(0, d, 2, dtype=dtype) / d)


def sinusoidal_encoding(T, d, dtype=torch.float64):
    """The (T, d) table of equation pos-sinusoid, one row per position."""
    check_count("T", T, 0)
    check_pairs(d, dtype)  # before arange: float8 has none
    angles = torch.arange(T, dtype=dtype)[:, None] * frequencies(d, dtype)
    pe = torch.empty(T, d, dtype=dtype)
    pe[:, 0::2], pe[:, 1::2] = angles.sin(), angles.cos()  # (T, d)
    return pe


def check_pairs(d, dtype):
    """Raise ValueError unless d is an even integer >= 2 (d / 2 pairs) and
    dtype one attention takes (check_dtype)."""
    if isinstance(d, bool) or not isinstance(d, int) or d < 2 or d % 2 != 0:
        raise ValueError(f"need an even size d >= 2 (pairs), got d={d!r}")
    check_dtype(dtype)


def check_dtype(dtype, name="dtype"):
    """Raise ValueError unless dtype is float16, bfloat16, float32 or
    float64 (attention.FLOAT_DTYPES): float8 has no arange, sin or neg."""
    if dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{name} must be a float type, a floating-point dtype attention "
            f"takes (float16, bfloat16, float32 or float64), got {dtype!r}"
        )


def rotary(x, positions=None):
    """Rotate each pair of the last axis of x (..., T, d_k) by its position."""
    T, d_k = check_rotary(x, positions)
    if positions is None:
        positions = torch.arange(T, device=x.device)
    omega = frequencies(d_k, x.dtype).to(x.device)  # (d_k / 2,)
    angles = positions.to(x.dtype)[:, None] * omega
    cos, sin = angles.cos(), angles.sin()  # (T, d_k / 2)
    x1, x2 = x[..., 0::2], x[..., 1::2]  # first and second of each pair
    rotated = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return rotated.flatten(-2)  # pairs back in place: (..., T, d_k)


def check_rotary(x, positions):
    """Raise ValueError unless x is (..., T, d_k) with d_k even; (T, d_k)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(
            f"x must be a floating-point tensor, got {shape_of(x)}"
        )
    check_dense("x", x)
    check_dtype(x.dtype, "x's dtype")
    if x.dim() < 2 or x.shape[-1] % 2 != 0:
        raise ValueError(
            f"rotary positions rotate pairs: the last axis (head size) must "
            f"be even, got shape {tuple(x.shape)}"
        )
    T = x.shape[-2]
    check_dense("positions", positions)  # a sparse or nested tensor: no sizes
    if positions is not None and (
        not isinstance(positions, torch.Tensor)
        or tuple(positions.shape) != (T,)
    ):
        raise ValueError(
            f"positions must be a ({T},) tensor, got {shape_of(positions)}"
        )
    if positions is not None and positions.device != x.device:
        raise ValueError(
            f"positions are on {positions.device}, x on {x.device}"
        )
    return T, x.shape[-1]


class RotarySelfAttention(SelfAttention):
    """Self-attention whose queries and keys are rotated by position (RoPE)."""

    def __init__(self, d, H, G=None, causal=False, w=None, backend="attend"):
        super().__init__(d, H, G, causal, w, backend)
        if self.d_k % 2 != 0:
            raise ValueError(
                f"rotary positions need an even head size, got d_k={self.d_k}"
            )

    def heads(self, x, positions=None):
        Q, K, V = super().heads(x)  # Q (B, H, T, d_k), K and V (B, G, T, d_k)
        return rotary(Q, positions), rotary(K, positions), V  # None: 0...T-1


class EncoderBlock(nn.Module):
    """Pre-norm Transformer encoder block, equation pos-block."""

    def __init__(
        self,
        d,
        H,
        d_ff,
        rotary=False,
        G=None,
        causal=False,
        w=None,
        backend="attend",
    ):
        super().__init__()
        check_count("d_ff", d_ff)
        attention = RotarySelfAttention if rotary else SelfAttention
        self.norm1 = nn.LayerNorm(d)
        self.self_attn = attention(d, H, G, causal, w, backend)
        self.norm2 = nn.LayerNorm(d)
        self.linear1, self.linear2 = nn.Linear(d, d_ff), nn.Linear(d_ff, d)

    def forward(
        self, x, mask=None, padding_mask=None, return_weights=False, cache=None
    ):
        check_vectors("x", x, self.norm1.weight, type(self).__name__)
        allowed = combine_masks(x, mask, padding_mask)  # (B, 1, T, T) or None
        attended, weights = self.self_attn(self.norm1(x), allowed, cache)
        y = x + attended  # residual around the attention
        z = y + self.linear2(F.relu(self.linear1(self.norm2(y))))  # and FFN
        return (z, weights) if return_weights else z


class DecoderBlock(EncoderBlock):
    """The pre-norm block with causal (optionally windowed) rotary attention."""

    def __init__(self, d, H, d_ff, G=None, w=None, backend="attend"):
        super().__init__(d, H, d_ff, True, G, True, w, backend)


def combine_masks(x, mask, padding_mask):
    """Check x (B, T, d) and the masks; one boolean (B, 1, T, T) mask or None."""
    for name, t in (("x", x), ("mask", mask), ("padding_mask", padding_mask)):
        check_dense(name, t)
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"x must have shape (B, T, d), got {shape_of(x)}")
    B, T, _ = x.shape
    if mask is None and padding_mask is None:
        return None
    allowed = torch.ones(B, 1, T, T, dtype=torch.bool, device=x.device)
    for name, m in (("mask", mask), ("padding_mask", padding_mask)):
        if isinstance(m, torch.Tensor) and m.device != x.device:
            raise ValueError(f"{name} is on {m.device}, x on {x.device}")
    if mask is not None:
        shapes = ((T, T), (B, T, T))
        if not isinstance(mask, torch.Tensor):
            raise ValueError(f"mask must be a tensor, got {shape_of(mask)}")
        if mask.dtype != torch.bool or tuple(mask.shape) not in shapes:
            raise ValueError(
                f"mask must be a boolean ({T}, {T}) or ({B}, {T}, {T}) "
                f"tensor, got {mask.dtype} {tuple(mask.shape)}"
            )
        allowed = allowed & (mask if mask.dim() == 2 else mask[:, None])
    if padding_mask is not None:
        if not isinstance(padding_mask, torch.Tensor):
            raise ValueError(
                f"padding_mask must be a tensor, got {shape_of(padding_mask)}"
            )
        if padding_mask.dtype != torch.bool or tuple(padding_mask.shape) != (
            B,
            T,
        ):
            raise ValueError(
                f"padding_mask must be a boolean ({B}, {T}) tensor, got "
                f"{padding_mask.dtype} {tuple(padding_mask.shape)}"
            )
        allowed = allowed & padding_mask[:, None, None, :]
    return check_rows(allowed)


def check_rows(allowed):
    """Return the boolean mask; raise ValueError if a query has no key."""
    if not isinstance(allowed, torch.Tensor) or allowed.dtype != torch.bool:
        raise ValueError(f"the mask must be boolean, got {shape_of(allowed)}")
    sees_a_key = allowed.any(dim=-1)
    if not sees_a_key.all():
        row = tuple(torch.nonzero(~sees_a_key)[0].tolist())
        raise ValueError(
            f"a query may attend to no key: the mask's row {row} is all "
            f"False, its softmax is undefined"
        )
    return allowed
