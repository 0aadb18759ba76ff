"""Chapter 15's code: what trained attention heads do.

- `AttnOnly`: an attention-only transformer (token and learned position
  embeddings added, then `layers` layers of H heads, no biases, no
  LayerNorm, no feed-forward block, an unembedding), the model of Elhage
  et al. 2021 ("A Mathematical Framework for Transformer Circuits");
- its circuits: `qk_matrix` (W_Q W_K^T, where a head looks), `ov_matrix`
  (W_V W_O, what it writes), `circuit_scores`, `circuit_output` and a
  one-layer model's `path_expansion`; `rotation` and `rotary_scores`, the
  position-dependent QK form of chapter 10's rotary attention;
- induction: `repeated_segments` (n random distinct tokens, n drawn per
  sequence, then the same n again, then fresh tokens),
  `in_context_metrics`, the head scores `prefix_matching`,
  `previous_token`, `same_token` and `copying_score`, `train_induction`
  (the training `make train-circuits` runs) and `drop_step`;
- `sequence_interval`, a Wilson interval for a share of answers that come
  in correlated sequences, and `t_interval` over seeds.
"""

import math
import numbers

import torch
import torch.nn.functional as F
from torch import nn

from seq2seq import _wilson
from transformer import RotarySelfAttention, frequencies


def check_count(name, n, low=1):
    """Raise ValueError unless n is an integer >= low."""
    if isinstance(n, bool) or not isinstance(n, int) or n < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {n!r}")


def check_tensor(name, t, dims):
    """Raise ValueError unless t is a tensor with `dims` dimensions."""
    if not isinstance(t, torch.Tensor) or t.dim() != dims:
        got = (
            f"{tuple(t.shape)}"
            if isinstance(t, torch.Tensor)
            else type(t).__name__
        )
        raise ValueError(f"{name} must be a {dims}-d tensor, got {got}")


def check_floats(**tensors):
    """Raise ValueError unless every tensor given is floating point and all
    share one dtype (a product of float32 and float64, or of integers,
    raises a RuntimeError in torch)."""
    dtypes = {t.dtype for t in tensors.values()}
    for name, t in tensors.items():
        if not t.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {t.dtype}")
    if len(dtypes) > 1:
        got = ", ".join(f"{n} {t.dtype}" for n, t in tensors.items())
        raise ValueError(f"need one floating dtype, got {got}")


def check_finite(name, t):
    """Raise ValueError unless every entry of the tensor t is finite."""
    if t.is_floating_point() or t.is_complex():
        if not torch.isfinite(t).all():
            raise ValueError(f"{name} holds a NaN or an infinity")


def check_tokens(tokens, vocab):
    """Raise ValueError unless tokens is a (B, T) int64 tensor of ids in
    0 ... vocab - 1 with T >= 1."""
    if (
        not isinstance(tokens, torch.Tensor)
        or tokens.dtype != torch.int64
        or tokens.dim() != 2
        or tokens.shape[1] == 0
    ):
        got = (
            f"{tuple(tokens.shape)} {tokens.dtype}"
            if isinstance(tokens, torch.Tensor)
            else type(tokens).__name__
        )
        raise ValueError(f"tokens must be (B, T >= 1) int64 ids, got {got}")
    if tokens.numel() and (tokens.min() < 0 or tokens.max() >= vocab):
        raise ValueError(
            f"a token id is outside the vocabulary 0 ... {vocab - 1}"
        )


