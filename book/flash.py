"""Tiled attention that trains: chapter 8's fast forward pass, in a module.

Chapter 8 builds `fast_attention`, attention computed one tile of scores at
a time with a lazy reference instead of a running maximum; it imports that
code from here, with the tile schedule and the input checks it needs, and
prints it. Training adds (issue 38):

- the log-sum-exp of every query (`fast_attention(..., return_lse=True)`),
  and a causal mask aligned bottom-right (`offset`, T_k - T_q);
- `flash_backward`, the gradients of Q, K and V from Q, K, V, the output,
  its gradient and the log-sum-exp, one recomputed tile of weights at a
  time (FlashAttention, Dao et al. 2022, Algorithm 4; FlashAttention-2, Dao
  2023, section 3.1.2 and Algorithm 2);
- `FlashAttention`, the autograd function of the two, and
  `flash_attention(Q, K, V, causal)`, what a model calls
  (transformer.SelfAttention with backend "flash");
- `saved_bytes`, what autograd keeps for a backward pass.
"""

import itertools
import math
import numbers

import torch

from attention import check_qkv_shapes, check_qkv_tensors


def check_qkv(Q, K, V):
    """ValueError unless Q (..., T_q, d_k), K (..., T_k, d_k), V (..., T_k, d_v)
    fit (NumPy arrays or torch tensors): attention.check_qkv_shapes with the
    same leading axes, a key even with no query, and one dtype."""
    check_qkv_shapes(Q, K, V, same_batch=True)  # and d_k >= 1
    if K.shape[-2] == 0:
        raise ValueError("attention needs at least one key")
    if not Q.dtype == K.dtype == V.dtype:
        raise ValueError(
            f"Q, K and V must have one dtype, got {Q.dtype}, "
            f"{K.dtype}, {V.dtype}"
        )


def check_torch(Q, K, V, finite=True):
    """Shape checks plus: floating-point torch tensors of one dtype on the
    CPU, where this file's buffers are; finite entries unless finite=False."""
    check_qkv_tensors(Q, K, V)  # attention.py's: one dtype and one device
    if Q.device.type != "cpu":
        raise ValueError(
            f"Q, K and V are on {Q.device}: these programs run on the CPU"
        )
    check_qkv(Q, K, V)
    if finite and not all(torch.isfinite(t).all() for t in (Q, K, V)):
        raise ValueError("Q, K or V contains NaN or infinite values")


def check_schedule(T_q, T_k, causal, offset):
    """Raise ValueError unless T_q >= 0 and T_k >= 0 are integers, with a
    key if there is a query, causal is True or False and the offset an
    integer >= 0."""
    for name, length in (("T_q", T_q), ("T_k", T_k)):
        if (
            not isinstance(length, numbers.Integral)
            or isinstance(length, bool)
            or length < 0
        ):
            raise ValueError(f"{name} must be an integer >= 0, got {length!r}")
    if T_k == 0 and T_q > 0:
        raise ValueError("attention needs at least one key: T_k = 0")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    check_offset(offset)


def tile_schedule(T_q, T_k, B_r, B_c, causal=False, offset=0):
    """List of tiles (i0, i1, j0, j1, needs_mask) that tiled attention computes.

    causal: query i sees keys 0 .. i + offset (offset T_k - T_q: bottom-right).
    """
    check_schedule(T_q, T_k, causal, offset)
    for name, size in (("B_r", B_r), ("B_c", B_c)):
        if (
            not isinstance(size, numbers.Integral)
            or isinstance(size, bool)
            or size < 1
        ):
            raise ValueError(
                f"{name} must be a positive integer, got {size!r}"
            )
    tiles = []
    for i0 in range(0, T_q, B_r):
        i1 = min(i0 + B_r, T_q)
        for j0 in range(0, T_k, B_c):
            j1 = min(j0 + B_c, T_k)
            if causal and j0 > i1 - 1 + offset:
                break  # this tile and the rest of the row: all future
            tiles.append((i0, i1, j0, j1, causal and j1 - 1 > i0 + offset))
    return tiles


