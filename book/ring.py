"""Attention across processes (chapter 17): ring attention and Ulysses.

P processes (ranks) on this machine share one sequence of T tokens: each
holds the queries, keys and values of its own tokens. Chapter 8's online
softmax merges partial results over disjoint sets of keys with their
log-sum-exp (`merge`), so a rank can attend to keys it receives a block at a
time:

- `split_positions`: which tokens each rank holds (contiguous, striped, or
  the head-and-tail "zigzag" split that balances a causal mask);
- `ring_forward`: keys and values passed round the ring with isend/irecv,
  the next block travelling while the current one is computed (Liu,
  Zaharia and Abbeel 2023), each block with chapter 8's `fast_attention`;
- `ring_backward`: chapter 13's `flash_backward` per block, the keys'
  and values' gradients travelling round the ring with them;
- `ulysses_forward`: an all-to-all from slices of the sequence to groups
  of heads, attention per head group, and back (Jacobs et al. 2023);
- `Comm`: the calls between ranks, each counting the bytes it moves;
- `RankPool`: P processes in one gloo group on the loopback interface
  (its rendezvous a file, gloo's sockets on lo),
  started once and reused, that always exit (a short timeout on the
  group); `ring_attention`, `ring_gradients` and `ulysses_attention` split
  the inputs, run the ranks in the pool and gather what they return.

Functions that run inside a rank take their process group as `group=`
(the pool passes it); the groups are the first n ranks, so a rank's number
in its group is its global number.
"""

import datetime
import math
import numbers
import os
import queue
import resource
import shutil
import socket
import tempfile
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.autograd.function import once_differentiable

from flash import fast_attention, flash_backward

SPLITS = ("contiguous", "striped", "zigzag")
GRACE = 10.0  # seconds the pool waits past the group's timeout


# --- the merge: two partial results over disjoint keys ----------------------


def merge(C_1, lse_1, C_2, lse_2):
    """(C, lse) of attention over keys J_1 and J_2 together, from each
    part's output C_u (..., T_q, d_v) and log-sum-exp lse_u (..., T_q)."""
    check_parts(C_1, lse_1, C_2, lse_2)
    lse = torch.logaddexp(lse_1, lse_2)  # log(exp(lse_1) + exp(lse_2))
    seen = lse > -math.inf  # a query neither part has a key for: weight 0
    zero = torch.zeros((), dtype=lse.dtype)
    w_1 = torch.where(seen, torch.exp(lse_1 - lse), zero)[..., None]
    w_2 = torch.where(seen, torch.exp(lse_2 - lse), zero)[..., None]
    return w_1 * C_1 + w_2 * C_2, lse


def check_parts(C_1, lse_1, C_2, lse_2):
    """ValueError unless both parts are tensors of one dtype and shape, each
    lse with the shape of its output without the last axis."""
    parts = {"C_1": C_1, "lse_1": lse_1, "C_2": C_2, "lse_2": lse_2}
    for name, t in parts.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor")
    if C_1.dim() < 1 or C_2.dim() < 1:
        raise ValueError("C_1 and C_2 need an axis of values: (..., d_v)")
    if C_1.shape != C_2.shape:
        raise ValueError(
            f"the outputs' shapes differ: C_1 {tuple(C_1.shape)}, "
            f"C_2 {tuple(C_2.shape)}"
        )
    for name, lse in (("lse_1", lse_1), ("lse_2", lse_2)):
        if lse.shape != C_1.shape[:-1]:
            raise ValueError(
                f"{name} must have shape {tuple(C_1.shape[:-1])}, "
                f"got {tuple(lse.shape)}"
            )
    if len({t.dtype for t in parts.values()}) > 1:
        raise ValueError("C_1, lse_1, C_2 and lse_2 must have one dtype")
    for name in ("lse_1", "lse_2"):
        if parts[name].isnan().any() or (parts[name] == math.inf).any():
            raise ValueError(f"{name} holds NaN or +inf: not a log-sum-exp")
    for name in ("C_1", "C_2"):
        if not parts[name].isfinite().all():
            raise ValueError(f"{name} holds NaN or an infinity")


# --- which tokens each rank holds ---------------------------------------------