class AttnOnly(nn.Module):
    """An attention-only transformer: x_0 = W_E[tokens] + W_pos[:T];
    layer l adds the sum over heads h of A_{l,h} X W_V W_O; logits = x_L
    W_U. Weights per layer and head: W_Q, W_K, W_V (layers, H, d, d_k),
    W_O (layers, H, d_k, d). Causal; no biases, no LayerNorm.

    W_E and W_pos start as embed_scale times N(0, 1) entries. The default
    0.25 is a measured setting, not derived: with nn.Embedding's N(0, 1)
    (embed_scale=1) the two-layer model's in-context loss stayed at ln 64
    for 1,000 to 1,500 steps at every learning rate tried (probes noted in
    tools/train/train_circuits.py); with 0.25 it drops within the budget."""

    def __init__(
        self, vocab, d=64, H=4, layers=2, context=64, embed_scale=0.25
    ):
        super().__init__()
        for name, n in (("vocab", vocab), ("d", d), ("H", H)):
            check_count(name, n)
        check_count("layers", layers)
        check_count("context", context)
        if d % H:
            raise ValueError(f"H = {H} heads must divide d = {d}")
        if (
            isinstance(embed_scale, bool)
            or not isinstance(embed_scale, (int, float))
            or not math.isfinite(embed_scale)
            or embed_scale <= 0
        ):
            raise ValueError(
                f"embed_scale must be a positive finite number, "
                f"got {embed_scale!r}"
            )
        self.vocab, self.d, self.H, self.d_k = vocab, d, H, d // H
        self.layers, self.context = layers, context
        self.W_E = nn.Parameter(torch.randn(vocab, d) * embed_scale)
        self.W_pos = nn.Parameter(torch.randn(context, d) * embed_scale)
        shape = (layers, H, d, self.d_k)
        self.W_Q = nn.Parameter(torch.randn(shape) / d**0.5)
        self.W_K = nn.Parameter(torch.randn(shape) / d**0.5)
        self.W_V = nn.Parameter(torch.randn(shape) / d**0.5)
        self.W_O = nn.Parameter(torch.randn(layers, H, self.d_k, d) / d**0.5)
        self.W_U = nn.Parameter(torch.randn(d, vocab) / d**0.5)

    def embed(self, tokens):
        """x_0 (B, T, d): token plus position embeddings."""
        check_tokens(tokens, self.vocab)
        T = tokens.shape[1]
        if T > self.context:
            raise ValueError(
                f"{T} tokens exceed the context of {self.context}"
            )
        return self.W_E[tokens] + self.W_pos[:T]

    def pattern(self, layer, x_q, x_k=None):
        """Weights A (B, H, T, T) of layer `layer`: queries from x_q, keys
        from x_k (default x_q), causal softmax of Q K^T / sqrt(d_k)."""
        x_k = x_q if x_k is None else x_k
        self.check_inputs(layer, x_q, x_k)
        Q = torch.einsum("btd,hdk->bhtk", x_q, self.W_Q[layer])
        K = torch.einsum("btd,hdk->bhtk", x_k, self.W_K[layer])
        scores = Q @ K.transpose(-2, -1) / self.d_k**0.5  # (B, H, T, T)
        T = x_q.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        return scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)

    def head_outputs(self, layer, x, A):
        """Each head's output A_h X W_V W_O (B, H, T, d)."""
        self.check_inputs(layer, x)
        V = torch.einsum("btd,hdk->bhtk", x, self.W_V[layer])
        return torch.einsum("bhtk,hkd->bhtd", A @ V, self.W_O[layer])

    def check_inputs(self, layer, *xs):
        """Raise ValueError unless layer is one of the model's and each x a
        (B, T, d) tensor."""
        check_heads(self, [(layer, 0)], "layer")
        for x in xs:
            if (
                not isinstance(x, torch.Tensor)
                or x.dim() != 3
                or (x.shape[-1] != self.d)
            ):
                raise ValueError(
                    f"x must be a (B, T, d = {self.d}) tensor, got "
                    f"{tuple(x.shape) if isinstance(x, torch.Tensor) else x!r}"
                )

    def forward(self, tokens, ablate=(), key_ablate=(), return_weights=False):
        """Logits (B, T, vocab); with return_weights, also every layer's
        weights (B, layers, H, T, T). `ablate`: (layer, head) pairs whose
        output is zeroed; `key_ablate`: pairs whose output is left out of
        the input of later layers' keys only (queries and values keep it),
        to test K-composition."""
        check_heads(self, ablate, "ablate")
        check_heads(self, key_ablate, "key_ablate")
        x = self.embed(tokens)  # (B, T, d)
        x_k = x  # the residual the keys read
        weights = []
        for layer in range(self.layers):
            A = self.pattern(layer, x, x_k)
            out = self.head_outputs(layer, x, A)  # (B, H, T, d)
            # Masks are applied only where a head of this layer is named:
            # multiplying by 1.0 changes nothing, so the result is the same
            # bit for bit, without the cost of a (B, H, T, d) product.
            if any(layer == a for a, _ in ablate):
                keep = torch.tensor(
                    [(layer, h) not in ablate for h in range(self.H)]
                )
                out = out * keep[:, None, None].to(out.dtype)
            total = out.sum(dim=1)
            if any(layer == a for a, _ in key_ablate):
                seen = torch.tensor(
                    [(layer, h) not in key_ablate for h in range(self.H)]
                )
                x_k = x_k + (out * seen[:, None, None].to(out.dtype)).sum(1)
            else:
                x_k = x_k + total
            x = x + total
            weights.append(A)
        logits = x @ self.W_U
        if return_weights:
            return logits, torch.stack(weights, dim=1)
        return logits


