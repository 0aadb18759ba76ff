"""The whole Transformer of Vaswani et al. (2017): an encoder, a decoder with
masked self-attention and cross-attention, and greedy decoding (issue 37).

It assembles what earlier chapters built, from book/transformer.py: chapter
6's pre-norm `EncoderBlock`, sinusoidal and rotary positions; chapter 10's
causal `SelfAttention` and its key/value `Cache` interface (`KVCache`);
chapter 9's cross-attention idea (a decoder query over the encoder's
states), here as scaled dot-product attention with heads. New here:

- `CrossAttention`: queries from the decoder, keys and values from the
  encoder's outputs (the "encoder-decoder attention" of Vaswani et al.,
  section 3.2.3), whose keys and values are computed once per source;
- `AlibiSelfAttention`: self-attention with ALiBi's linear bias
  (Press, Smith and Lewis 2022, section 3);
- `CrossDecoderBlock`: masked self-attention, cross-attention, feed-forward,
  each pre-norm with a residual (the decoder layer of Vaswani et al.,
  section 3.1, with the norm first as in `nn.TransformerDecoderLayer(
  norm_first=True)`);
- `Encoder` and `Decoder`: stacks of blocks with a final LayerNorm;
- `Seq2Seq`: embeddings, one of five position options, both stacks and a
  readout, with chapter 9's calling convention (`model(src, lengths,
  tgt_in)` and `model.greedy_decode(src, lengths, steps)`), so chapter 9's
  `train`, `held_out_loss` and `accuracy_by_length` run it unchanged;
- `greedy`: greedy decoding, uncached or with one cache per decoder layer;
  `cache_bytes`: the bytes each cache holds;
- `load_torch_weights`: copy the weights of PyTorch's `nn.Transformer`
  (or one of its layers or stacks) into the modules here, for the tests;
- `mirror_weight`, `error_kinds`, `first_wrong`, `error_breakdown`,
  `largest_weight_position` and `copies_source`: chapter 14's probes of
  the trained models (the weight on the mirrored digit; right, unreversed
  and other answers; where an answer first goes wrong; where
  cross-attention looks; which source digit an output digit copies).

Every public function raises a ValueError that names the problem on bad
input (an empty source or key sequence, mixed dtypes, mismatched shapes or
batches, a token outside the vocabulary); an empty query or target
sequence gives an empty result, as `F.scaled_dot_product_attention` does.

Masks are boolean, True where a query may attend to a key, as in
transformer.py. A source is a padded (B, S) tensor of token ids with its
lengths (B,): position j of row b is real if j < lengths[b].
"""

import math
import numbers
from statistics import NormalDist

import torch
import torch.nn.functional as F
from torch import nn

from attention import check_qkv_shapes, check_qkv_tensors, check_scores_finite
from transformer import (
    Cache,
    EncoderBlock,
    KVCache,
    RotarySelfAttention,
    SelfAttention,
    allowed_positions,
    attend,
    check_dense,
    check_dtype,
    check_finite,
    check_heads,
    check_rows,
    check_vectors,
    sinusoidal_encoding,
)

POSITIONS = ("sinusoidal", "rotary", "learned", "alibi", "none")


# --- ALiBi -------------------------------------------------------------------