def chunk_bounds(T, n):
    """(start, stop) of n contiguous chunks of T tokens; the first T mod n
    chunks hold one token more (torch.tensor_split's rule)."""
    size, extra = divmod(T, n)
    bounds, start = [], 0
    for u in range(n):
        stop = start + size + (u < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def check_split(T, P, split):
    """ValueError unless T >= 1 and 1 <= P <= T are integers and the split
    is known (every rank holds at least one token)."""
    for name, value in (("T", T), ("P", P)):
        if (
            not isinstance(value, numbers.Integral)
            or isinstance(value, bool)
            or value < 1
        ):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if P > T:
        raise ValueError(
            f"P = {P} processes for T = {T} tokens: a rank would hold none"
        )
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def rank_pieces(T, P, split, rank):
    """The tokens rank holds, as ranges (start, stop, step) in order:
    contiguous, chunk rank of P; striped, tokens rank, rank + P, ...;
    zigzag, chunks rank and 2P - 1 - rank of 2P (the head and the tail)."""
    check_split(T, P, split)
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral):
        raise ValueError(f"rank must be an integer, got {rank!r}")
    if not 0 <= rank < P:
        raise ValueError(f"rank {rank} of P = {P}: ranks are 0 to {P - 1}")
    if split == "striped":
        return [(rank, T, P)]
    if split == "contiguous":
        return [(*chunk_bounds(T, P)[rank], 1)]
    chunks = chunk_bounds(T, 2 * P)
    head, tail = chunks[rank], chunks[2 * P - 1 - rank]
    return [(*c, 1) for c in (head, tail) if c[1] > c[0]]


def split_positions(T, P, split="contiguous"):
    """The positions of the tokens each of the P ranks holds (P lists)."""
    check_split(T, P, split)
    return [
        [t for piece in rank_pieces(T, P, split, rank) for t in range(*piece)]
        for rank in range(P)
    ]


def block_plan(q_pieces, k_pieces, causal):
    """The attention calls between one rank's queries and another rank's
    keys: (r0, r1, c0, c1, causal, offset, scores) for local query rows
    r0:r1 and key rows c0:c1, with the causal offset fast_attention takes
    and the number of scores the mask keeps; pairs with no score are left
    out."""
    plan, row = [], 0
    for a0, a1, s in q_pieces:
        n_q, col = len(range(a0, a1, s)), 0
        for b0, b1, _ in k_pieces:
            n_k = len(range(b0, b1, s))
            # query i at a0 + s i sees key j at b0 + s j iff j <= i + o
            o = (a0 - b0) // s
            if not causal or o >= n_k - 1:  # every key before every query
                plan.append(
                    (row, row + n_q, col, col + n_k, False, 0, n_q * n_k)
                )
            elif o + n_q - 1 >= 0:  # the last query sees a key
                r0 = max(0, -o)  # earlier queries see none of these keys
                seen = sum(min(max(i + o + 1, 0), n_k) for i in range(n_q))
                call = (row + r0, row + n_q, col, col + n_k, True, max(o, 0))
                plan.append((*call, seen))
            col += n_k
        row += n_q
    return plan


def score_counts(T, P, split, causal=True):
    """The scores each rank computes (those its mask keeps) for one
    sequence and head, and the key blocks it computes any score of: two
    lists of P integers."""
    pieces = [rank_pieces(T, P, split, rank) for rank in range(P)]
    scores, blocks = [], []
    for rank in range(P):
        plans = [block_plan(pieces[rank], p, causal) for p in pieces]
        scores.append(sum(call[-1] for plan in plans for call in plan))
        blocks.append(sum(1 for plan in plans if plan))
    return scores, blocks


# --- the calls between ranks, counted -------------------------------------


class Comm:
    """The calls between the ranks of a group, each adding the bytes it
    sends and receives to `sent` and `received` (a rank's own share of an
    all-to-all never leaves it: not counted)."""

    def __init__(self, group=None):
        self.group = dist.group.WORLD if group is None else group
        self.rank = dist.get_rank(self.group)
        self.P = dist.get_world_size(self.group)
        self.sent = self.received = 0

    def ring_exchange(self, send, recv):
        """Start sending `send` to the next rank and receiving `recv` from
        the previous one; returns the two requests to wait for."""
        after, before = (self.rank + 1) % self.P, (self.rank - 1) % self.P
        self.sent += send.nbytes
        self.received += recv.nbytes
        return [
            dist.isend(send, after, group=self.group),
            dist.irecv(recv, before, group=self.group),
        ]

    def all_to_all(self, recv, send, recv_sizes, send_sizes):
        """Rank s gets the s-th part of `send` (send_sizes[s] numbers), and
        the r-th part of `recv` (recv_sizes[r]) comes from rank r."""
        item = send.element_size()
        self.sent += (sum(send_sizes) - send_sizes[self.rank]) * item
        self.received += (sum(recv_sizes) - recv_sizes[self.rank]) * item
        dist.all_to_all_single(
            recv, send, recv_sizes, send_sizes, group=self.group
        )