def check_heads(model, pairs, name):
    """Raise ValueError unless pairs is a collection of (layer, head) pairs
    of the model."""
    if not isinstance(model, AttnOnly):
        raise ValueError(
            f"model must be an AttnOnly, got {type(model).__name__}"
        )
    if not isinstance(pairs, list | tuple | set | frozenset):
        raise ValueError(
            f"{name} must be a list, tuple or set of (layer, head) pairs, "
            f"got {type(pairs).__name__}"
        )
    for pair in pairs:
        if (
            not isinstance(pair, tuple)
            or len(pair) != 2
            or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in pair
            )
            or not 0 <= pair[0] < model.layers
            or not 0 <= pair[1] < model.H
        ):
            raise ValueError(
                f"{name} takes (layer, head) pairs with 0 <= layer < "
                f"{model.layers} and 0 <= head < {model.H}, got {pair!r}"
            )


def check_head(model, layer, head):
    check_heads(model, [(layer, head)], "the head")


# The circuits (Elhage et al. 2021)


def qk_matrix(model, layer, head):
    """W_QK = W_Q W_K^T (d, d), of rank at most d_k: head h scores key x_j
    for query x_i as x_i W_QK x_j^T / sqrt(d_k)."""
    check_head(model, layer, head)
    return model.W_Q[layer, head] @ model.W_K[layer, head].T


def ov_matrix(model, layer, head):
    """W_OV = W_V W_O (d, d): what head h writes, A_h X W_OV."""
    check_head(model, layer, head)
    return model.W_V[layer, head] @ model.W_O[layer, head]


def circuit_scores(x, W_QK, d_k):
    """Scores x W_QK x^T / sqrt(d_k) (..., T, T) of x (..., T, d), unmasked."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError("x must be a tensor (..., T, d)")
    if not isinstance(W_QK, torch.Tensor):
        raise ValueError(
            f"W_QK must be a (d, d) tensor, got {type(W_QK).__name__}"
        )
    if W_QK.shape != (x.shape[-1], x.shape[-1]):
        raise ValueError(
            f"W_QK must be (d, d) = ({x.shape[-1]}, {x.shape[-1]}), got "
            f"{tuple(W_QK.shape)}"
        )
    check_count("d_k", d_k)
    check_floats(x=x, W_QK=W_QK)
    check_finite("x", x)
    check_finite("W_QK", W_QK)
    return x @ W_QK @ x.transpose(-2, -1) / d_k**0.5


def circuit_output(A, x, W_OV):
    """The layer's output sum_h A_h X W_OV,h (B, T, d) of weights A (B, H,
    T, T), x (B, T, d) and the heads' W_OV (H, d, d)."""
    if not all(isinstance(t, torch.Tensor) for t in (A, x, W_OV)) or (
        A.dim() != 4 or x.dim() != 3 or W_OV.dim() != 3
    ):
        raise ValueError("need A (B, H, T, T), x (B, T, d), W_OV (H, d, d)")
    B, H, T, _ = A.shape
    if x.shape[:2] != (B, T) or W_OV.shape != (H, x.shape[2], x.shape[2]):
        raise ValueError(
            f"shapes do not fit: A {tuple(A.shape)}, x {tuple(x.shape)}, "
            f"W_OV {tuple(W_OV.shape)}"
        )
    check_floats(A=A, x=x, W_OV=W_OV)
    for name, t in (("A", A), ("x", x), ("W_OV", W_OV)):
        check_finite(name, t)
    return torch.einsum("bhts,bsd,hde->bte", A, x, W_OV)


