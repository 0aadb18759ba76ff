"""Chapter 3: scaled dot-product attention, and book/attention.py, the one
definition that chapter 3 builds step by step and chapters 4 and 5 import.

The post's printed numbers (`SOURCE_WEIGHTS`, `SOURCE_ROW_SUMS`) and the
book's own derived ones (`SHARPENED_WEIGHTS`) are read from the chapter; the
post's Q, K and V are the chapter's own tensors (every cell run once). The
module is loaded from its path, book/attention.py."""

import importlib.util
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from conftest import BOOK, load_chapter, r_chunks
from torch.testing import assert_close

NOTEBOOK = "03_scaled_dot_product.ipynb"


def load_module(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


attention = load_module(BOOK / "attention.py")
sdpa = attention.scaled_dot_product_attention


@pytest.fixture(scope="module")
def ch03():
    return load_chapter(NOTEBOOK)


@pytest.fixture(scope="module")
def ch03_run():
    """Every cell of the chapter run top to bottom: its Q, K, V, E, A, C."""
    return load_chapter(NOTEBOOK, run_all=True)


def random_case(seed):
    """Random batch/head dims, lengths and sizes; Q, K, V in float32."""
    g = torch.Generator().manual_seed(seed)
    n_batch_dims = seed % 3  # (), (B,), (B, H)
    batch = tuple(
        int(n) for n in torch.randint(1, 4, (n_batch_dims,), generator=g)
    )
    T_q, T_k, d_k, d_v = (
        int(n) for n in torch.randint(1, 9, (4,), generator=g)
    )
    Q = torch.randn(*batch, T_q, d_k, generator=g)
    K = torch.randn(*batch, T_k, d_k, generator=g)
    V = torch.randn(*batch, T_k, d_v, generator=g)
    return g, Q, K, V


# --- The softmax Jacobian -----------------------------------------------------


@pytest.mark.parametrize("seed", range(10))
def test_softmax_jacobian_equals_autograd(ch03, seed):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(6, generator=g, dtype=torch.float64) * 3
    expected = torch.autograd.functional.jacobian(
        lambda s: F.softmax(s, -1), z
    )
    assert_close(
        ch03.softmax_jacobian(F.softmax(z, -1)), expected, rtol=0, atol=1e-12
    )


@pytest.mark.parametrize("seed", range(5))
def test_saturation_curve_equals_autograd(ch03, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(4, 5, generator=g, dtype=torch.float64)
    multipliers = [0.5, 1, 3, 10]
    max_weight, jac_norm = ch03.saturation_curve(scores, multipliers)
    assert max_weight.shape == jac_norm.shape == (4, 4)
    for i, c in enumerate(multipliers):
        for row in range(4):
            z = c * scores[row]
            jac = torch.autograd.functional.jacobian(
                lambda s: F.softmax(s, -1), z
            )
            norm = torch.linalg.matrix_norm(jac)
            assert_close(jac_norm[i, row], norm, rtol=0, atol=1e-12)
            assert max_weight[i, row] == F.softmax(z, -1).max()


def test_jacobian_norm_bound(ch03):
    """||J||_F <= sqrt(s (1 - s)) <= 1/2, reached at a two-way tie; the
    uniform softmax is not the steepest; a tie's norm rises with c."""
    g = torch.Generator().manual_seed(0)
    p = F.softmax(
        4 * torch.randn(2000, 5, generator=g, dtype=torch.float64), -1
    )
    norm = torch.linalg.matrix_norm(ch03.softmax_jacobian(p))
    s = (p**2).sum(-1)
    assert (norm <= (s * (1 - s)).sqrt() + 1e-12).all()
    assert (norm <= 0.5 + 1e-12).all()
    tie = torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64)
    uniform = torch.full((4,), 0.25, dtype=torch.float64)
    tie_norm = torch.linalg.matrix_norm(ch03.softmax_jacobian(tie))
    uniform_norm = torch.linalg.matrix_norm(ch03.softmax_jacobian(uniform))
    assert_close(tie_norm, torch.tensor(0.5, dtype=torch.float64))
    assert uniform_norm < tie_norm
    _, rising = ch03.saturation_curve(
        torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64), [1, 2, 4, 8, 64]
    )
    assert (rising[1:] > rising[:-1]).all()
    assert_close(rising[-1], tie_norm)