def alibi_slopes(H, dtype=torch.float64):
    """ALiBi's head-specific slopes m_1 ... m_H (Press et al. 2022, section 3).

    For H a power of two, the geometric sequence that starts at 2^(-8/H)
    with that ratio (H = 8: 1/2, 1/4, ..., 1/256). Otherwise, as the
    authors' code does (`get_slopes` in their repository
    ofirpress/attention_with_linear_biases): the slopes of the power of two
    just below H, then every other slope of twice that power.
    """
    if isinstance(H, bool) or not isinstance(H, int) or H < 1:
        raise ValueError(f"H must be a positive integer, got {H!r}")
    check_dtype(dtype)  # float16, bfloat16, float32 or float64

    def power_of_two(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    p = 1 << (H.bit_length() - 1)  # the largest power of two <= H
    slopes = power_of_two(p)
    if p < H:
        slopes += power_of_two(2 * p)[0::2][: H - p]
    return torch.tensor(slopes, dtype=dtype)


def alibi_bias(H, pos_q, pos_k, dtype=torch.float64):
    """The (H, T_q, T_k) bias -m_h |i - j| added to query i's score of key j.

    Press et al. (section 3) add -m_h (i - j) for a causal query i >= j; for
    a bidirectional encoder (not in the paper) we take the distance |i - j|
    on both sides, the same bias for every key a causal query may see: the
    form Press gives for encoder attention in issue 5 of the authors'
    repository, ofirpress/attention_with_linear_biases (linked from its
    README). Positions are 1-D integer tensors; no key for a query is an
    error, no query an empty bias.
    """
    for name, pos in (("pos_q", pos_q), ("pos_k", pos_k)):
        check_dense(name, pos)  # a sparse or nested tensor: no sizes
        if not is_integer_tensor(pos) or pos.dim() != 1:
            raise ValueError(
                f"{name} must be a 1-D tensor of integer positions, got "
                f"{describe(pos)}"
            )
    if len(pos_k) == 0 and len(pos_q) > 0:
        raise ValueError("an empty key sequence: the queries have no key")
    check_dtype(dtype)  # float16, bfloat16, float32 or float64
    if pos_q.device != pos_k.device:
        raise ValueError(
            f"pos_q is on {pos_q.device}, pos_k on {pos_k.device}"
        )
    distance = (pos_q[:, None] - pos_k[None, :]).abs().to(dtype)  # (T_q, T_k)
    slopes = alibi_slopes(H, dtype).to(pos_q.device)  # the positions' device
    return -slopes[:, None, None] * distance


def attend_biased(Q, K, V, mask=None, bias=None):
    """transformer.py's `attend` with a bias added to the scaled scores.

    Q, K, V and the bias must be finite (a key to hide: mask it): a NaN or
    an infinity in Q, K or the bias can make weights NaN (a bias row of
    -inf does); in V it makes outputs NaN or infinite. An unmasked score
    plus its bias that overflows its dtype (float16 stops at 65504), or an
    unmasked product Q K^T that does before the division, is a ValueError."""
    check_attention_inputs(Q, K, V, mask, bias)
    if bias is None:
        return attend(Q, K, V, mask)  # it checks Q, K and V's values
    check_finite(Q=Q, K=K, V=V, bias=bias)  # one reduction each
    scores = Q @ K.transpose(-2, -1) / Q.shape[-1] ** 0.5 + bias
    try:
        check_scores_finite(scores, mask)  # float16 overflows past 65504
    except ValueError:  # the product, or the bias added to it?
        product = Q @ K.transpose(-2, -1) / Q.shape[-1] ** 0.5
        check_scores_finite(product, mask)  # names Q K^T
        raise ValueError(
            f"a score Q K^T / sqrt(d_k) + bias overflowed {scores.dtype} "
            f"(largest {torch.finfo(scores.dtype).max:g}) where Q K^T / "
            f"sqrt(d_k) alone fits: scale Q, K or the bias down, or use a "
            f"wider dtype"
        ) from None
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = scores.softmax(dim=-1)
    return weights @ V, weights


class AlibiSelfAttention(SelfAttention):
    """chapter 10's `SelfAttention` (no window, G = H) whose scores get
    ALiBi's bias, `alibi_bias`, from the positions of queries and keys
    (the cache's positions in a cached call). No position is added to the
    tokens: the bias is the model's only position information."""

    def __init__(self, d, H, causal=False):
        super().__init__(d, H, causal=causal)

    def forward(self, x, mask=None, cache=None):
        check_vectors("x", x, self.in_proj.weight)
        check_cache(cache)
        T = x.shape[1]
        pos_q = (
            torch.arange(T, device=x.device)  # mask and bias: on x's device
            if cache is None
            else cache.next_positions(T)
        )
        Q, K, V = self.heads(x)
        pos_k = pos_q
        if cache is not None:
            if mask is not None:
                raise ValueError("a cached call takes no mask")
            cache.check_layer(self.w, self.causal)
            K, V, pos_k = cache.update(K, V)
        check_mask(mask, (*Q.shape[:-1], K.shape[-2]), Q.device)
        if self.causal or cache is not None:
            allowed = allowed_positions(pos_q, pos_k, None, self.causal)
            mask = allowed if mask is None else check_rows(mask & allowed)
        bias = alibi_bias(self.H, pos_q, pos_k, Q.dtype)  # (H, T, T_k)
        out, weights = attend_biased(Q, K, V, mask, bias)  # (B, H, T, d_k)
        B, H, T, d_k = out.shape
        out = out.transpose(1, 2).reshape(B, T, H * d_k)
        return self.out_proj(out), weights


def self_attention(d, H, positions, causal):
    """The self-attention of a block for a position option (or None)."""
    check_positions(positions)
    if positions == "rotary":
        return RotarySelfAttention(d, H, causal=causal)
    if positions == "alibi":
        return AlibiSelfAttention(d, H, causal=causal)
    return SelfAttention(d, H, causal=causal)  # positions added to tokens


# --- cross-attention and the decoder block -----------------------------------


class CrossAttention(nn.Module):
    """Multi-head attention from the decoder's tokens (queries) to the
    encoder's outputs (keys and values): Vaswani et al., section 3.2.3.

    One input projection `in_proj` (d -> 3d) holds W_Q, W_K and W_V stacked
    in that order, as `nn.MultiheadAttention.in_proj_weight` does; queries
    use its first d rows, keys and values the other 2d. No positions: a
    query's weights over the source depend only on what the encoder wrote.
    """

    def __init__(self, d, H):
        super().__init__()
        check_heads(d, H)
        self.H, self.d_k = H, d // H
        self.in_proj = nn.Linear(d, 3 * d)
        self.out_proj = nn.Linear(d, d)

    def keys_values(self, memory):
        """Keys and values (B, H, S, d_k) of the encoder's outputs (B, S, d):
        computed once per source, reused at every decoding step."""
        check_memory(memory, self.in_proj.weight)
        B, S, d = memory.shape
        W, b = self.in_proj.weight[d:], self.in_proj.bias[d:]
        kv = F.linear(memory, W, b).view(B, S, 2, self.H, self.d_k)
        K, V = kv.permute(2, 0, 3, 1, 4)  # each (B, H, S, d_k)
        return K, V

    def forward(self, x, kv, mask=None):
        """Outputs (B, T, d) and weights (B, H, T, S) of queries x (B, T, d)
        over keys and values kv = keys_values(memory); mask broadcasts to
        (B, H, T, S)."""
        check_vectors("x", x, self.in_proj.weight)
        B, T, d = x.shape
        Q = F.linear(x, self.in_proj.weight[:d], self.in_proj.bias[:d])
        Q = Q.view(B, T, self.H, self.d_k).transpose(1, 2)  # (B, H, T, d_k)
        check_attention_inputs(Q, *check_kv(kv), mask)
        out, weights = attend(Q, *kv, mask)
        out = out.transpose(1, 2).reshape(B, T, d)
        return self.out_proj(out), weights


class CrossDecoderBlock(nn.Module):
    """Pre-norm decoder block: masked self-attention, cross-attention to the
    encoder's outputs, then the feed-forward layer, each inside a residual
    (Vaswani et al., section 3.1, with the LayerNorm first as in
    `nn.TransformerDecoderLayer(norm_first=True)`).

    The self-attention is causal; `positions` "rotary" or "alibi" give it
    rotary queries and keys or ALiBi's bias, anything else chapter 6's plain
    attention (positions added to the tokens, or none). Parameter names
    follow `nn.TransformerDecoderLayer`'s (see `torch_key`).
    """

    def __init__(self, d, H, d_ff, positions=None):
        super().__init__()
        check_sizes(d=d, H=H, d_ff=d_ff)
        self.norm1 = nn.LayerNorm(d)
        self.self_attn = self_attention(d, H, positions, causal=True)
        self.norm2 = nn.LayerNorm(d)
        self.cross_attn = CrossAttention(d, H)
        self.norm3 = nn.LayerNorm(d)
        self.linear1, self.linear2 = nn.Linear(d, d_ff), nn.Linear(d_ff, d)

    def forward(self, x, memory, memory_mask=None, tgt_mask=None, cache=None):
        """Outputs (B, T, d), self-attention weights (B, H, T, T_k) and
        cross-attention weights (B, H, T, S).

        x: (B, T, d); memory: the encoder's outputs (B, S, d), or their
        keys and values `cross_attn.keys_values(memory)`; memory_mask: (B, S),
        True for a real source position; tgt_mask: (T, T) or (B, T, T), on
        top of the causal mask; cache: a `Cache` for the self-attention.
        """
        kv = check_block_inputs(x, memory, memory_mask, tgt_mask, self, cache)
        if kv is None:
            kv = self.cross_attn.keys_values(memory)
        if tgt_mask is not None and tgt_mask.dim() == 3:
            tgt_mask = tgt_mask[:, None]  # one mask per row, for every head
        attended, self_weights = self.self_attn(self.norm1(x), tgt_mask, cache)
        y = x + attended
        src_mask = None if memory_mask is None else memory_mask[:, None, None]
        crossed, cross_weights = self.cross_attn(self.norm2(y), kv, src_mask)
        z = y + crossed
        out = z + self.linear2(F.relu(self.linear1(self.norm3(z))))
        return out, self_weights, cross_weights


def check_block_inputs(
    x, memory, memory_mask, tgt_mask, block=None, cache=None
):
    """Raise ValueError on a bad shape, dtype or cache; the memory's (K, V)
    if given as such. With a block, x must have its width and dtype (the
    memory's are checked by its cross-attention)."""
    if block is None:
        check_vectors("x", x)
    else:
        check_vectors("x", x, block.norm1.weight)
        check_cache(cache)
    B, T, _ = x.shape
    kv = check_kv(memory) if isinstance(memory, tuple) else None
    if kv is not None:
        B_m, S = kv[0].shape[0], kv[0].shape[2]
    else:
        check_vectors("memory", memory)  # its width: keys_values checks
        B_m, S = memory.shape[:2]
    if B_m != B:
        raise ValueError(
            f"mismatched batch sizes: {B} target rows, {B_m} source rows"
        )
    if S == 0:
        raise ValueError("an empty source: the memory has no position")
    if memory_mask is not None:
        check_dense("memory_mask", memory_mask)
        if not is_bool_tensor(memory_mask) or tuple(memory_mask.shape) != (
            B,
            S,
        ):
            raise ValueError(
                f"memory_mask must be a boolean ({B}, {S}) tensor, got "
                f"{describe(memory_mask)}"
            )
        if memory_mask.device != x.device:
            raise ValueError(
                f"memory_mask is on {memory_mask.device}, x on {x.device}"
            )
        if not memory_mask.any(dim=-1).all():
            raise ValueError("an empty source: a row has no real position")
    check_tgt_mask(tgt_mask, B, T)
    return kv


def check_tgt_mask(tgt_mask, B, T):
    """Raise ValueError unless tgt_mask is None or boolean (T, T) or (B, T, T)."""
    if tgt_mask is None:
        return
    check_dense("the target mask", tgt_mask)
    if not is_bool_tensor(tgt_mask) or tuple(tgt_mask.shape) not in (
        (T, T),
        (B, T, T),
    ):
        raise ValueError(
            f"the target mask must be a boolean ({T}, {T}) or ({B}, {T}, {T}) "
            f"tensor, got {describe(tgt_mask)}"
        )


# --- the stacks --------------------------------------------------------------


class Encoder(nn.Module):
    """`layers` of chapter 6's pre-norm `EncoderBlock`, then a LayerNorm.

    Given the same weights (`load_torch_weights`), it equals the encoder of
    `nn.Transformer(norm_first=True, dropout=0)` (its `encoder`: layers and
    final norm) on the same inputs, which are the embedded tokens plus any
    added positions: nn.Transformer has neither embeddings nor readout, so
    the comparison covers the stack alone. It holds for positions
    "sinusoidal", "learned" and "none" (added to the inputs, or absent),
    and for "alibi" given ALiBi's bias as nn.Transformer's float mask
    (`src_mask`, one (S, S) bias per row and head, which it adds to the
    scores); "rotary" rotates queries and keys inside the attention, which
    no mask can do.
    """

    def __init__(self, d, H, d_ff, layers, positions=None):
        super().__init__()
        check_sizes(d=d, H=H, d_ff=d_ff, layers=layers)
        check_positions(positions)
        self.layers = nn.ModuleList()
        for _ in range(layers):
            block = EncoderBlock(d, H, d_ff, rotary=positions == "rotary")
            if positions == "alibi":
                block.self_attn = AlibiSelfAttention(d, H)
            self.layers.append(block)
        self.norm = nn.LayerNorm(d)

    def forward(self, x, padding_mask=None):
        """Outputs (B, S, d) of inputs x (B, S, d); padding_mask (B, S) is
        True at real positions (keys at other positions get no weight)."""
        check_memory(x, self.norm.weight, "x")
        for block in self.layers:
            x = block(x, padding_mask=padding_mask)
        return self.norm(x)


class Decoder(nn.Module):
    """`layers` of `CrossDecoderBlock`, then a LayerNorm: given the same
    weights, the decoder of `nn.Transformer(norm_first=True, dropout=0)`
    (see `Encoder` for what the comparison covers)."""

    def __init__(self, d, H, d_ff, layers, positions=None):
        super().__init__()
        check_sizes(d=d, H=H, d_ff=d_ff, layers=layers)
        check_positions(positions)
        self.layers = nn.ModuleList(
            CrossDecoderBlock(d, H, d_ff, positions) for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d)

    def memory_kv(self, memory):
        """Each layer's cross-attention keys and values of the memory."""
        return [block.cross_attn.keys_values(memory) for block in self.layers]

    def forward(self, x, memory, memory_mask=None, tgt_mask=None, caches=None):
        """Outputs (B, T, d) and cross-attention weights (B, layers, H, T, S).

        memory: the encoder's outputs (B, S, d), or `memory_kv(memory)`;
        caches: one `Cache` per layer for the self-attention, or None.
        """
        kv = memory if isinstance(memory, list) else None
        if kv is not None and len(kv) != len(self.layers):
            raise ValueError(
                f"memory_kv has {len(kv)} layers' keys and values, the "
                f"decoder {len(self.layers)} layers"
            )
        check_caches(caches, len(self.layers))
        cross = []
        for i, block in enumerate(self.layers):
            layer_memory = memory if kv is None else kv[i]
            cache = None if caches is None else caches[i]
            x, _, weights = block(
                x, layer_memory, memory_mask, tgt_mask, cache
            )
            cross.append(weights)
        return self.norm(x), torch.stack(cross, dim=1)


# --- the whole model ---------------------------------------------------------


class Seq2Seq(nn.Module):
    """The encoder-decoder Transformer: token embeddings, positions, the
    `Encoder` and `Decoder` stacks, and a linear readout to the vocabulary.

    positions (how token order reaches the model):
    - "sinusoidal": the table of Vaswani et al., section 3.5 (chapter 6's
      `sinusoidal_encoding`), added to the source and the target tokens;
    - "rotary": queries and keys of every self-attention rotated by their
      position (Su et al. 2021, section 3.2; chapter 6's `rotary`);
    - "learned": a trained vector per position (Gehring et al. 2017,
      section 3.1), added like the sinusoids; one table for the source,
      `max_len` rows, one for the target, `max_len + 1` rows (the start
      token and `max_len` digits), so every row is trained on strings of up
      to `max_len` tokens. A position past its table gets the table's last
      row (clamped): every string gets an answer, so accuracy past the
      training lengths can be measured, and a row that no training step
      updated would be random noise. Clamping is Shaw et al.'s (2018,
      section 3.2) choice for relative distances beyond k; for absolute
      positions it gives every token from the last row on the same
      position, which the model has never seen happen;
    - "alibi": no positions added; each self-attention's scores get the
      bias -m_h |i - j| (Press, Smith and Lewis 2022, section 3; `alibi_bias`;
      |i - j| in the bidirectional encoder);
    - "none": no positions anywhere (the NoPE of Kazemnejad et al. 2023,
      who study it in decoder-only models, whose causal mask orders the
      tokens). A bidirectional encoder has no such mask: it is
      permutation-equivariant (chapter 6), permuting the
      real source tokens permutes its outputs, and cross-attention, a
      weighted sum over them, sees only the multiset of source tokens.
      Every decoder output depends on the source through that multiset, so
      of the strings with one multiset of digits the model reverses at most
      one (the string whose reversal its one output is). The option is a
      control, not a contender.

    Cross-attention has no positions in any option. No dropout; the source
    and target embeddings are not shared with each other or the readout
    (Vaswani et al., section 3.4, share them), nor scaled by sqrt(d)
    (ibid.): chapter 6 adds positions to unscaled embeddings.

    `model(src, lengths, tgt_in)` and `model.greedy_decode(src, lengths,
    steps)` follow chapter 9's `Seq2Seq`: tokens ids in 0 ... vocab - 1,
    `bos` the start token the decoder begins with.
    """

    def __init__(
        self,
        vocab,
        d=64,
        H=4,
        d_ff=256,
        layers=(2, 2),
        positions="sinusoidal",
        max_len=10,
        bos=1,
    ):
        super().__init__()
        if positions not in POSITIONS:
            raise ValueError(
                f"positions must be one of {POSITIONS}, got {positions!r}"
            )
        check_sizes(vocab=vocab, max_len=max_len)
        if not is_count(bos, 0) or not bos < vocab:
            raise ValueError(
                f"bos={bos!r} is outside the vocabulary 0..{vocab - 1}"
            )
        if (
            not isinstance(layers, (tuple, list))
            or len(layers) != 2
            or not all(is_count(k) for k in layers)
        ):
            raise ValueError(
                f"layers must be a pair of positive integers (encoder, "
                f"decoder), got {layers!r}"
            )
        self.vocab, self.positions, self.bos = vocab, positions, bos
        self.max_len = max_len
        self.src_embed = nn.Embedding(vocab, d)
        self.tgt_embed = nn.Embedding(vocab, d)
        if positions == "learned":
            self.src_pos = nn.Embedding(max_len, d)
            self.tgt_pos = nn.Embedding(max_len + 1, d)
        self.encoder = Encoder(d, H, d_ff, layers[0], positions)
        self.decoder = Decoder(d, H, d_ff, layers[1], positions)
        self.readout = nn.Linear(d, vocab)

    def add_positions(self, x, start, table):
        """Tokens x (B, T, d) at positions start ... start + T - 1, plus
        their sinusoids or learned vectors (clamped to the table)."""
        check_vectors("x", x, self.readout.weight)
        if not is_count(start, 0):
            raise ValueError(f"start must be an integer >= 0, got {start!r}")
        if self.positions == "learned" and table not in (
            self.table("src"),
            self.table("tgt"),
        ):
            raise ValueError(
                "learned positions need the model's src or tgt table"
            )
        T, d = x.shape[1:]
        if self.positions == "sinusoidal":
            return x + sinusoidal_encoding(start + T, d, x.dtype)[start:]
        if self.positions == "learned":
            pos = torch.arange(start, start + T).clamp(
                max=table.num_embeddings - 1
            )
            return x + table(pos)
        return x  # rotary and ALiBi act inside attention; "none": nothing

    def encode(self, src, lengths):
        """The encoder's outputs (B, S, d) and the source mask (B, S)."""
        check_source(src, lengths, self.vocab)
        mask = torch.arange(src.shape[1]) < lengths[:, None]  # (B, S)
        x = self.add_positions(self.src_embed(src), 0, self.table("src"))
        return self.encoder(x, mask), mask

    def table(self, side):
        """The learned table of the source or target side, else None."""
        if side not in ("src", "tgt"):
            raise ValueError(f'side must be "src" or "tgt", got {side!r}')
        return getattr(self, f"{side}_pos", None)

    def decode(self, tgt_in, memory, mask, tgt_mask=None, caches=None):
        """Logits (B, T, vocab) and cross-attention weights (B, layers, H,
        T, S) of target tokens tgt_in (B, T) after the cached ones."""
        check_tokens("tgt_in", tgt_in, self.vocab)
        check_caches(caches, len(self.decoder.layers))
        start = 0 if caches is None else caches[0].length
        x = self.add_positions(
            self.tgt_embed(tgt_in), start, self.table("tgt")
        )
        y, cross = self.decoder(x, memory, mask, tgt_mask, caches)
        return self.readout(y), cross

    def forward(self, src, lengths, tgt_in, tgt_mask=None):
        """Teacher forcing: logits (B, T, vocab) and cross-attention weights
        (B, layers, H, T, S). tgt_mask (T, T) or (B, T, T), boolean,
        restricts the causal self-attention further."""
        check_batch(src, tgt_in)
        memory, mask = self.encode(src, lengths)
        return self.decode(tgt_in, memory, mask, tgt_mask)

    def greedy_decode(self, src, lengths, steps):
        """Chapter 9's interface: tokens (B, steps) and cross-attention
        weights (B, steps, S), the last layer's averaged over heads."""
        tokens, _, cross, _ = greedy(self, src, lengths, steps)
        return tokens, cross[:, -1].mean(dim=1)


def check_tokens(name, tokens, vocab):
    """Raise ValueError unless tokens (B, T) are ids in 0 ... vocab - 1."""
    if not is_integer_tensor(tokens) or tokens.dim() != 2:
        raise ValueError(
            f"{name} must be a (B, T) tensor of token ids, got "
            f"{describe(tokens)}"
        )
    bad = (tokens < 0) | (tokens >= vocab)
    if bad.any():
        raise ValueError(
            f"{name} holds token {int(tokens[bad][0])}, outside the "
            f"vocabulary 0..{vocab - 1}"
        )


def check_source(src, lengths, vocab):
    """Raise ValueError unless src (B, S) and lengths (B,) fit, none empty."""
    check_tokens("src", src, vocab)
    if not is_integer_tensor(lengths):
        raise ValueError(
            f"lengths must be a tensor of integers, got {describe(lengths)}"
        )
    if lengths.dim() != 1 or len(lengths) != len(src):
        raise ValueError(
            f"mismatched batch sizes: src has {len(src)} rows, lengths "
            f"shape {tuple(lengths.shape)}"
        )
    if src.shape[1] == 0 or (lengths < 1).any():
        raise ValueError("an empty source: every string needs a token")
    if (lengths > src.shape[1]).any():
        raise ValueError(
            f"lengths must be at most src's {src.shape[1]} columns"
        )


def check_batch(src, tgt_in):
    """Raise ValueError unless src and tgt_in have the same batch size."""
    for name, tokens in (("src", src), ("tgt_in", tgt_in)):
        if not isinstance(tokens, torch.Tensor):
            raise ValueError(
                f"{name} must be a tensor, got {describe(tokens)}"
            )
    if tgt_in.dim() >= 1 and src.dim() >= 1 and len(tgt_in) != len(src):
        raise ValueError(
            f"mismatched batch sizes: src has {len(src)} rows, tgt_in "
            f"{len(tgt_in)}"
        )


# --- greedy decoding ---------------------------------------------------------


@torch.no_grad()
def greedy(model, src, lengths, steps, cached=True):
    """Greedy decoding from the start token: each step appends the likeliest
    token. Returns tokens (B, steps), their logits (B, steps, vocab), the
    cross-attention weights (B, layers, H, steps, S) and the caches.

    Uncached (cached=False), step t runs the decoder over all t + 1 tokens
    so far and keeps the last position's outputs; cached, it feeds the one
    new token, its self-attention reading the earlier keys and values from a
    `KVCache` per layer, and its cross-attention the keys and values of the
    source computed once (`Decoder.memory_kv`). The caches returned are
    (self-attention caches, cross-attention keys and values), None
    uncached.
    """
    if not isinstance(model, Seq2Seq):
        raise ValueError(f"model must be a Seq2Seq, got {describe(model)}")
    if not is_count(steps):
        raise ValueError(f"greedy decoding needs steps >= 1, got {steps!r}")
    if not isinstance(cached, bool):
        raise ValueError(f"cached must be True or False, got {cached!r}")
    memory, mask = model.encode(src, lengths)
    B = len(src)
    tokens = torch.full((B, 1), model.bos)
    logits, cross = [], []
    if cached:
        kv = model.decoder.memory_kv(memory)  # once per source
        caches = [KVCache() for _ in model.decoder.layers]
    for _ in range(steps):
        if cached:
            step, weights = model.decode(
                tokens[:, -1:], kv, mask, None, caches
            )
        else:
            step, weights = model.decode(tokens, memory, mask)
        logits.append(step[:, -1])  # (B, vocab)
        cross.append(weights[..., -1, :])  # (B, layers, H, S)
        tokens = torch.cat([tokens, step[:, -1].argmax(-1, keepdim=True)], 1)
    out_caches = (caches, kv) if cached else None
    return (
        tokens[:, 1:],
        torch.stack(logits, dim=1),
        torch.stack(cross, dim=3),
        out_caches,
    )


def cache_bytes(caches):
    """Bytes of each cache `greedy` returns: {"self": [per layer], "cross":
    [per layer]}. A self-attention cache holds K and V of every token fed
    (2 B H t d_k numbers); a cross-attention one those of the source
    (2 B H S d_k), fixed from the first step."""
    if (
        not isinstance(caches, tuple)
        or len(caches) != 2
        or not isinstance(caches[0], list)
        or not isinstance(caches[1], list)
        or len(caches[0]) != len(caches[1])
    ):
        raise ValueError(
            "caches must be what a cached `greedy` returns: (self-attention "
            f"caches, cross-attention keys and values), got {describe(caches)}"
        )
    self_caches, kv = caches
    check_caches(self_caches, len(kv))
    for pair in kv:
        check_kv(pair)
    return {
        "self": [cache.nbytes() for cache in self_caches],
        "cross": [
            sum(t.nelement() * t.element_size() for t in pair) for pair in kv
        ],
    }


# --- weights from PyTorch's nn.Transformer -----------------------------------


def torch_key(key):
    """The name here of a parameter of nn.Transformer or one of its parts:
    `in_proj_weight` is `in_proj.weight` (and the bias), `multihead_attn`
    (cross-attention) is `cross_attn`; every other name is the same."""
    if not isinstance(key, str):
        raise ValueError(f"key must be a parameter name, got {describe(key)}")
    key = key.replace("in_proj_weight", "in_proj.weight")
    key = key.replace("in_proj_bias", "in_proj.bias")
    return key.replace("multihead_attn.", "cross_attn.")


def load_torch_weights(module, torch_module):
    """Copy every parameter of torch_module (nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer, nn.TransformerEncoder, nn.TransformerDecoder
    or nn.Transformer) into module (EncoderBlock, CrossDecoderBlock,
    Encoder, Decoder, or a module with `encoder` and `decoder` stacks)
    under the names `torch_key` gives; ValueError if the parameters differ
    in name or shape."""
    for name, m in (("module", module), ("torch_module", torch_module)):
        if not isinstance(m, nn.Module):
            raise ValueError(f"{name} must be an nn.Module, got {describe(m)}")
    theirs = {torch_key(k): v for k, v in torch_module.state_dict().items()}
    ours = module.state_dict()
    if isinstance(module, Seq2Seq):  # the stacks only, not the embeddings
        ours = {k: v for k, v in ours.items() if k in theirs}
    if set(theirs) != set(ours):
        raise ValueError(
            f"the parameters differ: only in {type(torch_module).__name__}: "
            f"{sorted(set(theirs) - set(ours))}; only in "
            f"{type(module).__name__}: {sorted(set(ours) - set(theirs))}"
        )
    for key, value in theirs.items():
        if value.shape != ours[key].shape:
            raise ValueError(
                f"{key}: shape {tuple(value.shape)} in "
                f"{type(torch_module).__name__}, {tuple(ours[key].shape)} here"
            )
    module.load_state_dict(theirs, strict=not isinstance(module, Seq2Seq))
    return module


# --- measuring the alignment -------------------------------------------------


def mirror_weight(weights, lengths):
    """Mean weight that output digit t (1 ... n) puts on input digit
    n + 1 - t, the digit it must copy when reversing: weights (B, ..., T, S)
    with T >= max(lengths); returns (...) pooled over the digits of all
    strings (chapter 9's per-string mean when all strings have one length;
    for a batch and any leading axes)."""
    check_weights(weights, lengths, rows=True)
    if len(lengths) == 0:
        raise ValueError("no strings: the mean weight is undefined")
    total, count = 0, 0
    for w, n in zip(weights, lengths.tolist()):
        rows = torch.arange(n)
        total = total + w[..., rows, n - 1 - rows].sum(dim=-1)
        count += n
    return total / count


# --- probes of the trained models (chapter 14) ---------------------------------

ERROR_KINDS = ("right", "unreversed", "other")  # error_kinds' 0, 1, 2


def answer_columns(lengths):
    """The columns an answer is judged on: the n digits and the end token
    of the longest string (0 for no string)."""
    return int(lengths.max()) + 1 if len(lengths) else 0


def error_kinds(pred, tgt, lengths):
    """Each string's answer, (B,): 0 right (tgt's n digits and end token),
    1 unreversed (the source as written: tgt's n digits in reverse order,
    then the end token; the answer for the string's reversal, which a model
    that cannot tell the two apart gives), 2 other. pred and tgt are
    (B, steps) token ids, steps > max(lengths); what follows the end token
    is not compared, and a palindrome's answer counts as right."""
    check_answers(pred, tgt, lengths)
    steps = answer_columns(lengths)
    pred, tgt = pred[:, :steps], tgt[:, :steps]
    pos, n = torch.arange(steps), lengths[:, None]
    compared = pos <= n  # (B, steps): the n digits and the end token
    mirror = (n - 1 - pos).clamp(min=0)  # the digit a reversal puts at pos
    unreversed = torch.where(pos < n, tgt.gather(1, mirror), tgt)
    right = ((pred == tgt) | ~compared).all(dim=1)
    copied = ((pred == unreversed) | ~compared).all(dim=1)
    return torch.where(right, 0, torch.where(copied, 1, 2))


def first_wrong(pred, tgt, lengths):
    """Each string's first wrong output position, from 1 (the end token is
    position n + 1), or 0 for a right answer: (B,)."""
    check_answers(pred, tgt, lengths)
    steps = answer_columns(lengths)
    if steps == 0:  # no strings: argmax has no column to reduce
        return torch.zeros(0, dtype=torch.long)
    compared = torch.arange(steps) <= lengths[:, None]  # (B, steps)
    wrong = (pred[:, :steps] != tgt[:, :steps]) & compared
    return torch.where(wrong.any(dim=1), wrong.double().argmax(dim=1) + 1, 0)


def error_breakdown(pred, tgt, lengths):
    """Counts over a batch: strings of each kind, {"right", "unreversed",
    "other"} (`error_kinds`), and "first": [c_1, ..., c_{m+1}], the wrong
    strings whose first wrong position (`first_wrong`) is 1, ..., m + 1,
    for m = max(lengths)."""
    kinds = error_kinds(pred, tgt, lengths)
    first = first_wrong(pred, tgt, lengths)
    counts = torch.bincount(kinds, minlength=len(ERROR_KINDS)).tolist()
    steps = answer_columns(lengths)
    firsts = torch.bincount(first, minlength=steps + 1)[1:].tolist()
    return dict(zip(ERROR_KINDS, counts, strict=True)) | {"first": firsts}


def wilson_interval(k, n, level=0.95):
    """Wilson's score interval for a proportion: k successes in n trials
    (an accuracy over n held-out strings), at the given level. k and n may
    be any integers (Python's, NumPy's), not bools."""

    def integer(x):
        return isinstance(x, numbers.Integral) and not isinstance(x, bool)

    if not (integer(k) and integer(n) and 0 <= k <= n and n >= 1):
        raise ValueError(f"need counts 0 <= k <= n and n >= 1, got {k=}, {n=}")
    return _wilson(int(k) / int(n), int(n), level)


def _wilson(p, n, level):
    """Wilson's interval for a share p of n trials (wilson_interval's
    formula; circuits.sequence_interval's with n the number of sequences)."""
    if not (isinstance(level, numbers.Real) and 0 < level < 1):
        raise ValueError(f"level must be a number in (0, 1), got {level!r}")
    z = NormalDist().inv_cdf((1 + level) / 2)
    z2 = z * z / n
    centre = (p + z2 / 2) / (1 + z2)
    half = z / (1 + z2) * math.sqrt(p * (1 - p) / n + z2 / (4 * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def difference_interval(k1, n1, k2, n2, level=0.95):
    """The interval for p1 - p2, two independent proportions k1/n1 and
    k2/n2, from their Wilson intervals (Newcombe 1998, method 10)."""
    l1, u1 = wilson_interval(k1, n1, level)
    l2, u2 = wilson_interval(k2, n2, level)
    p1, p2 = int(k1) / int(n1), int(k2) / int(n2)
    d = p1 - p2
    return (
        d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2),
        d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2),
    )


def largest_weight_position(weights, lengths):
    """The source position, from 1, that gets the largest weight at each
    output step, among each string's n real positions (the first of a
    tie): weights (B, ..., T, S) -> (B, ..., T)."""
    check_weights(weights, lengths)
    S = weights.shape[-1]
    real = torch.arange(S) < lengths[:, None]  # (B, S)
    real = real.view(len(real), *[1] * (weights.dim() - 2), S)
    return weights.masked_fill(~real, float("-inf")).argmax(dim=-1) + 1


def copies_source(pred, src, lengths, shift=0):
    """Whether output digit t (from 1) of each string of n digits is its
    source digit n + 1 - t - shift (from 1): the mirror, the digit a
    reversal copies, for shift = 0; the digit left of it, the mirror in a
    string of n - 1 digits, for shift = 1. pred (B, steps) and src (B, S)
    are token ids, steps and S >= max(lengths); returns (B, m) booleans for
    m = max(lengths), False for t > n and where that source position lies
    outside 1 ... n. A written digit equal to two source digits copies
    both."""
    check_lengths(lengths)
    m = int(lengths.max()) if len(lengths) else 0
    for name, t in (("pred", pred), ("src", src)):
        if not is_integer_tensor(t) or t.dim() != 2 or len(t) != len(lengths):
            raise ValueError(
                f"{name} must be a (B, steps) tensor of token ids with one "
                f"row per length ({len(lengths)}), got {describe(t)}"
            )
        if t.shape[1] < m:
            raise ValueError(
                f"{name} has {t.shape[1]} columns, fewer than {m} digits"
            )
    if isinstance(shift, bool) or not isinstance(shift, int):
        raise ValueError(f"shift must be an integer, got {shift!r}")
    t = torch.arange(1, m + 1)  # (m,): output digits
    n = lengths[:, None]  # (B, 1)
    position = n + 1 - t - shift  # (B, m): the source digit, from 1
    inside = (t <= n) & (position >= 1) & (position <= n)
    digit = src.gather(1, (position - 1).clamp(0, max(m - 1, 0)))
    return inside & (pred[:, :m] == digit)


# --- input checks ----------------------------------------------------------------


def describe(x):
    """A short description of x for an error message."""
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return f"{type(x).__name__} {x!r}"[:80]


def is_count(value, minimum=1):
    """True if value is an integer (not a bool) >= minimum."""
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and value >= minimum
    )