def path_expansion(model, tokens):
    """A one-layer model's logits as paths: the direct path x_0 W_U (B, T,
    vocab) and one term per head, A_h x_0 W_OV,h W_U (H, B, T, vocab);
    their sum is the model's logits."""
    check_heads(model, [], "path_expansion")  # ValueError unless AttnOnly
    if model.layers != 1:
        raise ValueError(
            f"path_expansion is the one-layer model's; this one has "
            f"{model.layers} layers"
        )
    x = model.embed(tokens)
    A = model.pattern(0, x)  # (B, H, T, T)
    direct = x @ model.W_U
    heads = torch.stack(
        [
            A[:, h] @ x @ ov_matrix(model, 0, h) @ model.W_U
            for h in range(model.H)
        ]
    )
    return direct, heads


# The rotary form (chapter 10's attention)


def rotation(m, d_k, dtype=torch.float64):
    """R_m (d_k, d_k): block-diagonal, the pair (2i, 2i + 1) turned by the
    angle m omega_i (chapter 6's frequencies) as a column vector is:
    [[cos, -sin], [sin, cos]]. rotary(x, p) = x R_p^T for a row x."""
    if isinstance(m, bool) or not isinstance(m, int):
        raise ValueError(f"m must be an integer offset, got {m!r}")
    angles = m * frequencies(d_k, dtype)  # ValueError unless d_k even
    R = torch.zeros(d_k, d_k, dtype=dtype)
    i = torch.arange(0, d_k, 2)
    R[i, i], R[i, i + 1] = angles.cos(), -angles.sin()
    R[i + 1, i], R[i + 1, i + 1] = angles.sin(), angles.cos()
    return R


def rotary_scores(layer, x, head):
    """Scores (B, T, T) of head `head` of chapter 10's rotary layer (a
    RotarySelfAttention with G = H) for its input x (B, T, d), from the
    weights alone: x~_i W~_Q R_{j-i} W~_K^T x~_j^T / sqrt(d_k), where x~ =
    [x, 1] and W~ stacks W and the bias (nn.Linear's y = x W^T + b)."""
    if not isinstance(layer, RotarySelfAttention):
        raise ValueError(
            f"layer must be a RotarySelfAttention, got {type(layer).__name__}"
        )
    d = layer.out_proj.weight.shape[0]
    check_tensor("x", x, 3)
    if x.shape[-1] != d:
        raise ValueError(f"x must be (B, T, d = {d}), got {tuple(x.shape)}")
    check_floats(x=x, layer=layer.in_proj.weight)
    check_finite("x", x)
    if layer.G != layer.H:
        raise ValueError("rotary_scores takes a layer with G = H")
    check_count("head", head, 0)
    if head >= layer.H:
        raise ValueError(f"head must be < H = {layer.H}, got {head}")
    d_k = layer.d_k
    W = layer.in_proj.weight.T  # (d, 3 d): queries, keys, values
    b = layer.in_proj.bias
    cols = slice(head * d_k, (head + 1) * d_k)
    W_Q = torch.cat([W[:, :d][:, cols], b[:d][None, cols]])  # (d + 1, d_k)
    W_K = torch.cat([W[:, d : 2 * d][:, cols], b[d : 2 * d][None, cols]])
    x1 = torch.cat([x, torch.ones_like(x[..., :1])], dim=-1)  # (B, T, d + 1)
    T = x.shape[1]
    i, j = torch.meshgrid(torch.arange(T), torch.arange(T), indexing="ij")
    scores = torch.zeros(x.shape[0], T, T, dtype=x.dtype)
    for m in range(-(T - 1), T):  # one matrix per offset j - i
        M = W_Q @ rotation(m, d_k, x.dtype) @ W_K.T  # (d + 1, d + 1)
        band = j - i == m
        scores[:, band] = (x1 @ M @ x1.transpose(-2, -1))[:, band]
    return scores / d_k**0.5


# The induction task