def check_intervals(intervals, current):
    """Raise ValueError unless intervals maps tiles (B_r, B_c), two integers
    >= 1, to (median, lo, hi) ratios, positive and finite with
    lo <= median <= hi, and holds at least one; and current is one of its
    tiles, as a list or tuple."""
    if not isinstance(intervals, dict) or not intervals:
        raise ValueError("the sweep holds no tile: intervals must be a dict")
    for tile in intervals:
        if not (
            isinstance(tile, tuple)
            and len(tile) == 2
            and all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 1
                for n in tile
            )
        ):
            raise ValueError(
                f"every key of intervals must be a tile (B_r, B_c) of two "
                f"integers >= 1, got {tile!r}"
            )
    for tile, value in intervals.items():
        if not (
            isinstance(value, tuple | list)
            and len(value) == 3
            and all(
                isinstance(x, numbers.Real) and math.isfinite(x) and x > 0
                for x in value
            )
        ):
            raise ValueError(
                f"every interval must be (median, lo, hi), three positive "
                f"numbers, got {value!r} for {tile}"
            )
        median, lo, hi = value
        if not lo <= median <= hi:
            raise ValueError(
                f"the interval of {tile} must hold its median: "
                f"lo <= median <= hi, got {value!r}"
            )
    if not isinstance(current, tuple | list) or tuple(current) not in list(
        intervals
    ):  # compared, not hashed: a list inside current is no TypeError
        raise ValueError(f"the current tile {current!r} is not in the sweep")


def choose_tile(intervals, current):
    """The tile [B_r, B_c] to use after a sweep: intervals maps (B_r, B_c)
    to (median, lo, hi), the median ratio SDPA time / our time and its 95 %
    interval. The current tile is kept while its interval overlaps that of
    the best median (the sweep cannot tell them apart); a tile measurably
    slower (its interval entirely below the best's) gives way to the tile
    with the best median."""
    check_intervals(intervals, current)
    best = max(intervals, key=lambda tile: intervals[tile][0])
    if intervals[tuple(current)][2] >= intervals[best][1]:
        return list(current)  # cannot be told apart from the best: kept
    return list(best)


# the tiles (B_r, B_c) in use; choose_tile keeps them after chapter 8's sweep
FAST_TILE = {"no mask": [512, 256], "causal": [256, 256]}
MARGIN = 20  # row sums of exp(e_ij - r_i) up to 2 ** 20 are accepted
# ones off: on, it is measurably slower without the mask (ablation);
# base2, inside, lazy on: the ablation cannot tell them apart from the
# version as set
LEVERS = {"base2": True, "inside": True, "ones": False, "lazy": True}


def augment(Q, K, V, base2=True, ones=True):
    """[log2e Q / sqrt(d_k), -r] (BH, T_q, d_k+1), [K^T; 1], [V, 1] if ones else V."""
    (T_q, d_k), T_k, d_v = Q.shape[-2:], K.shape[-2], V.shape[-1]
    BH = math.prod(Q.shape[:-2])  # batch and heads in one axis
    log2e = math.log2(math.e) if base2 else 1.0  # 2 ** (log2e x) == exp(x)
    Q_aug = torch.empty(BH, T_q, d_k + 1, dtype=Q.dtype)
    Q_aug[..., :d_k] = Q.reshape(BH, T_q, d_k) * (log2e / math.sqrt(d_k))
    Kt_aug = torch.ones(BH, d_k + 1, T_k, dtype=K.dtype)
    Kt_aug[:, :d_k] = K.reshape(BH, T_k, d_k).transpose(1, 2)
    Q_aug[..., d_k:] = -(Q_aug[..., :d_k] @ Kt_aug[:, :d_k, :1])  # -r_i
    V_aug = torch.ones(BH, T_k, d_v + ones, dtype=V.dtype)
    V_aug[..., :d_v] = V.reshape(BH, T_k, d_v)
    return Q_aug, Kt_aug, V_aug