def is_integer_tensor(t):
    return isinstance(t, torch.Tensor) and not (
        t.is_floating_point() or t.is_complex() or t.dtype == torch.bool
    )


def is_bool_tensor(t):
    return isinstance(t, torch.Tensor) and t.dtype == torch.bool


def is_float_tensor(t):
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def broadcasts(shape, target):
    """True if a tensor of `shape` broadcasts to `target` unchanged."""
    try:
        return torch.broadcast_shapes(shape, target) == torch.Size(target)
    except RuntimeError:
        return False


def check_sizes(**sizes):
    """Raise ValueError unless every size given (d=64, H=4, ...) is a
    positive integer."""
    for name, value in sizes.items():
        if not is_count(value):
            raise ValueError(
                f"{name} must be a positive integer, got {value!r}"
            )


def check_positions(positions):
    """Raise ValueError unless positions is None or one of POSITIONS."""
    if positions is not None and positions not in POSITIONS:
        raise ValueError(
            f"positions must be None or one of {POSITIONS}, got {positions!r}"
        )


def check_memory(memory, like, name="memory"):
    """check_vectors, and no empty source: S >= 1 positions."""
    check_vectors(name, memory, like)
    if memory.shape[1] == 0:
        raise ValueError(f"an empty source: {name} has no position")


