"""Chapter 16's masks and biases as FlexAttention's `mask_mod` and
`score_mod`, the blocks a `BlockMask` computes, and a decoding step of
fixed shape (issue 49).

PyTorch's FlexAttention (`torch.nn.attention.flex_attention`; Dong et al.
2024) computes softmax(score_mod(Q K^T / sqrt(d_k))) V where mask_mod
allows it. Both are small Python functions of the indices (b, h, q_idx,
kv_idx): `mask_mod` says whether query q_idx may see key kv_idx,
`score_mod` changes a score. Every mask of the book is one here:

- `causal` (top-left, query i sees keys j <= i), `bottom_right(offset)`
  (j <= i + offset; offset = T_k - T_q, chapter 13's second mask);
- `sliding_window(w)`: causal and j > i - w (chapter 10);
- `padding(lengths)`: key j of batch row b is real if j < lengths[b]
  (chapter 4);
- `sinks(s, w)`: causal, and j < s or j > i - w (chapter 11's SinkCache);
- `prefix_lm(P)`: every query sees the first P keys, and the keys before
  it (the prefix language model of Raffel et al. 2020, section 3.2.1);
- `documents(lengths)`: sequences packed into one row, each query seeing
  the earlier keys of its own document only;

and the score changes:

- `alibi(H)`: ALiBi's -m_h (i - j) (Press et al. 2022, section 3; with
  a causal mask), `alibi(H, symmetric=True)` chapter 14's -m_h |i - j|;
- `soft_cap(cap)`: cap tanh(score / cap), Gemma 2's logit soft-capping.

`attend(Q, K, V, mask_mod, score_mod)` runs FlexAttention with the
`BlockMask` of mask_mod: eagerly (`eager`, through PyTorch's private
debugging switch; `public` is the public path it is checked against),
unless it is called inside `torch.compile`. `band_blocks` counts by
hand the blocks of B x B scores (B = `BLOCK`) that a mask whose keys
form one interval per query leaves to compute, and which of them are
full; `block_counts` reads the same
from a `BlockMask`; `skipped` the share of blocks it skips, beside
`BlockMask.sparsity()`.

`fixed_step` is chapter 11's decoding step (book/gpt.py's `Decoder`)
with caches of one fixed shape, written in place at a position held in a
tensor: every step has the same shapes, so `torch.compile` compiles it
once (the reason Hugging Face's `StaticCache` exists). `greedy_fixed`
decodes with it, compiled or not.
"""

import math
import numbers
import warnings

import torch
import torch.nn.attention.flex_attention as flex_module
import torch.nn.functional as F
from torch.nn.attention.flex_attention import (
    BlockMask,
    create_block_mask,
    flex_attention,
)

from gpt import Decoder, check_new, check_prompt
from seq2seq import alibi_slopes

BLOCK = 128  # FlexAttention's default block: 128 queries x 128 keys
# the public path's one-time warning that eager FlexAttention computes every
# score (`public` silences it: we mean it)
EAGER_WARNING = "flex_attention called without torch.compile"


# --- masks -------------------------------------------------------------------


def causal(b, h, q_idx, kv_idx):
    """Top-left causal mask: query i sees keys j <= i."""
    return kv_idx <= q_idx  # every key up to the query itself


def bottom_right(offset):
    """Causal mask aligned bottom-right: query i sees keys j <= i + offset
    (offset = T_k - T_q: the last query sees every key)."""
    check_integer("offset", offset)

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    return mask_mod


def sliding_window(w):
    """Causal with a window of w keys: i - w < j <= i."""
    check_integer("the window w", w, low=1)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < w)

    return mask_mod


def padding(lengths):
    """Key j of batch row b is real if j < lengths[b] (lengths: (B,))."""
    lengths = check_lengths(lengths)

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]

    mask_mod.rows = len(lengths)  # block_mask checks it against B
    return mask_mod


def sinks(s, w):
    """Chapter 11's attention sinks: causal, and j < s or i - w < j."""
    check_integer("the number of sinks s", s)
    check_integer("the window w", w, low=1)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((kv_idx < s) | (q_idx - kv_idx < w))

    return mask_mod


def prefix_lm(P):
    """Every query sees the first P keys (the prefix) and keys j <= i."""
    check_integer("the prefix length P", P)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < P) | (kv_idx <= q_idx)

    return mask_mod


