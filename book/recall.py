"""Chapter 15's recall task: multi-query associative recall (MQAR; Arora et
al. 2023, "Zoology", section 4, "Explaining the associative recall
problem") for chapter 12's variants (book/variants.py).

A sequence holds N key-value pairs k_1 v_1 ... k_N v_N, then the N keys
again in a random order, each followed by its value; the model must give
each value after its query key. Keys are ids 0 ... KEYS - 1 (distinct in a
sequence), values KEYS ... VOCAB - 1 (drawn at random). Zoology spaces its
queries with other tokens and uses a larger vocabulary; here the queries
follow the pairs at once.

- `mqar_batch` draws sequences; `recall_accuracy` counts the right values;
  `top_gap`, how far its argmaxes are from a tie; `falls_below`, the first
  number of pairs whose accuracy is below a level; `window_reach`, the
  expected share of queried values within a sliding window's reach;
- `build_recall` builds the book's GPT (book/gpt.py) with one of RECALL's
  attentions and (with shift=True, the default) `PreviousToken` (the token
  before) in its embedding; `held_numbers` counts the numbers its caches
  hold after T tokens (the KV cache's, or the fixed state's);
- `train_recall`, the training `make train-circuits` runs, with the
  settings STEPS, BATCH, LR, PAIRS_TRAIN, PAIRS_EVAL, N_HELD, HELD_SEED.
"""

import math
import numbers
from fractions import Fraction
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn

from gpt import GPT, embed_tokens
from transformer import RotarySelfAttention
from variants import LinearAttention

KEYS, VOCAB = 32, 64  # key ids 0 ... 31, value ids 32 ... 63
H, LAYERS = 4, 2
WINDOW = 16  # the sliding window's w
SHIFT = True  # each model sees the token before (PreviousToken)

# The training of tools/train/train_circuits.py (`make train-circuits`):
# one count of pairs drawn per step from PAIRS_TRAIN, weighted to small N
# (cheaper steps); evaluated beyond: no training sequence has 32 pairs
PAIRS_TRAIN = (2, 2, 2, 4, 4, 8, 16)
PAIRS_EVAL = (2, 4, 8, 16, 32)
STEPS = 600
BATCH = 64  # sequences per step
LR = 3e-3  # every variant; 1e-2 drove linear attention's normaliser to 0
N_HELD = 256  # held-out sequences per count of pairs
HELD_SEED = 20_000  # count N's held-out sequences: seed HELD_SEED + N


def check_count(name, n, low=1):
    """Raise ValueError unless n is an integer >= low."""
    if isinstance(n, bool) or not isinstance(n, int) or n < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {n!r}")


def check_model(model):
    """Raise ValueError unless model is a torch module (callable on ids)."""
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"model must be a torch nn.Module, got {type(model).__name__}"
        )


def check_sequences(x, query, y=None):
    """Raise ValueError unless x (and y) are (B, T) int64 tensors and query
    a (B, T) bool tensor of one shape with some queries."""
    for name, t, dtype in (("x", x, torch.int64), ("y", y, torch.int64)):
        if name == "y" and y is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 2:
            raise ValueError(f"{name} must be a (B, T) int64 tensor")
    if not isinstance(query, torch.Tensor) or query.dtype != torch.bool:
        raise ValueError("query must be a (B, T) bool tensor")
    if query.shape != x.shape or (y is not None and y.shape != x.shape):
        raise ValueError("x, y and query must be (B, T) of one shape")
    if not query.any():
        raise ValueError("query must mark some queries")


def mqar_batch(B, pairs, gen):
    """B sequences of `pairs` pairs then as many queries: (x, y, query),
    each (B, 4 pairs - 1): x the input, y the next tokens, query True
    where y is a queried value."""
    check_count("B", B)
    check_count("pairs", pairs)
    if pairs > KEYS:
        raise ValueError(f"pairs = {pairs} exceeds the {KEYS} distinct keys")
    if not isinstance(gen, torch.Generator):
        raise ValueError(f"gen must be a torch.Generator, got {gen!r}")
    N = pairs
    keys = torch.rand(B, KEYS, generator=gen).argsort(dim=-1)[:, :N]
    values = torch.randint(KEYS, VOCAB, (B, N), generator=gen)
    order = torch.rand(B, N, generator=gen).argsort(dim=-1)
    asked = keys.gather(1, order)
    answers = values.gather(1, order)
    context = torch.stack([keys, values], dim=-1).flatten(1)  # (B, 2 N)
    queries = torch.stack([asked, answers], dim=-1).flatten(1)  # (B, 2 N)
    seq = torch.cat([context, queries], dim=1)  # (B, 4 N)
    query = torch.zeros(B, 4 * N - 1, dtype=torch.bool)
    query[:, 2 * N :: 2] = True  # at a query key, y is its value
    return seq[:, :-1], seq[:, 1:], query


