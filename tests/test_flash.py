"""book/flash.py: chapter 8's fast tiled forward pass, moved into the module
that chapter 8 imports and prints, checked against an independent naive
program and PyTorch's fused kernel (F.scaled_dot_product_attention)."""

import pytest
import torch
import torch.nn.functional as F
from conftest import BOOK  # noqa: F401  (puts book/ on sys.path)
from torch.testing import assert_close

import flash
import gpt
from explorer import attention_explorer

ATOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def qkv(T, S=None, d=16, d_v=None, batch=(2, 3), dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    S = T if S is None else S
    d_v = d if d_v is None else d_v
    return (
        torch.randn(*batch, T, d, generator=gen, dtype=dtype),
        torch.randn(*batch, S, d, generator=gen, dtype=dtype),
        torch.randn(*batch, S, d_v, generator=gen, dtype=dtype),
    )


def naive(q, k, v, causal=False):
    """softmax(q k^T / sqrt(d_k)) v with the whole score matrix; causal:
    query i sees keys 0 .. i (top-left, as SDPA's is_causal)."""
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if causal:
        T_q, T_k = scores.shape[-2:]
        seen = torch.ones(T_q, T_k, dtype=torch.bool).tril()
        scores = scores.masked_fill(~seen, float("-inf"))
    return scores.softmax(dim=-1) @ v


# --- chapter 8's fast forward: the margin and the exact recompute -------------


def count_fast_rows(monkeypatch):
    """Wrap the chapter's fast_row: the list of the `lazy` flag of each call
    (True: the lazy reference; False: the exact recompute of a row block)."""
    calls, fast_row = [], flash.fast_row

    def counting(*args):
        calls.append(args[-2])  # lazy
        return fast_row(*args)

    monkeypatch.setattr(flash, "fast_row", counting)
    return calls


@pytest.mark.parametrize("base2", [False, True])
def test_fast_recomputes_exactly_when_the_margin_is_exceeded(
    monkeypatch, base2
):
    """One query, keys 0 and 1 with scores 0 and s: the row sum relative to
    key 0's score is 1 + exp(s). Up to 2 ** MARGIN = 2 ** 20 (s < 13.86) the
    lazy row is kept; above, the row block is computed again, exactly."""
    assert flash.MARGIN == 20
    calls = count_fast_rows(monkeypatch)
    for s, recomputed in ((13.3, False), (14.3, True), (5.0, False)):
        q = torch.ones(1, 1, 1, dtype=torch.float64)
        k = torch.tensor([[[0.0], [s]]], dtype=torch.float64)
        v = torch.tensor([[[1.0], [2.0]]], dtype=torch.float64)
        calls.clear()
        got = flash.fast_attention(q, k, v, levers={"base2": base2})
        assert calls == ([True, False] if recomputed else [True]), s
        assert_close(got, naive(q, k, v), rtol=0, atol=1e-12)


def test_fast_recomputes_only_the_row_blocks_that_need_it(monkeypatch):
    """Random scores stay within the margin: no row block is recomputed.
    Scores rising 300 above key 0's: every row block is, once."""
    calls = count_fast_rows(monkeypatch)
    q, k, v = qkv(64, d=8, batch=(2,), dtype=torch.float32)
    flash.fast_attention(q, k, v, B_r=16, B_c=16)
    assert calls == [True] * 4
    calls.clear()
    q, k, v = late_rising_scores(64, 300.0, torch.float32)
    got = flash.fast_attention(q, k, v, B_r=16, B_c=16)
    assert calls == [True, False] * 4
    assert_close(got, naive(q, k, v), rtol=0, atol=1e-5)


def test_the_lazy_lever_picks_the_path(monkeypatch):
    """levers={"lazy": False}: every row block is computed once, with the
    reference raised to each tile's maximum (fast_row's exact path), and
    raise_reference runs once per tile; lazy (the default) never calls it
    on scores within the margin."""
    calls = count_fast_rows(monkeypatch)
    raised, raise_reference = [], flash.raise_reference

    def counting(*args):
        raised.append(1)
        return raise_reference(*args)

    monkeypatch.setattr(flash, "raise_reference", counting)
    q, k, v = qkv(64, d=8, batch=(2,), dtype=torch.float64)
    exact = flash.fast_attention(
        q, k, v, B_r=16, B_c=16, levers={"lazy": False}
    )
    assert calls == [False] * 4 and len(raised) == 16  # 4 x 4 tiles
    calls.clear(), raised.clear()
    lazy = flash.fast_attention(q, k, v, B_r=16, B_c=16)
    assert calls == [True] * 4 and raised == []
    assert_close(exact, lazy, rtol=0, atol=1e-12)
    assert_close(exact, naive(q, k, v), rtol=0, atol=1e-12)


# --- the fast tiled attention ---------------------------------------------------

ALL_LEVERS = ["as set", "all on", "all off"] + [
    f"toggle {name}" for name in ("base2", "inside", "ones", "lazy")
]


def levers_of(name):
    """The levers argument: the chapter's own, all on, all off, or the
    chapter's with one change toggled."""
    if name.startswith("all"):
        return dict.fromkeys(flash.LEVERS, name == "all on")
    lever = name.removeprefix("toggle ")
    return {lever: not flash.LEVERS[lever]} if lever in flash.LEVERS else {}


# lengths that are and are not multiples of the tile sides, tiles of one
# query and key, odd tiles, tiles larger than the sequence
FAST_CASES = [
    (1, 1, 1), (1, 512, 512), (2, 1, 1), (17, 1, 1), (17, 3, 5),
    (17, 16, 16), (97, 3, 5), (97, 7, 64), (97, 512, 512), (200, 16, 16),
    (200, 7, 64),
]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T, B_r, B_c", FAST_CASES)
def test_fast_equals_naive(T, B_r, B_c, causal, dtype):
    q, k, v = qkv(T, dtype=dtype, seed=T + 1)
    expected = naive(q, k, v, causal)
    for levers in ALL_LEVERS:  # every setting of the changes
        got = flash.fast_attention(
            q, k, v, causal, B_r, B_c, levers_of(levers)
        )
        assert got.dtype == dtype and got.shape == expected.shape
        assert_close(got, expected, rtol=0, atol=ATOL[dtype], msg=levers)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("L, S", [(5, 40), (40, 5), (33, 100), (1, 9)])
def test_fast_cross_attention_lengths(L, S, causal):
    q, k, v = qkv(L, S, d=8, d_v=5, batch=(3,))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    for levers in ALL_LEVERS:
        got = flash.fast_attention(q, k, v, causal, 4, 6, levers_of(levers))
        assert_close(got, expected, rtol=0, atol=1e-12, msg=levers)


@pytest.mark.parametrize("causal", [False, True])
def test_fast_float32_at_benchmark_shape(causal):
    """T = 2500 (no multiple of the tiles), 8 heads, d_k = 64, the default
    tiles: within 1e-5 of the fused kernel (an independent program) in
    float32."""
    q, k, v = qkv(2500, d=64, batch=(1, 8), dtype=torch.float32)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert_close(
        flash.fast_attention(q, k, v, causal), expected, rtol=0, atol=1e-5
    )


def late_rising_scores(T, top, dtype, seed=0):
    """One query row per head whose scores wander in [-8, 8] and then climb
    to `top` over the last keys: the last key tile holds the largest score
    by far, much more than MARGIN (base 2) above key 0's."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.rand(2, T, generator=gen, dtype=dtype) * 16 - 8
    s[:, -40:] = torch.linspace(0.0, top, 40, dtype=dtype)
    q = torch.zeros(2, T, 2, dtype=dtype)
    q[..., 0] = 2**0.5  # score q . k / sqrt(2) = s
    k = torch.zeros(2, T, 2, dtype=dtype)
    k[..., 0] = s
    v = torch.randn(2, T, 3, generator=gen, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize(
    "levers", ["as set", "all on", "all off", "toggle lazy"]
)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "dtype, top", [(torch.float32, 300.0), (torch.float64, 1000.0)]
)
def test_fast_maxima_rising_late(dtype, top, causal, levers):
    """Every term above the margin, and 2 ** (top log2 e) overflows: only a
    row of tiles recomputed with the exact reference gives the answer."""
    q, k, v = late_rising_scores(200, top, dtype)
    expected = naive(q, k, v, causal)
    assert torch.isfinite(expected).all()
    for B_r, B_c in ((16, 16), (7, 50), (512, 512), (200, 30)):
        got = flash.fast_attention(
            q, k, v, causal, B_r, B_c, levers_of(levers)
        )
        assert_close(got, expected, rtol=0, atol=ATOL[dtype])


def test_fast_moderate_rise_within_float32():
    """Scores 60 above key 0's: 2 ** 86 does not overflow float32, so only
    the margin check (not an infinity) sends the rows to the exact path."""
    q, k, v = late_rising_scores(100, 60.0, torch.float32)
    expected = naive(q, k, v)
    got = flash.fast_attention(q, k, v, B_r=8, B_c=16)
    assert_close(got, expected, rtol=0, atol=1e-5)


def test_fast_large_scores_do_not_overflow():
    q, k, v = qkv(50, dtype=torch.float32)
    got = flash.fast_attention(300.0 * q, k, v, B_r=8, B_c=8)
    assert torch.isfinite(got).all()
    expected = naive(300.0 * q, k, v)
    assert_close(got, expected, rtol=0, atol=1e-4)


def test_fast_large_values_do_not_overflow():
    """Terms up to about 2 ** 16 pass the margin check on the sums, and
    values of 1e35 then overflow float32 in the accumulator: the check must
    also require finite accumulators, and send those rows to the exact path."""
    q, k, v = late_rising_scores(100, 11.0, torch.float32)
    k[:, 0, 0] = 0.0  # key 0's score is 0, the others at most 11
    v = v * 1e35
    got = flash.fast_attention(q, k, v, B_r=8, B_c=16)
    expected = naive(q, k, v)
    assert torch.isfinite(expected).all() and torch.isfinite(got).all()
    assert_close(got / 1e35, expected / 1e35, rtol=0, atol=1e-5)


@pytest.mark.parametrize("levers", ALL_LEVERS)
def test_fast_causal_outputs_ignore_the_future(levers):
    """Masked keys get weight 0: values of 1e300 after t do not move the
    outputs up to t beyond rounding (a row block that meets large future
    scores takes the exact path, so the bits may differ, not the values)."""
    q, k, v = qkv(30)
    k2, v2 = k.clone(), v.clone()
    k2[..., 13:, :] = 50.0 * torch.randn_like(k2[..., 13:, :])
    v2[..., 13:, :] = 1e300
    args = (True, 4, 6, levers_of(levers))
    a = flash.fast_attention(q, k, v, *args)
    b = flash.fast_attention(q, k2, v2, *args)
    assert_close(a[..., :13, :], b[..., :13, :], rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "levers, message",
    [
        ({"speed": True}, "levers must be a dict with keys from"),
        ({"lazy": 1}, "True or False"),
        ([("lazy", False)], "levers must be a dict"),
    ],
)
def test_fast_rejects_bad_levers(levers, message):
    q, k, v = qkv(10)
    with pytest.raises(ValueError, match=message):
        flash.fast_attention(q, k, v, levers=levers)


@pytest.mark.parametrize("kwargs", [{"B_r": 0}, {"B_c": 2.5}, {"B_c": True}])
def test_fast_rejects_bad_block_sizes(kwargs):
    q, k, v = qkv(10)
    with pytest.raises(ValueError, match="must be a positive integer"):
        flash.fast_attention(q, k, v, **kwargs)


def test_fast_rejects_bad_tensors():
    q, k, v = qkv(10)
    with pytest.raises(ValueError, match="NaN or infinite"):
        flash.fast_attention(q, k.clone().fill_(float("inf")), v)
    with pytest.raises(ValueError, match="one dtype"):
        flash.fast_attention(q, k.float(), v)
    with pytest.raises(ValueError, match="floating-point torch tensor"):
        flash.fast_attention(q, k, v.numpy())


# --- the log-sum-exp of the forward ---------------------------------------------


def lse_of(q, k, causal=False, offset=0):
    """log sum_j exp(e_ij) over the keys query i sees, from whole scores."""
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if causal:
        T_q, T_k = scores.shape[-2:]
        seen = torch.ones(T_q, T_k, dtype=torch.bool).tril(offset)
        scores = scores.masked_fill(~seen, float("-inf"))
    return scores.logsumexp(dim=-1)


@pytest.mark.parametrize("levers", ALL_LEVERS)
@pytest.mark.parametrize("causal, offset", [(False, 0), (True, 0), (True, 9)])
def test_forward_returns_the_log_sum_exp(levers, causal, offset):
    """With every setting of the changes (base-2 exponentials included), the
    lse is log sum exp of the visible scores; C is what it was without it."""
    q, k, v = qkv(31, 40, d=8, d_v=5)
    args = (q, k, v, causal, 8, 16, levers_of(levers), offset)
    C, lse = flash.fast_attention(*args, return_lse=True)
    assert lse.shape == (2, 3, 31) and lse.dtype == q.dtype
    assert_close(lse, lse_of(q, k, causal, offset), rtol=0, atol=1e-12)
    assert torch.equal(C, flash.fast_attention(*args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_log_sum_exp_after_an_exact_recompute(dtype):
    """Rows sent to the exact path (scores climbing to `top`) raise their
    reference: the lse must follow it, not key 0's score."""
    q, k, v = late_rising_scores(200, 60.0, dtype)
    for causal in (False, True):
        _, lse = flash.fast_attention(q, k, v, causal, 16, 16, return_lse=True)
        assert_close(lse, lse_of(q, k, causal), rtol=0, atol=ATOL[dtype])


# --- the tiled backward pass and the autograd function --------------------------

# SDPA's masks: None, top-left (is_causal), bottom-right (causal_lower_right)
MASKS = [False, "top-left", "bottom-right"]


def sdpa(q, k, v, causal):
    """F.scaled_dot_product_attention with the mask `causal` names."""
    from torch.nn.attention.bias import causal_lower_right

    if causal == "bottom-right":
        mask = causal_lower_right(q.shape[-2], k.shape[-2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))


def gradients(fn, q, k, v, dC, causal):
    """(output, dQ, dK, dV) of fn(q, k, v, causal) for the output gradient dC."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, causal)
    out.backward(dC)
    return out.detach(), q.grad, k.grad, v.grad


# (T_q, T_k, B_r, B_c): T_q != T_k both ways, lengths no multiple of the
# tiles, one query, tiles larger than the sequence, and T_q == T_k
GRADIENT_CASES = [
    (37, 50, 16, 8), (50, 37, 7, 9), (13, 64, 5, 16), (1, 9, 4, 4),
    (100, 100, 16, 32), (257, 300, 64, 128), (40, 45, 512, 512),
]  # fmt: skip


@pytest.mark.parametrize("causal", MASKS)
@pytest.mark.parametrize("T_q, T_k, B_r, B_c", GRADIENT_CASES)
def test_gradients_equal_sdpa_float64(T_q, T_k, B_r, B_c, causal):
    """Output and dQ, dK, dV within 1e-10 of SDPA's in float64 (keys that
    no query sees get exactly 0, as SDPA's)."""
    q, k, v = qkv(T_q, T_k, d=16, d_v=8, seed=T_q + T_k)
    if causal == "bottom-right" and T_q > T_k:  # the first query: no key
        with pytest.raises(ValueError, match="T_q <= T_k"):
            flash.flash_attention(q, k, v, causal, B_r, B_c)
        return
    dC = torch.randn(2, 3, T_q, 8, dtype=torch.float64)

    def ours(q, k, v, causal):
        return flash.flash_attention(q, k, v, causal, B_r, B_c)

    for got, expected in zip(
        gradients(ours, q, k, v, dC, causal),
        gradients(sdpa, q, k, v, dC, causal),
    ):
        assert_close(got, expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("causal", MASKS)
def test_gradients_equal_sdpa_float32_default_tiles(causal):
    """At the default tiles, 8 heads, d_k = 64, T = 700 and 1100 keys:
    float32 rounding only."""
    q, k, v = qkv(700, 1100, d=64, batch=(1, 8), dtype=torch.float32)
    dC = torch.randn(1, 8, 700, 64)
    ours = gradients(flash.flash_attention, q, k, v, dC, causal)
    for got, expected in zip(ours, gradients(sdpa, q, k, v, dC, causal)):
        assert_close(got, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    "causal, T_q, T_k",
    [(False, 5, 7), (True, 7, 5), ("top-left", 4, 9), ("bottom-right", 3, 8)],
)
def test_gradcheck_float64(causal, T_q, T_k):
    """torch.autograd.gradcheck on small odd shapes, tiles of 2 x 3."""
    q, k, v = (
        t.requires_grad_() for t in qkv(T_q, T_k, d=3, d_v=5, batch=(2,))
    )
    assert torch.autograd.gradcheck(
        lambda q, k, v: flash.flash_attention(q, k, v, causal, 2, 3), (q, k, v)
    )


@pytest.mark.parametrize("base2", [True, False])
@pytest.mark.parametrize("inside", [True, False])
def test_backward_alone_equals_autograd_of_the_naive_program(inside, base2):
    """flash_backward from a forward's C and lse, against autograd through
    whole score matrices (no SDPA involved), top-left causal; with lse_i and
    D_i folded into the products (inside) or subtracted from each tile."""
    q, k, v = qkv(29, 29, d=8, d_v=6)
    dC = torch.randn(2, 3, 29, 6, dtype=torch.float64)
    C, lse = flash.fast_attention(q, k, v, True, 4, 8, return_lse=True)
    got = flash.flash_backward(
        q, k, v, C, lse, dC, True, 4, 8, 0, inside, base2
    )
    expected = gradients(naive, q, k, v, dC, True)[1:]
    for name, a, b in zip("QKV", got, expected):
        assert_close(a, b, rtol=0, atol=1e-12, msg=f"d{name}")


def test_bottom_right_is_top_left_shifted():
    """bottom-right: query i sees keys 0 .. i + T_k - T_q, so the last query
    sees every key and the first T_k - T_q + 1 of them the first."""
    q, k, v = qkv(4, 10, d=8)
    got = flash.flash_attention(q, k, v, "bottom-right")
    assert_close(
        got[..., -1, :], naive(q, k, v)[..., -1, :], rtol=0, atol=1e-12
    )
    first = naive(q[..., :1, :], k[..., :7, :], v[..., :7, :])
    assert_close(got[..., :1, :], first, rtol=0, atol=1e-12)


# --- what the backward needs: the saved tensors ---------------------------------


@pytest.mark.parametrize("causal", MASKS)
def test_saved_for_backward_are_the_inputs_output_and_lse(causal):
    """flash_attention saves Q, K, V, C and the log-sum-exp, nothing of size
    T_q x T_k; the naive program saves its T_q x T_k weights."""
    q, k, v = (t.requires_grad_() for t in qkv(30, 40, d=8, d_v=4))
    total, shapes = flash.saved_bytes(flash.flash_attention, q, k, v, causal)
    expected = [(2, 3, 30, 8), (2, 3, 40, 8), (2, 3, 40, 4), (2, 3, 30, 4)]
    assert sorted(shapes) == sorted([*expected, (2, 3, 30)])
    assert total == 8 * (2 * 3) * (30 * 8 + 40 * 8 + 40 * 4 + 30 * 4 + 30)
    assert not any(shape[-2:] == (30, 40) for shape in shapes)
    total_naive, shapes_naive = flash.saved_bytes(naive, q, k, v)
    assert any(shape[-2:] == (30, 40) for shape in shapes_naive)
    assert total_naive == 8 * 6 * (30 * 40 + 30 * 8 + 40 * 8 + 40 * 4)


def test_saved_bytes_counts_a_storage_once():
    """Two views of one tensor, saved by two operations, are one storage."""
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    y = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)

    def f(x, y):
        w = x.exp()  # saves its result, w
        return (w @ y.T).sum() + w.view(5, 6).sin().sum()  # w, y, w.view

    total, shapes = flash.saved_bytes(f, x, y)
    assert total == 8 * 2 * 30  # w and y
    assert len(shapes) == 2


# --- bad input -------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, T_q, message",
    [
        ({"causal": "lower-right"}, 10, "causal must be False, True"),
        ({"causal": 1}, 10, "causal must be False, True"),
        ({"causal": "bottom-right"}, 12, "T_q <= T_k"),
        ({"B_r": 0}, 10, "B_r must be a positive integer"),
        ({"B_c": 2.5}, 10, "B_c must be a positive integer"),
    ],
)
def test_flash_attention_rejects_bad_arguments(kwargs, T_q, message):
    q, k, v = qkv(T_q, 10)
    with pytest.raises(ValueError, match=message):
        flash.flash_attention(q, k, v, **kwargs)