def repeated_segments(B, T, vocab, gen, min_len=16, max_len=32, start=False):
    """B sequences (x, y, in_context), each (B, T): x the input, y the next
    tokens, in_context True where y can be copied from earlier in the
    sequence. Each sequence of T + 1 tokens is n distinct random tokens,
    n drawn per sequence from [min_len, max_len], the same n tokens again,
    then fresh tokens to the end; with start=True, a random number s in
    [0, T + 1 - 2 n] of fresh tokens comes first. Every token is distinct
    except for the copy. y at positions s + n ... s + 2 n - 2 is the next
    token of the copy, known from its first occurrence n tokens back."""
    check_count("B", B)
    check_count("min_len", min_len, 2)
    check_count("max_len", max_len, min_len)
    check_count("T", T, 2 * max_len)
    check_count("vocab", vocab)
    if not isinstance(start, bool):
        raise ValueError(f"start must be True or False, got {start!r}")
    if vocab < T + 1 - min_len:
        raise ValueError(
            f"vocab = {vocab} is too small for {T + 1 - min_len} distinct "
            f"tokens per sequence"
        )
    if not isinstance(gen, torch.Generator):
        raise ValueError(f"gen must be a torch.Generator, got {gen!r}")
    seqs = torch.empty(B, T + 1, dtype=torch.int64)
    in_context = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        n = int(torch.randint(min_len, max_len + 1, (), generator=gen))
        s = 0  # where the first copy starts
        if start:
            s = int(torch.randint(0, T + 2 - 2 * n, (), generator=gen))
        fresh = torch.randperm(vocab, generator=gen)[: T + 1 - n]
        second = torch.zeros(T + 1, dtype=torch.bool)
        second[s + n : s + 2 * n] = True
        seqs[b, ~second] = fresh
        seqs[b, s + n : s + 2 * n] = seqs[b, s : s + n]
        in_context[b, s + n : s + 2 * n - 1] = True
    return seqs[:, :-1], seqs[:, 1:], in_context


CHUNK = 64  # in_context_metrics evaluates at most this many sequences at once


@torch.no_grad()
def in_context_metrics(model, x, y, in_context, **ablation):
    """(loss on in-context targets, loss on the others, correct, total):
    mean cross-entropies (nats) over all the targets of each kind and the
    count of in-context targets predicted exactly (argmax), for the model
    called with `ablation`. The model sees at most CHUNK sequences at a
    time, which measured faster (256 float64 sequences of 64 tokens, one
    thread: 0.32 to 0.43 s in chunks of 64, 0.78 to 0.90 s at once, 5 runs
    each on a shared machine); the sums over the chunks are divided by the
    counts once, so the means are over all the targets."""
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"model must be a torch nn.Module, got {type(model).__name__}"
        )
    check_tensor("x", x, 2)
    check_tensor("y", y, 2)
    check_tensor("in_context", in_context, 2)
    if y.dtype != torch.int64 or in_context.dtype != torch.bool:
        raise ValueError("y must be int64 ids and in_context bool (B, T)")
    if not (x.shape == y.shape == in_context.shape):
        raise ValueError("x, y and in_context must have one shape (B, T)")
    if not in_context.any() or in_context.all():
        raise ValueError("in_context must mark some targets and not all")
    sums, right = [0.0, 0.0], 0
    for b in range(0, len(x), CHUNK):
        rows = slice(b, b + CHUNK)
        logits = model(x[rows], **ablation)
        losses = F.cross_entropy(
            logits.transpose(1, 2), y[rows], reduction="none"
        )
        ic = in_context[rows]
        sums[0] += losses[ic].sum().item()
        sums[1] += losses[~ic].sum().item()
        right += int((logits.argmax(dim=-1) == y[rows])[ic].sum())
    total = int(in_context.sum())
    return (
        sums[0] / total,
        sums[1] / (in_context.numel() - total),
        right,
        total,
    )


def check_weights(weights, tokens):
    """Raise ValueError unless weights is (..., T, T) and tokens (T,)."""
    if not isinstance(weights, torch.Tensor) or weights.dim() < 2:
        raise ValueError("weights must be a tensor (..., T, T)")
    T = weights.shape[-1]
    if weights.shape[-2] != T:
        raise ValueError(
            f"weights must be square (..., T, T), got {tuple(weights.shape)}"
        )
    if tokens is not None and (
        not isinstance(tokens, torch.Tensor) or tuple(tokens.shape) != (T,)
    ):
        raise ValueError(f"tokens must be a ({T},) tensor")
    check_floats(weights=weights)
    check_finite("weights", weights)


