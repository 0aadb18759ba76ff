"""Scaled dot-product attention: the book's one definition.

Chapter 3 builds it step by step and prints this function in full; chapter 4
explains its mask, chapter 5 its dropout. Later chapters import it:

    from attention import scaled_dot_product_attention

    C, A = scaled_dot_product_attention(Q, K, V, mask=None, dropout_p=0.0)

Notation (book/intro.md): Q (..., T_q, d_k), K (..., T_k, d_k),
V (..., T_k, d_v); scores E and weights A (..., T_q, T_k); outputs C
(..., T_q, d_v). Leading axes (batch B, heads H) broadcast.
"""

import numbers

import torch
import torch.nn.functional as F


def scaled_dot_product_attention(Q, K, V, mask=None, dropout_p=0.0):
    """C = softmax(Q K^T / sqrt(d_k)) V over the last two axes; returns (C, A).

    mask: None or a boolean tensor that broadcasts to (..., T_q, T_k), True
    where query i may attend to key j. A query that the mask lets attend to
    no key gets zero weights and a zero output (no NaN). dropout_p: each
    weight is zeroed with this probability and the others divided by
    1 - dropout_p. Finite inputs can still give scores too large for their
    dtype (float16 stops at 65504): an unmasked score that is not finite
    raises a ValueError instead of turning into NaN or a zero row.
    """
    check_attention_inputs(Q, K, V, mask, dropout_p)
    d_k = K.shape[-1]
    E = Q @ K.transpose(-2, -1) * d_k**-0.5  # scores (..., T_q, T_k)
    check_scores_finite(E, mask)
    if mask is not None:
        E = E.masked_fill(~mask, float("-inf"))  # hidden keys: exp(-inf) = 0
        empty = ~mask.any(dim=-1, keepdim=True)  # rows the mask leaves empty
    else:
        empty = torch.zeros((), dtype=torch.bool, device=E.device)  # none
    A = F.softmax(E.masked_fill(empty, 0.0), dim=-1)  # rows sum to 1 ...
    A = A.masked_fill(empty, 0.0)  # ... or to 0 when a row sees no key
    if dropout_p > 0:
        A = F.dropout(A, float(dropout_p))  # attention dropout (chapter 5)
    return A @ V, A  # C (..., T_q, d_v), A (..., T_q, T_k)


def check_scores_finite(E, mask=None):
    """Raise ValueError if a score the mask keeps overflowed its dtype."""
    bad = ~torch.isfinite(E)
    if mask is not None:
        bad = bad & mask
    if bad.any():
        raise ValueError(
            f"a score Q K^T / sqrt(d_k) or its product Q K^T overflowed "
            f"{E.dtype} (largest {torch.finfo(E.dtype).max:g}): scale Q and "
            f"K down or use a wider dtype"
        )