def test_flash_attention_rejects_bad_tensors():
    q, k, v = qkv(10)
    with pytest.raises(ValueError, match="NaN or infinite"):
        flash.flash_attention(q, k.clone().fill_(float("nan")), v)
    with pytest.raises(ValueError, match="one dtype"):
        flash.flash_attention(q, k.float(), v)
    with pytest.raises(ValueError, match="floating-point torch tensor"):
        flash.flash_attention(q, k, v.numpy())
    with pytest.raises(ValueError, match="same size d_k"):
        flash.flash_attention(q, k[..., :4], v)


@pytest.mark.parametrize(
    "Q, message",
    [
        (
            torch.randn(10, dtype=torch.float64),
            r"Q must have shape \(\.\.\., T, size\)",
        ),
        ([[1.0, 2.0]], "floating-point torch tensor"),
        (None, "floating-point torch tensor"),
    ],
)
def test_bottom_right_checks_the_tensors_before_reading_their_shapes(
    Q, message
):
    """The bottom-right mask reads T_q and T_k: it raised IndexError or
    AttributeError on tensors that fast_attention would have refused."""
    q, k, v = qkv(10)
    with pytest.raises(ValueError, match=message):
        flash.flash_attention(Q, k, v, causal="bottom-right")
    with pytest.raises(ValueError, match=r"K must have shape"):
        flash.flash_attention(q, k[0, 0, 0], v, causal="bottom-right")