def check_kv(kv):
    """Raise ValueError unless kv is a pair (K, V) of float (B, H, S, d_k)
    tensors of one shape and dtype (`CrossAttention.keys_values`); kv."""
    if (
        not isinstance(kv, (tuple, list))
        or len(kv) != 2
        or not all(is_float_tensor(t) and t.dim() == 4 for t in kv)
    ):
        raise ValueError(
            "kv must be the pair (K, V) of (B, H, S, d_k) tensors that "
            f"keys_values returns, got {describe(kv)}"
        )
    K, V = kv
    if K.shape != V.shape or K.dtype != V.dtype:
        raise ValueError(f"K and V differ: {describe(K)} and {describe(V)}")
    return tuple(kv)


def check_cache(cache):
    """Raise ValueError unless cache is None or a transformer.py `Cache`."""
    if cache is not None and not isinstance(cache, Cache):
        raise ValueError(
            f"cache must be a Cache or None, got {describe(cache)}"
        )


def check_caches(caches, layers):
    """Raise ValueError unless caches is None or one `Cache` per layer."""
    if caches is None:
        return
    if not isinstance(caches, (list, tuple)) or len(caches) != layers:
        raise ValueError(
            f"caches must be a list of {layers} caches, one per layer, got "
            f"{describe(caches)}"
        )
    for cache in caches:
        check_cache(cache)