def check_ranks(comm, T, split, causal, Q, K, V, *more):
    """On every rank, the same ValueError naming the problem unless each
    rank holds its tokens' Q, K, V (and more tensors, each (..., rows, x)
    or (..., rows)) with one batch shape, d_k, d_v and dtype, and every
    rank was given the same T, split and causal."""
    problem = None
    tensors = (Q, K, V, *more)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        problem = "Q, K, V (and C, lse, dC) must be torch tensors"
    elif Q.dim() < 2 or not Q.is_floating_point():
        problem = f"Q must be floating point (..., rows, d_k), got {Q.shape}"
    elif not Q.shape[:-1] == K.shape[:-1] == V.shape[:-1]:
        problem = (
            f"Q {tuple(Q.shape)}, K {tuple(K.shape)} and V "
            f"{tuple(V.shape)} must hold the same tokens"
        )
    elif Q.shape[-1] != K.shape[-1] or Q.shape[-1] == 0:
        problem = f"Q and K must have one d_k >= 1: {Q.shape}, {K.shape}"
    elif any(t.dtype != Q.dtype for t in tensors):
        problem = "all tensors must have one dtype"
    mine = {
        "problem": problem,
        "settings": (T, split, causal),
        "batch": tuple(Q.shape[:-2]) if problem is None else None,
        "sizes": (Q.shape[-1], V.shape[-1], str(Q.dtype))
        if not problem
        else None,
        "rows": Q.shape[-2] if problem is None else None,
        "more": [tuple(t.shape) for t in more] if problem is None else None,
    }
    everyone = [None] * comm.P
    dist.all_gather_object(everyone, mine, group=comm.group)
    for rank, theirs in enumerate(everyone):
        if theirs["problem"] is not None:
            raise ValueError(f"rank {rank}: {theirs['problem']}")
    for key in ("settings", "batch", "sizes"):
        for rank, theirs in enumerate(everyone):
            if theirs[key] != everyone[0][key]:
                raise ValueError(
                    f"mismatched {key} across ranks: rank 0 has "
                    f"{everyone[0][key]}, rank {rank} has {theirs[key]}"
                )
    check_split(T, comm.P, split)  # the same verdict on every rank
    expected = [len(p) for p in split_positions(T, comm.P, split)]
    for rank, theirs in enumerate(everyone):
        if theirs["rows"] != expected[rank]:
            raise ValueError(
                f"mismatched shapes across ranks: rank {rank} holds "
                f"{theirs['rows']} tokens, its {split} share of T = {T} is "
                f"{expected[rank]}"
            )
        rows_out = (*theirs["batch"], expected[rank])
        for shape in theirs["more"]:
            if tuple(shape[: len(rows_out)]) != rows_out:
                raise ValueError(
                    f"rank {rank}: C, lse and dC must have the shape "
                    f"{rows_out} (+ d_v), got {shape}"
                )
    return expected


# --- ring attention, forward and backward -------------------------------------


def ring_forward(Q, K, V, T, split, causal, overlap=True, group=None):
    """This rank's output C and log-sum-exp lse, with what it counted.

    Q, K, V (..., rows, d): this rank's tokens of a sequence of T. At step
    s the rank holds the keys and values of rank (rank - s) mod P; with
    overlap, the next block is already travelling while this one is
    computed; without, it is sent once the block is done.
    """
    comm = Comm(group)
    rows = check_ranks(comm, T, split, causal, Q, K, V)
    P, rank, d_k = comm.P, comm.rank, K.shape[-1]
    pieces = [rank_pieces(T, P, split, r) for r in range(P)]
    KV = torch.cat([K, V], dim=-1)  # one message: (..., rows, d_k + d_v)
    C = Q.new_zeros(*Q.shape[:-1], V.shape[-1])
    lse = Q.new_full(Q.shape[:-1], -math.inf)  # no key yet
    counted = {"blocks": 0, "scores": 0, "compute": 0.0}  # scores per head
    for step in range(P):
        owner = (rank - step) % P  # whose keys and values this rank holds
        requests, last = [], step == P - 1
        if not last:  # the block after this one: rank owner - 1's
            nxt = KV.new_empty(
                *KV.shape[:-2], rows[(owner - 1) % P], KV.shape[-1]
            )
            if overlap:
                requests = comm.ring_exchange(KV, nxt)
        start = time.thread_time()
        plan = block_plan(pieces[rank], pieces[owner], causal)
        for r0, r1, c0, c1, masked, offset, seen in plan:
            K_b, V_b = KV[..., c0:c1, :d_k], KV[..., c0:c1, d_k:]
            C_b, lse_b = fast_attention(
                Q[..., r0:r1, :], K_b, V_b, masked, offset=offset,
                return_lse=True,
            )  # fmt: skip
            C[..., r0:r1, :], lse[..., r0:r1] = merge(
                C[..., r0:r1, :], lse[..., r0:r1], C_b, lse_b
            )
            counted["scores"] += seen
        counted["blocks"] += bool(plan)
        counted["compute"] += time.thread_time() - start
        if not last:
            if not overlap:
                requests = comm.ring_exchange(KV, nxt)
            for request in requests:
                request.wait()
            KV = nxt
    counted.update(sent=comm.sent, received=comm.received)
    return C, lse, counted


