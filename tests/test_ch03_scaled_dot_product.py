"""Chapter 3: scaled dot-product attention, the functions defined in the notebook.

The post's printed numbers (`SOURCE_WEIGHTS`, `SOURCE_ROW_SUMS`) and the
book's own derived ones (`SHARPENED_WEIGHTS`) are read from the chapter; the
post's Q, K and V are the chapter's own tensors (every cell run once)."""

import json
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import BOOK, load_chapter
from torch.testing import assert_close

NOTEBOOK = "03_scaled_dot_product.ipynb"


@pytest.fixture(scope="module")
def ch03():
    return load_chapter(NOTEBOOK)


@pytest.fixture(scope="module")
def ch03_run():
    """Every cell of the chapter run top to bottom: its Q, K, V and scores."""
    return load_chapter(NOTEBOOK, run_all=True)


def random_case(seed):
    """Random batch/head dims, lengths and sizes; q, k, v in float32."""
    g = torch.Generator().manual_seed(seed)
    n_batch_dims = seed % 3  # (), (B,), (B, H)
    batch = tuple(
        int(n) for n in torch.randint(1, 4, (n_batch_dims,), generator=g)
    )
    L, S, d_k, d_v = (int(n) for n in torch.randint(1, 9, (4,), generator=g))
    q = torch.randn(*batch, L, d_k, generator=g)
    k = torch.randn(*batch, S, d_k, generator=g)
    v = torch.randn(*batch, S, d_v, generator=g)
    return g, q, k, v


# --- The post's numbers, from the chapter's own tensors ----------------------


def test_source_weights_and_row_sums(ch03, ch03_run):
    Q, K, V = ch03_run.Q, ch03_run.K, ch03_run.V
    out, w = ch03.scaled_dot_product_attention(Q, K, V)
    expected = torch.tensor(ch03.SOURCE_WEIGHTS)
    assert_close(w[0], expected, rtol=0, atol=5e-5)
    row_sums = torch.tensor(ch03.SOURCE_ROW_SUMS)
    assert_close(w[0].sum(-1), row_sums, rtol=0, atol=1e-6)
    assert out.shape == V.shape


def test_sharpened_weights(ch03, ch03_run):
    # 12 x the scaled scores = the scaled scores of 12 x the queries
    Q, K, V = ch03_run.Q, ch03_run.K, ch03_run.V
    _, w = ch03.scaled_dot_product_attention(12 * Q, K, V)
    expected = torch.tensor(ch03.SHARPENED_WEIGHTS)
    assert_close(w[0], expected, rtol=0, atol=5e-5)
    max_weight, _ = ch03.saturation_curve(ch03_run.attention_scores[0], [12])
    assert_close(max_weight[0], expected.max(-1).values, rtol=0, atol=5e-5)


def test_source_rows_lose_their_gradient(ch03, ch03_run):
    scores = ch03_run.attention_scores[0]
    _, jac_norm = ch03.saturation_curve(scores, [1, 12, 128])
    assert jac_norm[1, 1] < jac_norm[0, 1] / 30
    assert (jac_norm[2] < 1e-3).all()


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


# --- The reusable function against PyTorch's ---------------------------------


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("kind", ["none", "bool", "float", "causal"])
def test_equals_torch_sdpa(ch03, seed, kind):
    g, q, k, v = random_case(seed)
    L, S = q.shape[-2], k.shape[-2]
    if kind == "causal":
        ours, w = ch03.scaled_dot_product_attention(
            q, k, v, mask=torch.ones(L, S, dtype=torch.bool).tril()
        )
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        mask = None
        if kind == "bool":
            mask = torch.rand(L, S, generator=g) > 0.4
            mask[:, int(torch.randint(S, (1,), generator=g))] = (
                True  # no empty row
            )
        elif kind == "float":
            mask = torch.randn(q.shape[:-2] + (L, S), generator=g)
        ours, w = ch03.scaled_dot_product_attention(q, k, v, mask=mask)
        theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert ours.shape == q.shape[:-1] + (v.shape[-1],)
    assert w.shape == q.shape[:-1] + (S,)
    assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert_close(w.sum(-1), torch.ones(w.shape[:-1]), rtol=0, atol=1e-6)


def test_multi_head_shapes(ch03):
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 4, 6, 8, generator=g)  # (B, H, L, d_k)
    k = torch.randn(2, 4, 9, 8, generator=g)  # (B, H, S, d_k)
    v = torch.randn(2, 4, 9, 5, generator=g)
    mask = torch.rand(2, 1, 6, 9, generator=g) > 0.3  # broadcast over heads
    mask[..., 0] = True
    out, w = ch03.scaled_dot_product_attention(q, k, v, mask=mask)
    assert out.shape == (2, 4, 6, 5) and w.shape == (2, 4, 6, 9)
    assert_close(
        out,
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        rtol=0,
        atol=1e-6,
    )
    assert (w[~mask.expand_as(w)] == 0).all()