def check_mask(mask, shape, device):
    """Raise ValueError unless mask is None or a boolean tensor on device
    (Q's) that broadcasts to shape."""
    check_dense("mask", mask)
    if mask is not None and not (
        is_bool_tensor(mask) and broadcasts(mask.shape, shape)
    ):
        raise ValueError(
            f"mask must be a boolean tensor that broadcasts to {tuple(shape)}, "
            f"got {describe(mask)}"
        )
    if mask is not None and mask.device != device:
        raise ValueError(f"mask is on {mask.device}, Q on {device}")


def check_attention_inputs(Q, K, V, mask=None, bias=None):
    """Raise ValueError unless Q (..., T_q, d_k), K (..., T_k, d_k) and V
    (..., T_k, d_v) are float tensors of one dtype with the same leading
    axes (batch, heads), every query has a key, and mask (boolean) and
    bias (Q's dtype) broadcast to the scores (..., T_q, T_k). T_q = 0 is
    allowed: no query, an empty result. Q, K and V: attention.py's
    checks, with equal leading axes."""
    check_qkv_tensors(Q, K, V)  # float tensors, one dtype and device
    for name, t in dict(Q=Q, K=K, V=V, mask=mask, bias=bias).items():
        check_dense(name, t)  # nested, or a sparse or nested mask or bias
    check_qkv_shapes(Q, K, V, same_batch=True)  # d_k >= 1, T_k, batches
    T_q, T_k = Q.shape[-2], K.shape[-2]
    scores = (*Q.shape[:-1], T_k)
    if bias is not None:
        if not is_float_tensor(bias) or not broadcasts(bias.shape, scores):
            raise ValueError(
                f"bias must be a float tensor that broadcasts to the scores "
                f"{scores}, got {describe(bias)}"
            )
        if bias.dtype != Q.dtype:
            raise ValueError(f"mixed dtypes: Q {Q.dtype}, bias {bias.dtype}")
        if bias.device != Q.device:
            raise ValueError(f"bias is on {bias.device}, Q on {Q.device}")
    check_mask(mask, scores, Q.device)
    if Q.device.type == "meta":  # before any value check (check_rows)
        raise ValueError("Q is on meta: attention needs values")
    if mask is not None and T_q > 0:
        check_rows(mask)