def test_dot_product_variance(ch03):
    raw, scaled = ch03.dot_product_variance(
        [1, 16, 256], n_samples=4000, seed=5
    )
    assert_close(
        torch.tensor(raw), torch.tensor([1.0, 16.0, 256.0]), rtol=0.15, atol=0
    )
    assert_close(torch.tensor(scaled), torch.ones(3), rtol=0, atol=0.15)
    with pytest.raises(ValueError, match="n_samples >= 2"):
        ch03.dot_product_variance([4], n_samples=1)
    with pytest.raises(ValueError, match="every d_k >= 1"):
        ch03.dot_product_variance([0, 4])


# --- The module against PyTorch's function -----------------------------------


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("kind", ["none", "bool", "causal", "empty rows"])
def test_module_equals_torch_sdpa(seed, kind):
    g, Q, K, V = random_case(seed)
    T_q, T_k = Q.shape[-2], K.shape[-2]
    if kind == "causal":
        ours, A = sdpa(
            Q, K, V, mask=torch.ones(T_q, T_k, dtype=torch.bool).tril()
        )
        theirs = F.scaled_dot_product_attention(Q, K, V, is_causal=True)
    else:
        mask = None
        if kind == "bool":
            mask = torch.rand(T_q, T_k, generator=g) > 0.4
            mask[:, int(torch.randint(T_k, (1,), generator=g))] = True
        elif kind == "empty rows":  # some queries see no key at all
            mask = torch.rand(T_q, T_k, generator=g) > 0.4
            mask[int(torch.randint(T_q, (1,), generator=g))] = False
        ours, A = sdpa(Q, K, V, mask=mask)
        theirs = F.scaled_dot_product_attention(Q, K, V, attn_mask=mask)
        if mask is not None:
            empty = ~mask.any(-1)  # (T_q,)
            assert (A[..., empty, :] == 0).all()
            assert (ours[..., empty, :] == 0).all()
    assert ours.shape == Q.shape[:-1] + (V.shape[-1],)
    assert A.shape == Q.shape[:-1] + (T_k,)
    assert not ours.isnan().any()
    assert_close(ours, theirs, rtol=0, atol=1e-6)


def test_multi_head_shapes():
    g = torch.Generator().manual_seed(11)
    Q = torch.randn(2, 4, 6, 8, generator=g)  # (B, H, T_q, d_k)
    K = torch.randn(2, 4, 9, 8, generator=g)  # (B, H, T_k, d_k)
    V = torch.randn(2, 4, 9, 5, generator=g)
    mask = torch.rand(2, 1, 6, 9, generator=g) > 0.3  # broadcast over heads
    mask[..., 0] = True
    C, A = sdpa(Q, K, V, mask=mask)
    assert C.shape == (2, 4, 6, 5) and A.shape == (2, 4, 6, 9)
    theirs = F.scaled_dot_product_attention(Q, K, V, attn_mask=mask)
    assert_close(C, theirs, rtol=0, atol=1e-6)
    assert (A[~mask.expand_as(A)] == 0).all()


def test_dropout_is_attention_dropout():
    """dropout_p zeroes weights after the softmax and rescales the rest by
    1 / (1 - p); with p = 0 nothing changes."""
    g = torch.Generator().manual_seed(4)
    Q, K, V = (torch.randn(2, 6, 4, generator=g) for _ in range(3))
    C0, A0 = sdpa(Q, K, V)
    torch.manual_seed(0)
    C1, A1 = sdpa(Q, K, V, dropout_p=0.5)
    kept = A1 != 0
    assert 0 < kept.sum() < kept.numel()
    assert_close(A1[kept], A0[kept] * 2, rtol=1e-6, atol=0)
    assert_close(C1, A1 @ V, rtol=0, atol=0)
    C2, A2 = sdpa(Q, K, V, dropout_p=0.0)
    assert torch.equal(C2, C0) and torch.equal(A2, A0)


