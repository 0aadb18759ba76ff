"""Tiled attention that trains: chapter 8's fast forward pass, in a module.

Chapter 8 builds `fast_attention`, attention computed one tile of scores at
a time with a lazy reference instead of a running maximum; it imports that
code from here, with the tile schedule and the input checks it needs, and
prints it.
"""

import itertools
import math
import numbers

import torch


def check_qkv(Q, K, V):
    """ValueError unless Q (..., T_q, d_k), K (..., T_k, d_k), V (..., T_k, d_v) fit."""
    for name, t in (("Q", Q), ("K", K), ("V", V)):
        if len(t.shape) < 2:
            raise ValueError(
                f"{name} must have shape (..., length, size), "
                f"got {tuple(t.shape)}"
            )
    if not Q.shape[:-2] == K.shape[:-2] == V.shape[:-2]:
        raise ValueError(
            f"batch and head dimensions differ: Q {tuple(Q.shape)}, "
            f"K {tuple(K.shape)}, V {tuple(V.shape)}"
        )
    if Q.shape[-1] != K.shape[-1]:
        raise ValueError(
            f"Q and K must have the same size d_k: Q has "
            f"{Q.shape[-1]}, K has {K.shape[-1]}"
        )
    if K.shape[-2] != V.shape[-2]:
        raise ValueError(
            f"every key needs one value: K has {K.shape[-2]} "
            f"positions, V has {V.shape[-2]}"
        )
    if K.shape[-2] == 0:
        raise ValueError("attention needs at least one key")
    if not Q.dtype == K.dtype == V.dtype:
        raise ValueError(
            f"Q, K and V must have one dtype, got {Q.dtype}, "
            f"{K.dtype}, {V.dtype}"
        )


def check_torch(Q, K, V):
    """Shape checks plus: floating-point torch tensors with finite entries."""
    if not all(isinstance(t, torch.Tensor) for t in (Q, K, V)):
        raise ValueError("Q, K and V must be torch tensors")
    check_qkv(Q, K, V)
    if not Q.is_floating_point():
        raise ValueError(f"Q, K and V must be floating point, got {Q.dtype}")
    if not all(torch.isfinite(t).all() for t in (Q, K, V)):
        raise ValueError("Q, K or V contains NaN or infinite values")


def tile_schedule(T_q, T_k, B_r, B_c, causal=False):
    """List of tiles (i0, i1, j0, j1, needs_mask) that tiled attention computes."""
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
            if causal and j0 > i1 - 1:
                break  # this tile and the rest of the row: all future
            tiles.append((i0, i1, j0, j1, causal and j1 - 1 > i0))
    return tiles


# the tiles (B_r, B_c); the measured sweep is below
FAST_TILE = {"no mask": [512, 256], "causal": [256, 256]}
MARGIN = 20  # row sums of exp(e_ij - r_i) up to 2 ** 20 are accepted
# each change on or off, as it measured on the machine of the benchmark
LEVERS = {"base2": False, "inside": True, "ones": False, "lazy": True}


def augment(Q, K, V, base2=True, ones=True):
    """[c Q / sqrt(d_k), -r] (BH, T_q, d_k+1), [K^T; 1], [V, 1] if ones else V."""
    (T_q, d_k), T_k, d_v = Q.shape[-2:], K.shape[-2], V.shape[-1]
    c = math.log2(math.e) if base2 else 1.0  # 2 ** (c x) == exp(x)
    Q_aug = torch.empty(math.prod(Q.shape[:-2]), T_q, d_k + 1, dtype=Q.dtype)
    Q_aug[..., :d_k] = Q.reshape(-1, T_q, d_k) * (c / math.sqrt(d_k))
    Kt_aug = torch.ones(Q_aug.shape[0], d_k + 1, T_k, dtype=K.dtype)
    Kt_aug[:, :d_k] = K.reshape(-1, T_k, d_k).transpose(1, 2)
    Q_aug[..., d_k:] = -(Q_aug[..., :d_k] @ Kt_aug[:, :d_k, :1])  # -r_i
    V_aug = torch.ones(Q_aug.shape[0], T_k, d_v + ones, dtype=V.dtype)
    V_aug[..., :d_v] = V.reshape(-1, T_k, d_v)
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


def fast_row(E_buf, Q_i, Kt, V_aug, C_i, l_i, row, lazy, levers):
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
            keep = torch.ones(i1 - i0, j1 - j0, dtype=E.dtype).tril_(i0 - j0)
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


def fast_attention(Q, K, V, causal=False, B_r=None, B_c=None, levers=None):
    """tiled_attention's function, computed with the changes above."""
    levers = check_fast(Q, K, V, levers)
    tile = FAST_TILE["causal" if causal else "no mask"]  # unless given
    B_r = tile[0] if B_r is None else B_r
    B_c = tile[1] if B_c is None else B_c
    tiles = tile_schedule(Q.shape[-2], K.shape[-2], B_r, B_c, causal)
    Q_aug, Kt, V_aug = augment(Q, K, V, levers["base2"], levers["ones"])
    (BH, T_q, _), (T_k, d_v) = Q_aug.shape, V.shape[-2:]
    rows_max = min(B_r, T_q)
    C = torch.empty(BH, T_q, d_v, dtype=Q.dtype)
    E_buf = torch.empty(BH, rows_max, min(B_c, T_k), dtype=Q.dtype)
    C_buf = torch.empty(BH, rows_max, V_aug.shape[-1], dtype=Q.dtype)
    l_buf = (
        None if levers["ones"] else torch.empty(BH, rows_max, 1, dtype=Q.dtype)
    )
    for (i0, i1), row in itertools.groupby(tiles, key=lambda t: t[:2]):
        Q_i, C_i = Q_aug[:, i0:i1].contiguous(), C_buf[:, : i1 - i0]
        l_i = None if l_buf is None else l_buf[:, : i1 - i0]
        args = (E_buf, Q_i, Kt, V_aug, C_i, l_i, list(row))
        if not fast_row(*args, levers["lazy"], levers):
            fast_row(*args, False, levers)  # exact: reference = maximum
        sums = C_i[..., -1:] if l_i is None else l_i
        torch.div(C_i[..., :d_v], sums, out=C[:, i0:i1])
    return C.reshape(*Q.shape[:-1], d_v)


def check_fast(Q, K, V, levers):
    """check_torch, plus: levers names only known changes, with True/False."""
    check_torch(Q, K, V)
    levers = {} if levers is None else levers
    if not isinstance(levers, dict) or not set(levers) <= set(LEVERS):
        raise ValueError(f"levers must be a dict with keys from {set(LEVERS)}")
    if not all(isinstance(on, bool) for on in levers.values()):
        raise ValueError("every entry of levers must be True or False")
    return {**LEVERS, **levers}
