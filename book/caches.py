"""Chapter 11's caches past the training length and in 8 bits.

Both implement the cache interface of transformer.py (`Cache`):

- `SinkCache(s, w, scheme)`: attention sinks (StreamingLLM, Xiao et al.
  2024): the first s tokens are kept as well as a rolling window of the
  last w. With scheme="absolute" every key keeps its rotary position in the
  text (the book's positions); with scheme="cache" the positions are those
  within the cache (StreamingLLM, section 3.2), so that the sinks sit just
  before the window;
- `Int8Cache(keys)`: keys and values stored as int8 codes with an absmax
  scale, values one scale per token, keys one per token (keys="token") or,
  as KIVI does (Liu et al. 2024), one per channel for each group of `group`
  tokens (keys="channel"), the last incomplete group kept unquantised.

`quantize` and `dequantize` are the absmax 8-bit code that `Int8Cache` uses
for its keys and values; `check_keys` is the check both caches make of the
keys and values they are given.
"""

import torch

from transformer import Cache, rotary

LEVELS = 127  # int8 codes -127..127 (symmetric: -128 is never used)


def quantize(x, dim, scale=None):
    """int8 codes and absmax scale of x along dim: x ~ codes * scale.

    The scale is max |x| / 127 along dim (kept as a size-1 axis), so that
    |x - codes * scale| <= scale / 2 for every element; an all-zero slice
    gets scale 1 and codes 0, stored exactly. A given scale must be > 0 and
    broadcast against x, with |x| <= 127.5 scales (larger raises ValueError).
    """
    check_floats("x", x)
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise ValueError(f"dim must be an integer, got {dim!r}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} is out of range for x of {x.dim()} axes")
    if x.shape[dim] == 0:
        raise ValueError(
            f"x {tuple(x.shape)} is empty along dim {dim}: no absmax to "
            f"scale by"
        )
    check_finite("x", x)
    if scale is None:
        scale = x.abs().amax(dim=dim, keepdim=True) / LEVELS
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    else:
        scale = torch.as_tensor(scale, dtype=x.dtype)
        check_broadcast("the scale", scale, x)
        check_finite("the scale", scale)
        if not (scale > 0).all():
            raise ValueError(f"the scale must be > 0, got {scale.min()}")
        if (x.abs() > (LEVELS + 0.5) * scale).any():
            raise ValueError(
                f"values beyond {LEVELS + 0.5} scales do not fit in int8 codes"
            )
    codes = (x / scale).round().clamp(-LEVELS, LEVELS).to(torch.int8)
    return codes, scale


def dequantize(codes, scale):
    """The numbers that int8 codes and their scale stand for."""
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.int8:
        raise ValueError(f"codes must be an int8 tensor, got {_kind(codes)}")
    check_floats("the scale", scale)
    check_broadcast("the scale", scale, codes)
    check_finite("the scale", scale)
    return codes.to(scale.dtype) * scale


def _kind(x):
    """A short description of x for an error message."""
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor {tuple(x.shape)}"
    return type(x).__name__


def check_floats(name, x):
    """Raise ValueError unless x is a floating-point tensor."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(
            f"{name} must be a floating-point tensor, got {_kind(x)}"
        )


def check_finite(name, x):
    """Raise ValueError if tensor x holds a NaN or an infinity."""
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} holds NaN or infinite values")


def check_broadcast(name, a, x):
    """Raise ValueError unless tensor a broadcasts against x's shape."""
    try:
        shape = torch.broadcast_shapes(a.shape, x.shape)
    except RuntimeError:
        shape = None
    if shape != x.shape:
        raise ValueError(
            f"{name} {tuple(a.shape)} does not broadcast against "
            f"{tuple(x.shape)}"
        )