def document_ids(lengths):
    """The document of each position of documents of `lengths`, packed."""
    lengths = check_lengths(lengths, low=1)
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths)


def documents(lengths):
    """Documents of `lengths` packed into one row: query i sees key j if
    both are in one document and j <= i."""
    doc = document_ids(lengths)  # (T,)

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

    mask_mod.tokens = len(doc)  # block_mask checks it against T_q and T_k
    return mask_mod


# --- score changes -----------------------------------------------------------


def alibi(H, symmetric=False, dtype=torch.float64):
    """ALiBi's bias added to head h's scores: -m_h (i - j), the paper's
    (for a causal mask: j <= i), or with symmetric=True chapter 14's
    -m_h |i - j|. m_h: seq2seq.alibi_slopes(H)."""
    slopes = alibi_slopes(H, dtype)  # ValueError: H, dtype
    if not isinstance(symmetric, bool):
        raise ValueError(f"symmetric must be True or False, got {symmetric!r}")

    def score_mod(score, b, h, q_idx, kv_idx):
        distance = q_idx - kv_idx
        if symmetric:
            distance = distance.abs()
        return score - slopes[h] * distance

    return score_mod


def soft_cap(cap):
    """Gemma 2's logit soft-capping: every score becomes cap tanh(score /
    cap), within (-cap, cap)."""
    if isinstance(cap, bool) or not (
        isinstance(cap, numbers.Real) and 0 < cap < math.inf
    ):
        raise ValueError(f"the cap must be a positive number, got {cap!r}")

    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return score_mod


# --- FlexAttention -----------------------------------------------------------


def block_mask(mask_mod, T_q, T_k, B=None, block=BLOCK):
    """The BlockMask of mask_mod for T_q queries and T_k keys, blocks of
    block x block scores; B batch rows (None: one mask for all rows).
    ValueError if `padding`'s lengths are not one per batch row, if
    `documents` do not hold exactly T_q = T_k tokens, or if mask_mod
    indexes a tensor it captured out of range."""
    check_integer("T_q", T_q, low=1)
    check_integer("T_k", T_k, low=1)
    check_integer("the block", block, low=1)
    if not callable(mask_mod):
        raise ValueError(f"mask_mod must be a function, got {mask_mod!r}")
    rows = getattr(mask_mod, "rows", None)  # flex.padding's
    if rows is not None and (1 if B is None else B) != rows:
        raise ValueError(
            f"padding has {rows} lengths, one per batch row, but B = {B}"
        )
    tokens = getattr(mask_mod, "tokens", None)  # flex.documents'
    if tokens is not None and not T_q == T_k == tokens:
        raise ValueError(
            f"the documents hold {tokens} tokens, but T_q = {T_q} and "
            f"T_k = {T_k}: their lengths must add up to T"
        )
    try:
        return create_block_mask(
            mask_mod, B, None, T_q, T_k, device="cpu", BLOCK_SIZE=block
        )
    except IndexError as error:  # e.g. and_masks(padding(...), ...)
        raise ValueError(
            f"mask_mod indexes a tensor it captured out of range for "
            f"B = {B}, T_q = {T_q}, T_k = {T_k}: {error}"
        ) from error


def attend(Q, K, V, mask_mod=None, score_mod=None, block=BLOCK):
    """FlexAttention of Q (B, H, T_q, d_k), K (B, H, T_k, d_k), V (B, H,
    T_k, d_v) with mask_mod (None: every key) and score_mod (None: none),
    eager unless called inside torch.compile. A query that sees no key
    gets zeros (FlexAttention's choice; SDPA gives NaN)."""
    check_qkv(Q, K, V)
    if score_mod is not None and not callable(score_mod):
        raise ValueError(f"score_mod must be a function, got {score_mod!r}")
    mask = None
    if mask_mod is not None:
        B, _, T_q, _ = Q.shape
        mask = block_mask(mask_mod, T_q, K.shape[-2], B, block)
    try:
        return eager(Q, K, V, score_mod, mask)
    except IndexError as error:  # e.g. alibi(H) with more heads than H
        raise ValueError(
            f"the mask_mod or score_mod indexes a tensor it captured out of "
            f"range for Q {tuple(Q.shape)} (its heads, perhaps): {error}"
        ) from error