def ring_backward(
    Q, K, V, C, lse, dC, T, split, causal, overlap=True, group=None
):
    """This rank's dQ, dK, dV, with what it counted.

    The keys and values go round the ring as in ring_forward; beside each
    block travels its gradient dK, dV, to which every rank adds its
    queries' part (flash_backward of this rank's rows against the block,
    with the whole sequence's C and lse); after P steps a last hop brings
    each block's sum home.
    """
    comm = Comm(group)
    rows = check_ranks(comm, T, split, causal, Q, K, V, C, lse, dC)
    P, rank, d_k = comm.P, comm.rank, K.shape[-1]
    pieces = [rank_pieces(T, P, split, r) for r in range(P)]
    KV = torch.cat([K, V], dim=-1)
    dKV = torch.zeros_like(KV)  # the gradient of the block this rank holds
    dQ = torch.zeros_like(Q)
    counted = {"blocks": 0, "scores": 0, "compute": 0.0}
    for step in range(P):
        owner = (rank - step) % P  # the block (and its gradient) held now
        requests = []
        if step < P - 1:
            shape = (*KV.shape[:-2], rows[(owner - 1) % P], KV.shape[-1])
            nxt, d_nxt = KV.new_empty(shape), KV.new_empty(shape)
            if overlap:
                requests = comm.ring_exchange(KV, nxt)
        else:  # the last hop: each block's gradient to its own rank
            shape = (*KV.shape[:-2], rows[rank], KV.shape[-1])
            d_nxt = KV.new_empty(shape)
        start = time.thread_time()
        plan = block_plan(pieces[rank], pieces[owner], causal)
        for r0, r1, c0, c1, masked, offset, seen in plan:
            dQ_b, dK_b, dV_b = flash_backward(
                Q[..., r0:r1, :], KV[..., c0:c1, :d_k], KV[..., c0:c1, d_k:],
                C[..., r0:r1, :], lse[..., r0:r1], dC[..., r0:r1, :],
                masked, offset=offset,
            )  # fmt: skip
            dQ[..., r0:r1, :] += dQ_b
            dKV[..., c0:c1, :d_k] += dK_b
            dKV[..., c0:c1, d_k:] += dV_b
            counted["scores"] += seen
        counted["blocks"] += bool(plan)
        counted["compute"] += time.thread_time() - start
        if step < P - 1 and not overlap:
            requests = comm.ring_exchange(KV, nxt)
        if P > 1:  # a lone rank keeps its gradient
            requests += comm.ring_exchange(dKV, d_nxt)
        else:
            d_nxt = dKV
        for request in requests:
            request.wait()
        if step < P - 1:
            KV = nxt
        dKV = d_nxt
    counted.update(sent=comm.sent, received=comm.received)
    return dQ, dKV[..., :d_k], dKV[..., d_k:], counted


def ring_bytes(T, P, split, batch, d_k, d_v, itemsize=8, backward=False):
    """The bytes each rank sends in ring_forward (or ring_backward): the
    keys and values of every block but the one it receives last, (P - 1)
    blocks; the backward pass adds the gradient of every block, P blocks."""
    check_sizes(batch, d_k=d_k, d_v=d_v, itemsize=itemsize)
    rows = [len(p) for p in split_positions(T, P, split)]
    per_token = math.prod(batch) * (d_k + d_v) * itemsize
    sent = []
    for rank in range(P):
        kv = sum(rows) - rows[(rank + 1) % P] if P > 1 else 0
        grads = sum(rows) if backward and P > 1 else 0
        sent.append((kv + grads) * per_token)
    return sent


# --- Ulysses: sequence slices to head groups and back ------------------------