def check_keys(K, V, held=None):
    """Raise ValueError unless K and V are floating-point tensors (B, G, T,
    d_k) of one shape and dtype, with B, G and d_k >= 1 (T may be 0), and,
    if the cache already holds a tensor `held` (B, G, *, d_k), of its batch,
    heads, size and dtype."""
    check_floats("K", K)
    check_floats("V", V)
    if K.dim() != 4:
        raise ValueError(f"K must be (B, G, T, d_k), got {tuple(K.shape)}")
    if V.shape != K.shape:
        raise ValueError(
            f"V {tuple(V.shape)} does not match K {tuple(K.shape)}"
        )
    if V.dtype != K.dtype:
        raise ValueError(f"mixed dtypes: K is {K.dtype}, V is {V.dtype}")
    B, G, _, d_k = K.shape
    if min(B, G, d_k) < 1:
        raise ValueError(
            f"K {tuple(K.shape)} has an empty batch, head or key axis"
        )
    if held is not None:
        if (B, G, d_k) != (held.shape[0], held.shape[1], held.shape[-1]):
            raise ValueError(
                f"K {tuple(K.shape)} does not match the cache's batch, "
                f"heads and key size (B, G, d_k) = "
                f"{(held.shape[0], held.shape[1], held.shape[-1])}: one "
                f"cache serves one batch of one layer"
            )
        if K.dtype != held.dtype:
            raise ValueError(
                f"the cache holds {held.dtype} keys, got {K.dtype}"
            )


def check_tokens(name, n, low=0):
    """Raise ValueError unless n is an integer >= low."""
    if isinstance(n, bool) or not isinstance(n, int) or n < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {n!r}")


class SinkCache(Cache):
    """The first s tokens (the sinks) and a rolling window of the last w.

    A query at position i attends to the sinks 0..s-1 and to the keys
    i - w < j <= i. Past its s + w slots it takes one token per call. The
    layer must be causal, rotary, without a window of its own (the cache is
    the window). scheme="absolute": keys keep their rotary positions in the
    text. scheme="cache" (StreamingLLM, section 3.2): positions within the
    cache; the window is contiguous with the query, so only the sinks move,
    rotated forward by the gap i - (s + w - 1) between them and the window.
    """

    def __init__(self, s, w, scheme="cache"):
        check_tokens("the number of sinks s", s)
        check_tokens("the window w", w, low=1)
        if scheme not in ("cache", "absolute"):
            raise ValueError(
                f"scheme must be 'cache' or 'absolute', got {scheme!r}"
            )
        self.s, self.w, self.scheme = s, w, scheme
        self.length, self.capacity = 0, s + w
        self.K = self.V = self.pos = None

    def check_layer(self, w, causal):
        """Raise ValueError unless the layer is causal without a window."""
        if not causal or w is not None:
            raise ValueError(
                f"a sink cache needs a causal layer without a window (the "
                f"cache is the window), got causal={causal}, window {w}"
            )

    def slots(self, pos):
        """Slot of each position: sinks first, then a rolling window."""
        if not isinstance(pos, torch.Tensor) or pos.is_floating_point():
            raise ValueError(
                f"positions must be an integer tensor, got {_kind(pos)}"
            )
        if (pos < 0).any():
            raise ValueError(f"positions must be >= 0, got {pos.min()}")
        return torch.where(pos < self.s, pos, self.s + (pos - self.s) % self.w)

    def update(self, K, V):
        """Store K, V (B, G, T, d_k); the keys, values and positions of every
        slot for the new tokens' queries (-1: an empty slot)."""
        check_keys(K, V, self.K)
        T = K.shape[-2]
        if T > 1 and self.length + T > self.capacity:
            raise ValueError(
                f"a sink cache of {self.capacity} slots takes one token per "
                f"call past its capacity; got {T} tokens after {self.length}"
            )
        if self.K is None:
            B, G, _, d_k = K.shape
            self.K = K.new_zeros(B, G, self.capacity, d_k)
            self.V = K.new_zeros(B, G, self.capacity, d_k)
            self.pos = torch.full((self.capacity,), -1, dtype=torch.long)
        pos = self.next_positions(T)
        slots = self.slots(pos)
        self.K[..., slots, :], self.V[..., slots, :] = K, V
        self.pos[slots] = pos
        self.length += T
        keys = self.K
        gap = self.length - self.capacity  # tokens between sinks and window
        if self.scheme == "cache" and gap > 0 and self.s > 0:
            keys = self.K.clone()  # stored keys keep their text positions
            shift = torch.full((self.s,), gap)
            keys[..., : self.s, :] = rotary(self.K[..., : self.s, :], shift)
        return keys, self.V, self.pos.clone()

    def nbytes(self):
        """Bytes of the keys and values held (all s + w slots)."""
        if self.K is None:
            return 0
        return 2 * self.K.nelement() * self.K.element_size()

    def crop(self, n):
        """Keep the first n tokens, if the keys that the query at n will
        see (the sinks and n - w < j < n) are still held."""
        self.check_crop(n)
        oldest = max(self.s, self.length - self.w)  # earlier: overwritten
        if max(self.s, n - self.w + 1) < oldest:
            raise ValueError(
                f"cannot crop to {n} tokens: this sink cache has overwritten "
                f"the tokens from {self.s} to {oldest - 1}"
            )
        if self.pos is not None:
            self.pos[self.pos >= n] = -1
        self.length = n