def mean_on(weights, keys):
    """Mean over the queries with at least one key in keys (T, T) of the
    weight they give to those keys; ValueError if no query has one."""
    check_weights(weights, None)
    check_tensor("keys", keys, 2)
    if keys.dtype != torch.bool or keys.shape != weights.shape[-2:]:
        raise ValueError("keys must be a bool (T, T) tensor")
    rows = keys.any(dim=-1)
    if not rows.any():
        raise ValueError("no query has a key to score")
    return (weights * keys).sum(dim=-1)[..., rows].mean(dim=-1)


def prefix_matching(weights, tokens):
    """Olsson et al.'s prefix-matching score per head (...): the mean over
    queries i of the weight on keys j <= i whose previous token equals
    token i (tokens[j - 1] == tokens[i]), over the queries that have one."""
    check_weights(weights, tokens)
    T = len(tokens)
    keys = torch.zeros(T, T, dtype=torch.bool)
    keys[:, 1:] = tokens[:, None] == tokens[None, :-1]
    return mean_on(weights, keys & torch.ones(T, T, dtype=torch.bool).tril())


def same_token(weights, tokens):
    """The mean weight a query gives to earlier keys j < i of its own token."""
    check_weights(weights, tokens)
    T = len(tokens)
    keys = (tokens[:, None] == tokens[None, :]).tril(-1)
    return mean_on(weights, keys & torch.ones(T, T, dtype=torch.bool).tril(-1))


def previous_token(weights):
    """The mean weight query i gives to key i - 1 (queries 1 ... T - 1)."""
    check_weights(weights, None)
    T = weights.shape[-1]
    if T < 2:
        raise ValueError("a previous-token score needs T >= 2")
    return weights.diagonal(offset=-1, dim1=-2, dim2=-1).mean(dim=-1)


def copying_score(M):
    """Elhage et al.'s summary of a full OV circuit M (vocab, vocab), such
    as W_E W_OV W_U: sum(lambda) / sum(|lambda|) over its eigenvalues
    (real part of the sum): +1 when every eigenvalue is positive, a head
    that raises the logit of the token it attends to."""
    if (
        not isinstance(M, torch.Tensor)
        or M.dim() != 2
        or M.shape[0] != M.shape[1]
    ):
        raise ValueError("M must be a square matrix (vocab, vocab)")
    check_finite("M", M)
    lam = torch.linalg.eigvals(M.double())
    total = lam.abs().sum().item()
    if not total > 0:
        raise ValueError("M has no nonzero eigenvalue")
    return lam.sum().real.item() / total


def probe_sequence(n, vocab, gen):
    """Olsson et al.'s probe: n distinct random tokens, then the same n
    again: (2 n,) int64."""
    check_count("n", n, 2)
    check_count("vocab", vocab)
    if not isinstance(gen, torch.Generator):
        raise ValueError(f"gen must be a torch.Generator, got {gen!r}")
    if n > vocab:
        raise ValueError(f"n = {n} distinct tokens need vocab >= {n}")
    first = torch.randperm(vocab, generator=gen)[:n]
    return torch.cat([first, first])


def finite(v):
    """True if v is a finite real number (Python's or NumPy's), not a bool."""
    return (
        isinstance(v, numbers.Real)
        and not isinstance(v, bool)
        and math.isfinite(v)
    )


def drop_step(steps, losses, threshold):
    """The first logged step whose loss is below threshold (None if
    never). steps and losses are lists or tuples of one length; every
    loss and the threshold finite numbers."""
    if not isinstance(steps, list | tuple) or not isinstance(
        losses, list | tuple
    ):
        raise ValueError("steps and losses must be lists or tuples")
    if len(steps) != len(losses) or not len(steps):
        raise ValueError(
            "steps and losses must be non-empty and of one length"
        )
    if not finite(threshold):
        raise ValueError(
            f"threshold must be a finite number, got {threshold!r}"
        )
    for step, loss in zip(steps, losses):
        if not finite(loss):
            raise ValueError(
                f"the loss at step {step} is not finite, got {loss!r}"
            )
        if loss < threshold:
            return step
    return None


# Training (make train-circuits)

SIZES = {"vocab": 64, "d": 64, "H": 4, "context": 64}  # the trained models'
N_EVAL = 256  # held-out sequences of every evaluation
EVAL_SEED = 10_000  # their generator's seed (training's are 0, 1, 2)