def heads_of_all(comm, X, rows):
    """(..., H, rows[rank], d) -> (..., H / P, T, d): this rank's head group
    (heads rank H/P to (rank + 1) H/P - 1) for every token."""
    *batch, H, n, d = X.shape
    P, g = comm.P, H // comm.P
    send = X.reshape(*batch, P, g, n, d).movedim(-4, 0).contiguous()
    per = math.prod(batch) * g * d  # numbers per token and head group
    recv = X.new_empty(sum(rows) * per)
    comm.all_to_all(
        recv, send.reshape(-1), [r * per for r in rows], [n * per] * P
    )
    parts = recv.split([r * per for r in rows])
    return torch.cat(
        [p.reshape(*batch, g, r, d) for p, r in zip(parts, rows)], -2
    )


def tokens_of_all(comm, Y, rows):
    """(..., H / P, T, d) -> (..., H, rows[rank], d): the inverse of
    heads_of_all."""
    *batch, g, _, d = Y.shape
    P, n = comm.P, rows[comm.rank]
    per = math.prod(batch) * g * d
    send = torch.cat([p.reshape(-1) for p in Y.split(rows, dim=-2)])
    recv = Y.new_empty(P * n * per)
    comm.all_to_all(recv, send, [n * per] * P, [r * per for r in rows])
    out = recv.reshape(P, *batch, g, n, d).movedim(0, -4)  # (..., P, g, n, d)
    return out.reshape(*batch, P * g, n, d)


def ulysses_forward(Q, K, V, T, causal, group=None):
    """This rank's output C (..., H, rows, d_v), with what it counted: an
    all-to-all gives each rank H / P heads of every token, it attends
    (chapter 8's fast_attention over all T), and an all-to-all returns
    each rank its tokens of every head."""
    comm = Comm(group)
    rows = check_ranks(comm, T, "contiguous", causal, Q, K, V)
    if Q.dim() < 3 or Q.shape[-3] % comm.P:
        heads = Q.shape[-3] if Q.dim() >= 3 else "no head axis"
        raise ValueError(
            f"Ulysses needs H divisible by P: H = {heads}, P = {comm.P}"
        )
    Q_h, K_h, V_h = (heads_of_all(comm, X, rows) for X in (Q, K, V))
    start = time.thread_time()
    C_h = fast_attention(Q_h, K_h, V_h, causal)  # (..., H / P, T, d_v)
    compute = time.thread_time() - start
    C = tokens_of_all(comm, C_h, rows)
    counted = {
        "compute": compute,
        "sent": comm.sent,
        "received": comm.received,
    }
    return C, counted


def check_sizes(batch, **sizes):
    """ValueError unless batch is a tuple of integers >= 1 and each size
    (d_k, d_v, itemsize, H) an integer >= 1."""
    if not isinstance(batch, tuple) or not all(
        isinstance(n, numbers.Integral) and not isinstance(n, bool) and n >= 1
        for n in batch
    ):
        raise ValueError(
            f"batch must be a tuple of integers >= 1, got {batch!r}"
        )
    for name, n in sizes.items():
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {n!r}")


def ulysses_bytes(T, P, batch, H, d_k, d_v, itemsize=8):
    """The bytes each rank sends in ulysses_forward: Q, K and V of its
    tokens for the other ranks' heads, then the other ranks' tokens of its
    heads' output."""
    check_sizes(batch, H=H, d_k=d_k, d_v=d_v, itemsize=itemsize)
    rows = [len(p) for p in split_positions(T, P, "contiguous")]
    if H % P:
        raise ValueError(f"Ulysses needs H divisible by P: H = {H}, P = {P}")
    per = math.prod(batch) * (H // P) * itemsize  # per token and head group
    return [
        (P - 1) * n * per * (2 * d_k + d_v) + (T - n) * per * d_v for n in rows
    ]


# --- the processes -----------------------------------------------------------


def socket_addresses(group=None):
    """The local IP addresses of this process's TCP sockets, sorted: its
    file descriptors matched against Linux's /proc/net/tcp and tcp6 (an
    empty list where /proc has neither)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[9] in inodes:
                found.add(address(fields[1].split(":")[0]))
    return sorted(found)


def address(hexed):
    """An IP address as /proc/net/tcp writes it (host byte order, 32-bit
    words) as text: '0100007F' -> '127.0.0.1'."""
    raw = b"".join(
        bytes.fromhex(hexed[i : i + 8])[::-1] for i in range(0, len(hexed), 8)
    )
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, raw)


def loopback():
    """The name of the loopback interface (lo on Linux, lo0 on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n.startswith("lo")), names[0])