@pytest.mark.parametrize("causal", [False, True, "bottom-right"])
def test_no_query_gives_an_empty_result_and_zero_gradients(causal):
    """As SDPA: an empty output, an empty log-sum-exp; dK and dV are 0."""
    q, k, v = (t.requires_grad_() for t in qkv(0, 7, d_v=5))
    out = flash.flash_attention(q, k, v, causal)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal is True)
    assert out.shape == want.shape == (2, 3, 0, 5)
    out.sum().backward()
    assert q.grad.shape == (2, 3, 0, 16)
    assert not k.grad.any() and not v.grad.any()
    C, lse = flash.fast_attention(q, k, v, bool(causal), return_lse=True)
    assert C.shape == (2, 3, 0, 5) and lse.shape == (2, 3, 0)


@pytest.mark.parametrize("causal", [False, True, "bottom-right"])
def test_flash_attention_refuses_d_k_zero(causal):
    """d_k = 0 would divide the scores by sqrt(0): a ValueError naming d_k,
    not a ZeroDivisionError."""
    q, k, v = qkv(4, 5, d_v=3)
    with pytest.raises(ValueError, match="d_k >= 1"):
        flash.flash_attention(q[..., :0], k[..., :0], v, causal)


def test_fast_attention_and_backward_refuse_d_k_zero():
    """d_k = 0: a ValueError naming d_k from the forward and the backward,
    not a ZeroDivisionError (issue 47); SDPA gives the mean of the values."""
    q, k, v = qkv(4, 5, d=0, d_v=3)
    C = torch.zeros(2, 3, 4, 3, dtype=torch.float64)
    lse = torch.zeros(2, 3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="got d_k = 0"):
        flash.fast_attention(q, k, v)
    with pytest.raises(ValueError, match="got d_k = 0"):
        flash.flash_backward(q, k, v, C, lse, torch.ones_like(C))


