"""Chapter 8: scores, masked attention, the reversal data and the seq2seq model."""

import math

import pytest
import torch
from conftest import load_chapter


@pytest.fixture(scope="module")
def ch08():
    # the chapter's settings, undone afterwards for other test modules
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    yield load_chapter("08_additive_attention.ipynb")
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)


def tiny():
    """A 2-d query, three keys and hand-picked parameters."""
    s = torch.tensor([1.0, 2.0])
    H = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, -1.0]])
    W = torch.tensor([[1.0, 0.0], [0.0, 3.0]])
    W1 = torch.tensor(
        [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]
    )  # (d_s, d_a) = (2, 3)
    W2 = torch.tensor(
        [[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]
    )  # (d_h, d_a) = (2, 3)
    v = torch.tensor([1.0, 2.0, -1.0])
    return s, H, W, W1, W2, v


def test_scores_by_hand(ch08):
    s, H, W, W1, W2, v = tiny()
    # dot: [1*1 + 2*0, 1*0 + 2*1, 1*2 - 2*1]
    torch.testing.assert_close(
        ch08.score_dot(s, H), torch.tensor([1.0, 2.0, 0.0])
    )
    torch.testing.assert_close(
        ch08.score_scaled_dot(s, H),
        torch.tensor([1.0, 2.0, 0.0]) / math.sqrt(2),
    )
    # general: s W = [1, 6]; [1, 6] . h_i
    torch.testing.assert_close(
        ch08.score_general(s, H, W), torch.tensor([1.0, 6.0, -4.0])
    )
    # additive: s W1 = [1, 2, 0]; h_i W2 = [0, 0, 1], [1, 0, 0], [-1, 0, 2]
    t = math.tanh
    expected = torch.tensor(
        [
            t(1) + 2 * t(2) - t(1),
            t(2) + 2 * t(2) - t(0),
            t(0) + 2 * t(2) - t(2),
        ]
    )
    torch.testing.assert_close(
        ch08.score_additive(s, H, W1, W2, v), expected, rtol=0, atol=1e-6
    )
    # precomputed key projections give the same scores
    torch.testing.assert_close(
        ch08.score_additive(s, H, W1, W2, v, H_W2=H @ W2),
        expected,
        rtol=0,
        atol=1e-6,
    )


@pytest.mark.parametrize("batch", [(), (3,), (2, 4)])
def test_score_shapes(ch08, batch):
    gen = torch.Generator().manual_seed(0)
    d_s, d_h, d_a, n = 5, 4, 6, 7
    s_same = torch.randn(*batch, d_h, generator=gen)
    s = torch.randn(*batch, d_s, generator=gen)
    H = torch.randn(*batch, n, d_h, generator=gen)
    W = torch.randn(d_s, d_h, generator=gen)
    W1 = torch.randn(d_s, d_a, generator=gen)
    W2 = torch.randn(d_h, d_a, generator=gen)
    v = torch.randn(d_a, generator=gen)
    assert ch08.score_dot(s_same, H).shape == (*batch, n)
    assert ch08.score_scaled_dot(s_same, H).shape == (*batch, n)
    assert ch08.score_general(s, H, W).shape == (*batch, n)
    assert ch08.score_additive(s, H, W1, W2, v).shape == (*batch, n)


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda c, s, H, W, W1, W2, v: c.score_dot(torch.ones(3), H),
            "one size",
        ),
        (
            lambda c, s, H, W, W1, W2, v: c.score_dot(s, torch.ones(2, 3, 2)),
            "batch shapes differ",
        ),
        (
            lambda c, s, H, W, W1, W2, v: c.score_dot(s, torch.ones(0, 2)),
            "at least one key",
        ),
        (
            lambda c, s, H, W, W1, W2, v: c.score_general(
                s, H, torch.ones(3, 2)
            ),
            r"W must have shape \(2, 2\)",
        ),
        (
            lambda c, s, H, W, W1, W2, v: c.score_additive(
                s, H, W1, W2[:1], v
            ),
            r"W2 must have shape \(2, 3\)",
        ),
        (
            lambda c, s, H, W, W1, W2, v: c.score_additive(
                s, H, W1, W2, v[:2]
            ),
            r"W1 must have shape \(2, 2\)",
        ),
        (
            lambda c, s, H, W, W1, W2, v: c.score_additive(
                s, H, W1, W2, v[None]
            ),
            r"v must be a vector, got shape \(1, 3\)",
        ),
    ],
)
def test_scores_reject_bad_shapes(ch08, call, message):
    with pytest.raises(ValueError, match=message):
        call(ch08, *tiny())