def eager(Q, K, V, score_mod, mask):
    """flex_attention(Q, K, V, score_mod, block_mask=mask) eagerly, with
    PyTorch's PRIVATE switch `_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG` set
    for the call and restored after it. Without it, flex_attention runs
    each call through torch.compile with the "eager" backend, which traces
    every new mask_mod and score_mod first, and warns once (`public`). On
    2026-12-07 the public path took 33 s of user CPU against 17 s for
    tests/test_flex.py and tests/test_ch16_flex_attention.py (one run
    each), and dynamo refused the hooks of a chapter loaded by
    tools/chapter_loader.py (a module named by its path). PyTorch
    means the switch "ONLY for debugging score_mod and mask_mod
    functions": it "bypasses the required internal compilation that
    ensures correctness and performance" and "doesn't work with the
    backwards pass and may produce incorrect results" (its comment and
    warning in torch/nn/attention/flex_attention.py, 2.13). Forward pass
    only; tests/test_flex.py checks that the output equals the public
    path's on every mask and score_mod of this module."""
    before = flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
    flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    try:
        return flex_attention(Q, K, V, score_mod=score_mod, block_mask=mask)
    finally:
        flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = before


def public(Q, K, V, score_mod, mask):
    """flex_attention(Q, K, V, score_mod, block_mask=mask) the public way:
    traced by dynamo, its one-time warning silenced. `eager`'s reference."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=EAGER_WARNING)
        return flex_attention(Q, K, V, score_mod, mask)


def dense_mask(mask_mod, T_q, T_k, B=1):
    """mask_mod evaluated at every (b, q_idx, kv_idx): (B, 1, T_q, T_k)."""
    if not callable(mask_mod):
        raise ValueError(f"mask_mod must be a function, got {mask_mod!r}")
    for name, n in (("T_q", T_q), ("T_k", T_k), ("B", B)):
        check_integer(name, n, low=1)
    b = torch.arange(B)[:, None, None, None]
    q = torch.arange(T_q)[None, None, :, None]
    kv = torch.arange(T_k)[None, None, None, :]
    h = torch.zeros((), dtype=torch.long)
    return mask_mod(b, h, q, kv).expand(B, 1, T_q, T_k)


# --- blocks ------------------------------------------------------------------


def band_blocks(T_q, T_k, first, last, block=BLOCK):
    """(computed, full): the blocks of block x block scores that hold at
    least one allowed score, and those whose every score is allowed, for
    a mask under which query i sees the keys first(i) <= j <= last(i).

    By hand, from the intervals: first and last are nondecreasing and the
    intervals of queries i and i + 1 overlap or touch, so the queries
    i0 ... i1 - 1 of a block see the keys first(i0) ... last(i1 - 1), and
    every one of them sees first(i1 - 1) ... last(i0). A block cut short
    by the end of the scores (T not a multiple of the block) is never
    full: FlexAttention pads it with scores that are masked."""
    for name, n in (("T_q", T_q), ("T_k", T_k), ("the block", block)):
        check_integer(name, n, low=1)
    if not callable(first) or not callable(last):
        raise ValueError(
            f"first and last must be functions of i: {first!r}, {last!r}"
        )
    computed = full = 0
    for i0 in range(0, T_q, block):
        i1 = min(i0 + block, T_q)
        for j0 in range(0, T_k, block):
            j1 = min(j0 + block, T_k)
            if first(i0) <= j1 - 1 and j0 <= last(i1 - 1):
                computed += 1
                whole = i1 - i0 == block and j1 - j0 == block
                if whole and first(i1 - 1) <= j0 and j1 - 1 <= last(i0):
                    full += 1
    return computed, full


def block_counts(mask):
    """(computed, full) blocks of a BlockMask, summed over its rows."""
    if not isinstance(mask, BlockMask):
        raise ValueError(
            f"mask must be a BlockMask, got {type(mask).__name__}"
        )
    partial = int(mask.kv_num_blocks.sum())
    full = (
        0
        if mask.full_kv_num_blocks is None
        else int(mask.full_kv_num_blocks.sum())
    )
    return partial + full, full


def tile_kinds(mask):
    """The tiles of a BlockMask's first batch row and head, (rows,
    columns) of tiles: 0 skipped, 1 partial (masked), 2 full."""
    if not isinstance(mask, BlockMask):
        raise ValueError(
            f"mask must be a BlockMask, got {type(mask).__name__}"
        )
    rows = mask.kv_num_blocks.shape[-1]
    columns = math.ceil(mask.seq_lengths[1] / mask.BLOCK_SIZE[1])
    kinds = torch.zeros(rows, columns, dtype=torch.long)
    for kind, counts, indices in (
        (1, mask.kv_num_blocks, mask.kv_indices),
        (2, mask.full_kv_num_blocks, mask.full_kv_indices),
    ):
        if counts is None:
            continue
        for r in range(rows):
            kinds[r, indices[0, 0, r, : counts[0, 0, r]]] = kind
    return kinds


def grid(T_q, T_k, block=BLOCK):
    """The blocks of a T_q x T_k score matrix: ceil(T_q/B) ceil(T_k/B)."""
    for name, n in (("T_q", T_q), ("T_k", T_k), ("the block", block)):
        check_integer(name, n, low=1)
    return math.ceil(T_q / block) * math.ceil(T_k / block)


def skipped(mask):
    """The percentage of a BlockMask's blocks that it skips, out of
    ceil(T_q / B) ceil(T_k / B) per batch row (BlockMask.sparsity()
    divides by T_q T_k / B^2 instead, below zero when T is not a
    multiple of the block)."""
    computed, _ = block_counts(mask)
    T_k = mask.seq_lengths[1]
    # kv_num_blocks: (B, H, ceil(T_q / B_q)), one count per row of blocks
    rows = mask.kv_num_blocks.numel()
    return 100 * (1 - computed / (rows * math.ceil(T_k / mask.BLOCK_SIZE[1])))


# --- a decoding step of fixed shape ------------------------------------------


def new_buffers(decoder, B=1):
    """Keys and values of every layer for `decoder.capacity` positions:
    two zero tensors (layers, B, G, capacity, d_k), allocated once."""
    if not isinstance(decoder, Decoder):
        raise ValueError(f"decoder must be a gpt.Decoder, got {decoder!r}")
    check_integer("B", B, low=1)
    shape = (len(decoder.layers), B, decoder.G, decoder.capacity, decoder.d_k)
    dtype = decoder.embed.dtype
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


def fixed_step(decoder, tokens, pos, K_buf, V_buf):
    """Logits (B, vocab) of one token per row, tokens (B, 1), at position
    pos (a 0-d integer tensor): chapter 11's Decoder.step with every key
    slot in the attention and the slots after pos masked. Its keys and
    values are written in place into K_buf, V_buf (new_buffers), so each
    call has the same shapes, whatever pos."""
    B = tokens.shape[0]
    H, G, d_k, d = decoder.H, decoder.G, decoder.d_k, decoder.d
    at = pos.view(1)  # (1,): the slot written and the rotation's row
    cos = decoder.cos.index_select(0, at)  # (1, d_k / 2)
    sin = decoder.sin.index_select(0, at)
    seen = torch.arange(decoder.capacity)[None] <= pos  # (1, capacity)
    x = F.embedding(tokens, decoder.embed)  # (B, 1, d)
    for i, (n1w, n1b, Wi, bi, Wo, bo, n2w, n2b, W1, b1, W2, b2) in enumerate(
        decoder.layers
    ):
        h = F.linear(F.layer_norm(x, (d,), n1w, n1b), Wi, bi)
        qk = h[..., : (H + G) * d_k].view(B, 1, H + G, d_k)
        q1, q2 = qk[..., 0::2], qk[..., 1::2]  # as Decoder.rotate
        qk = torch.stack([q1 * cos - q2 * sin, q1 * sin + q2 * cos], -1)
        Q, K = qk.flatten(-2).transpose(1, 2).split([H, G], dim=1)
        V = h[..., (H + G) * d_k :].view(B, 1, G, d_k).transpose(1, 2)
        K_buf[i].index_copy_(2, at, K)  # slot pos of (B, G, capacity, d_k)
        V_buf[i].index_copy_(2, at, V)
        out = decoder.attention(Q, K_buf[i], V_buf[i], seen).transpose(1, 2)
        x = x + F.linear(out.reshape(B, 1, d), Wo, bo)
        h = F.relu(F.linear(F.layer_norm(x, (d,), n2w, n2b), W1, b1))
        x = x + F.linear(h, W2, b2)
    x = F.layer_norm(x, (d,), *decoder.norm)
    return F.linear(x[:, 0], *decoder.readout)


def greedy_fixed(decoder, prompt, n_new, step=fixed_step):
    """The prompt (P,) and n_new greedy tokens after it, and the logits of
    each new token's step (n_new, vocab), with `step` (fixed_step, or it
    compiled) fed one token per call, the prompt's too."""
    if not isinstance(decoder, Decoder):
        raise ValueError(f"decoder must be a gpt.Decoder, got {decoder!r}")
    check_prompt(prompt)
    check_new(n_new)
    P = len(prompt)
    if P + n_new > decoder.capacity:
        raise ValueError(
            f"{P} + {n_new} tokens exceed the decoder's capacity of "
            f"{decoder.capacity}"
        )
    K_buf, V_buf = new_buffers(decoder)
    tokens = torch.empty(P + n_new, dtype=torch.long)
    tokens[:P] = prompt
    step_logits = []
    for t in range(P + n_new - 1):
        token = tokens[None, t : t + 1].clone()  # (1, 1), at offset 0
        logits = step(decoder, token, torch.tensor(t), K_buf, V_buf)
        if t >= P - 1:  # the prompt's last token and every new one
            tokens[t + 1] = logits[0].argmax()
            step_logits.append(logits[0])
    return tokens, torch.stack(step_logits)