# --- review of the shared checks (issue 47, fresh review F2-F5) ---------------


def flash_programs(q, k, v):
    """flash_attention, fast_attention and flash_backward on q, k, v (the
    backward with C, lse and dC of their shapes, on q's device)."""
    C = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.zeros(q.shape[:-1], dtype=q.dtype, device=q.device)
    return [
        lambda: flash.flash_attention(q, k, v),
        lambda: flash.fast_attention(q, k, v),
        lambda: flash.flash_backward(q, k, v, C, lse, torch.ones_like(C)),
    ]


def test_programs_refuse_tensors_on_other_devices():
    """K on the meta device raised RuntimeError (the forward) or
    NotImplementedError (the backward); all three on it as well: the
    buffers are on the CPU."""
    q, k, v = qkv(5)
    for run in flash_programs(q, k.to("meta"), v):
        with pytest.raises(ValueError, match="one device"):
            run()
    meta = [t.to("meta") for t in (q, k, v)]
    for run in flash_programs(*meta):
        with pytest.raises(ValueError, match="on the CPU"):
            run()
    C, lse = flash.fast_attention(q, k, v, return_lse=True)
    for i, name in enumerate(("C", "lse", "dC")):
        args = [C, lse, torch.ones_like(C)]
        args[i] = args[i].to("meta")
        with pytest.raises(ValueError, match=f"{name} is .* on meta, Q is"):
            flash.flash_backward(q, k, v, *args)