def recall_accuracy(model, x, y, query):
    """(right, total): the queried values the model predicts exactly."""
    check_model(model)
    check_sequences(x, query, y)
    with torch.no_grad():
        right = model(x).argmax(dim=-1) == y
    return int(right[query].sum()), int(query.sum())


def top_gap(model, x, query):
    """The smallest gap between the two highest logits at a query: if it
    exceeds the rounding differences between processors, every argmax, and
    so every count of `recall_accuracy`, is the same on all of them."""
    check_model(model)
    check_sequences(x, query)
    with torch.no_grad():
        top2 = model(x)[query].topk(2, dim=-1).values  # (queries, 2)
    return (top2[:, 0] - top2[:, 1]).min().item()


def finite(v):
    """True if v is a finite real number (Python's or NumPy's), not a bool."""
    return (
        isinstance(v, numbers.Real)
        and not isinstance(v, bool)
        and math.isfinite(v)
    )


def falls_below(pairs, accuracies, level=0.5):
    """The first number of pairs (in increasing order) whose accuracy is
    below `level`, or None if none is. ValueError on a count that is not
    an integer, counts that do not strictly increase, an accuracy or level
    that is not a finite number (a NaN is never below a level), or lists
    of different lengths."""
    if not isinstance(pairs, list | tuple) or not isinstance(
        accuracies, list | tuple
    ):
        raise ValueError("pairs and accuracies must be lists or tuples")
    if len(pairs) != len(accuracies) or not len(pairs):
        raise ValueError("pairs and accuracies must be non-empty, one each")
    if not all(
        isinstance(n, numbers.Integral) and not isinstance(n, bool)
        for n in pairs
    ):
        raise ValueError(f"pairs must be integers, got {list(pairs)}")
    if any(a >= b for a, b in pairwise(pairs)):
        raise ValueError(f"pairs must increase strictly, got {list(pairs)}")
    if not all(finite(a) for a in accuracies):
        raise ValueError(
            f"accuracies must be finite numbers, got {list(accuracies)}"
        )
    if not finite(level):
        raise ValueError(f"level must be a finite number, got {level!r}")
    for n, a in zip(pairs, accuracies):
        if a < level:
            return n
    return None


def window_reach(pairs, w):
    """The expected share (an exact Fraction) of queried values that lie
    within the last w inputs of their query, in mqar_batch's sequences of
    `pairs` = N pairs. The query key at input position i = 2 N + 2 r (the
    r-th query, r = 0 ... N - 1, positions from 0) asks for the value of
    pair m (m = 1 ... N) at position p = 2 m - 1; it is within reach if
    i - p < w: the window of book/transformer.py's allowed_positions (the
    `w` of book/gpt.py's GPT and chapter 12's "window" model), where query
    i sees keys j with i - w < j <= i, the last w inputs including itself.
    The query order is a uniformly random permutation, so the r-th query
    asks for each pair with probability 1 / N and the share is the count of
    pairs (r, m) within reach over N^2. For N = 8 and w = 16: 36 / 64."""
    check_count("pairs", pairs)
    if KEYS < pairs:  # mqar_batch's limit
        raise ValueError(f"pairs = {pairs} exceeds the {KEYS} distinct keys")
    check_count("w", w)
    N = pairs
    near = sum(
        2 * N + 2 * r - (2 * m - 1) < w
        for r in range(N)
        for m in range(1, N + 1)
    )
    return Fraction(near, N * N)


def linear(d):
    return lambda i: LinearAttention(d, H, rule="linear")


def gated_delta(d):
    return lambda i: LinearAttention(d, H, rule="gated_delta")


def hybrid(d):
    """Layer 0 Gated DeltaNet, layer 1 chapter 10's attention (chapter 12's)."""
    return lambda i: (
        LinearAttention(d, H, rule="gated_delta")
        if i == 0
        else RotarySelfAttention(d, H, causal=True)
    )