def raise_reference(E, Q_i, C_i, l_i, base2):
    """Raise each row's reference r_i to the tile's maximum, if higher."""
    shift = E.amax(dim=-1, keepdim=True).clamp_(min=0)  # (BH, B_r, 1)
    E.sub_(shift)
    Q_i[..., -1:].sub_(shift)  # the last column holds -r_i
    factor = torch.exp2(-shift) if base2 else torch.exp(-shift)  # <= 1
    C_i.mul_(factor)
    if l_i is not None:  # a separate sum (the "ones" change switched off)
        l_i.mul_(factor)


def fast_row(E_buf, Q_i, Kt, V_aug, C_i, l_i, row, offset, lazy, levers):
    """All tiles of one row block; False if a term may exceed 2 ** MARGIN."""
    C_i.zero_()
    if l_i is not None:
        l_i.zero_()
    for i0, i1, j0, j1, needs_mask in row:
        E = E_buf[:, : i1 - i0, : j1 - j0]
        if levers["inside"]:  # (ch8-augmented): q . k - r in one product
            torch.bmm(Q_i, Kt[:, :, j0:j1], out=E)
        else:
            torch.bmm(Q_i[..., :-1], Kt[:, :-1, j0:j1], out=E)
            E.add_(Q_i[..., -1:])
        keep = None
        if needs_mask:  # future keys: score at the reference, weight 0
            keep = torch.ones(i1 - i0, j1 - j0, dtype=E.dtype)
            keep.tril_(i0 - j0 + offset)  # 1 where key j <= i + offset
            E.mul_(keep)
        if not lazy:
            raise_reference(E, Q_i, C_i, l_i, levers["base2"])
        A_tile = E.exp2_() if levers["base2"] else E.exp_()
        if keep is not None:
            A_tile.mul_(keep)
        C_i.baddbmm_(A_tile, V_aug[:, j0:j1])  # outputs (and sums, if ones)
        if l_i is not None:
            l_i.add_(A_tile.sum(dim=-1, keepdim=True))
    sums = C_i[..., -1:] if l_i is None else l_i
    return bool((sums <= 2.0**MARGIN).all() and C_i.isfinite().all())


def fast_attention(
    Q, K, V, causal=False, B_r=None, B_c=None, levers=None, offset=0,
    return_lse=False,
):  # fmt: skip
    """tiled_attention's function, computed with the changes above.

    causal: query i sees keys 0 .. i + offset. With return_lse, also each
    query's log-sum-exp (..., T_q), from its reference and row sum.
    """
    levers = check_fast(Q, K, V, levers, offset)
    tile = FAST_TILE["causal" if causal else "no mask"]  # unless given
    B_r = tile[0] if B_r is None else B_r
    B_c = tile[1] if B_c is None else B_c
    tiles = tile_schedule(Q.shape[-2], K.shape[-2], B_r, B_c, causal, offset)
    Q_aug, Kt, V_aug = augment(Q, K, V, levers["base2"], levers["ones"])
    (BH, T_q, _), (T_k, d_v) = Q_aug.shape, V.shape[-2:]
    rows_max = min(B_r, T_q)
    C = torch.empty(BH, T_q, d_v, dtype=Q.dtype)
    lse = torch.empty(BH, T_q, dtype=Q.dtype)
    E_buf = torch.empty(BH, rows_max, min(B_c, T_k), dtype=Q.dtype)
    C_buf = torch.empty(BH, rows_max, V_aug.shape[-1], dtype=Q.dtype)
    l_buf = (
        None if levers["ones"] else torch.empty(BH, rows_max, 1, dtype=Q.dtype)
    )
    for (i0, i1), row in itertools.groupby(tiles, key=lambda t: t[:2]):
        Q_i, C_i = Q_aug[:, i0:i1].contiguous(), C_buf[:, : i1 - i0]
        l_i = None if l_buf is None else l_buf[:, : i1 - i0]
        args = (E_buf, Q_i, Kt, V_aug, C_i, l_i, list(row), offset)
        if not fast_row(*args, levers["lazy"], levers):
            fast_row(*args, False, levers)  # exact: reference = maximum
        sums = C_i[..., -1:] if l_i is None else l_i
        torch.div(C_i[..., :d_v], sums, out=C[:, i0:i1])
        if return_lse:  # r_i + log l_i: B_r logarithms per row of tiles
            r = -Q_i[..., -1] * (math.log(2) if levers["base2"] else 1.0)
            torch.add(r, sums[..., 0].log(), out=lse[:, i0:i1])
    C = C.reshape(*Q.shape[:-1], d_v)
    return (C, lse.reshape(Q.shape[:-1])) if return_lse else C