# --- checks ------------------------------------------------------------------


def check_integer(name, n, low=0):
    """Raise ValueError unless n is an integer >= low."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {n!r}")


def check_lengths(lengths, low=0):
    """The lengths as a 1-D int64 tensor; ValueError unless they are
    integers >= low."""
    if isinstance(lengths, list | tuple):
        if not all(
            isinstance(n, numbers.Integral) and not isinstance(n, bool)
            for n in lengths
        ):
            raise ValueError(f"lengths must be integers, got {lengths!r}")
        lengths = torch.tensor(lengths, dtype=torch.long)
    if (
        not isinstance(lengths, torch.Tensor)
        or lengths.dim() != 1
        or lengths.is_floating_point()
        or lengths.dtype == torch.bool
        or len(lengths) == 0
    ):
        raise ValueError(
            f"lengths must be a non-empty 1-D list or tensor of integers, "
            f"got {lengths!r}"
        )
    if (lengths < low).any():
        raise ValueError(f"every length must be >= {low}, got {lengths}")
    return lengths.long()


def check_qkv(Q, K, V):
    """Raise ValueError unless Q (B, H, T_q, d_k), K (B, H, T_k, d_k) and
    V (B, H, T_k, d_v) are floating-point tensors of one dtype with a key
    for every query, all finite, none requiring a gradient (FlexAttention
    has no backward pass on a CPU: it raises NotImplementedError)."""
    for name, t in (("Q", Q), ("K", K), ("V", V)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(
                f"{name} must be a tensor (B, H, T, d), got "
                f"{tuple(t.shape) if isinstance(t, torch.Tensor) else t!r}"
            )
        if not t.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {t.dtype}")
        if t.requires_grad:  # refused even under torch.no_grad()
            raise ValueError(
                f"{name} requires a gradient: FlexAttention has no backward "
                f"pass on a CPU (pass {name}.detach())"
            )
    if not Q.dtype == K.dtype == V.dtype:
        raise ValueError(
            f"mixed dtypes: Q {Q.dtype}, K {K.dtype}, V {V.dtype}"
        )
    if not Q.shape[:2] == K.shape[:2] == V.shape[:2]:
        raise ValueError(
            f"batch and heads differ: Q {tuple(Q.shape)}, K "
            f"{tuple(K.shape)}, V {tuple(V.shape)}"
        )
    if Q.shape[-1] != K.shape[-1] or Q.shape[-1] == 0:
        raise ValueError(
            f"Q and K need one size d_k >= 1: {Q.shape[-1]}, {K.shape[-1]}"
        )
    if K.shape[-2] != V.shape[-2] or K.shape[-2] == 0 or Q.shape[-2] == 0:
        raise ValueError(
            f"{Q.shape[-2]} queries, {K.shape[-2]} keys and {V.shape[-2]} "
            f"values: at least one query and one key, one value per key"
        )
    for name, t in (("Q", Q), ("K", K), ("V", V)):
        if not torch.isfinite(t).all():
            raise ValueError(f"{name} holds NaN or an infinity")