class PreviousToken(nn.Module):
    """The GPT's token embedding plus a second embedding of the token
    before: x_t = E[token_t] + P[token_(t-1)] (P of a zero row at t = 0).
    A causal convolution of width 2 on one-hot tokens, like the short
    convolutions Gated DeltaNet puts on its queries, keys and values (Yang
    et al. 2025, section 3.4; Based has short gated convolutions as layers
    of their own). It holds nothing between calls, so it serves whole
    sequences only: a GPT whose embedding it is refuses caches that already
    hold tokens (`gpt.check_forward`), since a call would give its first
    token a zero row where the token before belongs, which no cache keeps."""

    reads_previous_token = True  # gpt.check_forward: whole sequences only

    def __init__(self, embed, vocab):
        super().__init__()
        if not isinstance(embed, nn.Embedding):
            raise ValueError(
                f"embed must be an nn.Embedding, got {type(embed).__name__}"
            )
        check_count("vocab", vocab)
        self.token = embed
        self.previous = nn.Embedding(vocab, embed.weight.shape[1])

    @property
    def weight(self):
        return self.token.weight

    def forward(self, tokens):
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
            raise ValueError("tokens must be a (B, T) tensor of token ids")
        x = embed_tokens(tokens, self.token.weight)  # ValueError: a bad id
        before = self.previous(tokens[:, :-1])  # (B, T - 1, d)
        return torch.cat([x[:, :1], x[:, 1:] + before], dim=1)


# name: GPT's keyword arguments, "attention" a function of d
RECALL = {
    "mha": {},
    "window": {"w": WINDOW},
    "linear": {"attention": linear},
    "gated_delta": {"attention": gated_delta},
    "hybrid": {"attention": hybrid},
}


def build_recall(name, d, seed, shift=SHIFT):
    """A fresh GPT (vocab VOCAB, H heads, LAYERS layers, d_ff = 2 d) with
    RECALL[name]'s attention, torch seeded by `seed` first; with shift=True
    its embedding is `PreviousToken` (the token before added), with
    shift=False the plain GPT embedding."""
    if not isinstance(name, str) or name not in RECALL:
        raise ValueError(
            f"unknown model {name!r}: choose one of {list(RECALL)}"
        )
    check_count("d", d, H)
    check_count("seed", seed, 0)
    if not isinstance(shift, bool):
        raise ValueError(f"shift must be True or False, got {shift!r}")
    if d % (2 * H):
        raise ValueError(f"d = {d} must be a multiple of 2 H = {2 * H}")
    kwargs = dict(RECALL[name])
    if "attention" in kwargs:
        kwargs["attention"] = kwargs["attention"](d)
    torch.manual_seed(seed)
    model = GPT(VOCAB, d=d, H=H, layers=LAYERS, d_ff=2 * d, **kwargs)
    if shift:
        model.embed = PreviousToken(model.embed, VOCAB)
    return model


@torch.no_grad()
def held_numbers(model, T):
    """The numbers one sequence's caches hold after T tokens (all layers):
    keys and values for attention, the state for linear attention."""
    if not isinstance(model, GPT):
        raise ValueError(
            f"model must be a GPT (book/gpt.py), got {type(model).__name__}"
        )
    check_count("T", T)
    caches = model.new_caches()
    model(torch.zeros(1, T, dtype=torch.int64), caches=caches)
    size = next(model.parameters()).element_size()  # bytes per number
    return sum(c.nbytes() for c in caches) // size


def train_recall(model, steps, seed, pairs, B=32, lr=1e-3):
    """Adam (linear decay to 0) on mqar_batch with a number of pairs drawn
    from `pairs` at each step; the loss is the cross-entropy on the
    queried values only. Returns each step's loss."""
    check_model(model)
    check_count("steps", steps, 0)
    check_count("seed", seed, 0)
    check_count("B", B)
    if not finite(lr) or lr <= 0:
        raise ValueError(f"lr must be a positive finite number, got {lr!r}")
    if (
        not isinstance(pairs, list | tuple)
        or not pairs
        or any(isinstance(n, bool) or not isinstance(n, int) for n in pairs)
    ):
        raise ValueError(
            f"pairs must be a non-empty list of integers, got {pairs!r}"
        )
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * (1 - step / steps)
        N = pairs[int(torch.randint(len(pairs), (), generator=gen))]
        x, y, query = mqar_batch(B, N, gen)
        logits = model(x)
        loss = F.cross_entropy(logits[query], y[query])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