@pytest.mark.parametrize("Q", [[[1.0, 2.0]], None, 1.5])
def test_check_qkv_names_what_has_no_shape(Q):
    """flash.check_qkv (NumPy arrays or tensors) raised AttributeError."""
    _, k, v = qkv(3)
    with pytest.raises(
        ValueError, match=r"Q must have shape \(\.\.\., T, size\)"
    ):
        flash.check_qkv(Q, k, v)


def test_no_query_and_no_key_is_refused():
    """T_q = T_k = 0 passes the shared check (an empty result there); flash's
    check_qkv refuses it: without that check flash_attention and
    fast_attention raise RuntimeError, flash_backward returns empty
    gradients."""
    q, k, v = qkv(0, 0, d_v=5)
    for run in flash_programs(q, k, v):
        with pytest.raises(
            ValueError, match="attention needs at least one key"
        ):
            run()


def test_batches_that_only_broadcast_are_refused():
    """Q (1, 4, 3) with K and V (2, 4, 3) broadcast, but the programs
    reshape to one batch-and-heads axis: same_batch=True refuses them."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 3, generator=gen, dtype=torch.float64)
    k, v = (
        torch.randn(2, 4, 3, generator=gen, dtype=torch.float64) for _ in "kv"
    )
    for run in flash_programs(q, k, v):
        with pytest.raises(ValueError, match="mismatched batches"):
            run()


def backward_inputs(T=9):
    q, k, v = qkv(T, d_v=5)
    C, lse = flash.fast_attention(q, k, v, return_lse=True)
    return q, k, v, C, lse, torch.ones_like(C)


def test_flash_backward_refuses_bad_inputs():
    q, k, v, C, lse, dC = backward_inputs()
    cases = [
        ((q, k, v, C[..., :4], lse, dC), r"C must have shape \(2, 3, 9, 5\)"),
        ((q, k, v, C, lse[..., :8], dC), r"lse must have shape \(2, 3, 9\)"),
        ((q, k, v, C, lse, dC[:1]), r"dC must have shape"),
        ((q, k, v, C, lse, dC.float()), "dC is torch.float32 on cpu, Q is"),
        ((q, k, v, C, lse.float(), dC), "lse is torch.float32"),
        ((q, k, v, C, lse, dC.numpy()), "dC must be a torch tensor"),
        ((q, k[..., :4], v, C, lse, dC), "same size d_k"),
        ((q, k.float(), v, C, lse, dC), "one dtype"),
        ((q.long(), k.long(), v.long(), C, lse, dC), "floating-point"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            flash.flash_backward(*args)
    for kwargs, message in [
        ({"inside": 1}, "inside must be True or False"),
        ({"base2": None}, "base2 must be True or False"),
        ({"causal": "yes"}, "causal must be True or False"),
        ({"offset": -1}, "offset -1 < 0"),
        ({"B_r": 0}, "B_r must be a positive integer"),
    ]:
        with pytest.raises(ValueError, match=message):
            flash.flash_backward(q, k, v, C, lse, dC, **kwargs)


def test_flash_backward_of_no_query():
    q, k, v, C, lse, dC = backward_inputs()
    dQ, dK, dV = flash.flash_backward(
        q[..., :0, :], k, v, C[..., :0, :], lse[..., :0], dC[..., :0, :]
    )
    assert dQ.shape == (2, 3, 0, 16) and not dK.any() and not dV.any()


def test_tile_schedule_refuses_bad_lengths_and_masks():
    assert flash.tile_schedule(0, 5, 4, 4, causal=True) == []
    for args, message in [
        ((-1, 5, 4, 4), "T_q must be an integer >= 0"),
        ((5, 2.0, 4, 4), "T_k must be an integer >= 0"),
        ((5, 0, 4, 4), "at least one key"),
        ((5, 5, 4, 4, "causal"), "causal must be True or False"),
        ((5, 5, 4, 4, True, -2), "offset -2 < 0"),
        ((5, 5, 4, 4, True, 1.0), "offset must be an integer"),
    ]:
        with pytest.raises(ValueError, match=message):
            flash.tile_schedule(*args)


def test_choose_tile_and_saved_bytes_refuse_bad_arguments():
    one = {(64, 64): (0.9, 0.8, 0.95)}
    for intervals in (
        [((64, 64), (0.9, 0.8, 0.95))],
        {64: 0.9},
        {(64, 0): 0.9},
    ):
        with pytest.raises(ValueError, match="intervals"):
            flash.choose_tile(intervals, [64, 64])
    for value in ("0.9", (0.9, 0.8), (0.9, float("nan"), 1.0), 0.9):
        with pytest.raises(ValueError, match="three positive numbers"):
            flash.choose_tile({(64, 64): value}, [64, 64])
    with pytest.raises(ValueError, match="must hold its median"):
        flash.choose_tile({(64, 64): (0.9, 0.95, 0.99)}, [64, 64])
    for current in ([64, 128], 64, None, [[64], 64]):
        with pytest.raises(ValueError, match="not in the sweep"):
            flash.choose_tile(one, current)
    with pytest.raises(ValueError, match="fn must be a function"):
        flash.saved_bytes(torch.ones(3))


@pytest.mark.parametrize("offset", [-1, 1.5, True])
def test_fast_attention_rejects_bad_offsets(offset):
    q, k, v = qkv(10)
    with pytest.raises(ValueError, match="offset"):
        flash.fast_attention(q, k, v, True, offset=offset)


# --- SelfAttention's "flash" backend (book/transformer.py) ----------------------


def layers(kind, G, causal, seed=0, backend="flash"):
    """The same float64 layer twice: backend "attend", then `backend`."""
    import copy

    import transformer

    torch.manual_seed(seed)
    cls = getattr(transformer, kind)
    plain = cls(32, 4, G, causal).double()
    tiled = copy.deepcopy(plain)
    tiled.backend = backend
    return plain, tiled


def run(layer, x, dout, cache=None):
    """Output, and the gradients of x and of every parameter, for dout."""
    x = x.detach().clone().requires_grad_()
    layer.zero_grad()
    out, weights = layer(x, cache=cache)
    out.backward(dout)
    grads = [x.grad] + [p.grad for p in layer.parameters()]
    return out.detach(), weights, grads


@pytest.mark.parametrize("backend", ["flash", "sdpa"])
@pytest.mark.parametrize("kind", ["SelfAttention", "RotarySelfAttention"])
@pytest.mark.parametrize("G", [None, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_self_attention_backend_equals_the_default(kind, G, causal, backend):
    """Same outputs and gradients (input and parameters) as backend
    "attend", grouped key/value heads included; no weights returned."""
    plain, tiled = layers(kind, G, causal, backend=backend)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 13, 32, generator=gen, dtype=torch.float64)
    dout = torch.randn(2, 13, 32, generator=gen, dtype=torch.float64)
    out, weights, grads = run(plain, x, dout)
    got, no_weights, got_grads = run(tiled, x, dout)
    assert weights is not None and no_weights is None
    assert_close(got, out, rtol=0, atol=1e-12)
    for a, b in zip(got_grads, grads):
        assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize("backend", ["flash", "sdpa"])
@pytest.mark.parametrize("causal", [False, True])
def test_self_attention_backend_with_a_growing_cache(causal, backend):
    """A prefill of 6 tokens, then 5 more through the cache (T_q < T_k: the
    bottom-right mask), then one: the default backend's outputs."""
    from transformer import KVCache

    plain, tiled = layers("RotarySelfAttention", 2, causal, backend=backend)
    x = torch.randn(1, 12, 32, dtype=torch.float64)
    caches = KVCache(), KVCache()
    for start, end in ((0, 6), (6, 11), (11, 12)):
        with torch.no_grad():
            out, _ = plain(x[:, start:end], cache=caches[0])
            got, weights = tiled(x[:, start:end], cache=caches[1])
        assert weights is None
        assert_close(got, out, rtol=0, atol=1e-12)


