"""Chapter 10's GPT and its training, in a module for the chapter and tools/.

A character-level GPT built from the decoder block of transformer.py, the
training loop that fits it (`get_batch`, `train`) and the loss that judges
it (`validation_loss`). Chapter 10 imports them from here and prints them;
tools/train/train_gpt.py trains the stored weights (data/gpt_G4.pt, gpt_G1.pt)
with them, so the parameter names are those of the stored state dicts.

Chapter 11 adds what decoding fast needs: `StaticCache`, buffers allocated
once and written in place; `BatchCache`, the same with a length per batch
row; `Decoder`, a GPT's weights read once and stepped with fewer small
operations (each saving an option, to measure it); `greedy` and
`greedy_batch`, greedy decoders for one prompt or for prompts of different
lengths decoded together.
"""

import torch
import torch.nn.functional as F
from torch import nn

from transformer import (
    Cache,
    DecoderBlock,
    KVCache,
    RotarySelfAttention,
    allowed_positions,
    attend,
    check_count,
    check_keys_values,
    frequencies,
    rotary,
    shape_of,
)

TOKEN_DTYPES = (torch.int64, torch.int32)  # what F.embedding takes as ids


def embed_tokens(tokens, weight):
    """F.embedding(tokens, weight): row t of weight (vocab, d) for each
    token id t. ValueError for ids that are not int64 or int32, or outside
    0 ... vocab - 1; the range is checked only when the lookup fails, so a
    call adds no operation."""
    if (
        not isinstance(tokens, torch.Tensor)
        or tokens.dtype not in TOKEN_DTYPES
    ):
        raise ValueError(
            f"tokens must be a tensor of int64 or int32 token ids, got "
            f"{shape_of(tokens)}"
        )
    try:
        return F.embedding(tokens, weight)
    except IndexError:
        vocab = len(weight)
        bad = tokens[(tokens < 0) | (tokens >= vocab)]
        raise ValueError(
            f"token id {int(bad[0])} is outside the vocabulary 0 ... "
            f"{vocab - 1}"
        ) from None


class TokenEmbedding(nn.Embedding):
    """nn.Embedding whose lookup names a token id outside the vocabulary
    (embed_tokens) instead of raising an IndexError."""

    def forward(self, tokens):
        return embed_tokens(tokens, self.weight)


class GPT(nn.Module):
    """Embedding, `layers` causal pre-norm blocks, LayerNorm, readout.

    `attention`, if given, builds each block's attention: `attention(i)`
    is layer i's module (chapter 12's variants, in variants.py), called
    as `(x, mask, cache) -> (outputs, weights or None)`, in place of the
    rotary self-attention; its `new_cache()` gives its cache. `backend`
    is SelfAttention's: "flash" or "sdpa" trains without weight matrices
    (chapter 13) and returns None for each layer's weights.
    """

    def __init__(
        self,
        vocab,
        d=64,
        H=4,
        layers=2,
        d_ff=256,
        G=None,
        w=None,
        context=1024,
        attention=None,
        backend="attend",
    ):
        super().__init__()
        if attention is not None and (
            G is not None or w is not None or backend != "attend"
        ):
            raise ValueError(
                "G, w and backend set chapter 10's attention; with "
                "attention=..., the variant's layers set their own"
            )
        check_sizes(vocab, layers, context)  # integers >= 1
        self.context, self.w = context, w
        self.embed = TokenEmbedding(vocab, d)  # nn.Embedding, named errors
        self.blocks = nn.ModuleList(
            DecoderBlock(d, H, d_ff, G, w, backend) for _ in range(layers)
        )
        if attention is not None:  # a variant: attention(i) is layer i's
            for i, block in enumerate(self.blocks):
                block.self_attn = attention(i)
        self.norm = nn.LayerNorm(d)
        self.readout = nn.Linear(d, vocab)

    def forward(self, tokens, caches=None, return_weights=False):
        """Next-token logits (B, T, vocab) of tokens (B, T); with
        return_weights, also every block's weights (B, layers, H, T, T_k),
        or a list of them with None for a layer that has no weights (a
        variant without a weight matrix, such as linear attention, or the
        "flash" and "sdpa" backends)."""
        check_forward(self, tokens, caches)  # ValueError: shapes, caches
        x, weights = self.embed(tokens), []  # (B, T, d); ValueError: a bad id
        for i, block in enumerate(self.blocks):
            cache = None if caches is None else caches[i]
            x, A = block(x, cache=cache, return_weights=True)
            weights.append(A)  # (B, H, T, T_k)
        logits = self.readout(self.norm(x))
        if return_weights:
            if any(A is None for A in weights):
                return logits, weights
            return logits, torch.stack(weights, dim=1)
        return logits

    def new_caches(self, spare=0):
        """One empty cache per block: its attention's own if it has a
        `new_cache()` (a variant's), else a KVCache: rolling if the model
        has a window w, with `spare` slots beyond it (w + spare in all;
        chapter 11's speculative decoding crops back into them)."""
        caches = []
        for block in self.blocks:
            if hasattr(block.self_attn, "new_cache"):
                caches.append(block.self_attn.new_cache())
            elif self.w is None:
                caches.append(KVCache())
            else:
                caches.append(KVCache(self.w, spare))
        return caches