def check_fast(Q, K, V, levers, offset=0):
    """check_torch, plus: levers names only known changes, with True/False;
    the causal offset is an integer >= 0 (every query sees key 0)."""
    check_torch(Q, K, V)
    check_offset(offset)
    levers = {} if levers is None else levers
    if not isinstance(levers, dict) or not set(levers) <= set(LEVERS):
        raise ValueError(f"levers must be a dict with keys from {set(LEVERS)}")
    if not all(isinstance(on, bool) for on in levers.values()):
        raise ValueError("every entry of levers must be True or False")
    return {**LEVERS, **levers}


def check_offset(offset):
    """Raise ValueError unless the causal offset is an integer >= 0."""
    if isinstance(offset, bool) or not isinstance(offset, numbers.Integral):
        raise ValueError(f"offset must be an integer, got {offset!r}")
    if offset < 0:
        raise ValueError(
            f"offset {offset} < 0: the first queries would see no key"
        )


def flash_backward(
    Q, K, V, C, lse, dC, causal=False, B_r=None, B_c=None, offset=0,
    inside=True, base2=True,
):  # fmt: skip
    """dQ, dK, dV of attention, one tile of weights at a time.

    From the forward's output C (..., T_q, d_v) and log-sum-exp lse
    (..., T_q) and the output's gradient dC: each tile of weights is
    recomputed, alpha_ij = exp(e_ij - lse_i), never stored. Key blocks form
    the outer loop, as in FlashAttention-2's Algorithm 2, so each block's
    dK_j and dV_j are summed in one buffer; dQ gathers every key block's part.
    inside=False subtracts lse_i and Delta_i from each tile (chapter 13's
    ablation) instead of folding them into the products as extra columns;
    base2 computes each weight as 2 ** (log2e (e_ij - lse_i)), log2e = log2(e).
    """
    check_backward(Q, K, V, C, lse, dC, inside, base2)
    tile = FAST_TILE["causal" if causal else "no mask"]  # unless given
    B_r = tile[0] if B_r is None else B_r
    B_c = tile[1] if B_c is None else B_c
    tiles = tile_schedule(Q.shape[-2], K.shape[-2], B_r, B_c, causal, offset)
    (T_q, d_k), (T_k, d_v), dtype = Q.shape[-2:], V.shape[-2:], Q.dtype
    BH = math.prod(Q.shape[:-2])  # batch and heads in one axis
    dC3 = dC.reshape(BH, T_q, d_v)
    # log2e [q_i / sqrt(d_k), -lse_i] . [k_j, 1] = log2e (e_ij - lse_i)
    log2e = math.log2(math.e) if base2 else 1.0  # 1.0: exp, not exp2
    Q_aug = torch.empty(BH, T_q, d_k + 1, dtype=dtype)
    Q_aug[..., :d_k] = Q.reshape(BH, T_q, d_k) * (log2e * d_k**-0.5)
    Q_aug[..., d_k] = -log2e * lse.reshape(BH, T_q)
    Kt_aug = torch.ones(BH, d_k + 1, T_k, dtype=dtype)
    Kt_aug[:, :d_k] = K.reshape(BH, T_k, d_k).transpose(1, 2)
    K3 = K.reshape(BH, T_k, d_k)
    # [dc_i, -Delta_i] . [v_j, 1] = dA_ij - Delta_i, Delta_i = dc_i . c_i
    dC_aug = torch.empty(BH, T_q, d_v + 1, dtype=dtype)
    dC_aug[..., :d_v] = dC3
    dC_aug[..., d_v] = -(dC3 * C.reshape(BH, T_q, d_v)).sum(dim=-1)
    Vt_aug = torch.ones(BH, d_v + 1, T_k, dtype=dtype)
    Vt_aug[:, :d_v] = V.reshape(BH, T_k, d_v).transpose(1, 2)
    Kt3, Vt3 = Kt_aug[:, :d_k], Vt_aug[:, :d_v]  # without the ones
    dQ = torch.zeros(BH, T_q, d_k, dtype=dtype)
    dK = torch.zeros(BH, T_k, d_k, dtype=dtype)  # keys no query sees: 0
    dV = torch.zeros(BH, T_k, d_v, dtype=dtype)
    A_buf = torch.empty(BH, min(B_r, T_q), min(B_c, T_k), dtype=dtype)
    dE_buf = torch.empty_like(A_buf)
    by_key_block = sorted(tiles, key=lambda t: (t[2], t[0]))
    for (j0, j1), column in itertools.groupby(by_key_block, lambda t: t[2:4]):
        dK_j, dV_j = dK[:, j0:j1], dV[:, j0:j1]  # (BH, j1 - j0, d)
        for i0, i1, _, _, needs_mask in column:
            A = A_buf[:, : i1 - i0, : j1 - j0]
            if inside:  # [q_i / sqrt(d_k), -lse_i] . [k_j, 1]
                torch.bmm(Q_aug[:, i0:i1], Kt_aug[:, :, j0:j1], out=A)
            else:
                torch.bmm(Q_aug[:, i0:i1, :d_k], Kt3[:, :, j0:j1], out=A)
                A.add_(Q_aug[:, i0:i1, d_k:])
            keep = None
            if needs_mask:  # future keys: exp(0) = 1, then weight 0
                keep = torch.ones(i1 - i0, j1 - j0, dtype=dtype)
                keep.tril_(i0 - j0 + offset)
                A.mul_(keep)
            A = A.exp2_() if base2 else A.exp_()  # the weights, recomputed
            if keep is not None:
                A.mul_(keep)
            dV_j.baddbmm_(A.transpose(1, 2), dC3[:, i0:i1])  # A^T dC
            dE = dE_buf[:, : i1 - i0, : j1 - j0]
            if inside:  # [dc_i, -Delta_i] . [v_j, 1]
                torch.bmm(dC_aug[:, i0:i1], Vt_aug[:, :, j0:j1], out=dE)
            else:
                torch.bmm(dC3[:, i0:i1], Vt3[:, :, j0:j1], out=dE)
                dE.add_(dC_aug[:, i0:i1, d_v:])
            dE.mul_(A)  # dE_ij = alpha_ij (dA_ij - Delta_i)
            dQ[:, i0:i1].baddbmm_(dE, K3[:, j0:j1])  # dE K, scaled below
            dK_j.baddbmm_(dE.transpose(1, 2), Q_aug[:, i0:i1, :d_k])
    dQ.mul_(d_k**-0.5)  # dQ = dE K / sqrt(d_k)
    dK.mul_(1 / log2e)  # dK = dE^T Q / sqrt(d_k); Q_aug's columns: log2e times
    return (
        dQ.reshape(Q.shape),
        dK.reshape(*K.shape[:-1], d_k),
        dV.reshape(*V.shape[:-1], d_v),
    )