class Int8Cache(Cache):
    """A growing cache whose keys and values are int8 codes with scales.

    Values: one absmax scale per token (over its d_k channels). Keys: one
    per token as well (keys="token"), or one per channel over each group of
    `group` tokens (keys="channel", KIVI); the tokens of an incomplete group
    stay in the input's precision until the group is full. Scales are kept
    in the input's dtype. `update` returns the keys and values as read back
    from the cache, the new tokens' own included. `crop` may cut into the
    unquantised rest, or between groups; a cut into a quantised key group
    raises ValueError: that group's scales were set by tokens it drops, and
    its kept keys' own values are gone.
    """

    def __init__(self, keys="token", group=32):
        if keys not in ("token", "channel"):
            raise ValueError(
                f"keys must be 'token' or 'channel', got {keys!r}"
            )
        check_tokens("the group size", group, low=1)
        self.keys, self.group = keys, group
        self.length, self.capacity = 0, None
        self.parts = None  # name -> tensor, once the first keys arrive

    def check_layer(self, w, causal):
        """A growing cache keeps every key: any layer may use it."""

    def update(self, K, V):
        """Quantise and store K, V (B, G, T, d_k); every key and value so
        far, dequantised, and their positions."""
        check_keys(K, V, None if self.parts is None else self.parts["K_rest"])
        T = K.shape[-2]
        if self.parts is None:
            self.parts = self.empty(K)
        p = self.parts
        v_codes, v_scale = quantize(V, dim=-1)
        p["V"] = torch.cat([p["V"], v_codes], dim=-2)
        p["V_scale"] = torch.cat([p["V_scale"], v_scale], dim=-2)
        if self.keys == "token":
            k_codes, k_scale = quantize(K, dim=-1)
            p["K"] = torch.cat([p["K"], k_codes], dim=-2)
            p["K_scale"] = torch.cat([p["K_scale"], k_scale], dim=-2)
        else:
            p["K_rest"] = torch.cat([p["K_rest"], K], dim=-2)
            while p["K_rest"].shape[-2] >= self.group:
                block = p["K_rest"][..., : self.group, :]
                k_codes, k_scale = quantize(block, dim=-2)  # per channel
                p["K"] = torch.cat([p["K"], k_codes], dim=-2)
                p["K_scale"] = torch.cat([p["K_scale"], k_scale], dim=-2)
                p["K_rest"] = p["K_rest"][..., self.group :, :]
        self.length += T
        return self.read_keys(), self.read_values(), torch.arange(self.length)

    def empty(self, K):
        """Empty codes, scales and unquantised rest, shaped like K."""
        check_keys(K, K)
        B, G, _, d_k = K.shape
        codes = torch.zeros(B, G, 0, d_k, dtype=torch.int8)
        k_width = 1 if self.keys == "token" else d_k
        return {
            "K": codes,
            "V": codes.clone(),
            "K_scale": K.new_zeros(B, G, 0, k_width),
            "V_scale": K.new_zeros(B, G, 0, 1),
            "K_rest": K.new_zeros(B, G, 0, d_k),
        }

    def read_keys(self):
        """Every key held, dequantised, followed by the unquantised rest."""
        self.check_started()
        p = self.parts
        if self.keys == "token":
            keys = dequantize(p["K"], p["K_scale"])
        else:  # one scale per channel and group: repeat it over the group
            scale = p["K_scale"].repeat_interleave(self.group, dim=-2)
            keys = dequantize(p["K"], scale)
        return torch.cat([keys, p["K_rest"]], dim=-2)

    def read_values(self):
        """Every value held, dequantised."""
        self.check_started()
        return dequantize(self.parts["V"], self.parts["V_scale"])

    def check_started(self):
        """Raise ValueError if no keys have been stored yet."""
        if self.parts is None:
            raise ValueError(
                "the cache holds no keys yet: call update(K, V) first"
            )

    def nbytes(self):
        """Bytes of the codes, the scales and the unquantised keys."""
        if self.parts is None:
            return 0
        return sum(
            t.nelement() * t.element_size() for t in self.parts.values()
        )

    def crop(self, n):
        """Keep the first n tokens, as if the later ones had never come: cut
        into the unquantised keys or between key groups (keys="channel");
        ValueError for a cut into a quantised group."""
        self.check_crop(n)
        if self.parts is None:
            return
        p = self.parts
        if self.keys == "channel":
            quantised = p["K"].shape[-2]  # tokens in whole, quantised groups
            if n < quantised and n % self.group:
                start = n - n % self.group
                raise ValueError(
                    f"cannot crop to {n} tokens: keys {start} to {n - 1} "
                    f"share their group's per-channel scales with the "
                    f"dropped keys after them (to {start + self.group - 1}), "
                    f"and their unquantised values are gone; crop to a "
                    f"multiple of {self.group}, to {quantised} or more, or "
                    f"use keys='token'"
                )
            full = min(n, quantised) // self.group  # whole groups kept
            p["K"] = p["K"][..., : full * self.group, :]
            p["K_scale"] = p["K_scale"][..., :full, :]
            p["K_rest"] = p["K_rest"][..., : max(0, n - quantised), :]
        else:
            p["K"], p["K_scale"] = p["K"][..., :n, :], p["K_scale"][..., :n, :]
        p["V"], p["V_scale"] = p["V"][..., :n, :], p["V_scale"][..., :n, :]
        self.length = n