def check_forward(model, tokens, caches):
    """Raise ValueError unless the GPT model can take tokens (B, T) and
    caches: None, or one cache per block, each its own, all at one length
    (the blocks run in order at every call) and holding B rows, and empty
    if the embedding reads the token before (`reads_previous_token`,
    chapter 15's `recall.PreviousToken`); with room in the context for T
    more tokens (no limit with a window)."""
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        raise ValueError(
            f"tokens must be (B, T) token ids, got {shape_of(tokens)}"
        )
    seen = 0
    if caches is not None:
        check_caches(caches, len(model.blocks), "model.new_caches()")
        seen = caches[0].length
        held = [getattr(c, "K", None) for c in caches]  # keys, if any
        rows = {K.shape[0] for K in held if torch.is_tensor(K)}
        if rows - {tokens.shape[0]}:
            raise ValueError(
                f"the caches hold {rows.pop()} rows, the tokens "
                f"{tokens.shape[0]}: a cache serves one batch"
            )
        if seen and getattr(model.embed, "reads_previous_token", False):
            raise ValueError(
                f"the caches hold {seen} tokens, but this model's embedding "
                "adds each token's predecessor, which no cache keeps: call "
                "it on whole sequences (from empty caches)"
            )
    if model.w is None and seen + tokens.shape[1] > model.context:
        raise ValueError(
            f"{seen + tokens.shape[1]} tokens exceed the context of "
            f"{model.context}"
        )


def check_sizes(vocab, layers, context):
    """Raise ValueError unless vocab, layers and context are integers >= 1."""
    check_count("vocab", vocab)
    check_count("layers", layers)
    check_count("context", context)


def check_caches(caches, layers, make):
    """Raise ValueError unless caches is a list of `layers` caches, each its
    own, all at one length; `make` names the call that builds them."""
    if not isinstance(caches, list | tuple) or len(caches) != layers:
        got = len(caches) if isinstance(caches, list | tuple) else caches
        raise ValueError(
            f"caches must be a list of {layers} caches, one per layer "
            f"({make}), got {got!r}"
        )
    if not all(isinstance(c, Cache) for c in caches):
        raise ValueError(f"caches must be Cache objects ({make})")
    if len({id(c) for c in caches}) < layers:
        raise ValueError(f"each layer needs its own cache ({make})")
    lengths = [c.length for c in caches]
    if len(set(lengths)) > 1:
        raise ValueError(
            f"the caches hold {lengths} tokens: every layer's cache must "
            f"see every call, in order"
        )