def pack(obj):
    """Tensors as NumPy arrays (marked), for a queue between processes."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", obj.detach().cpu().numpy())
    if isinstance(obj, (list, tuple)):
        return type(obj)(pack(x) for x in obj)
    if isinstance(obj, dict):
        return {k: pack(v) for k, v in obj.items()}
    return obj


def unpack(obj):
    """The inverse of pack."""
    if (
        isinstance(obj, tuple)
        and len(obj) == 2
        and isinstance(obj[1], np.ndarray)
    ):
        if isinstance(obj[0], str) and obj[0] == "tensor":
            return torch.from_numpy(obj[1])
    if isinstance(obj, (list, tuple)):
        return type(obj)(unpack(x) for x in obj)
    if isinstance(obj, dict):
        return {k: unpack(v) for k, v in obj.items()}
    return obj


def serve(rank, P, store, timeout, threads, tasks, results, quiet=True):
    """One rank: join the group, make the groups of the first 1 .. P - 1
    ranks, then run each (function, n, args) sent until None arrives or
    the parent is gone; leave the group unless killed (close() kills a rank
    stuck in a call). quiet: the rank's own
    output (gloo's messages) goes to /dev/null, not to the parent's."""
    if quiet:  # in a notebook they would land in whichever cell runs
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
    os.environ["GLOO_SOCKET_IFNAME"] = loopback()  # loopback only
    torch.set_num_threads(threads)
    parent = os.getppid()
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",  # the rendezvous: a file
            rank=rank,
            world_size=P,
            timeout=datetime.timedelta(seconds=timeout),
        )
        groups = {n: dist.new_group(list(range(n))) for n in range(1, P)}
        groups[P] = dist.group.WORLD
        results.put(("ready", rank, None))
        while True:
            try:
                task = tasks.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent:
                    return  # the parent died: no one will send None
                continue
            if task is None:
                return
            fn, n, args = task
            try:
                out = fn(*unpack(args), group=groups[n])
                results.put(("done", rank, pack(out)))
            except Exception as error:  # reported; the parent decides
                results.put(("error", rank, describe(error)))
    except Exception as error:
        results.put(("error", rank, describe(error)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def describe(error):
    """(type name, message, traceback) of an exception, for the parent."""
    return type(error).__name__, str(error), traceback.format_exc()


class RankError(RuntimeError):
    """A rank failed or did not answer in time; the pool is closed."""


class RankPool:
    """P processes in one gloo group on this machine (gloo's sockets on the
    loopback interface, the rendezvous a file in a temporary folder),
    started once and reused: `run(fn, args)` runs fn(*args[r],
    group=...) on ranks r = 0 .. len(args) - 1 and returns their results.

    Every call between ranks gives up after `timeout` seconds. When every
    rank refuses its input with the same ValueError, run raises it and the
    pool stays open; any other failure, or a rank silent for longer than
    timeout + GRACE seconds, closes the pool and raises RankError. The
    processes exit on close(), at the end of a `with` block, or when their
    parent is gone.
    quiet=False lets the ranks print to the parent's output.
    """

    def __init__(
        self, P=4, timeout=30.0, start_method="forkserver", threads=1,
        quiet=True,
    ):  # fmt: skip
        check_pool(P, timeout, threads)
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":  # torch imported once, then forks
            ctx.set_forkserver_preload(["torch", "ring"])  # ring if found
        self.P, self.timeout, self.closed = P, timeout, False
        self.folder = tempfile.mkdtemp(prefix="ring-")  # the group's store
        store = os.path.join(self.folder, "store")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(P)]
        self.processes = [
            ctx.Process(
                target=serve,
                args=(
                    r,
                    P,
                    store,
                    timeout,
                    threads,
                    self.tasks[r],
                    self.results,
                    quiet,
                ),
                daemon=True,
            )
            for r in range(P)
        ]
        for process in self.processes:
            process.start()
        try:
            self.collect(range(P), "starting the group")
        except BaseException:
            self.close()
            raise

    def run(self, fn, args):
        """[fn(*args[r], group=...) for r in range(n)] on ranks 0 .. n - 1,
        n = len(args), in the group of those n ranks."""
        if self.closed:
            raise ValueError("this pool is closed: start a new RankPool")
        if not callable(fn) or not 1 <= len(args) <= self.P:
            raise ValueError(
                f"run needs a function and 1 to {self.P} argument tuples, "
                f"got {fn!r} and {len(args)}"
            )
        for rank, arguments in enumerate(args):
            self.tasks[rank].put((fn, len(args), pack(tuple(arguments))))
        return self.collect(range(len(args)), fn.__name__)

    def collect(self, ranks, what):
        """Every rank's answer; raise as the class says."""
        ranks, answers = list(ranks), {}
        deadline = time.monotonic() + self.timeout + GRACE
        while len(answers) < len(ranks):
            try:
                kind, rank, payload = self.results.get(timeout=0.2)
                answers[rank] = (kind, payload)
                continue
            except queue.Empty:
                pass
            gone = [r for r in ranks if r not in answers]
            dead = [r for r in gone if not self.processes[r].is_alive()]
            if dead or time.monotonic() > deadline:
                self.close()
                raise RankError(
                    f"{what}: no answer from ranks {gone} "
                    f"({'exited' if dead else 'timed out'}); pool closed"
                )
        errors = {r: p for r, (kind, p) in answers.items() if kind == "error"}
        if not errors:
            return [unpack(answers[r][1]) for r in ranks]
        names = {name for name, _, _ in errors.values()}
        messages = {message for _, message, _ in errors.values()}
        if len(errors) == len(ranks) and names == {"ValueError"}:
            if len(messages) == 1:  # every rank refused the same input
                raise ValueError(messages.pop())
        self.close()
        first = min(errors)
        name, message, _ = errors[first]
        raise RankError(
            f"{what} failed on ranks {sorted(errors)}; pool closed. Rank "
            f"{first}: {name}: {message}"
        )

    def alive(self):
        """How many of the pool's processes are still running."""
        return sum(process.is_alive() for process in self.processes)

    def close(self):
        """Ask every rank to leave, then end the ones that do not."""
        if self.closed:
            return
        self.closed = True
        for tasks in self.tasks:
            tasks.put(None)
        end = time.monotonic() + 5.0
        for process in self.processes:
            process.join(max(end - time.monotonic(), 0.1))
        for process in self.processes:
            if process.is_alive():  # stuck in a call: end it
                process.kill()
                process.join(5.0)
        for q in (*self.tasks, self.results):
            q.cancel_join_thread()
            q.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def check_pool(P, timeout, threads):
    """ValueError unless P and threads are integers >= 1 and the timeout a
    positive number of seconds."""
    for name, value in (("P", P), ("threads", threads)):
        if (
            not isinstance(value, numbers.Integral)
            or isinstance(value, bool)
            or value < 1
        ):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if isinstance(timeout, bool) or not (
        isinstance(timeout, numbers.Real) and 0 < timeout < math.inf
    ):
        raise ValueError(f"timeout must be a positive number, got {timeout!r}")


def fail_on_rank(bad, group=None):
    """Rank `bad` raises at once; every other rank waits for a tensor from
    it, until the group's timeout ends the wait (a test of the pool)."""
    rank = dist.get_rank(group)
    if rank == bad:
        raise RuntimeError(f"rank {bad} fails on purpose")
    buffer = torch.empty(1)
    dist.recv(buffer, bad, group=group)  # never sent: the timeout fires
    return rank


# --- the parent's side: split, run, gather -----------------------------------


def check_call(pool, Q, K, V, P, heads=False):
    """ValueError unless the pool is a RankPool with P ranks or more, and
    Q, K, V are torch tensors (..., T, d) of one sequence with P <= T
    tokens (and, for Ulysses, a head axis: (..., H, T, d))."""
    if not isinstance(pool, RankPool):
        raise ValueError(f"pool must be a RankPool, got {type(pool).__name__}")
    if not isinstance(P, numbers.Integral) or isinstance(P, bool):
        raise ValueError(f"P must be an integer, got {P!r}")
    if not 1 <= P <= pool.P:
        raise ValueError(f"P = {P}: the pool has ranks for 1 to {pool.P}")
    if not all(isinstance(t, torch.Tensor) for t in (Q, K, V)):
        raise ValueError("Q, K and V must be torch tensors")
    if Q.dim() < 2 + heads or not Q.shape[:-1] == K.shape[:-1] == V.shape[:-1]:
        raise ValueError(
            f"Q, K, V must be (..., {'H, ' * heads}T, d) for the same tokens, "
            f"got {tuple(Q.shape)}, {tuple(K.shape)}, {tuple(V.shape)}"
        )
    for name, t in (("Q", Q), ("K", K), ("V", V)):
        if not t.is_floating_point() or not t.isfinite().all():
            raise ValueError(f"{name} must be floating point and finite")
    check_split(Q.shape[-2], P, "contiguous")  # P <= T
    return Q.shape[-2]


def gather(parts, positions, T, axis=-2):
    """The rows (along axis) of every rank's tensor put back at their
    positions in one tensor of T rows."""
    shape = list(parts[0].shape)
    shape[axis] = T
    out = parts[0].new_empty(shape)
    for part, index in zip(parts, positions):
        out.index_copy_(axis % out.dim(), torch.tensor(index), part)
    return out


def ring_attention(
    pool, Q, K, V, P, causal=False, split="contiguous", overlap=True
):
    """Attention of Q, K, V (..., T, d) computed by P ranks of the pool
    round a ring: (C, lse, what each rank counted)."""
    T = check_call(pool, Q, K, V, P)
    check_split(T, P, split)
    positions = split_positions(T, P, split)
    args = [
        (Q[..., i, :], K[..., i, :], V[..., i, :], T, split, causal, overlap)
        for i in positions
    ]
    results = pool.run(ring_forward, args)
    C = gather([r[0] for r in results], positions, T)
    lse = gather([r[1] for r in results], positions, T, axis=-1)
    return C, lse, [r[2] for r in results]


def ring_gradients(
    pool, Q, K, V, C, lse, dC, P, causal=False, split="contiguous",
    overlap=True,
):  # fmt: skip
    """dQ, dK, dV of attention computed by P ranks round a ring, from the
    forward's C and lse and the output's gradient dC, and what each rank
    counted."""
    T = check_call(pool, Q, K, V, P)
    check_backward_inputs(Q, V, C, lse, dC)
    check_split(T, P, split)
    positions = split_positions(T, P, split)
    args = [
        (*(X[..., i, :] for X in (Q, K, V, C)), lse[..., i], dC[..., i, :])
        + (T, split, causal, overlap)
        for i in positions
    ]
    results = pool.run(ring_backward, args)
    grads = [gather([r[u] for r in results], positions, T) for u in range(3)]
    return (*grads, [r[3] for r in results])


def check_backward_inputs(Q, V, C, lse, dC):
    """ValueError unless C and dC have the output's shape (..., T, d_v), lse
    the shape (..., T), all of Q's dtype."""
    out = (*Q.shape[:-1], V.shape[-1])
    for name, t, shape in (
        ("C", C, out),
        ("dC", dC, out),
        ("lse", lse, Q.shape[:-1]),
    ):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape):
            got = (
                tuple(t.shape)
                if isinstance(t, torch.Tensor)
                else type(t).__name__
            )
            raise ValueError(
                f"{name} must have shape {tuple(shape)}, got {got}"
            )
        if t.dtype != Q.dtype:
            raise ValueError(f"{name} is {t.dtype}, Q is {Q.dtype}")
        if not t.isfinite().all():  # dC, C or lse of a rank
            raise ValueError(f"{name} holds NaN or an infinity")


