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
  number of pairs whose accuracy is below a level;
- `build_recall` builds the book's GPT (book/gpt.py) with one of RECALL's
  attentions and `PreviousToken` (the token before) in its embedding;
  `held_numbers` counts the numbers its caches hold after T tokens (the KV
  cache's, or the fixed state's);
- `train_recall`, the training `make train-circuits` runs.
"""

import torch
import torch.nn.functional as F
from torch import nn

from gpt import GPT
from transformer import RotarySelfAttention
from variants import LinearAttention

KEYS, VOCAB = 32, 64  # key ids 0 ... 31, value ids 32 ... 63
H, LAYERS = 4, 2
WINDOW = 16  # the sliding window's w
SHIFT = True  # each model sees the token before (PreviousToken)


def check_count(name, n, low=1):
    """Raise ValueError unless n is an integer >= low."""
    if isinstance(n, bool) or not isinstance(n, int) or n < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {n!r}")


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
    if not (x.shape == y.shape == query.shape) or not query.any():
        raise ValueError("x, y and query must be (B, T) with some queries")
    with torch.no_grad():
        right = model(x).argmax(dim=-1) == y
    return int(right[query].sum()), int(query.sum())


def top_gap(model, x, query):
    """The smallest gap between the two highest logits at a query: if it
    exceeds the rounding differences between processors, every argmax, and
    so every count of `recall_accuracy`, is the same on all of them."""
    if x.shape != query.shape or not query.any():
        raise ValueError("x and query must be (B, T) with some queries")
    with torch.no_grad():
        top2 = model(x)[query].topk(2, dim=-1).values  # (queries, 2)
    return (top2[:, 0] - top2[:, 1]).min().item()


def falls_below(pairs, accuracies, level=0.5):
    """The first number of pairs (in increasing order) whose accuracy is
    below `level`, or None if none is."""
    if len(pairs) != len(accuracies) or not len(pairs):
        raise ValueError("pairs and accuracies must be non-empty, one each")
    if list(pairs) != sorted(pairs):
        raise ValueError(f"pairs must increase, got {list(pairs)}")
    for n, a in zip(pairs, accuracies):
        if a < level:
            return n
    return None


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
    A causal convolution of width 2 on one-hot tokens, the short
    convolution that Based and Gated DeltaNet put before their fixed-state
    layers; it holds one token between calls, so it serves whole sequences
    (a model called token by token would need that token in its cache)."""

    def __init__(self, embed, vocab):
        super().__init__()
        self.token = embed
        self.previous = nn.Embedding(vocab, embed.weight.shape[1])

    @property
    def weight(self):
        return self.token.weight

    def forward(self, tokens):
        x = self.token(tokens)  # (B, T, d); ValueError: a bad id
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


def build_recall(name, d, seed):
    """A fresh GPT (vocab VOCAB, H heads, LAYERS layers, d_ff = 2 d) with
    RECALL[name]'s attention, torch seeded by `seed` first."""
    if name not in RECALL:
        raise ValueError(
            f"unknown model {name!r}: choose one of {list(RECALL)}"
        )
    check_count("d", d, H)
    if d % (2 * H):
        raise ValueError(f"d = {d} must be a multiple of 2 H = {2 * H}")
    kwargs = dict(RECALL[name])
    if "attention" in kwargs:
        kwargs["attention"] = kwargs["attention"](d)
    torch.manual_seed(seed)
    model = GPT(VOCAB, d=d, H=H, layers=LAYERS, d_ff=2 * d, **kwargs)
    if SHIFT:
        model.embed = PreviousToken(model.embed, VOCAB)
    return model


@torch.no_grad()
def held_numbers(model, T):
    """The numbers one sequence's caches hold after T tokens (all layers):
    keys and values for attention, the state for linear attention."""
    check_count("T", T)
    caches = model.new_caches()
    model(torch.zeros(1, T, dtype=torch.int64), caches=caches)
    size = next(model.parameters()).element_size()  # bytes per number
    return sum(c.nbytes() for c in caches) // size


def train_recall(model, steps, seed, pairs, B=32, lr=1e-3):
    """Adam (linear decay to 0) on mqar_batch with a number of pairs drawn
    from `pairs` at each step; the loss is the cross-entropy on the
    queried values only. Returns each step's loss."""
    check_count("steps", steps, 0)
    if not pairs or any(
        isinstance(n, bool) or not isinstance(n, int) for n in pairs
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