@pytest.mark.parametrize("seed", range(10))
def test_additive_weights_sum_to_one_and_padding_gets_zero(ch08, seed):
    torch.manual_seed(seed)
    attn = ch08.AdditiveAttention(query_size=5, key_size=4, attn_size=6)
    gen = torch.Generator().manual_seed(100 + seed)
    B, n = 8, 9
    s = torch.randn(B, 5, generator=gen) * 3
    H = torch.randn(B, n, 4, generator=gen) * 3
    lengths = torch.randint(1, n + 1, (B,), generator=gen)
    mask = torch.arange(n) < lengths[:, None]
    with torch.no_grad():
        context, weights = attn(s, H, mask)
        _, weights_all = attn(s, H, torch.ones(B, n, dtype=torch.bool))
    assert context.shape == (B, 4) and weights.shape == (B, n)
    torch.testing.assert_close(
        weights.sum(dim=-1), torch.ones(B), rtol=0, atol=1e-6
    )
    torch.testing.assert_close(
        weights_all.sum(dim=-1), torch.ones(B), rtol=0, atol=1e-6
    )
    assert (weights[~mask] == 0).all()
    assert (weights[mask] > 0).all()
    # the padded keys' contents do not matter
    H_noisy = torch.where(mask[..., None], H, torch.full_like(H, 1e3))
    with torch.no_grad():
        context_noisy, weights_noisy = attn(s, H_noisy, mask)
    torch.testing.assert_close(weights_noisy, weights, rtol=0, atol=0)
    torch.testing.assert_close(context_noisy, context, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "mask, message",
    [
        (torch.ones(2, 4, dtype=torch.int64), "boolean"),
        (torch.ones(2, 3, dtype=torch.bool), r"mask has shape \(2, 3\)"),
        (
            torch.tensor([[True, False, False, False], [False] * 4]),
            "hides every key",
        ),
    ],
)
def test_attention_weights_rejects_bad_masks(ch08, mask, message):
    with pytest.raises(ValueError, match=message):
        ch08.attention_weights(torch.zeros(2, 4), mask)


@pytest.mark.parametrize(
    "seed, min_len, max_len", [(0, 6, 10), (5, 1, 4), (9, 3, 3)]
)
def test_targets_are_the_reversed_inputs(ch08, seed, min_len, max_len):
    V = ch08.Vocab
    src, lengths, tgt = ch08.make_reversal_data(500, min_len, max_len, seed)
    assert src.shape == (500, max_len) and tgt.shape == (500, max_len + 1)
    assert lengths.min() >= min_len and lengths.max() <= max_len
    for src_k, n_k, tgt_k in zip(src, lengths, tgt):
        digits = src_k[:n_k]
        assert ((digits >= V.FIRST_DIGIT) & (digits < V.SIZE)).all()
        assert torch.equal(tgt_k[:n_k], digits.flip(0))
        assert tgt_k[n_k] == V.EOS
        assert (tgt_k[n_k + 1 :] == V.PAD).all() and (
            src_k[n_k:] == V.PAD
        ).all()
    # the same seed gives the same data
    again = ch08.make_reversal_data(500, min_len, max_len, seed)
    assert all(torch.equal(a, b) for a, b in zip((src, lengths, tgt), again))


def test_generator_rejects_bad_lengths(ch08):
    with pytest.raises(ValueError, match="min_len <= max_len"):
        ch08.make_reversal_data(10, 5, 4, 0)
    with pytest.raises(ValueError, match="at least 1"):
        ch08.make_reversal_data(0, 1, 4, 0)


