"""Chapter 17's module book/ring.py: the merge, the splits, ring attention
forward and backward, Ulysses and the bytes they send, run by one pool of
four processes for the whole file, checked against PyTorch's
F.scaled_dot_product_attention (SDPA) and its autograd, and against counts
made here from the positions alone, on shapes the chapter never prints."""

import math
import socket
import sys
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from conftest import BOOK  # noqa: F401  (puts book/ on sys.path)
from torch.testing import assert_close

import gpt
import ring
import transformer

TOL = {"rtol": 0, "atol": 1e-12}
T_ODD = 13  # divisible by none of P = 2, 3, 4, nor by 2P


@pytest.fixture(scope="module")
def pool():
    with ring.RankPool(4, timeout=20.0) as started:
        yield started


def qkv(T, batch=(2, 3), d_k=5, d_v=7, seed=0, grad=False):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((*batch, T, d_k), (*batch, T, d_k), (*batch, T, d_v))
    return [
        torch.randn(s, generator=gen, dtype=torch.float64).requires_grad_(grad)
        for s in shapes
    ]


def reference_lse(Q, K, causal):
    """Each query's log-sum-exp of its scores, with the whole matrix."""
    E = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])
    if causal:
        T = E.shape[-1]
        E = E.masked_fill(
            ~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf
        )
    return torch.logsumexp(E, dim=-1)


# --- the merge ---------------------------------------------------------------