@pytest.mark.parametrize("seed", range(10))
def test_causal_outputs_ignore_the_future(ch03, seed):
    g = torch.Generator().manual_seed(seed)
    T, t = 7, seed % 6
    q, k, v = (torch.randn(2, T, 4, generator=g) for _ in range(3))
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for tensor in (q2, k2, v2):
        tensor[:, t + 1 :] = torch.randn(2, T - t - 1, 4, generator=g)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    out, _ = ch03.scaled_dot_product_attention(q, k, v, mask=causal)
    out2, _ = ch03.scaled_dot_product_attention(q2, k2, v2, mask=causal)
    assert_close(out2[:, : t + 1], out[:, : t + 1], rtol=0, atol=1e-6)
    assert not torch.allclose(out2[:, t + 1 :], out[:, t + 1 :])


@pytest.mark.parametrize("n_pad", [1, 3])
def test_padding_leaves_real_outputs_unchanged(ch03, n_pad):
    g = torch.Generator().manual_seed(n_pad)
    q, k, v = (torch.randn(5, 4, generator=g) for _ in range(3))
    out, _ = ch03.scaled_dot_product_attention(q, k, v)
    q_p, k_p, v_p = (
        torch.cat([t, 50 * torch.randn(n_pad, 4, generator=g)])
        for t in (q, k, v)
    )
    keep = torch.arange(5 + n_pad) < 5  # (S,) broadcasts
    out_p, w_p = ch03.scaled_dot_product_attention(q_p, k_p, v_p, mask=keep)
    assert_close(out_p[:5], out, rtol=0, atol=1e-6)
    assert (w_p[:, 5:] == 0).all()


# --- Bad inputs are named -----------------------------------------------------


def test_fully_masked_row_raises(ch03):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 3, 4, generator=g) for _ in range(3))
    mask = torch.ones(3, 3, dtype=torch.bool)
    mask[1] = False
    with pytest.raises(ValueError, match="every key masked"):
        ch03.scaled_dot_product_attention(q, k, v, mask=mask)
    additive = torch.zeros(3, 3)
    additive[2] = float("-inf")
    with pytest.raises(ValueError, match="every key masked"):
        ch03.scaled_dot_product_attention(q, k, v, mask=additive)


@pytest.mark.parametrize(
    "shapes, message",
    [
        (((3, 4), (5, 2), (5, 6)), "same size d_k: q has 4, k has 2"),
        (((3, 4), (5, 4), (6, 6)), "k has 5 positions, v has 6"),
        (
            ((4,), (5, 4), (5, 6)),
            r"q must have shape \(\.\.\., length, size\)",
        ),
        (((2, 3, 4), (3, 5, 4), (3, 5, 6)), "batch dimensions do not match"),
        (((3, 4), (0, 4), (0, 6)), "at least one key"),
    ],
)
def test_bad_shapes_raise(ch03, shapes, message):
    q, k, v = (torch.ones(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        ch03.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize(
    "mask, message",
    [
        (
            torch.ones(4, 4, dtype=torch.bool),
            r"mask of shape \(4, 4\) does not broadcast",
        ),
        (torch.ones(3, 1, 3, dtype=torch.bool), "does not broadcast"),
        (torch.ones(3, dtype=torch.bool), "does not broadcast"),
        (torch.ones(2, 5, dtype=torch.int64), "boolean or floating point"),
    ],
)
def test_bad_masks_raise(ch03, mask, message):
    q, k, v = torch.ones(2, 4), torch.ones(5, 4), torch.ones(5, 3)
    with pytest.raises(ValueError, match=message):
        ch03.scaled_dot_product_attention(q, k, v, mask=mask)


def test_bad_values_raise(ch03):
    q = torch.ones(2, 4)
    with pytest.raises(ValueError, match="floating-point"):
        ch03.scaled_dot_product_attention(q.long(), q, q)
    with pytest.raises(ValueError, match="NaN or infinite"):
        ch03.scaled_dot_product_attention(
            q, q, torch.full((2, 4), float("nan"))
        )
    with pytest.raises(ValueError, match="non-empty last axis"):
        ch03.softmax_jacobian(torch.ones(2, 0))


# --- The tabs show the code that runs ----------------------------------------


def test_python_tabs_equal_the_cells_that_run():
    """Each tab set holds the post's R chunk (never run: `eval: false`) and
    exactly the Python of the collapsed code cell that follows it."""
    cells = json.loads((BOOK / NOTEBOOK).read_text(encoding="utf-8"))["cells"]
    checked = 0
    for i, cell in enumerate(cells):
        text = "".join(cell["source"])
        if cell["cell_type"] != "markdown" or "{tab-set}" not in text:
            continue
        blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
        assert len(blocks) == 1, f"cell {i}: one Python tab per tab set"
        following = cells[i + 1]
        assert following["cell_type"] == "code"
        assert "hide-input" in following["metadata"].get("tags", [])
        assert "".join(following["source"]).strip() == blocks[0].strip(), i
        assert re.search(r"```r\n#\| eval: false\n", text), i
        checked += 1
    assert checked == 7