def get_batch(data, B, T, gen):
    """B random windows of T tokens and their next tokens: (x, y), (B, T)."""
    check_batch(data, B, T, gen)
    starts = torch.randint(len(data) - T, (B,), generator=gen)
    x = torch.stack([data[s : s + T] for s in starts])
    y = torch.stack([data[s + 1 : s + T + 1] for s in starts])
    return x, y


def check_batch(data, B, T, gen=None):
    """Raise ValueError unless data is a 1-d tensor of token ids longer than
    T, B >= 1 and T >= 0 integers, and gen a torch.Generator or None."""
    if not isinstance(data, torch.Tensor) or data.dim() != 1:
        raise ValueError(f"data must be a 1-d tensor, got {shape_of(data)}")
    if data.dtype not in TOKEN_DTYPES:
        raise ValueError(f"data must hold token ids, got {data.dtype}")
    check_count("B", B)
    check_count("T", T, 0)
    if len(data) <= T:
        raise ValueError(
            f"a window of T={T} tokens and its next token need {T + 1} "
            f"tokens, data has {len(data)}"
        )
    if gen is not None and not isinstance(gen, torch.Generator):
        raise ValueError(f"gen must be a torch.Generator, got {gen!r}")


def check_training(data, steps, B, T, lr):
    """Raise ValueError unless steps >= 0, T >= 1, lr > 0 and a batch of
    B windows of T tokens fits in data."""
    check_count("steps", steps, 0)
    check_count("T", T)
    check_batch(data, B, T)
    if not isinstance(lr, int | float) or not 0 < lr < float("inf"):
        raise ValueError(f"lr must be a number > 0, got {lr!r}")


def train(model, data, steps, B=32, T=128, lr=3e-3, seed=0, extra_loss=None):
    """AdamW on random windows; returns the loss of every step. With
    `extra_loss`, each step's loss also adds extra_loss(step, weights),
    the attention weights of that step (chapter 12's sparse model); the
    returned losses stay the cross-entropy alone."""
    check_training(data, steps, B, T, lr)
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * (1 - step / steps)  # linear decay to 0
        x, y = get_batch(data, B, T, gen)
        if extra_loss is None:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            total = loss
        else:
            logits, weights = model(x, return_weights=True)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            total = loss + extra_loss(step, weights)
        optimizer.zero_grad()
        total.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@torch.no_grad()
def validation_loss(model, x, y, rows=64):
    """Mean cross-entropy (nats) of the model on x, y (N, T), `rows` at a time."""
    check_targets(model, x, y, rows)
    total = 0.0
    for i in range(0, len(x), rows):
        logits = model(x[i : i + rows]).double()
        total += F.cross_entropy(
            logits.flatten(0, 1), y[i : i + rows].flatten(), reduction="sum"
        ).item()
    return total / y.numel()


def check_targets(model, x, y, rows):
    """Raise ValueError unless x and y are (N, T) token ids of one shape,
    not empty, y's within the model's vocabulary, and rows >= 1."""
    for name, t in (("x", x), ("y", y)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name} must be (N, T), got {shape_of(t)}")
        if t.dtype not in TOKEN_DTYPES:
            raise ValueError(f"{name} must hold token ids, got {t.dtype}")
    if x.shape != y.shape or x.numel() == 0:
        raise ValueError(
            f"x and y must have one non-empty shape, got {tuple(x.shape)} "
            f"and {tuple(y.shape)}"
        )
    vocab = model.readout.out_features
    if y.min() < 0 or y.max() >= vocab:
        raise ValueError(
            f"a target in y is outside the vocabulary 0 ... {vocab - 1}"
        )
    check_count("rows", rows)