def test_self_attention_backend_refuses_what_it_cannot_do():
    import transformer

    x = torch.randn(1, 5, 32)
    with pytest.raises(ValueError, match="backend must be one of"):
        transformer.SelfAttention(32, 4, backend="tiles")
    windowed = transformer.SelfAttention(32, 4, causal=True, w=3)
    windowed.backend = "flash"
    with pytest.raises(ValueError, match="no mask and no window"):
        windowed(x)
    layer = transformer.SelfAttention(32, 4, backend="flash")
    with pytest.raises(ValueError, match="no mask and no window"):
        layer(x, mask=torch.ones(5, 5, dtype=torch.bool))
    block = transformer.EncoderBlock(32, 4, 64, backend="sdpa")
    assert block(x).shape == x.shape
    assert block(x, return_weights=True)[1] is None  # none computed
    with pytest.raises(ValueError, match="G, w and backend"):
        gpt.GPT(10, attention=lambda i: None, backend="flash")


@pytest.mark.parametrize("backend", ["flash", "sdpa"])
def test_gpt_backend_equals_the_default(backend):
    """Chapter 10's GPT, float64: logits and every parameter's gradient as
    with backend "attend"; then 4 tokens generated through KVCaches."""
    import copy

    torch.manual_seed(0)
    plain = gpt.GPT(11, d=16, H=2, layers=2, d_ff=32).double()
    fused = gpt.GPT(11, d=16, H=2, layers=2, d_ff=32, backend=backend)
    fused.load_state_dict(copy.deepcopy(plain.state_dict()))
    fused.double()
    tokens = torch.randint(0, 11, (3, 19), generator=torch.Generator())
    logits = []
    for model in (plain, fused):
        out = model(tokens)
        out.square().mean().backward()
        logits.append(out.detach())
    assert_close(logits[1], logits[0], rtol=0, atol=1e-12)
    for a, b in zip(fused.parameters(), plain.parameters()):
        assert_close(a.grad, b.grad, rtol=0, atol=1e-10)
    weights = fused(tokens, return_weights=True)[1]
    assert weights == [None, None]
    with pytest.raises(ValueError, match="computes no weight matrix"):
        attention_explorer([weights], ["t"] * 19)
    with torch.no_grad():
        (text, steps), (got, got_steps) = (
            gpt.greedy(m, tokens[0, :5], 4) for m in (plain, fused)
        )
    assert torch.equal(got, text)
    assert_close(got_steps, steps, rtol=0, atol=1e-12)