def part(Q, K, V, keys):
    """Attention of Q over the keys listed, and its log-sum-exp."""
    E = Q @ K[..., keys, :].transpose(-2, -1) / math.sqrt(Q.shape[-1])
    return E.softmax(-1) @ V[..., keys, :], torch.logsumexp(E, -1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_merge_of_two_disjoint_key_sets_is_attention_over_both(seed):
    Q, K, V = qkv(11, seed=seed)
    keys = torch.randperm(11, generator=torch.Generator().manual_seed(seed))
    C, lse = ring.merge(*part(Q, K, V, keys[:4]), *part(Q, K, V, keys[4:]))
    assert_close(C, F.scaled_dot_product_attention(Q, K, V), **TOL)
    assert_close(lse, reference_lse(Q, K, False), **TOL)


def test_merge_with_nothing_yet_keeps_the_other_part():
    Q, K, V = qkv(6)
    C_2, lse_2 = part(Q, K, V, list(range(6)))
    C, lse = ring.merge(
        torch.zeros_like(C_2), torch.full_like(lse_2, -math.inf), C_2, lse_2
    )
    assert torch.equal(C, C_2) and torch.equal(lse, lse_2)


def test_merge_refuses_parts_that_do_not_fit():
    C, lse = torch.zeros(2, 3, 4), torch.zeros(2, 3)
    with pytest.raises(ValueError, match="shapes differ"):
        ring.merge(C, lse, torch.zeros(2, 4, 4), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="lse_2 must have shape"):
        ring.merge(C, lse, C, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="one dtype"):
        ring.merge(C, lse, C, lse.double())
    with pytest.raises(ValueError, match="floating-point"):
        ring.merge(C, lse, C.long(), lse)


# --- the splits and the work they give each rank -------------------------------


@pytest.mark.parametrize("split", ring.SPLITS)
@pytest.mark.parametrize(
    "T, P", [(5, 5), (7, 2), (13, 3), (13, 4), (32, 4), (9, 4)]
)
def test_every_split_gives_each_token_to_one_rank(split, T, P):
    positions = ring.split_positions(T, P, split)
    assert len(positions) == P and all(positions)
    assert sorted(t for p in positions for t in p) == list(range(T))
    assert all(p == sorted(p) for p in positions)


@pytest.mark.parametrize("T, P", [(13, 3), (13, 4), (32, 4), (9, 4)])
def test_the_splits_follow_their_rules(T, P):
    tokens = torch.arange(T)
    chunks = [c.tolist() for c in torch.tensor_split(tokens, P)]
    assert ring.split_positions(T, P, "contiguous") == chunks
    striped = ring.split_positions(T, P, "striped")
    assert striped == [[t for t in range(T) if t % P == r] for r in range(P)]
    halves = [c.tolist() for c in torch.tensor_split(tokens, 2 * P)]
    zigzag = [halves[r] + halves[2 * P - 1 - r] for r in range(P)]
    assert ring.split_positions(T, P, "zigzag") == zigzag


@pytest.mark.parametrize("split", ring.SPLITS)
@pytest.mark.parametrize("T, P", [(13, 3), (13, 4), (40, 4), (9, 4), (24, 3)])
def test_score_counts_equal_a_count_by_position(split, T, P):
    positions = ring.split_positions(T, P, split)
    scores, blocks = ring.score_counts(T, P, split, causal=True)
    assert scores == [sum(t + 1 for t in p) for p in positions]  # keys <= t
    seen = [  # key blocks with a key at or before one of the queries
        sum(1 for keys in positions if min(keys) <= max(p)) for p in positions
    ]
    assert blocks == seen
    full, all_blocks = ring.score_counts(T, P, split, causal=False)
    assert full == [len(p) * T for p in positions] and all_blocks == [P] * P


@pytest.mark.parametrize("P", [2, 3, 4, 8])
def test_the_balanced_splits_are_within_10_percent_the_plain_is_not(P):
    T = 2 * P * 64
    for split in ("striped", "zigzag"):
        scores, _ = ring.score_counts(T, P, split)
        assert max(scores) <= 1.1 * sum(scores) / P
    scores, blocks = ring.score_counts(T, P, "contiguous")
    assert blocks == list(range(1, P + 1))  # the last rank: P blocks
    ratio = scores[-1] / scores[0]  # ((2P - 1) n + 1) / (n + 1), n = T/P
    assert 0.99 * (2 * P - 1) < ratio < 2 * P - 1
    zigzag, _ = ring.score_counts(T, P, "zigzag")
    assert len(set(zigzag)) == 1  # T divisible by 2P: exactly equal


def test_the_splits_refuse_bad_sizes():
    with pytest.raises(ValueError, match="P = 5 processes for T = 4"):
        ring.split_positions(4, 5)
    with pytest.raises(ValueError, match="split must be one of"):
        ring.split_positions(8, 2, "random")
    for T, P in [(0, 1), (4, 0), (4.0, 2), (True, 1)]:
        with pytest.raises(ValueError, match="integer >= 1"):
            ring.split_positions(T, P)


# --- ring attention, forward ----------------------------------------------


@pytest.mark.parametrize("split", ring.SPLITS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("P", [2, 3, 4])
def test_ring_forward_equals_sdpa(pool, P, causal, split):
    Q, K, V = qkv(T_ODD, seed=P)
    C, lse, counted = ring.ring_attention(pool, Q, K, V, P, causal, split)
    assert_close(
        C, F.scaled_dot_product_attention(Q, K, V, is_causal=causal), **TOL
    )
    assert_close(lse, reference_lse(Q, K, causal), **TOL)
    scores, blocks = ring.score_counts(T_ODD, P, split, causal)
    assert [c["scores"] for c in counted] == scores
    assert [c["blocks"] for c in counted] == blocks


@pytest.mark.parametrize("overlap", [False, True])
def test_ring_forward_without_overlap_gives_the_same_output(pool, overlap):
    Q, K, V = qkv(10, batch=(2,), d_k=3, d_v=2, seed=7)
    C, _, _ = ring.ring_attention(pool, Q, K, V, 3, True, "zigzag", overlap)
    assert_close(
        C, F.scaled_dot_product_attention(Q, K, V, is_causal=True), **TOL
    )


def test_ring_forward_on_one_rank_and_one_token_per_rank(pool):
    Q, K, V = qkv(4, batch=(), seed=3)
    for P in (1, 4):
        C, _, _ = ring.ring_attention(pool, Q, K, V, P, True, "striped")
        expected = F.scaled_dot_product_attention(Q, K, V, is_causal=True)
        assert_close(C, expected, **TOL)


# --- ring attention, backward -------------------------------------------------


@pytest.mark.parametrize("split", ring.SPLITS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("P", [2, 3, 4])
def test_ring_backward_equals_sdpa_gradients(pool, P, causal, split):
    Q, K, V = qkv(T_ODD, seed=10 + P, grad=True)
    C = F.scaled_dot_product_attention(Q, K, V, is_causal=causal)
    dC = torch.randn(
        C.shape, generator=torch.Generator().manual_seed(P), dtype=C.dtype
    )
    expected = torch.autograd.grad(C, (Q, K, V), dC)
    Q, K, V = (X.detach() for X in (Q, K, V))
    C, lse, _ = ring.ring_attention(pool, Q, K, V, P, causal, split)
    *grads, counted = ring.ring_gradients(
        pool, Q, K, V, C, lse, dC, P, causal, split
    )
    for got, want in zip(grads, expected):
        assert_close(got, want, **TOL)
    assert [c["scores"] for c in counted] == ring.score_counts(
        T_ODD, P, split, causal
    )[0]


def test_ring_autograd_function_equals_sdpa(pool):
    Q, K, V = qkv(9, batch=(2,), seed=5, grad=True)
    C = ring.RingAttention.apply(Q, K, V, pool, 3, True, "striped")
    (C * C).sum().backward()
    got = [X.grad.clone() for X in (Q, K, V)]
    for X in (Q, K, V):
        X.grad = None
    C = F.scaled_dot_product_attention(Q, K, V, is_causal=True)
    (C * C).sum().backward()
    for g, X in zip(got, (Q, K, V)):
        assert_close(g, X.grad, **TOL)


def test_a_gpt_step_through_the_ring_equals_the_one_process_step(pool):
    data = torch.randint(
        0, 11, (400,), generator=torch.Generator().manual_seed(0)
    )
    models, losses = [], []
    for attend in (None, ring.ring_backend(pool, 4, "zigzag")):
        torch.manual_seed(0)
        model = gpt.GPT(
            11, d=16, H=4, layers=2, d_ff=32, backend="flash"
        ).double()
        patch = mock.patch.object(
            transformer,
            "flash_attention",
            attend or transformer.flash_attention,
        )
        with patch:
            losses.append(gpt.train(model, data, 2, B=2, T=10))
        models.append(model)
    assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]), **TOL)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert_close(a, b, **TOL)


