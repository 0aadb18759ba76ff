"""Chapter 6 (positions): the attention module, the three kinds of
positions, the pre-norm block and the forward-fill model of the notebook.
The attention, positions and block live in book/transformer.py, which the
chapter imports and prints (chapter 10 reuses them)."""

import ast
import inspect
import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
import train_positions
from conftest import BOOK, load_chapter
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import transformer

ATOL = 1e-6  # float32, as in the chapter
# The block is compared with PyTorch's layer in float64: rounding then
# differs by about 1e-15, and LayerNorm (eps 1e-5) can amplify a difference
# at most about 1 / sqrt(eps) = 316 times, so BLOCK_ATOL = 1e-9 has a wide
# margin on every shape, CPU and thread count, while any wrong formula (a
# missing residual, a norm in the wrong place, a wrong mask) differs by far
# more. (In float32 a fixed tolerance failed on random small shapes, where
# LayerNorm over two numbers amplifies rounding.)
BLOCK_ATOL = 1e-9

# (B, T, d, H): one head, many heads, one token, head size 1, odd sizes
SHAPES = [
    (1, 3, 32, 4),
    (2, 5, 12, 3),
    (3, 1, 8, 8),
    (4, 7, 16, 1),
    (2, 6, 30, 5),
    (1, 9, 6, 6),
    (3, 8, 64, 8),
]
MASKS = [None, "causal", "padding", "causal+padding", "random"]
# what the chapter teaches and imports from book/transformer.py
SHARED = (
    "attend",
    "check_heads",
    "SelfAttention",
    "frequencies",
    "sinusoidal_encoding",
    "rotary",
    "check_rotary",
    "RotarySelfAttention",
    "EncoderBlock",
    "combine_masks",
    "check_rows",
)


@pytest.fixture(scope="module")
def ch():
    return load_chapter("06_positions.ipynb")


@pytest.fixture(scope="module")
def ch05():
    return load_chapter("05_multi_head.ipynb")


def randomise(module, gen):
    """Random biases and LayerNorm scales, so that every parameter counts."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))


def make_masks(kind, B, T, H, gen):
    """Our (mask, padding_mask) and PyTorch's (src_mask, key_padding_mask)."""
    mask = padding = None
    if kind is not None and "causal" in kind:
        mask = torch.ones(T, T, dtype=torch.bool).tril()
    if kind is not None and "padding" in kind:
        lengths = torch.randint(1, T + 1, (B,), generator=gen)
        padding = torch.arange(T) < lengths[:, None]  # the first is real
    if kind == "random":
        mask = torch.rand(B, T, T, generator=gen) < 0.5
        mask |= torch.eye(T, dtype=torch.bool)  # no query without a key
    torch_mask = None
    if mask is not None:
        torch_mask = (
            ~mask if mask.dim() == 2 else (~mask).repeat_interleave(H, 0)
        )
    torch_pad = None if padding is None else ~padding
    return (mask, padding), (torch_mask, torch_pad)


def code_cells():
    """(index, source, outputs) of every code cell of the chapter."""
    cells = json.loads((BOOK / "06_positions.ipynb").read_text("utf-8"))
    return [
        (i, "".join(c["source"]), c.get("outputs", []))
        for i, c in enumerate(cells["cells"])
        if c["cell_type"] == "code"
    ]


# ---------------------------------------------------------------- one source


@pytest.mark.parametrize("name", SHARED)
def test_chapter_names_are_the_module_objects(ch, name):
    assert getattr(ch, name) is getattr(transformer, name)