def test_self_attention_backend_refuses_per_row_positions():
    """A cache whose rows have positions of their own (chapter 11's batched
    decoding) needs a mask per row: refused."""
    import transformer

    class RowsCache(transformer.KVCache):
        def next_positions(self, T):
            return super().next_positions(T).expand(2, T)

    layer = transformer.SelfAttention(32, 4, causal=True, backend="flash")
    with pytest.raises(ValueError, match="every earlier key, in order"):
        layer(torch.randn(2, 3, 32), cache=RowsCache())


def test_no_second_derivative():
    """The backward is not itself differentiated: asking for a gradient of
    the gradients is refused (once_differentiable), not silently wrong."""
    q, k, v = (t.requires_grad_() for t in qkv(6, 6, d=4, batch=(1,)))
    out = flash.flash_attention(q, k, v, True)
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match=r"twice|does not require grad"):
        dq.sum().backward()


def test_choose_tile_keeps_the_current_tile_unless_measurably_slower():
    """The rule: the current tile stays while its interval overlaps the
    best median's interval; only a tile whose interval lies entirely below
    the best's gives way, to the tile with the best median."""
    sweep = {
        (256, 256): (0.81, 0.72, 0.84),  # the best median
        (512, 256): (0.72, 0.67, 0.82),
        (512, 512): (0.70, 0.60, 0.86),  # the highest upper end
        (64, 1024): (0.66, 0.55, 0.75),  # overlaps, below the best median
        (64, 512): (0.64, 0.58, 0.72),  # touches the best's lower end
        (64, 2048): (0.64, 0.57, 0.66),  # entirely below: slower
    }
    for kept in ([512, 256], (512, 512), [64, 1024], [64, 512], [256, 256]):
        assert flash.choose_tile(sweep, kept) == list(kept)
    assert flash.choose_tile(sweep, [64, 2048]) == [256, 256]
    del sweep[(256, 256)]  # now (512, 256) has the best median, 0.72
    assert flash.choose_tile(sweep, [64, 2048]) == [512, 256]
    with pytest.raises(ValueError, match="no tile"):
        flash.choose_tile({}, [64, 64])


@pytest.mark.parametrize("name", ["Q", "K", "V"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_flash_backward_refuses_non_finite_q_k_v(name, bad):
    """A NaN or an infinity in Q, K or V gave NaN gradients without an
    error (fresh review of issue 47, round 2); now a ValueError naming the
    tensor (a check for NaN alone would let +inf and -inf through)."""
    q, k, v, C, lse, dC = backward_inputs()
    tensors = {"Q": q, "K": k, "V": v}
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[3] = bad
    with pytest.raises(ValueError, match=f"^{name} contains NaN or infinite"):
        flash.flash_backward(*tensors.values(), C, lse, dC)


@pytest.mark.parametrize("name", ["C", "lse", "dC"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_flash_backward_refuses_non_finite_c_lse_dc(name, bad):
    """A NaN or infinite C, lse or dC is a ValueError naming it, not
    gradients that are NaN everywhere (review round 2 of issue 47)."""
    q, k, v, C, lse, dC = backward_inputs()
    tensors = {"C": C, "lse": lse, "dC": dC}
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[3] = bad
    with pytest.raises(ValueError, match=f"^{name} contains NaN or infinite"):
        flash.flash_backward(q, k, v, *tensors.values())