def test_teacher_forcing_shifts_the_targets(ch08):
    V = ch08.Vocab
    src, lengths, tgt = ch08.make_reversal_data(16, 2, 6, seed=1)
    src_b, len_b, tgt_in, tgt_out = ch08.teacher_forcing_batch(
        src, lengths, tgt
    )
    n = int(lengths.max())
    assert torch.equal(len_b, lengths)
    assert src_b.shape == (16, n) and tgt_out.shape == tgt_in.shape == (
        16,
        n + 1,
    )
    assert (tgt_in[:, 0] == V.BOS).all()
    assert torch.equal(tgt_in[:, 1:], tgt_out[:, :-1])


def small_model(ch08, use_attention, seed=0):
    torch.manual_seed(seed)
    return ch08.Seq2Seq(
        vocab_size=ch08.Vocab.SIZE,
        emb_size=8,
        hidden_size=16,
        attn_size=16,
        use_attention=use_attention,
    )


@pytest.mark.parametrize("use_attention", [True, False])
def test_training_is_deterministic(ch08, use_attention):
    data = ch08.make_reversal_data(200, 6, 10, seed=0)
    runs = [
        ch08.train(
            small_model(ch08, use_attention),
            data,
            steps=4,
            batch_size=16,
            lr=3e-3,
            seed=0,
        )
        for _ in range(2)
    ]
    assert len(runs[0]) == 4
    assert runs[0] == runs[1]
    # the losses move, so equal lists are not a constant
    assert runs[0][0] != runs[0][-1]


def test_model_shapes_and_padding(ch08):
    model = small_model(ch08, use_attention=True)
    src, lengths, tgt = ch08.make_reversal_data(12, 3, 7, seed=2)
    src_b, len_b, tgt_in, _ = ch08.teacher_forcing_batch(src, lengths, tgt)
    with torch.no_grad():
        logits, weights = model(src_b, len_b, tgt_in)
    B, T, n = tgt_in.shape[0], tgt_in.shape[1], src_b.shape[1]
    assert logits.shape == (B, T, ch08.Vocab.SIZE)
    assert weights.shape == (B, T, n)
    padded = (torch.arange(n) >= len_b[:, None])[:, None, :].expand(B, T, n)
    assert (weights[padded] == 0).all()
    torch.testing.assert_close(
        weights.sum(-1), torch.ones(B, T), rtol=0, atol=1e-6
    )
    # filling the padding with digits changes nothing
    noisy = torch.where(
        src_b == ch08.Vocab.PAD, ch08.Vocab.FIRST_DIGIT + 7, src_b
    )
    with torch.no_grad():
        logits_noisy, weights_noisy = model(noisy, len_b, tgt_in)
    assert torch.equal(logits_noisy, logits) and torch.equal(
        weights_noisy, weights
    )
    pred, pred_weights = model.greedy_decode(src_b, len_b, steps=T)
    assert pred.shape == (B, T) and pred_weights.shape == (B, T, n)
    baseline = small_model(ch08, use_attention=False)
    with torch.no_grad():
        logits_base, weights_base = baseline(src_b, len_b, tgt_in)
    assert (
        logits_base.shape == (B, T, ch08.Vocab.SIZE) and weights_base is None
    )


def test_model_rejects_bad_lengths(ch08):
    model = small_model(ch08, use_attention=True)
    src = torch.full((2, 4), ch08.Vocab.FIRST_DIGIT)
    tgt_in = torch.full((2, 5), ch08.Vocab.BOS)
    with pytest.raises(ValueError, match=r"lengths must lie in 1\.\.4"):
        model(src, torch.tensor([0, 4]), tgt_in)
    with pytest.raises(ValueError, match=r"lengths must lie in 1\.\.4"):
        model(src, torch.tensor([5, 4]), tgt_in)
    with pytest.raises(ValueError, match=r"tgt_in must be \(B, T\)"):
        model(src, torch.tensor([2, 4]), tgt_in[:1])


def test_exact_match(ch08):
    P, E = ch08.Vocab.PAD, ch08.Vocab.EOS
    tgt = torch.tensor([[5, 6, E, P], [7, 8, 9, E]])
    pred = torch.tensor([[5, 6, E, 9], [7, 8, 4, E]])
    assert ch08.exact_match(pred, tgt).tolist() == [True, False]
    with pytest.raises(ValueError, match="differ"):
        ch08.exact_match(pred[:, :3], tgt)