def ulysses_attention(pool, Q, K, V, P, causal=False):
    """Attention of Q, K, V (..., H, T, d) computed by P ranks with
    Ulysses' all-to-alls (one each for Q, K, V and C): (C, counts)."""
    T = check_call(pool, Q, K, V, P, heads=True)
    if Q.shape[-3] % P:
        raise ValueError(
            f"Ulysses needs H divisible by P: H = {Q.shape[-3]}, P = {P}"
        )
    positions = split_positions(T, P, "contiguous")
    args = [
        (Q[..., i, :], K[..., i, :], V[..., i, :], T, causal)
        for i in positions
    ]
    results = pool.run(ulysses_forward, args)
    return gather([r[0] for r in results], positions, T), [
        r[1] for r in results
    ]


class RingAttention(torch.autograd.Function):
    """Attention whose forward pass is ring_attention and whose backward
    pass is ring_gradients, both run by the pool's ranks."""

    @staticmethod
    def forward(ctx, Q, K, V, pool, P, causal, split):
        C, lse, _ = ring_attention(pool, Q, K, V, P, causal, split)
        ctx.save_for_backward(Q, K, V, C, lse)
        ctx.settings = (pool, P, causal, split)
        return C

    @staticmethod
    @once_differentiable
    def backward(ctx, dC):
        Q, K, V, C, lse = ctx.saved_tensors
        pool, P, causal, split = ctx.settings
        dQ, dK, dV, _ = ring_gradients(
            pool, Q, K, V, C, lse, dC.contiguous(), P, causal, split
        )
        return dQ, dK, dV, None, None, None, None


def ring_backend(pool, P, split="zigzag"):
    """A function (Q, K, V, causal) -> C with flash_attention's arguments,
    computed round the ring: what transformer.SelfAttention's "flash"
    backend calls, once it is put in the place of flash_attention. Only
    self-attention: T_q = T_k, so a bottom-right mask is a causal one."""

    def attend(Q, K, V, causal=False):
        if Q.shape[-2] != K.shape[-2]:
            raise ValueError(
                f"the ring attends a sequence to itself: T_q = "
                f"{Q.shape[-2]}, T_k = {K.shape[-2]}"
            )
        return RingAttention.apply(Q, K, V, pool, P, bool(causal), split)

    return attend


def peak_rss(group=None):
    """The most resident memory this rank's process has held, in bytes
    (Linux's ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