def train_induction(model, steps, seed, B=32, lr=1e-3, every=25):
    """Adam on fresh batches of repeated_segments (the model's vocab and
    context); returns the log: a dict per evaluation (every `every` steps
    and after the last) with the step, the training loss, the held-out
    in-context and other losses, and per head (layer l, head h) the
    prefix-matching and same-token scores on one probe sequence."""
    check_heads(model, [], "train_induction")  # ValueError unless AttnOnly
    check_count("steps", steps, 0)
    check_count("every", every)
    check_count("seed", seed, 0)
    check_count("B", B)
    if not finite(lr) or lr <= 0:
        raise ValueError(f"lr must be a positive finite number, got {lr!r}")
    V, T = model.vocab, model.context
    gen = torch.Generator().manual_seed(seed)
    held = repeated_segments(
        N_EVAL, T, V, torch.Generator().manual_seed(EVAL_SEED)
    )
    probe = probe_sequence(T // 2, V, torch.Generator().manual_seed(EVAL_SEED))
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    log, loss = [], float("nan")
    for step in range(steps + 1):
        if step % every == 0 or step == steps:
            ic, other, right, total = in_context_metrics(model, *held)
            with torch.no_grad():
                _, A = model(probe[None], return_weights=True)
            row = {
                "step": step,
                "train_loss": loss,
                "in_context_loss": ic,
                "other_loss": other,
                "in_context_acc": right / total,
            }
            pm, st = prefix_matching(A[0], probe), same_token(A[0], probe)
            for i in range(model.layers):
                for h in range(model.H):
                    row[f"prefix_{i}{h}"] = pm[i, h].item()
                    row[f"same_{i}{h}"] = st[i, h].item()
            log.append(row)
        if step == steps:
            break
        x, y, _ = repeated_segments(B, T, V, gen)
        logits = model(x)
        loss_t = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss_t.backward()
        optimizer.step()
        loss = loss_t.item()
    return log


def t_quantile(p, df):
    """Student's t quantile for df = 1 or 2 (closed forms, as chapter 12)."""
    if not isinstance(p, float) or not 0 < p < 1 or df not in (1, 2):
        raise ValueError(f"need 0 < p < 1 and df = 1 or 2, got {p!r}, {df!r}")
    if df == 1:  # p = 1/2 + arctan(t) / pi
        return math.tan(math.pi * (p - 0.5))
    a = 2 * p - 1  # p = 1/2 + t / (2 sqrt(t^2 + 2))
    return a * math.sqrt(2 / (1 - a**2))


def t_interval(values, level=0.95):
    """(mean, low, high, df) of the mean of 2 or 3 independent values (one
    per seed): mean -+ t* standard errors, t* with df = n - 1."""
    if not isinstance(values, list | tuple) or len(values) not in (2, 3):
        raise ValueError(f"need a list of 2 or 3 values, got {values!r}")
    if not all(
        isinstance(v, int | float)
        and not isinstance(v, bool)
        and math.isfinite(v)
        for v in values
    ):
        raise ValueError(f"values must be finite numbers, got {values!r}")
    if not finite(level) or not 0 < level < 1:
        raise ValueError(f"level must be a number in (0, 1), got {level!r}")
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(1 - (1 - level) / 2, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half, n - 1


def sequence_interval(right, total, sequences, level=0.95):
    """(low, high): Wilson's score interval for the share p = right / total
    of right answers when the answers come in `sequences` sequences whose
    answers may be correlated, computed with n = sequences trials: the most
    conservative case, every sequence all right or all wrong (the formula
    of seq2seq.wilson_interval with this p and n). With sequences = total
    (independent answers) it is wilson_interval(right, total)."""

    def integer(v):
        return isinstance(v, numbers.Integral) and not isinstance(v, bool)

    if not all(integer(v) for v in (right, total, sequences)):
        raise ValueError(
            f"right, total and sequences must be integers, got {right!r}, "
            f"{total!r}, {sequences!r}"
        )
    if not 0 <= right <= total:
        raise ValueError(f"need 0 <= right <= total, got {right}, {total}")
    if not 1 <= sequences <= total:
        raise ValueError(
            f"need 1 <= sequences <= total = {total}, got {sequences}"
        )
    return _wilson(int(right) / int(total), int(sequences), level)