@pytest.mark.parametrize("p", [0.2, 0.75])
def test_dropout_p_is_the_probability_to_drop(p):
    """About a fraction p of the weights is zeroed, the rest scaled by
    1 / (1 - p) (the fraction checked within 5 standard deviations)."""
    g = torch.Generator().manual_seed(5)
    Q, K, V = (torch.randn(8, 16, 4, generator=g) for _ in range(3))
    _, A0 = sdpa(Q, K, V)
    torch.manual_seed(1)
    _, A1 = sdpa(Q, K, V, dropout_p=p)
    kept = A1 != 0
    n = kept.numel()
    assert abs(kept.sum().item() / n - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5
    assert_close(A1[kept], A0[kept] / (1 - p), rtol=1e-6, atol=0)


def test_compare_with_torch_passes_and_checks_every_mask(ch03, monkeypatch):
    """The chapter's check passes for the book's function on fresh shapes,
    and fails for a function that gets the causal mask right but ignores
    any other mask: it really compares with a random mask too."""
    gen = torch.Generator().manual_seed(8)
    Q, K, V = (torch.randn(2, 5, 4, generator=gen) for _ in range(3))
    ch03.compare_with_torch(Q, K, V, gen)

    def causal_only(Q, K, V, mask=None):
        if mask is not None and not torch.equal(mask, mask.tril()):
            mask = None  # forgets every mask but the causal one
        return sdpa(Q, K, V, mask=mask)

    monkeypatch.setattr(ch03, "scaled_dot_product_attention", causal_only)
    with pytest.raises(AssertionError):
        ch03.compare_with_torch(Q, K, V, gen)


# --- Bad inputs are named -----------------------------------------------------


@pytest.mark.parametrize(
    "shapes, message",
    [
        (((3, 4), (5, 2), (5, 6)), "same size d_k: Q has 4, K has 2"),
        (((3, 4), (5, 4), (6, 6)), "K has 5 rows, V has 6"),
        (((4,), (5, 4), (5, 6)), r"Q must have shape \(\.\.\., T, size\)"),
        (((2, 3, 4), (3, 5, 4), (3, 5, 6)), "batch dimensions do not match"),
        (((3, 4), (0, 4), (0, 6)), "at least one key"),
        (((3, 0), (5, 0), (5, 6)), "d_k >= 1 .* got d_k = 0"),  # not 1 / 0
    ],
)
def test_bad_shapes_raise(shapes, message):
    Q, K, V = (torch.ones(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        sdpa(Q, K, V)


@pytest.mark.parametrize("Q", [[[1.0, 2.0]], None, 1.5])
def test_shape_check_names_what_has_no_shape(Q):
    """check_qkv_shapes, printed in chapters 3 and 8, reads .shape: a list,
    None or a float raised AttributeError (issue 47, fresh review F3)."""
    K = torch.ones(3, 2)
    with pytest.raises(
        ValueError, match=r"Q must have shape \(\.\.\., T, size\)"
    ):
        attention.check_qkv_shapes(Q, K, K)
    with pytest.raises(ValueError, match=r"V must have shape .* got float"):
        attention.check_qkv_shapes(K, K, 2.0)


@pytest.mark.parametrize(
    "mask, message",
    [
        (
            torch.ones(4, 4, dtype=torch.bool),
            r"mask of shape \(4, 4\) does not broadcast",
        ),
        (torch.ones(3, 1, 3, dtype=torch.bool), "does not broadcast"),
        (torch.ones(3, dtype=torch.bool), "does not broadcast"),
        (  # broadcasts, but to (2, 2, 5), larger than the scores (2, 5)
            torch.ones(2, 2, 5, dtype=torch.bool),
            r"mask of shape \(2, 2, 5\) does not broadcast",
        ),
        (torch.ones(2, 5), "must be a boolean tensor"),
        (torch.ones(2, 5, dtype=torch.int64), "must be a boolean tensor"),
    ],
)
def test_bad_masks_raise(mask, message):
    Q, K, V = torch.ones(2, 4), torch.ones(5, 4), torch.ones(5, 3)
    with pytest.raises(ValueError, match=message):
        sdpa(Q, K, V, mask=mask)


@pytest.mark.parametrize(
    "dtypes, message",
    [
        ((torch.float32, torch.float64, torch.float64), "K is torch.float64"),
        ((torch.float64, torch.float32, torch.float64), "K is torch.float32"),
        ((torch.float64, torch.float64, torch.float32), "V is torch.float32"),
        ((torch.float16, torch.float16, torch.float32), "V is torch.float32"),
    ],
)
def test_mixed_dtypes_raise(dtypes, message):
    """Issue 47: a float32 Q with a float64 K passed the checks and the
    product raised a RuntimeError; now the check names the dtypes."""
    Q, K, V = (torch.ones(2, 4, dtype=dtype) for dtype in dtypes)
    with pytest.raises(ValueError, match=message + ".*one dtype"):
        sdpa(Q, K, V)


def test_mixed_devices_raise():
    Q, V = torch.ones(2, 4), torch.ones(3, 4)
    K = torch.ones(3, 4, device="meta")  # a second device on any machine
    with pytest.raises(ValueError, match=r"K is torch\.float32 on meta"):
        sdpa(Q, K, V)


def test_mask_on_another_device_raises():
    """A mask on another device than Q was a RuntimeError from masked_fill
    (fresh review of issue 47, round 2); now a ValueError naming both."""
    Q, K, V = torch.ones(3, 4), torch.ones(3, 4), torch.ones(3, 4)
    mask = torch.ones(3, 3, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match=r"^mask is on meta, Q on cpu$"):
        sdpa(Q, K, V, mask=mask)


def test_meta_tensors_raise():
    """Q, K and V on meta (shapes without values) were a RuntimeError from
    the finiteness check; now a ValueError naming the device."""
    Q, K, V = (torch.ones(3, 4, device="meta") for _ in range(3))
    with pytest.raises(ValueError, match=r"^Q, K and V are on meta"):
        sdpa(Q, K, V)


@pytest.mark.parametrize("T_k", [3, 0])
@pytest.mark.parametrize("with_mask", [False, True])
def test_no_query_gives_an_empty_result_as_torch(T_k, with_mask):
    """T_q = 0: C (..., 0, d_v) and A (..., 0, T_k), the shape PyTorch's
    function returns, whatever T_k (no query lacks a key)."""
    Q = torch.ones(2, 0, 4)
    K, V = torch.ones(2, T_k, 4), torch.ones(2, T_k, 5)
    mask = torch.ones(0, T_k, dtype=torch.bool) if with_mask else None
    C, A = sdpa(Q, K, V, mask=mask)
    theirs = F.scaled_dot_product_attention(Q, K, V, attn_mask=mask)
    assert C.shape == theirs.shape == (2, 0, 5)
    assert A.shape == (2, 0, T_k)


def test_bad_values_raise(ch03):
    Q = torch.ones(2, 4)
    with pytest.raises(ValueError, match="floating-point"):
        sdpa(Q.long(), Q, Q)
    with pytest.raises(ValueError, match="NaN or infinite"):
        sdpa(Q, Q, torch.full((2, 4), float("nan")))
    with pytest.raises(ValueError, match="Q contains NaN or infinite"):
        sdpa(torch.tensor([[0.0, float("inf")]]), Q[:, :2], Q)
    for p in (-0.1, 1.0):
        with pytest.raises(ValueError, match="dropout_p must be in"):
            sdpa(Q, Q, Q, dropout_p=p)
    with pytest.raises(ValueError, match="non-empty last axis"):
        ch03.softmax_jacobian(torch.ones(2, 0))
    for p in ("0.1", None):
        with pytest.raises(ValueError, match="dropout_p must be a number"):
            sdpa(Q, Q, Q, dropout_p=p)
    torch.manual_seed(0)  # a Fraction is a number F.dropout takes as float
    C, _ = sdpa(Q, Q, Q, dropout_p=Fraction(1, 10))
    assert torch.isfinite(C).all()


@pytest.mark.parametrize(
    "dtype, x", [(torch.float16, 70.0), (torch.float32, 1e20)]
)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_overflowing_scores_raise(dtype, x, sign):
    """Finite inputs whose scores overflow (float16: Q K^T = 70 * 70 * 16
    = 78400 > 65504 before the scale 1/4) are refused, not turned into NaN
    (sign +1) or a silently zeroed row (sign -1), as before the fix."""
    Q = torch.full((1, 2, 16), x, dtype=dtype)
    V = torch.ones(1, 2, 1, dtype=dtype)
    assert torch.isinf(Q @ (sign * Q).transpose(-2, -1)).all()
    with pytest.raises(ValueError, match=f"overflowed {dtype}"):
        sdpa(Q, sign * Q, V)
    keep_one = torch.tensor([[True, False], [True, False]])
    with pytest.raises(ValueError, match="overflowed"):
        sdpa(Q, sign * Q, V, mask=keep_one)


def test_overflow_behind_the_mask_is_allowed():
    """A hidden key may hold a score that overflows: it gets weight 0, and
    only a row the mask leaves empty gives zeros."""
    Q = torch.ones(1, 2, 16, dtype=torch.float16)
    K = torch.tensor([1.0, 70.0], dtype=torch.float16)[:, None] * Q[0]
    Q[0, 1] = 70.0
    V = torch.tensor([[2.0], [5.0]], dtype=torch.float16)
    mask = torch.tensor([[True, True], [True, False]])
    C, A = sdpa(Q, K, V, mask=mask)
    assert A[0, 1].tolist() == [1.0, 0.0] and C[0, 1].item() == 2.0
    ref = F.scaled_dot_product_attention(
        Q[:, :1].double(), K.double(), V.double()
    )
    assert_close(C[:, :1].double(), ref, atol=1e-3, rtol=1e-3)
    C, A = sdpa(Q, K, V, mask=torch.tensor([[True, True], [False, False]]))
    assert A[0, 1].tolist() == [0.0, 0.0] and C[0, 1].item() == 0.0


def test_the_posts_r_code_is_shown_unrun():
    """The post's seven R chunks for these steps, each `eval: false`."""
    chunks = r_chunks(NOTEBOOK)
    assert len(chunks) == 7
    assert all(chunk.startswith("#| eval: false\n") for chunk in chunks)


# --- The post's numbers, and the module == the chapter's steps -------------
# (last: they run every cell of the chapter once, which takes seconds, and
# `make mutants` stops at the first failure)


def test_module_equals_the_chapters_steps(ch03_run):
    """book/attention.py's function returns, bit for bit, the A and C that
    the chapter computes step by step, and its own E is the chapter's."""
    C, A = sdpa(ch03_run.Q, ch03_run.K, ch03_run.V)
    assert torch.equal(A, ch03_run.A)
    assert torch.equal(C, ch03_run.C)
    Q, K = ch03_run.Q, ch03_run.K
    E = Q @ K.transpose(-2, -1) * K.shape[-1] ** -0.5
    assert torch.equal(E, ch03_run.E)
    assert torch.equal(F.softmax(E, -1) @ ch03_run.V, C)


def test_chapter_uses_the_module(ch03_run):
    """The chapter's name is the module's function, not a copy."""
    assert ch03_run.scaled_dot_product_attention.__module__ == "attention"
    assert (
        ch03_run.scaled_dot_product_attention.__code__.co_code
        == sdpa.__code__.co_code
    )


def test_source_weights_and_row_sums(ch03, ch03_run):
    _, A = sdpa(ch03_run.Q, ch03_run.K, ch03_run.V)
    assert_close(A[0], torch.tensor(ch03.SOURCE_WEIGHTS), rtol=0, atol=5e-5)
    row_sums = torch.tensor(ch03.SOURCE_ROW_SUMS)
    assert_close(A[0].sum(-1), row_sums, rtol=0, atol=1e-6)


def test_sharpened_weights(ch03, ch03_run):
    # 12 x the scaled scores = the scaled scores of 12 x the queries
    Q, K, V = ch03_run.Q, ch03_run.K, ch03_run.V
    _, A = sdpa(12 * Q, K, V)
    expected = torch.tensor(ch03.SHARPENED_WEIGHTS)
    assert_close(A[0], expected, rtol=0, atol=5e-5)
    max_weight, _ = ch03.saturation_curve(ch03_run.E[0], [12])
    assert_close(max_weight[0], expected.max(-1).values, rtol=0, atol=5e-5)


def test_source_rows_lose_their_gradient(ch03, ch03_run):
    _, jac_norm = ch03.saturation_curve(ch03_run.E[0], [1, 12, 128])
    assert jac_norm[1, 1] < jac_norm[0, 1] / 30
    assert (jac_norm[2] < 1e-3).all()


def test_on_ramp(ch03_run):
    """The PyTorch on-ramp's claims: a Generator with the global seed draws
    the same numbers; d/dw (3w)^2 = 36 at w = 2; one SGD step lowers the
    loss; nn.Linear's weight is (out, in)."""
    assert ch03_run.w.grad.item() == 36.0
    assert ch03_run.losses[1] < ch03_run.losses[0]
    assert tuple(ch03_run.layer.weight.shape) == (2, 3)
    torch.manual_seed(0)
    a = torch.randn(3)
    assert torch.equal(
        torch.randn(3, generator=torch.Generator().manual_seed(0)), a
    )


def test_saturation_curve_refuses_no_multipliers(ch03):
    scores = torch.tensor([1.0, 0.0], dtype=torch.float64)
    with pytest.raises(ValueError, match="at least one multiplier"):
        ch03.saturation_curve(scores, [])


@pytest.mark.parametrize(
    "make, named",
    [
        (lambda t: t.to(torch.float8_e4m3fn), r"torch\.float8_e4m3fn"),
        (lambda t: t.to(torch.float8_e5m2), r"torch\.float8_e5m2"),
        (lambda t: t.to_sparse(), r"torch\.sparse_coo"),
        (lambda t: t.to_sparse_csr(), r"torch\.sparse_csr"),
    ],
)
def test_float8_and_sparse_tensors_raise(make, named):
    """float8 and sparse tensors passed is_floating_point() and then raised
    NotImplementedError or RuntimeError (fresh review of issue 47, round 4, F4); the
    shared check (attention.check_qkv_tensors) now names dtype and layout."""
    Q, K, V = (make(torch.ones(3, 4)) for _ in range(3))
    with pytest.raises(ValueError, match=rf"^Q is .*{named}.*strided layout"):
        sdpa(Q, K, V)


def test_nested_tensors_raise():
    """A nested tensor reports the strided layout, passed the check and
    raised NotImplementedError in the product; now a named ValueError."""
    Q = torch.nested.nested_tensor([torch.ones(3, 4), torch.ones(3, 4)])
    K = V = torch.ones(2, 3, 4)
    with pytest.raises(ValueError, match=r"^Q is torch\.float32 \(nested\)"):
        sdpa(Q, K, V)
    with pytest.raises(ValueError, match=r"^K is torch\.float32 \(nested\)"):
        sdpa(K, Q, V)


@pytest.mark.parametrize(
    "make, named",
    [
        (lambda m: m.to_sparse(), r"torch\.sparse_coo"),
        (lambda m: m[0].to_sparse_csr(), r"torch\.sparse_csr"),
        (lambda m: torch.nested.nested_tensor(list(m)), "a nested tensor"),
    ],
)
def test_sparse_and_nested_masks_raise(make, named):
    """A sparse or nested boolean mask passed check_mask and raised
    NotImplementedError in masked_fill (issue 47); now a named ValueError."""
    Q, K, V = (torch.ones(2, 3, 4) for _ in range(3))
    mask = make(torch.ones(2, 3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=rf"^mask must be a dense .*{named}"):
        sdpa(Q, K, V, mask)


def test_the_collapsed_cell_prints_every_check_and_the_prose_counts_them():
    """The cell printed six checks and the prose said 'all six' while
    scaled_dot_product_attention also calls check_scores_finite (fresh
    review of issue 47, round 4): every check_ function of attention.py
    is printed, and the prose's count is theirs."""
    import ast
    import json
    import re

    source = (BOOK / "attention.py").read_text()
    checks = {
        node.name
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("check_")
    }
    cells = json.loads((BOOK / NOTEBOOK).read_text())["cells"]
    text = ["".join(cell["source"]) for cell in cells]
    at = next(
        i for i, t in enumerate(text) if "getsource(attention.check_" in t
    )
    printed = re.findall(r"getsource\(attention\.(check_\w+)\)", text[at])
    assert sorted(printed) == sorted(checks)
    words = {6: "six", 7: "seven", 8: "eight", 9: "nine"}
    prose = " ".join(" ".join(text[at - 3 : at]).split())  # one line
    assert f"the collapsed cell prints all {words[len(checks)]}" in prose