def check_attention_inputs(Q, K, V, mask=None, dropout_p=0.0):
    """Raise a ValueError that names the problem unless the inputs fit."""
    check_qkv_tensors(Q, K, V)
    if Q.device.type == "meta":  # shapes without values: nothing to check
        raise ValueError("Q, K and V are on meta: attention needs values")
    for name, t in (("Q", Q), ("K", K), ("V", V)):
        if not torch.isfinite(t).all():
            raise ValueError(f"{name} contains NaN or infinite values")
    batch = check_qkv_shapes(Q, K, V)
    if not isinstance(dropout_p, numbers.Real):
        raise ValueError(f"dropout_p must be a number, got {dropout_p!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if mask is not None:
        check_mask(mask, (*batch, Q.shape[-2], K.shape[-2]), Q.device)


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_qkv_tensors(Q, K, V):
    """Raise a ValueError naming the input unless Q, K and V are
    floating-point torch tensors of one dtype on one device (their axes:
    check_qkv_shapes): float16, bfloat16, float32 or float64, strided (not
    float8, sparse or nested). Types only, never values: no tensor operation."""
    for name, t in (("Q", Q), ("K", K), ("V", V)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point torch tensor")
        if (
            t.dtype not in FLOAT_DTYPES
            or t.layout != torch.strided
            or t.is_nested
        ):
            kind = "nested" if t.is_nested else t.layout
            raise ValueError(
                f"{name} is {t.dtype} ({kind}): attention takes float16, "
                f"bfloat16, float32 or float64 in the strided layout, not nested"
            )
        if t.dtype != Q.dtype or t.device != Q.device:
            raise ValueError(
                f"{name} is {t.dtype} on {t.device}, Q is {Q.dtype} on "
                f"{Q.device}: Q, K and V need one dtype and one device"
            )


def check_qkv_shapes(Q, K, V, same_batch=False):
    """Raise a ValueError that names the problem unless the shapes of Q
    (..., T_q, d_k), K (..., T_k, d_k) and V (..., T_k, d_v) fit (torch
    tensors or NumPy arrays: shapes only): d_k >= 1, a value per key, a
    key for any query, and leading axes (batch, heads) that broadcast, or
    with same_batch=True are equal; return those axes' shape."""
    for name, t in (("Q", Q), ("K", K), ("V", V)):
        shape = getattr(t, "shape", None)  # None: a list, None, a number
        if shape is None or len(shape) < 2:
            got = type(t).__name__ if shape is None else tuple(shape)
            raise ValueError(
                f"{name} must have shape (..., T, size), got {got}"
            )
    if Q.shape[-1] != K.shape[-1]:
        raise ValueError(
            f"Q and K must have the same size d_k: "
            f"Q has {Q.shape[-1]}, K has {K.shape[-1]}"
        )
    if K.shape[-2] != V.shape[-2]:
        raise ValueError(
            f"every key needs one value: "
            f"K has {K.shape[-2]} rows, V has {V.shape[-2]}"
        )
    if same_batch and not Q.shape[:-2] == K.shape[:-2] == V.shape[:-2]:
        raise ValueError(
            f"mismatched batches: Q {tuple(Q.shape)}, K {tuple(K.shape)} and "
            f"V {tuple(V.shape)} must have the same leading axes (batch, "
            f"heads)"
        )
    return check_batch_and_keys(Q, K, V)


def check_batch_and_keys(Q, K, V):
    """Raise ValueError unless d_k >= 1, every query has a key and the
    leading axes of Q, K and V broadcast; return their broadcast shape."""
    check_d_k(K.shape[-1])
    if K.shape[-2] == 0 and Q.shape[-2] > 0:  # no query: an empty result
        raise ValueError(
            f"attention needs at least one key for its {Q.shape[-2]} queries"
        )
    try:
        return torch.broadcast_shapes(Q.shape[:-2], K.shape[:-2], V.shape[:-2])
    except RuntimeError:
        shapes = f"Q {tuple(Q.shape)}, K {tuple(K.shape)}, V {tuple(V.shape)}"
        raise ValueError(
            f"batch dimensions do not match: {shapes} (their batch axes must "
            f"broadcast)"
        ) from None


def check_d_k(d_k):
    """Raise ValueError unless queries and keys hold d_k >= 1 numbers."""
    if d_k == 0:
        raise ValueError(
            "attention needs d_k >= 1 numbers per query and key, got d_k = 0: "
            "the scale 1 / sqrt(d_k) would divide by zero"
        )


def check_mask(mask, scores_shape, device):
    """Raise ValueError unless mask is a dense (strided, not nested) boolean
    tensor on Q's device that broadcasts to scores_shape (no larger)."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        got = getattr(mask, "dtype", type(mask).__name__)
        raise ValueError(
            f"mask must be a boolean tensor (True = attend), got {got}"
        )
    if mask.is_nested or mask.layout != torch.strided:
        got = "a nested tensor" if mask.is_nested else mask.layout
        raise ValueError(f"mask must be a dense (strided) tensor, got {got}")
    if mask.device != device:
        raise ValueError(f"mask is on {mask.device}, Q on {device}")
    try:
        fits = torch.broadcast_shapes(mask.shape, scores_shape) == scores_shape
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to the "
            f"scores' shape {tuple(scores_shape)}"
        )