# --- Ulysses ----------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("P", [2, 3, 4])
def test_ulysses_equals_sdpa(pool, P, causal):
    Q, K, V = qkv(T_ODD, batch=(2, 12), seed=20 + P)
    C, counted = ring.ulysses_attention(pool, Q, K, V, P, causal)
    assert_close(
        C, F.scaled_dot_product_attention(Q, K, V, is_causal=causal), **TOL
    )
    sent = ring.ulysses_bytes(T_ODD, P, (2,), 12, 5, 7)
    assert [c["sent"] for c in counted] == sent


def test_ulysses_refuses_heads_not_divisible_by_P(pool):
    Q, K, V = qkv(8, batch=(1, 6))
    with pytest.raises(ValueError, match="H divisible by P: H = 6, P = 4"):
        ring.ulysses_attention(pool, Q, K, V, 4)
    rows = ring.split_positions(8, 4)
    args = [(Q[..., r, :], K[..., r, :], V[..., r, :], 8, False) for r in rows]
    with pytest.raises(ValueError, match="H divisible by P: H = 6, P = 4"):
        pool.run(ring.ulysses_forward, args)  # the ranks' own check
    C, _ = ring.ulysses_attention(pool, Q, K, V, 3)  # the pool still works
    assert_close(C, F.scaled_dot_product_attention(Q, K, V), **TOL)


# --- what travels --------------------------------------------------------------


@pytest.mark.parametrize(
    "T, P, split",
    [(T_ODD, 3, "zigzag"), (16, 4, "contiguous"), (10, 4, "striped")],
)
def test_bytes_sent_and_received_equal_the_formula(pool, T, P, split):
    Q, K, V = qkv(T, batch=(3,), d_k=4, d_v=6, seed=1)
    C, lse, forward = ring.ring_attention(pool, Q, K, V, P, True, split)
    sent = ring.ring_bytes(T, P, split, (3,), 4, 6)
    assert [c["sent"] for c in forward] == sent
    assert [c["received"] for c in forward] == sent[-1:] + sent[:-1]
    *_, backward = ring.ring_gradients(
        pool, Q, K, V, C, lse, torch.ones_like(C), P, True, split
    )
    sent_back = ring.ring_bytes(T, P, split, (3,), 4, 6, backward=True)
    assert [c["sent"] for c in backward] == sent_back
    rows = [len(p) for p in ring.split_positions(T, P, split)]
    per_token = 3 * (4 + 6) * 8
    assert (
        sum(sent)
        == sum(sum(rows) - rows[(r + 1) % P] for r in range(P)) * per_token
    )
    assert (
        sum(sent_back) - sum(sent) == P * T * per_token
    )  # every gradient, P hops