def check_backward(Q, K, V, C, lse, dC, inside, base2):
    """ValueError unless flash_backward's tensors fit: Q, K, V as for
    fast_attention (check_torch), C and dC (..., T_q, d_v) and lse
    (..., T_q), all finite and of one dtype and device; inside and base2
    True or False (causal and the offset: in tile_schedule)."""
    for name, t in (("C", C), ("lse", lse), ("dC", dC)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch tensor")
    check_torch(Q, K, V, finite=False)  # finite: below, naming the tensor
    for name, x in (("Q", Q), ("K", K), ("V", V)):
        if not torch.isfinite(x).all():  # else NaN gradients, no error
            raise ValueError(f"{name} contains NaN or infinite values")
    output = (*Q.shape[:-1], V.shape[-1])  # (..., T_q, d_v)
    for name, t, shape in (
        ("C", C, output),
        ("dC", dC, output),
        ("lse", lse, Q.shape[:-1]),
    ):
        if tuple(t.shape) != tuple(shape):
            raise ValueError(
                f"{name} must have shape {tuple(shape)} for these Q and V, got "
                f"{tuple(t.shape)}"
            )
        if t.dtype != Q.dtype or t.device != Q.device:
            raise ValueError(
                f"{name} is {t.dtype} on {t.device}, Q is {Q.dtype} on "
                f"{Q.device}: one dtype and one device"
            )
        if not torch.isfinite(t).all():
            raise ValueError(f"{name} contains NaN or infinite values")
    for name, flag in (("inside", inside), ("base2", base2)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be True or False, got {flag!r}")


class FlashAttention(torch.autograd.Function):
    """Attention whose forward is fast_attention and whose backward is
    flash_backward: it saves Q, K, V, the output C and the log-sum-exp (one
    number per query), and no T_q x T_k tensor."""

    @staticmethod
    def forward(ctx, Q, K, V, causal, offset, B_r, B_c):
        C, lse = fast_attention(
            Q, K, V, causal, B_r, B_c, offset=offset, return_lse=True
        )
        ctx.save_for_backward(Q, K, V, C, lse)
        ctx.settings = (causal, B_r, B_c, offset)
        return C

    @staticmethod
    @torch.autograd.function.once_differentiable  # no gradient of gradients
    def backward(ctx, dC):
        Q, K, V, C, lse = ctx.saved_tensors
        dQ, dK, dV = flash_backward(Q, K, V, C, lse, dC, *ctx.settings)
        return dQ, dK, dV, None, None, None, None  # none for the settings


CAUSAL_MASKS = ("top-left", "bottom-right")  # besides False and True


def flash_attention(Q, K, V, causal=False, B_r=None, B_c=None):
    """softmax(Q K^T / sqrt(d_k)) V, forward and backward in tiles.

    Q (..., T_q, d_k), K (..., T_k, d_k), V (..., T_k, d_v). causal: False;
    True or "top-left", query i sees keys 0 .. i (SDPA's is_causal); or
    "bottom-right", query i sees keys 0 .. i + T_k - T_q, the last query
    every key (torch.nn.attention.bias.causal_lower_right; a prefill after
    T_k - T_q cached tokens). B_r, B_c: the tiles (default FAST_TILE).

    Warning: the backward pass is once_differentiable. When the output's
    gradient carries no graph (a loss linear in the output), neither do
    dQ, dK, dV, even with create_graph=True: a penalty on them alone
    raises an error, and added to another loss it silently adds nothing
    to that loss's gradients.
    """
    offset = check_causal(Q, K, V, causal)
    return FlashAttention.apply(Q, K, V, bool(causal), offset, B_r, B_c)


def check_causal(Q, K, V, causal):
    """The offset of the causal diagonal; ValueError for an unknown mask,
    for inputs check_torch refuses (d_k = 0 among them) or for a bottom-right
    mask under which the first queries would see no key (after the shapes'
    checks: it reads T_q and T_k)."""
    if not isinstance(causal, bool) and not (
        isinstance(causal, str) and causal in CAUSAL_MASKS
    ):
        raise ValueError(
            f"causal must be False, True, 'top-left' or 'bottom-right', "
            f"got {causal!r}"
        )
    check_torch(Q, K, V, finite=False)  # T_q, T_k and d_k >= 1 exist
    if causal != "bottom-right":
        return 0
    T_q, T_k = Q.shape[-2], K.shape[-2]
    if T_q > T_k:
        raise ValueError(
            f"a bottom-right causal mask needs T_q <= T_k, got T_q = {T_q} "
            f"queries for T_k = {T_k} keys: the first would see no key"
        )
    return T_k - T_q


def saved_bytes(fn, *args, **kwargs):
    """Run fn(*args, **kwargs); the memory autograd keeps for its backward:
    (the bytes of every storage it saves, each storage once, however many
    views of it are saved; the shape of the first tensor saved from each)."""
    if not callable(fn):
        raise ValueError(f"fn must be a function to run, got {fn!r}")
    saved = {}

    def pack(t):
        saved.setdefault(t.untyped_storage().data_ptr(), t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args, **kwargs)
    total = sum(t.untyped_storage().nbytes() for t in saved.values())
    return total, [tuple(t.shape) for t in saved.values()]