def check_lengths(lengths):
    """Raise ValueError unless lengths is a 1-D integer tensor, each >= 1."""
    if not is_integer_tensor(lengths) or lengths.dim() != 1:
        raise ValueError(
            f"lengths must be a 1-D tensor of integers, got {describe(lengths)}"
        )
    if (lengths < 1).any():
        raise ValueError("an empty source: every string needs a digit")


def check_answers(pred, tgt, lengths):
    """Raise ValueError unless pred and tgt are (B, steps) token ids, one
    row per length, with a column for every digit and the end token."""
    check_lengths(lengths)
    for name, t in (("pred", pred), ("tgt", tgt)):
        if not is_integer_tensor(t) or t.dim() != 2:
            raise ValueError(
                f"{name} must be a (B, steps) tensor of token ids, got "
                f"{describe(t)}"
            )
        if len(t) != len(lengths):
            raise ValueError(
                f"mismatched batch sizes: {name} has {len(t)} rows, lengths "
                f"{len(lengths)}"
            )
        if t.shape[1] < answer_columns(lengths):
            raise ValueError(
                f"{name} has {t.shape[1]} columns, too few for "
                f"{int(lengths.max())} digits and the end token"
            )


def check_weights(weights, lengths, rows=False):
    """Raise ValueError unless weights (B, ..., T, S) are float, one row
    per length, with a source column for every digit (and, with rows=True,
    an output row for every digit)."""
    check_lengths(lengths)
    if not is_float_tensor(weights) or weights.dim() < 3:
        raise ValueError(
            f"weights must be a float tensor (B, ..., T, S), got "
            f"{describe(weights)}"
        )
    if len(weights) != len(lengths):
        raise ValueError(
            f"mismatched batch sizes: weights have {len(weights)} rows, "
            f"lengths {len(lengths)}"
        )
    if not torch.isfinite(weights).all():
        raise ValueError("weights contain NaN or infinite values")
    longest = int(lengths.max()) if len(lengths) else 0
    if weights.shape[-1] < longest or (rows and weights.shape[-2] < longest):
        raise ValueError(
            f"weights of shape {tuple(weights.shape)} are too small for a "
            f"string of {longest} digits"
        )