def test_ulysses_sends_less_than_the_ring_when_T_is_divisible():
    T, P, batch, H, d = 64, 4, (1,), 8, 16
    ring_sent = ring.ring_bytes(T, P, "contiguous", (*batch, H), d, d)
    ulysses = ring.ulysses_bytes(T, P, batch, H, d, d)
    assert ring_sent == [(P - 1) * (T // P) * H * 2 * d * 8] * P
    assert ulysses == [4 * (P - 1) * (T // P) * (H // P) * d * 8] * P
    assert ring_sent[0] == ulysses[0] * P // 2


# --- bad input, named; ranks that fail -----------------------------------------


def test_ring_attention_refuses_bad_input(pool):
    Q, K, V = qkv(3)
    with pytest.raises(ValueError, match="P = 4 processes for T = 3 tokens"):
        ring.ring_attention(pool, Q, K, V, 4)
    with pytest.raises(ValueError, match="the pool has ranks for 1 to 4"):
        ring.ring_attention(pool, Q, K, V, 5)
    with pytest.raises(ValueError, match="same tokens"):
        ring.ring_attention(pool, Q, K[..., :2, :], V, 2)
    with pytest.raises(ValueError, match="split must be one of"):
        ring.ring_attention(pool, Q, K, V, 2, split="random")
    with pytest.raises(ValueError, match="pool must be a RankPool"):
        ring.ring_attention(None, Q, K, V, 2)


def test_mismatched_shapes_across_ranks_are_named_on_every_rank(pool):
    Q, K, V = qkv(8, batch=(2,))
    rows = ring.split_positions(8, 2)
    args = [
        (Q[..., r, :], K[..., r, :], V[..., r, :], 8, "contiguous", True)
        for r in rows
    ]
    wide = (
        args[1][:2]
        + (torch.zeros(2, 4, 9, dtype=torch.float64),)
        + args[1][3:]
    )
    with pytest.raises(ValueError, match="mismatched sizes across ranks"):
        pool.run(ring.ring_forward, [args[0], wide])
    short = tuple(X[..., :3, :] for X in args[1][:3]) + args[1][3:]
    with pytest.raises(ValueError, match="rank 1 holds 3 tokens"):
        pool.run(ring.ring_forward, [args[0], short])
    other_T = args[1][:3] + (9,) + args[1][4:]
    with pytest.raises(ValueError, match="mismatched settings across ranks"):
        pool.run(ring.ring_forward, [args[0], other_T])
    bad_K = args[1][:1] + (args[1][1][..., :2],) + args[1][2:]
    with pytest.raises(ValueError, match="rank 1: "):
        pool.run(ring.ring_forward, [args[0], bad_K])
    C, _, _ = ring.ring_attention(pool, Q, K, V, 2, True)  # still usable
    assert_close(
        C, F.scaled_dot_product_attention(Q, K, V, is_causal=True), **TOL
    )


def test_a_failing_rank_does_not_leave_the_others_hanging():
    pool = ring.RankPool(2, timeout=2.0)
    try:
        with pytest.raises(ring.RankError, match=r"failed on ranks \[0, 1\]"):
            pool.run(ring.fail_on_rank, [(1,), (1,)])  # rank 0: timed out
        assert pool.closed and pool.alive() == 0
        with pytest.raises(ValueError, match="closed"):
            pool.run(ring.fail_on_rank, [(1,), (1,)])
    finally:
        pool.close()


def test_the_pool_refuses_bad_settings():
    for kwargs, match in [
        ({"P": 0}, "P must be an integer >= 1"),
        ({"P": 2, "timeout": 0}, "timeout must be a positive number"),
        ({"P": 2, "timeout": math.inf}, "timeout must be a positive number"),
        ({"P": 2, "threads": 1.5}, "threads must be an integer >= 1"),
    ]:
        with pytest.raises(ValueError, match=match):
            ring.RankPool(**kwargs)


def test_pack_and_unpack_carry_tensors_through_a_queue():
    X = torch.arange(6.0).reshape(2, 3).t()  # not contiguous
    obj = (X, [1, "tensor"], {"a": X[0]})
    back = ring.unpack(ring.pack(obj))
    assert torch.equal(back[0], X) and back[1] == [1, "tensor"]
    assert torch.equal(back[2]["a"], X[0])


@pytest.mark.skipif(sys.platform != "linux", reason="Linux's /proc and lo")
def test_the_ranks_talk_over_the_loopback_interface_only(pool):
    """Every TCP socket of every rank (gloo's connections) is bound to a
    loopback address; the rendezvous is a file, so no socket listens on
    another interface (fresh review of chapter 17, round 1)."""
    assert ring.loopback() == "lo"
    addresses = pool.run(ring.socket_addresses, [()] * 4)
    assert all(addresses), addresses  # gloo's connections are there
    assert {a for rank in addresses for a in rank} <= {"127.0.0.1", "::1"}
    with socket.socket() as s:  # the parent's own, as a reference
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert "127.0.0.1" in ring.socket_addresses()


def test_proc_addresses_are_read_in_host_order():
    assert ring.address("0100007F") == "127.0.0.1"
    assert ring.address("0202000A") == "10.0.2.2"
    assert ring.address("00000000000000000000000001000000") == "::1"


def test_merge_of_two_parts_without_keys_is_zero_not_nan():
    C = torch.zeros(2, 3, 4, dtype=torch.float64)
    lse = torch.full((2, 3), -math.inf, dtype=torch.float64)
    out, out_lse = ring.merge(C, lse, C, lse)
    assert torch.equal(out, C) and torch.equal(out_lse, lse)
    bad = lse.clone()
    bad[0, 1] = math.nan
    with pytest.raises(ValueError, match="lse_1 holds NaN"):
        ring.merge(C, bad, C, lse)


def test_non_finite_inputs_are_named_before_any_rank_runs(pool):
    """A NaN on one rank's slice made that rank alone fail in fast_attention:
    a RankError and a closed pool (fresh review, round 2); now a
    ValueError in the parent, the pool still open."""
    Q, K, V = torch.randn(3, 1, 2, 8, 4, dtype=torch.float64)
    for name in "QKV":
        bad = {"Q": Q, "K": K, "V": V}
        bad[name] = bad[name].clone()
        bad[name][0, 0, 1, 2] = math.nan
        match = f"^{name} must be floating point and finite"
        with pytest.raises(ValueError, match=match):
            ring.ring_attention(pool, bad["Q"], bad["K"], bad["V"], 4)
    C, lse, _ = ring.ring_attention(pool, Q, K, V, 4)
    dC = torch.full_like(C, math.inf)
    with pytest.raises(ValueError, match="dC holds NaN or an infinity"):
        ring.ring_gradients(pool, Q, K, V, C, lse, dC, 4)
    assert not pool.closed


@pytest.mark.parametrize(
    "rank, match",
    [(5, "rank 5 of P = 2"), (-1, "rank -1 of P = 2"), (1.0, "integer")],
)
def test_rank_pieces_refuses_ranks_outside_the_group(rank, match):
    for split in ring.SPLITS:
        with pytest.raises(ValueError, match=match):
            ring.rank_pieces(8, 2, split, rank)


def test_merge_names_outputs_without_a_value_axis():
    scalar = torch.zeros((), dtype=torch.float64)
    with pytest.raises(ValueError, match="need an axis of values"):
        ring.merge(scalar, scalar, scalar, scalar)


def test_ring_gradients_name_inputs_of_the_wrong_shape(pool):
    Q, K, V = torch.randn(3, 1, 2, 8, 4, dtype=torch.float64)
    C, lse, dC = Q.clone(), Q[..., 0].clone(), Q.clone()
    for args, match in (
        ((C, lse[..., :5], dC), "lse must have shape"),
        ((C, lse, dC[..., :5, :]), "dC must have shape"),
        ((C[..., :3], lse, dC), "C must have shape"),
        ((C.float(), lse, dC), "C is torch.float32"),
    ):
        with pytest.raises(ValueError, match=match):
            ring.ring_gradients(pool, Q, K, V, *args, 4)


def test_peak_memory_is_read_in_bytes(pool):
    peaks = pool.run(ring.peak_rss, [()] * 4)
    assert all(p > 50e6 and p % 1024 == 0 for p in peaks)  # torch is loaded


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: ring.ring_bytes(8, 2, "contiguous", (1,), -4, 2), "d_k"),
        (
            lambda: ring.ring_bytes(8, 2, "contiguous", (1,), 4, 2, 0),
            "itemsize",
        ),
        (lambda: ring.ring_bytes(8, 2, "contiguous", [1], 4, 2), "batch"),
        (lambda: ring.ulysses_bytes(8, 2, (1,), 0, 4, 4), "H"),
        (lambda: ring.ulysses_bytes(8, 2, (1,), 2, 4, 0), "d_v"),
    ],
)
def test_the_byte_formulas_refuse_sizes_below_one(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_the_byte_formulas_refuse_what_cannot_run():
    with pytest.raises(ValueError, match="H divisible by P: H = 6, P = 4"):
        ring.ulysses_bytes(16, 4, (1,), 6, 8, 8)
    with pytest.raises(ValueError, match="P = 5 processes for T = 4"):
        ring.ring_bytes(4, 5, "zigzag", (1,), 8, 8)