def test_no_cell_defines_the_module_names_again():
    for i, source, _ in code_cells():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                assert node.name not in SHARED, (i, node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = getattr(node, "targets", None) or [node.target]
                names = {t.id for t in targets if isinstance(t, ast.Name)}
                assert not names & set(SHARED), (i, names)


# ---------------------------------------------------------------- attention


@pytest.mark.parametrize("B, T, d, H", SHAPES)
@pytest.mark.parametrize("masked", [False, True])
def test_self_attention_equals_torch(ch, B, T, d, H, masked):
    gen = torch.Generator().manual_seed(B * 100 + T)
    torch.manual_seed(T)
    attn = ch.SelfAttention(d, H)
    randomise(attn, gen)
    mha = ch.to_torch_mha(attn)
    x = torch.randn(B, T, d, generator=gen)
    mask = torch.ones(T, T, dtype=torch.bool).tril() if masked else None
    with torch.no_grad():
        out, w = attn(x, mask)
        out_t, w_t = mha(
            x, x, x, attn_mask=ch.blocked(mask), average_attn_weights=False
        )
    assert out.shape == (B, T, d) and w.shape == (B, H, T, T)
    torch.testing.assert_close(out, out_t, rtol=0, atol=ATOL)
    torch.testing.assert_close(w, w_t, rtol=0, atol=ATOL)


@pytest.mark.parametrize("B, T, d, H", SHAPES)
@pytest.mark.parametrize("masked", [False, True])
def test_self_attention_equals_chapter5_batched(ch, ch05, B, T, d, H, masked):
    """With zero input biases, the compact module is chapter 5's batched one."""
    torch.manual_seed(T + d)
    theirs = ch05.BatchedMultiHeadAttention(d, H)
    ours = ch.SelfAttention(d, H)
    with torch.no_grad():
        ours.in_proj.weight.copy_(theirs.qkv.weight)
        ours.in_proj.bias.zero_()
        ours.out_proj.load_state_dict(theirs.output_linear.state_dict())
    x = torch.randn(B, T, d)
    mask = torch.ones(T, T, dtype=torch.bool).tril() if masked else None
    with torch.no_grad():
        out, w = ours(x, mask)
        out_5, w_5 = theirs(x, mask=mask, return_weights=True)
    torch.testing.assert_close(out, out_5, rtol=0, atol=ATOL)
    torch.testing.assert_close(w, w_5, rtol=0, atol=ATOL)


def test_attend_equals_sdpa(ch):
    gen = torch.Generator().manual_seed(0)
    Q, K, V = torch.randn(3, 2, 3, 6, 5, generator=gen)
    keep = torch.rand(6, 6, generator=gen) < 0.5
    keep[:, 0] = True
    for mask in (None, keep):
        out, w = ch.attend(Q, K, V, mask)
        torch.testing.assert_close(
            out,
            F.scaled_dot_product_attention(Q, K, V, attn_mask=mask),
            rtol=0,
            atol=ATOL,
        )
        torch.testing.assert_close(
            w.sum(-1), torch.ones(2, 3, 6), rtol=0, atol=ATOL
        )


# ---------------------------------------------------------------- block


def check_block(ch, B, T, d, H, kind, seed, d_ff=None):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    block = ch.EncoderBlock(d, H, d_ff or 2 * d + 1)
    randomise(block, gen)
    block = block.double()
    layer = ch.to_torch_layer(block).double()
    x = torch.randn(B, T, d, generator=gen, dtype=torch.float64)
    (mask, pad), (t_mask, t_pad) = make_masks(kind, B, T, H, gen)
    if t_mask is not None and t_mask.is_floating_point():
        t_mask = t_mask.double()
    with torch.no_grad():
        ours = block(x, mask, pad)
        theirs = layer(x, src_mask=t_mask, src_key_padding_mask=t_pad)
        layer.train()  # the slow path too (dropout is 0)
        theirs_train = layer(x, src_mask=t_mask, src_key_padding_mask=t_pad)
    assert ours.shape == (B, T, d)
    for reference in (theirs, theirs_train):
        torch.testing.assert_close(ours, reference, rtol=0, atol=BLOCK_ATOL)


@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("B, T, d, H", SHAPES)
def test_block_equals_torch_layer(ch, B, T, d, H, kind):
    check_block(ch, B, T, d, H, kind, seed=B + 10 * T + 100 * d)


@settings(max_examples=30, deadline=None)
@given(
    B=st.integers(1, 3),
    T=st.integers(1, 9),
    H=st.integers(1, 4),
    d_k=st.integers(1, 8),
    d_ff=st.integers(1, 40),
    kind=st.sampled_from(MASKS),
    seed=st.integers(0, 10_000),
)
def test_block_equals_torch_layer_random(ch, B, T, H, d_k, d_ff, kind, seed):
    check_block(ch, B, T, H * d_k, H, kind, seed, d_ff=d_ff)


def test_parameter_count(ch):
    for d, H, d_ff in ((8, 2, 16), (48, 1, 96), (30, 5, 7)):
        block = ch.EncoderBlock(d, H, d_ff)
        table = ch.parameter_table(block)
        expected = 4 * d**2 + 2 * d * d_ff + d_ff + 9 * d
        assert table["total"][0] == expected
        assert ch.count_parameters(ch.to_torch_layer(block)) == expected
        assert (
            sum(n for k, (n, _) in table.items() if k != "total") == expected
        )


@pytest.mark.parametrize("bad", [3, None, [torch.nn.Linear(2, 2)]])
def test_count_parameters_refuses_a_non_module(ch, bad):
    """count_parameters(3) raised AttributeError ('int' has no parameters)."""
    with pytest.raises(ValueError, match=r"expected a torch\.nn\.Module, got"):
        ch.count_parameters(bad)


# ---------------------------------------------------------------- positions


def test_sinusoids_follow_the_formula(ch):
    pe = ch.sinusoidal_encoding(20, 10)
    for pos in range(20):
        for i in range(5):
            angle = pos / 10000 ** (2 * i / 10)
            assert abs(pe[pos, 2 * i].item() - math.sin(angle)) < 1e-12
            assert abs(pe[pos, 2 * i + 1].item() - math.cos(angle)) < 1e-12


@settings(max_examples=40, deadline=None)
@given(d=st.integers(1, 40), T=st.integers(2, 80), k=st.integers(-79, 79))
def test_sinusoid_shift_is_a_fixed_linear_map(ch, d, T, k):
    assume(abs(k) < T)
    d = 2 * d
    pe = ch.sinusoidal_encoding(T, d)
    pos = torch.arange(max(0, -k), min(T, T - k))  # pos and pos + k exist
    M = ch.shift_matrix(k, d)
    torch.testing.assert_close(pe[pos] @ M, pe[pos + k], rtol=0, atol=1e-11)
    # a rotation: orthogonal, and M_k M_j = M_{k+j}
    torch.testing.assert_close(
        M @ M.T, torch.eye(d, dtype=torch.float64), rtol=0, atol=1e-12
    )
    torch.testing.assert_close(
        M @ ch.shift_matrix(3, d),
        ch.shift_matrix(k + 3, d),
        rtol=0,
        atol=1e-12,
    )


@pytest.mark.parametrize("T, d", [(30, 8), (64, 48), (5, 2)])
def test_sinusoid_dot_product_depends_on_distance_only(ch, T, d):
    pe = ch.sinusoidal_encoding(T, d)
    gram = pe @ pe.T
    for shift in range(1, T):
        torch.testing.assert_close(
            gram[shift:, shift:], gram[:-shift, :-shift], rtol=0, atol=1e-12
        )
    torch.testing.assert_close(gram, gram.T, rtol=0, atol=1e-12)


def reference_rope(x, positions):
    """Equation pos-rope with explicit 2 x 2 matrices, one row at a time."""
    T, d_k = x.shape
    out = torch.empty_like(x)
    for t in range(T):
        for i in range(d_k // 2):
            phi = positions[t].item() * 10000 ** (-2 * i / d_k)
            R = torch.tensor(
                [
                    [math.cos(phi), math.sin(phi)],
                    [-math.sin(phi), math.cos(phi)],
                ],
                dtype=x.dtype,
            )
            out[t, 2 * i : 2 * i + 2] = x[t, 2 * i : 2 * i + 2] @ R
    return out


def test_rotary_is_equation_pos_rope(ch):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(7, 10, dtype=torch.float64, generator=gen)
    positions = torch.tensor([0, 1, 2, 5, 9, 30, 100])
    torch.testing.assert_close(
        ch.rotary(x, positions),
        reference_rope(x, positions),
        rtol=0,
        atol=1e-12,
    )
    torch.testing.assert_close(
        ch.rotary(x), reference_rope(x, torch.arange(7)), rtol=0, atol=1e-12
    )


def llama_complex_rope(x, positions):
    """Meta's Llama form (apply_rotary_emb): pairs (2i, 2i+1) as complex
    numbers, multiplied by exp(i m theta_i)."""
    d_k = x.shape[-1]
    theta = 10000.0 ** (-torch.arange(0, d_k, 2, dtype=x.dtype) / d_k)
    turn = torch.polar(torch.ones_like(theta), positions[:, None] * theta)
    z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(z * turn).flatten(-2)


def neox_rope(x, positions):
    """GPT-NeoX / Hugging Face form: x cos + rotate_half(x) sin, dimension i
    paired with i + d_k / 2."""
    d_k = x.shape[-1]
    theta = 10000.0 ** (-torch.arange(0, d_k, 2, dtype=x.dtype) / d_k)
    angles = torch.cat([positions[:, None] * theta] * 2, dim=-1)  # (T, d_k)
    x1, x2 = x[..., : d_k // 2], x[..., d_k // 2 :]
    return x * angles.cos() + torch.cat([-x2, x1], dim=-1) * angles.sin()


@pytest.mark.parametrize("d_k", [2, 4, 10, 64])
def test_interleaved_and_rotate_half_layouts(ch, d_k):
    gen = torch.Generator().manual_seed(d_k)
    q, k = torch.randn(2, 9, d_k, dtype=torch.float64, generator=gen)
    positions = torch.tensor([0, 1, 2, 3, 7, 20, 100, 101, 999])
    perm = ch.evens_then_odds(d_k)
    assert sorted(perm.tolist()) == list(range(d_k))
    # the chapter's interleaved RoPE is Llama's complex form ...
    torch.testing.assert_close(
        ch.rotary(q, positions),
        llama_complex_rope(q, positions),
        rtol=0,
        atol=1e-12,
    )
    # ... its rotate-half RoPE is GPT-NeoX's form ...
    torch.testing.assert_close(
        ch.rotary_half(q, positions),
        neox_rope(q, positions),
        rtol=0,
        atol=1e-12,
    )
    # ... and the two differ by the permutation of the head's dimensions
    torch.testing.assert_close(
        ch.rotary_half(q[:, perm], positions),
        ch.rotary(q, positions)[:, perm],
        rtol=0,
        atol=1e-12,
    )
    scores = ch.rotary(q, positions) @ ch.rotary(k, positions).T
    permuted = (
        neox_rope(q[:, perm], positions) @ neox_rope(k[:, perm], positions).T
    )
    torch.testing.assert_close(permuted, scores, rtol=0, atol=1e-10)
    if d_k > 2:  # without the permutation the layouts disagree
        unpermuted = neox_rope(q, positions) @ neox_rope(k, positions).T
        assert (unpermuted - scores).abs().max() > 1e-3


@settings(max_examples=40, deadline=None)
@given(
    d_k=st.integers(1, 32),
    m=st.integers(0, 500),
    n=st.integers(0, 500),
    shift=st.integers(-200, 200),
    seed=st.integers(0, 10_000),
)
def test_rotary_score_depends_on_distance_only(ch, d_k, m, n, shift, seed):
    d_k = 2 * d_k
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 1, d_k, dtype=torch.float64, generator=gen)
    m_, n_ = torch.tensor([m]), torch.tensor([n])
    score = (ch.rotary(q, m_) * ch.rotary(k, n_)).sum()
    relative = (q * ch.rotary(k, n_ - m_)).sum()
    moved = (ch.rotary(q, m_ + shift) * ch.rotary(k, n_ + shift)).sum()
    assert abs(score - relative) < 1e-10
    assert abs(score - moved) < 1e-10
    # a rotation keeps the length of every vector
    assert abs(ch.rotary(q, m_).norm() - q.norm()) < 1e-12


def test_rotary_model_scores_are_toeplitz(ch):
    """In a rotary model, the score of a blank for a digit depends on n - m;
    with learned positions it does not."""
    torch.manual_seed(0)
    rotary_model = ch.FillModel("rotary").double()
    learned_model = ch.FillModel("learned").double()
    s = ch.position_scores(rotary_model, 20)
    torch.testing.assert_close(s[3:, 3:], s[:-3, :-3], rtol=0, atol=1e-10)
    s = ch.position_scores(learned_model, 20)
    assert (s[3:, 3:] - s[:-3, :-3]).abs().max() > 1e-3


# ---------------------------------------------------------------- order


@pytest.mark.parametrize("B, T, d, H", SHAPES)
def test_attention_and_block_are_permutation_equivariant(ch, B, T, d, H):
    gen = torch.Generator().manual_seed(d + T)
    torch.manual_seed(d)
    attn, block = ch.SelfAttention(d, H), ch.EncoderBlock(d, H, 2 * d)
    x = torch.randn(B, T, d, generator=gen)
    perm = torch.randperm(T, generator=gen)
    with torch.no_grad():
        out, w = attn(x)
        out_p, w_p = attn(x[:, perm])
        torch.testing.assert_close(out_p, out[:, perm], rtol=0, atol=ATOL)
        torch.testing.assert_close(
            w_p, w[:, :, perm][:, :, :, perm], rtol=0, atol=ATOL
        )
        torch.testing.assert_close(
            block(x[:, perm]), block(x)[:, perm], rtol=0, atol=ATOL
        )


@pytest.mark.parametrize("scheme", ["none", "sinusoidal", "learned", "rotary"])
def test_positions_break_equivariance(ch, scheme):
    torch.manual_seed(1)
    model = ch.FillModel(scheme).double()
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 11, (4, 12), generator=gen)
    perm = torch.randperm(12, generator=gen)
    with torch.no_grad():
        change = (model(tokens[:, perm]) - model(tokens)[:, perm]).abs().max()
    if scheme == "none":
        assert change < 1e-10
    else:
        assert change > 1e-3


def test_without_positions_every_blank_gets_the_same_answer(ch):
    """The ceiling of equation pos-ceiling holds for any position-free model."""
    gen = torch.Generator().manual_seed(5)
    x, y = ch.make_batch(200, 16, gen)
    for seed in range(3):
        torch.manual_seed(seed)
        model = ch.FillModel("none").double()
        assert ch.blank_rows_spread(model, x) < 1e-12
        assert ch.accuracy(model, x, y) <= ch.position_free_ceiling(x, y)


# ---------------------------------------------------------------- the task


def reference_fill(row):
    out, last = [], None
    for t in row.tolist():
        last = t if t != 10 else last
        out.append(last)
    return out


def test_forward_fill_and_batches(ch):
    gen = torch.Generator().manual_seed(7)
    for T in (1, 2, 16, 40):
        x, y = ch.make_batch(50, T, gen)
        assert x.shape == y.shape == (50, T)
        assert (x[:, 0] != ch.BLANK).all()
        assert ((x >= 0) & (x <= ch.BLANK)).all()
        assert all(reference_fill(r) == f.tolist() for r, f in zip(x, y))
        assert ((y >= 0) & (y < 10)).all()
    assert ch.decode(ch.encode("5__8_1")[0]) == "5__8_1"
    assert ch.forward_fill(ch.encode("5__8_1")).tolist() == [
        [5, 5, 5, 8, 8, 1]
    ]


def test_ceiling_by_hand(ch):
    x = ch.encode("5__8___")  # blanks need 5, 5, 8, 8, 8
    y = ch.forward_fill(x)
    assert ch.position_free_ceiling(x, y) == pytest.approx(3 / 5)


# ---------------------------------------------------------------- bad input


def test_bad_inputs_raise_value_error(ch):
    x = torch.randn(2, 5, 8)
    block = ch.EncoderBlock(8, 2, 16)
    with pytest.raises(ValueError, match="not divisible"):
        ch.SelfAttention(10, 3)
    with pytest.raises(ValueError, match="not divisible"):
        ch.EncoderBlock(12, 5, 8)
    with pytest.raises(ValueError, match="even head size"):
        ch.RotarySelfAttention(12, 4)  # d_k = 3
    with pytest.raises(ValueError, match="even head size"):
        ch.EncoderBlock(6, 2, 8, rotary=True)
    with pytest.raises(ValueError, match="even"):
        ch.rotary(torch.randn(2, 5, 7))
    with pytest.raises(ValueError, match="positions"):
        ch.rotary(torch.randn(5, 4), torch.arange(4))
    with pytest.raises(ValueError, match="mask"):
        block(x, mask=torch.ones(5, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask"):
        block(x, mask=torch.ones(3, 5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="boolean"):
        block(x, mask=torch.ones(5, 5))
    with pytest.raises(ValueError, match="padding_mask"):
        block(x, padding_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="no key"):
        block(x, padding_mask=torch.tensor([[True] * 5, [False] * 5]))
    with pytest.raises(ValueError, match="shape"):
        block(torch.randn(5, 8))
    with pytest.raises(ValueError, match="even"):
        ch.sinusoidal_encoding(4, 7)
    with pytest.raises(ValueError, match="scheme"):
        ch.FillModel("alibi")
    with pytest.raises(ValueError, match="64 learned positions"):
        ch.FillModel("learned")(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="digit"):
        ch.forward_fill(ch.encode("_5"))


def test_fully_masked_row_is_refused_not_nan(ch):
    """Causal mask and left padding leave the first query without a key."""
    block = ch.EncoderBlock(8, 2, 16)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    left_padded = torch.tensor([[False, True, True, True]])
    with pytest.raises(ValueError, match="no key"):
        block(torch.randn(1, 4, 8), causal, left_padded)


# ------------------------------------------- what the text states (issue 31)


def test_rotary_attention_rotates_queries_and_keys_not_values(ch):
    """The text: "It rotates each query and each key"; "The values are not
    rotated". RotarySelfAttention is SelfAttention with Q and K rotated by Llama's
    complex form of RoPE (written here, not the module's `rotary`)."""
    gen = torch.Generator().manual_seed(21)
    torch.manual_seed(21)
    attn = ch.RotarySelfAttention(12, 2)  # d_k = 6
    randomise(attn, gen)
    x = torch.randn(2, 5, 12, generator=gen)
    positions = torch.arange(5)
    with torch.no_grad():
        Q0, K0, V0 = transformer.SelfAttention.heads(attn, x)  # unrotated
        Q, K, V = attn.heads(x)
        assert torch.equal(V, V0)  # the values as they are
        for ours, plain in ((Q, Q0), (K, K0)):
            torch.testing.assert_close(
                ours, llama_complex_rope(plain, positions), rtol=0, atol=ATOL
            )
        Q_r, K_r = (llama_complex_rope(t, positions) for t in (Q0, K0))
        C = F.scaled_dot_product_attention(Q_r, K_r, V0)  # (B, H, T, d_k)
        expected = attn.out_proj(C.transpose(1, 2).reshape(2, 5, 12))
        out, _ = attn(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=ATOL)


def test_rotary_block_uses_rotary_attention(ch):
    assert type(ch.EncoderBlock(8, 2, 16, rotary=True).self_attn) is (
        ch.RotarySelfAttention
    )
    assert type(ch.EncoderBlock(8, 2, 16).self_attn) is ch.SelfAttention


def small_model(ch, scheme, max_len=10):
    """A FillModel small enough for a test, in float64, every parameter
    random (LayerNorm scales and biases included)."""
    torch.manual_seed(3)
    model = ch.FillModel(scheme, d=8, H=2, d_ff=12, max_len=max_len).double()
    randomise(model, torch.Generator().manual_seed(4))
    return model


@pytest.mark.parametrize("scheme", ["none", "sinusoidal", "learned", "rotary"])
def test_fill_model_is_embedding_positions_block_layernorm_readout(ch, scheme):
    """The model of the text: a token embedding, positions, one pre-norm
    block, a final LayerNorm and a linear readout, written out here with
    F.layer_norm and F.linear."""
    model = small_model(ch, scheme)
    assert type(model.norm) is torch.nn.LayerNorm
    assert model.norm.normalized_shape == (8,) and model.norm.eps == 1e-5
    tokens = torch.randint(0, 11, (3, 7), generator=torch.Generator())
    x = model.embed(tokens)
    if scheme == "sinusoidal":
        angle = torch.arange(7.0, dtype=torch.float64)[:, None] / 10000 ** (
            torch.arange(0, 8, 2, dtype=torch.float64) / 8
        )
        pe = torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(-2)
        x = x + pe  # added to the tokens, pairs (sin, cos)
    elif scheme == "learned":
        x = x + model.positions.weight[:7]  # rows 0 ... T - 1
    rotary = scheme == "rotary"
    assert type(model.block.self_attn) is (
        ch.RotarySelfAttention if rotary else ch.SelfAttention
    )
    with torch.no_grad():
        torch.testing.assert_close(
            model.embed_positions(tokens), x, rtol=0, atol=1e-12
        )
        z = model.block(x)
        normed = F.layer_norm(
            z, (8,), model.norm.weight, model.norm.bias, eps=1e-5
        )
        expected = F.linear(normed, model.readout.weight, model.readout.bias)
        logits, weights = model(tokens, return_weights=True)
    assert logits.shape == (3, 7, 10) and weights.shape == (3, 2, 7, 7)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-12)


def test_learned_positions_end_at_max_len(ch):
    """The table holds max_len rows: T = max_len works, max_len + 1 raises."""
    model = small_model(ch, "learned", max_len=6)
    assert model(torch.zeros(1, 6, dtype=torch.long)).shape == (1, 6, 10)
    with pytest.raises(ValueError, match="table of 6 learned positions"):
        model(torch.zeros(1, 7, dtype=torch.long))
    for scheme in ("none", "sinusoidal", "rotary"):  # no table, no limit
        model = small_model(ch, scheme, max_len=6)
        assert model(torch.zeros(1, 9, dtype=torch.long)).shape == (1, 9, 10)


class Recorder(torch.nn.Module):
    """A stand-in model for `train`: per-token logits from a table, and a
    record of every batch it was given and what it answered."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(11, 10)
        self.calls = []

    def forward(self, x):
        logits = self.table(x)
        self.calls.append((x.clone(), logits.detach().clone()))
        return logits


def test_train_defaults_are_the_texts(ch):
    """The text: 800 batches of 64 strings, with lengths drawn from 8 to 16,
    and a learning rate that decays linearly from 3e-3 to 0."""
    defaults = {
        name: p.default
        for name, p in inspect.signature(ch.train).parameters.items()
    }
    assert defaults["steps"] == 800 and defaults["batch"] == 64
    assert defaults["lr"] == 3e-3 and defaults["lengths"] == (8, 16)


def test_train_learning_rate_decays_linearly_to_zero(ch, monkeypatch):
    """The rate Adam uses at step s of n is lr (1 - s / n): lr at the first
    step, lr / n at the last."""
    used = []

    class RecordingAdam(torch.optim.Adam):
        def step(self, closure=None):
            used.append([group["lr"] for group in self.param_groups])
            return super().step(closure)

    monkeypatch.setattr(torch.optim, "Adam", RecordingAdam)
    ch.train(Recorder(), steps=5, batch=2, lr=0.01, lengths=(3, 4))
    expected = [0.01, 0.008, 0.006, 0.004, 0.002]
    assert [lr for (lr,) in used] == pytest.approx(expected, rel=1e-12)


def test_train_draws_lengths_and_scores_the_blanks(ch):
    """Every length from lengths[0] to lengths[1] inclusive is drawn, batch
    strings at a time; each loss is the cross-entropy at the blanks only."""
    model = Recorder()
    losses = ch.train(model, steps=80, batch=3, lengths=(3, 6), seed=1)
    assert len(losses) == len(model.calls) == 80
    assert {x.shape for x, _ in model.calls} == {(3, T) for T in (3, 4, 5, 6)}
    for loss, (x, logits) in zip(losses, model.calls):
        blank = x == ch.BLANK
        y = torch.tensor([reference_fill(row) for row in x])
        expected = F.cross_entropy(logits[blank], y[blank])
        assert loss == pytest.approx(expected.item(), rel=1e-5)


def test_accuracy_counts_the_blanks_only(ch):
    class AlwaysZero(torch.nn.Module):
        def forward(self, x):
            return F.one_hot(torch.zeros_like(x), 10).double()

    x = ch.encode("5__0_")  # blanks need 5, 5, 0
    assert ch.accuracy(AlwaysZero(), x, ch.forward_fill(x)) == pytest.approx(
        1 / 3
    )


def test_make_batch_digit_probability(ch):
    """Each position after the first holds a digit with probability 0.3,
    each digit equally likely."""
    x, _ = ch.make_batch(2000, 20, torch.Generator().manual_seed(8))
    is_digit = x[:, 1:] != ch.BLANK  # 38,000 positions: sd of the share 0.0024
    assert abs(is_digit.double().mean().item() - 0.3) < 0.015
    counts = torch.bincount(x[:, 1:][is_digit], minlength=10)
    assert counts.min() > 0.8 * counts.float().mean()


# ------------------------------------- the stored training (issue 39)
# The chapter trains a short run only and loads the four models that
# `make train-positions` (tools/train/train_positions.py) trained and stored.


@pytest.fixture(scope="module")
def stored(ch):
    """The stored log (pandas) and weights ({scheme: state_dict})."""
    return pd.read_csv(BOOK / ch.LOG), torch.load(BOOK / ch.WEIGHTS)


def test_stored_weights_reach_the_logged_accuracies(ch, stored):
    """Every accuracy the log records (and the chapter prints), recomputed
    here from the stored weights on the chapter's test sets; no blank's
    answer is within 1e-7 of a tie between two digits, so rounding that
    differs between processors cannot change it."""
    log, weights = stored
    logged = log.groupby("scheme").last()
    assert set(weights) == set(logged.index) == set(ch.SCHEMES)
    for s in ch.SCHEMES:
        model = ch.new_model(s)
        model.load_state_dict(weights[s])
        for T in ch.TEST_LENGTHS:
            x, y = ch.make_test_set(T)
            assert x.shape == (1000, T)
            blank = x == ch.BLANK
            with torch.no_grad():
                logits = model(x)[blank]  # (blanks, 10)
            right = (logits.argmax(dim=-1) == y[blank]).double().mean()
            assert abs(right.item() - logged.loc[s, f"acc_{T}"]) < 1e-12
            top2 = logits.topk(2, dim=-1).values
            assert (top2[:, 0] - top2[:, 1]).min() > 1e-7, (s, T)


def test_stored_log_starts_from_the_chapters_models(ch, stored):
    """800 steps per model; the loss of step 0 is that of the chapter's
    freshly initialised model (new_model) on the first batch `train`
    draws; the learned table's rows 16 to 63 are still new_model's. (The
    float32 normal draws of the initialisation differ by a few ulps between
    PyTorch's CPU kernels, hence tolerances; another seed differs by far
    more.)"""
    log, weights = stored
    for s in ch.SCHEMES:
        rows = log[log.scheme == s]
        assert rows.step.tolist() == list(range(800))
        gen = torch.Generator().manual_seed(0)  # train's seed and draws
        T = int(torch.randint(8, 17, (1,), generator=gen))
        x, y = ch.make_batch(64, T, gen)
        blank = x == ch.BLANK
        with torch.no_grad():
            loss = F.cross_entropy(ch.new_model(s)(x)[blank], y[blank])
        assert abs(rows.loss.iloc[0] - loss.item()) < 1e-6
    fresh = ch.new_model("learned").positions.weight.detach()
    gap = (weights["learned"]["positions.weight"] - fresh).abs()
    assert gap[16:].max() < 1e-5 and gap[:16].amax(dim=1).min() > 0.1


def test_training_script_runs_the_chapters_code(ch, monkeypatch):
    """tools/train/train_positions.py defines none of the chapter's functions
    again; its models are the chapter's new_model trained by the chapter's
    train, and its log holds their losses and, in each model's last row,
    their accuracies and seconds."""
    tree = ast.parse(Path(train_positions.__file__).read_text("utf-8"))
    script_defs = {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.ClassDef)
    }
    assert not script_defs & set(vars(ch)), script_defs & set(vars(ch))
    models, losses, seconds = train_positions.train_all(ch, steps=3)
    monkeypatch.setattr(ch, "TEST_LENGTHS", (8, 12))  # a short log
    log = train_positions.log_table(ch, models, losses, seconds)
    assert list(log.columns) == [
        "scheme",
        "step",
        "loss",
        "acc_8",
        "acc_12",
        "wall_s",
        "cpu_s",
    ]
    for s in ch.SCHEMES:
        model = ch.new_model(s)
        assert losses[s] == ch.train(model, steps=3)
        for name, value in model.state_dict().items():
            assert torch.equal(models[s].state_dict()[name], value), name
        rows = log[log.scheme == s]
        assert rows.loss.tolist() == losses[s]
        assert rows.iloc[:-1].acc_8.isna().all()
        assert rows.acc_12.iloc[-1] == ch.accuracy(
            model, *ch.make_test_set(12)
        )
        assert rows.cpu_s.iloc[-1] == seconds[s][1]


# ------------------------------------------------ the printed source, last
# These fail on any edit of book/transformer.py until `make outputs`; they
# come last so that `make mutants` (pytest -x) names the behavioural test
# that catches a planted bug in the module, not this one.


@pytest.mark.parametrize("name", SHARED)
def test_chapter_prints_the_module_source(name):
    """Each shared piece is shown where it is taught: a cell prints its
    source, and the stored output is the module's current source."""
    source = inspect.getsource(getattr(transformer, name))
    shown = [
        "".join(
            "".join(o["text"]) for o in outputs if o.get("name") == "stdout"
        )
        for _, code, outputs in code_cells()
        if f"inspect.getsource({name})" in code
    ]
    assert len(shown) == 1, name
    assert source in shown[0], f"{name}: stored output differs from module"


def test_source_check_sees_a_stale_output(monkeypatch):
    """The check above can fail: a module changed after `make outputs`."""
    stale = "def attend(Q, K, V, mask=None):\n    return None\n"
    monkeypatch.setattr(inspect, "getsource", lambda obj: stale)
    with pytest.raises(AssertionError, match="stored output differs"):
        test_chapter_prints_the_module_source("attend")


def test_empty_strings_and_no_blanks_raise_value_error(ch):
    """No blank: the accuracy on the blanks is 0/0; T = 0: no string."""
    x = ch.encode("5381")  # digits only
    y = ch.forward_fill(x)
    with pytest.raises(ValueError, match="no blank"):
        ch.position_free_ceiling(x, y)
    model = ch.FillModel("none").double()
    with pytest.raises(ValueError, match="no blank"):
        ch.accuracy(model, x, y)
    with pytest.raises(ValueError, match="T >= 1"):
        ch.make_batch(2, 0, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="T >= 1"):
        ch.forward_fill(torch.zeros(2, 0, dtype=torch.long))