@torch.no_grad()
def stepwise_logits(model, x, caches):
    """Logits (B, T, vocab) of x (B, T) fed one token per call into caches
    (T = 0: an empty result, the caches unchanged)."""
    vocab = model.readout.out_features
    check_ids("x", x, vocab)
    if x.dim() != 2 or x.shape[0] < 1:
        raise ValueError(f"x must be (B, T) with B >= 1, got {tuple(x.shape)}")
    if len(caches) != len(model.blocks):
        raise ValueError(
            f"{len(caches)} caches for {len(model.blocks)} blocks: give one "
            f"per block"
        )
    if x.shape[1] == 0:
        dtype = model.readout.weight.dtype
        return torch.zeros(x.shape[0], 0, vocab, dtype=dtype)
    return torch.cat([model(x[:, [t]], caches) for t in range(x.shape[1])], 1)


def check_ids(name, ids, vocab):
    """Raise ValueError unless ids is an integer tensor of tokens in
    0..vocab-1."""
    integer = isinstance(ids, torch.Tensor) and not (
        ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool
    )
    if not integer:
        raise ValueError(f"{name} must hold integer token ids: {_kind(ids)}")
    outside = ids[(ids < 0) | (ids >= vocab)]
    if len(outside):
        raise ValueError(
            f"{name} holds token {int(outside[0])}, outside the vocabulary "
            f"0..{vocab - 1}"
        )


def position_losses(logits, y):
    """Cross-entropy (nats, float64) at each position, mean over rows: (T,)."""
    check_floats("logits", logits)
    check_finite("logits", logits)  # a NaN or inf logit gives a NaN loss
    if logits.dim() != 3 or logits.shape[0] < 1 or logits.shape[-1] < 1:
        raise ValueError(
            f"logits must be (B, T, vocab) with B, vocab >= 1, got "
            f"{tuple(logits.shape)}"
        )
    check_ids("y", y, logits.shape[-1])
    if logits.shape[:2] != y.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} do not match targets "
            f"{tuple(y.shape)}"
        )
    log_p = logits.double().log_softmax(dim=-1)
    return -log_p.gather(-1, y[..., None])[..., 0].mean(dim=0)