class StaticCache(Cache):
    """Keys and values of one layer in buffers of `capacity` token slots,
    allocated at the first update and written in place: no torch.cat per
    step. Token j sits in slot j; `update` returns views of the slots
    filled so far, so a query sees exactly the growing cache's keys."""

    def __init__(self, capacity):
        if isinstance(capacity, bool) or not isinstance(capacity, int):
            raise ValueError(f"capacity must be an integer, got {capacity!r}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity, self.length = capacity, 0
        self.K = self.V = None
        self.slots = torch.arange(capacity)  # the position held by each slot

    def check_layer(self, w, causal):
        """Every key up to `capacity` is kept: any layer may use it."""

    def check_room(self, T):
        """Raise ValueError unless T more tokens fit."""
        if self.length + T > self.capacity:
            raise ValueError(
                f"{self.length + T} tokens exceed the capacity of "
                f"{self.capacity} of this static cache"
            )

    def allocate(self, K):
        """Buffers (B, G, capacity, d_k) shaped and typed like K."""
        B, G, _, d_k = K.shape
        self.K = K.new_zeros(B, G, self.capacity, d_k)
        self.V = K.new_zeros(B, G, self.capacity, d_k)

    def update(self, K, V):
        """Write K, V (B, G, T, d_k) into the next T slots; return views of
        the keys, values and positions of every token so far."""
        check_keys_values(K, V, self.K)  # ValueError: shapes, dtype, batch
        T = K.shape[-2]
        self.check_room(T)
        if self.K is None:
            self.allocate(K)
        end = self.length + T
        self.K[..., self.length : end, :] = K  # in place, no new tensor
        self.V[..., self.length : end, :] = V
        self.length = end
        return self.K[..., :end, :], self.V[..., :end, :], self.slots[:end]

    def nbytes(self):
        """Bytes of the buffers: all `capacity` slots, from the first update."""
        if self.K is None:
            return 0
        return self.K.nelement() * self.K.element_size() * 2

    def crop(self, n):
        """Keep the first n tokens: later slots are overwritten next."""
        self.check_crop(n)
        self.length = n


class BatchCache(StaticCache):
    """A static cache whose B rows hold sequences of different lengths:
    row r's token j sits in slot j, slots past its length are empty
    (position -1), and its next token goes to slot `lengths[r]`.
    `length` is the slots in use, the longest row's length."""

    def __init__(self, capacity, B):
        super().__init__(capacity)
        if isinstance(B, bool) or not isinstance(B, int) or B < 1:
            raise ValueError(f"B must be an integer >= 1, got {B!r}")
        self.lengths = torch.zeros(B, dtype=torch.long)  # tokens per row
        self.pos = torch.full((B, capacity), -1)  # (B, capacity), -1: empty

    def next_positions(self, T):
        """Positions of the next T tokens of each row: (B, T)."""
        return self.lengths[:, None] + torch.arange(T)

    def update(self, K, V):
        """Write each row's T new tokens after its own; return views of the
        slots in use, with positions (B, slots), -1 where a row has none."""
        check_keys_values(K, V, self.K)
        B, G, T, d_k = K.shape
        if B != len(self.lengths):
            raise ValueError(
                f"this cache has {len(self.lengths)} rows, got {B}"
            )
        self.check_room(T)
        if self.K is None:
            self.allocate(K)
        pos = self.next_positions(T)  # (B, T): the slots to write
        index = pos[:, None, :, None].expand(B, G, T, d_k)
        self.K.scatter_(2, index, K)
        self.V.scatter_(2, index, V)
        self.pos.scatter_(1, pos, pos)
        self.lengths += T
        self.length = int(self.lengths.max())
        end = self.length
        return self.K[..., :end, :], self.V[..., :end, :], self.pos[:, :end]

    def check_room(self, T):
        if int(self.lengths.max()) + T > self.capacity:
            raise ValueError(
                f"{int(self.lengths.max()) + T} tokens exceed the capacity "
                f"of {self.capacity} of this batch cache"
            )

    def crop_rows(self, lengths):
        """Keep the first lengths[r] tokens of each row r (lengths (B,))."""
        lengths = torch.as_tensor(lengths)
        if lengths.shape != self.lengths.shape or lengths.is_floating_point():
            raise ValueError(
                f"lengths must be {len(self.lengths)} integers, got "
                f"{lengths.dtype} {tuple(lengths.shape)}"
            )
        if (lengths < 0).any() or (lengths > self.lengths).any():
            raise ValueError(
                f"cannot crop rows to {lengths.tolist()} tokens: they hold "
                f"{self.lengths.tolist()}"
            )
        self.pos[self.pos >= lengths[:, None]] = -1  # their slots are empty
        self.lengths = lengths.clone()
        self.length = int(lengths.max())

    def crop(self, n):
        """Keep at most the first n tokens of every row."""
        self.check_crop(n)
        self.crop_rows(self.lengths.clamp(max=n))


class Decoder:
    """A GPT's weights, read once, stepped without nn.Module calls.

    `step` computes what `GPT.forward` does, with the levers chapter 11
    measures as options: `tables`, rotary cos and sin computed once for
    `capacity` positions (else `rotary` at each step); `mask=False`, no
    mask for one new token that may see every cached key (no window,
    positions shared by the rows); `fused`, PyTorch's fused
    scaled_dot_product_attention instead of `attend`. Queries and keys
    are rotated together, in one pass.
    """

    def __init__(self, model, capacity, tables=True, mask=False, fused=True):
        if not isinstance(model, GPT):
            raise ValueError(
                f"model must be a GPT, got {type(model).__name__}"
            )
        if getattr(model.embed, "reads_previous_token", False):
            raise ValueError(
                "a Decoder reads the token embedding's weight alone, but "
                "this model's embedding also adds each token's predecessor "
                "(chapter 15's PreviousToken): run the model itself on whole "
                "sequences"
            )
        attn = model.blocks[0].self_attn
        if any(
            type(b.self_attn) is not RotarySelfAttention for b in model.blocks
        ):
            raise ValueError(
                "a Decoder steps the rotary self-attention of chapter 10 "
                "only, not a variant's attention"
            )
        self.H, self.G, self.d_k, self.w = attn.H, attn.G, attn.d_k, model.w
        self.d = model.embed.weight.shape[1]
        check_count("capacity", capacity)
        self.capacity = capacity
        if capacity > model.context and model.w is None:
            raise ValueError(
                f"capacity {capacity} exceeds the model's context of "
                f"{model.context}"
            )
        self.tables, self.mask, self.fused = tables, mask, fused
        p = {k: v.detach() for k, v in model.named_parameters()}
        self.embed = p["embed.weight"]
        self.layers = [
            [
                p[f"blocks.{i}.{name}"]
                for name in (
                    "norm1.weight",
                    "norm1.bias",
                    "self_attn.in_proj.weight",
                    "self_attn.in_proj.bias",
                    "self_attn.out_proj.weight",
                    "self_attn.out_proj.bias",
                    "norm2.weight",
                    "norm2.bias",
                    "linear1.weight",
                    "linear1.bias",
                    "linear2.weight",
                    "linear2.bias",
                )
            ]
            for i in range(len(model.blocks))
        ]
        self.norm = p["norm.weight"], p["norm.bias"]
        self.readout = p["readout.weight"], p["readout.bias"]
        dtype = self.embed.dtype
        angles = torch.arange(capacity).to(dtype)[:, None] * frequencies(
            self.d_k, dtype
        )  # as `rotary` computes them: (capacity, d_k / 2)
        self.cos, self.sin = angles.cos(), angles.sin()

    def new_caches(self, B=None):
        """One StaticCache per layer, or a BatchCache of B rows."""
        if B is None:
            return [StaticCache(self.capacity) for _ in self.layers]
        return [BatchCache(self.capacity, B) for _ in self.layers]

    def check_step(self, tokens, caches):
        """Raise ValueError unless tokens is (B, T) and caches this
        decoder's: one StaticCache per layer (BatchCaches of B rows), each
        its own, at one length, with room for T more tokens, and holding
        keys of its heads, size and dtype."""
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
            raise ValueError(
                f"tokens must be (B, T) token ids, got {shape_of(tokens)}"
            )
        check_caches(caches, len(self.layers), "decoder.new_caches()")
        B, T = tokens.shape
        for cache in caches:
            if not isinstance(cache, StaticCache):
                raise ValueError(
                    f"a Decoder steps static caches (decoder.new_caches()),"
                    f" got {type(cache).__name__}"
                )
            if isinstance(cache, BatchCache) and len(cache.lengths) != B:
                raise ValueError(
                    f"the batch caches hold {len(cache.lengths)} rows, the "
                    f"tokens {B}: new_caches(B) for another batch"
                )
            if cache.capacity > self.capacity:
                raise ValueError(
                    f"a cache of {cache.capacity} slots, this decoder's "
                    f"tables of {self.capacity} positions: "
                    f"decoder.new_caches()"
                )
            want = (B, self.G, self.d_k, self.embed.dtype)
            K = cache.K
            if K is not None and (*K.shape[:2], K.shape[-1], K.dtype) != want:
                raise ValueError(
                    f"a cache holds keys (B, G, d_k, dtype) = "
                    f"{(*K.shape[:2], K.shape[-1], K.dtype)}, this step needs "
                    f"{want}: caches serve one decoder and one batch"
                )
        caches[0].check_room(T)

    def rotate(self, x, pos):
        """Rotate x (B, T, heads, d_k) by positions (T,) or (B, T)."""
        if not self.tables:
            rows = x.transpose(1, 2)  # (B, heads, T, d_k): rotary's layout
            if pos.dim() == 1:
                return rotary(rows, pos).transpose(1, 2)
            return torch.stack(
                [rotary(r, p).transpose(0, 1) for r, p in zip(rows, pos)]
            )
        cos, sin = self.cos[pos][..., None, :], self.sin[pos][..., None, :]
        x1, x2 = x[..., 0::2], x[..., 1::2]  # first and second of each pair
        rotated = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)
        return rotated.flatten(-2)

    def attention(self, Q, K, V, mask):
        """Attention of Q (B, H, T, d_k) over K, V (B, G, T_k, d_k)."""
        if self.G != self.H:  # each key/value head serves H / G query heads
            K = K.repeat_interleave(self.H // self.G, dim=1)
            V = V.repeat_interleave(self.H // self.G, dim=1)
        if self.fused:
            return F.scaled_dot_product_attention(Q, K, V, attn_mask=mask)
        return attend(Q, K, V, mask, rows_checked=True)[0]  # each sees itself

    def step(self, tokens, caches):
        """Logits (B, T, vocab) of tokens (B, T) after the cached ones."""
        self.check_step(tokens, caches)  # before the tables are indexed
        B, T = tokens.shape
        H, G, d_k, d = self.H, self.G, self.d_k, self.d
        pos_q = caches[0].next_positions(T)  # (T,) or (B, T)
        x = embed_tokens(tokens, self.embed)  # (B, T, d)
        for (n1w, n1b, Wi, bi, Wo, bo, n2w, n2b, W1, b1, W2, b2), cache in zip(
            self.layers, caches
        ):
            h = F.linear(F.layer_norm(x, (d,), n1w, n1b), Wi, bi)
            qk = self.rotate(
                h[..., : (H + G) * d_k].view(B, T, H + G, d_k), pos_q
            )
            Q, K = qk.transpose(1, 2).split([H, G], dim=1)
            V = h[..., (H + G) * d_k :].view(B, T, G, d_k).transpose(1, 2)
            K, V, pos_k = cache.update(K, V)
            mask = None
            if self.mask or T > 1 or pos_q.dim() == 2 or self.w is not None:
                mask = allowed_positions(pos_q, pos_k, self.w)
            out = self.attention(Q, K, V, mask).transpose(1, 2)
            x = x + F.linear(out.reshape(B, T, d), Wo, bo)
            h = F.relu(F.linear(F.layer_norm(x, (d,), n2w, n2b), W1, b1))
            x = x + F.linear(h, W2, b2)
        return F.linear(F.layer_norm(x, (d,), *self.norm), *self.readout)


def check_prompt(prompt, name="the prompt"):
    """Raise ValueError unless prompt is a non-empty 1-d tensor of ids."""
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 1:
        raise ValueError(f"{name} must be a 1-d tensor of token ids")
    if len(prompt) == 0:
        raise ValueError(f"{name} is empty: there is no last token to extend")
    if prompt.is_floating_point() or prompt.dtype in (torch.bool,):
        raise ValueError(f"{name} must hold integer token ids")


def check_new(n_new):
    if isinstance(n_new, bool) or not isinstance(n_new, int) or n_new < 1:
        raise ValueError(f"n_new must be an integer >= 1, got {n_new!r}")


def greedy(model, prompt, n_new, caches="growing"):
    """The prompt (T,) and n_new greedy tokens after it; the logits of each
    step (n_new, vocab). `model` is a GPT or a Decoder; `caches`: "growing"
    (model.new_caches(): a variant's own caches, else KVCache, rolling if
    the model has a window),
    "static" (StaticCache) or None (no cache: every step runs the model
    over all tokens so far); a Decoder always uses static caches."""
    if not isinstance(model, GPT | Decoder):
        raise ValueError(f"model must be a GPT or a Decoder, got {model!r}")
    check_prompt(prompt)
    check_new(n_new)
    P = len(prompt)
    tokens = torch.empty(P + n_new, dtype=torch.long)  # written in place
    tokens[:P] = prompt
    if isinstance(model, Decoder):
        cache_list, forward = model.new_caches(), model.step
    elif caches in ("growing", "static", None):
        forward = model
        cache_list = {
            "growing": model.new_caches,
            "static": lambda: [StaticCache(P + n_new) for _ in model.blocks],
            None: lambda: None,
        }[caches]()
    else:
        raise ValueError(
            f'caches must be "growing", "static" or None, got {caches!r}'
        )
    step_logits, step_input = [], tokens[None, :P]
    for t in range(P, P + n_new):
        logits = forward(step_input, cache_list)[0, -1]  # (vocab,)
        tokens[t] = logits.argmax()
        step_logits.append(logits)
        cached = cache_list is not None
        step_input = (
            tokens[None, t : t + 1] if cached else tokens[None, : t + 1]
        )
    return tokens, torch.stack(step_logits)


def greedy_batch(decoder, prompts, n_new):
    """Greedy decoding of B prompts of different lengths together: a list
    of B tensors, each prompt followed by its n_new tokens, and the logits
    (B, n_new, vocab). The prompts are right-padded into one prefill call
    (a causal query never sees the padding after it); each row's cache is
    then cropped to its own length, and every step feeds one token per row
    at that row's own position."""
    if not isinstance(decoder, Decoder):
        raise ValueError(
            "greedy_batch needs a Decoder: Decoder(model, capacity)"
        )
    if len(prompts) == 0:
        raise ValueError("the batch holds no prompt")
    for b, prompt in enumerate(prompts):
        check_prompt(prompt, f"prompt {b} of the batch")
    check_new(n_new)
    B, lengths = len(prompts), torch.tensor([len(p) for p in prompts])
    padded = torch.zeros(B, int(lengths.max()), dtype=torch.long)
    for b, prompt in enumerate(prompts):
        padded[b, : len(prompt)] = prompt  # right padding, token 0
    caches = decoder.new_caches(B)
    logits = decoder.step(padded, caches)  # (B, P_max, vocab)
    for cache in caches:
        cache.crop_rows(lengths)
    logits = logits[torch.arange(B), lengths - 1]  # each row's last token
    new = torch.empty(B, n_new, dtype=torch.long)
    step_logits = []
    for s in range(n_new):
        new[:, s] = logits.argmax(dim=-1)
        step_logits.append(logits)
        if s + 1 < n_new:
            logits = decoder.step(new[:, s : s + 1], caches)[:, -1]
    outputs = [torch.cat([p, row]) for p, row in zip(prompts, new)]
    return outputs, torch.stack(step_logits, dim=1)
