"""Chapter 9: scores, masked attention, the reversal data and the seq2seq model."""

import math

import pytest
import torch
from conftest import BOOK, load_chapter


@pytest.fixture(scope="module")
def ch09():
    return load_chapter("09_additive_attention.ipynb")


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
    )  # (d_k, d_a) = (2, 3)
    v = torch.tensor([1.0, 2.0, -1.0])
    return s, H, W, W1, W2, v


def test_scores_by_hand(ch09):
    s, H, W, W1, W2, v = tiny()
    # dot: [1*1 + 2*0, 1*0 + 2*1, 1*2 - 2*1]
    torch.testing.assert_close(
        ch09.score_dot(s, H), torch.tensor([1.0, 2.0, 0.0])
    )
    torch.testing.assert_close(
        ch09.score_scaled_dot(s, H),
        torch.tensor([1.0, 2.0, 0.0]) / math.sqrt(2),
    )
    # general: s W = [1, 6]; [1, 6] . h_i
    torch.testing.assert_close(
        ch09.score_general(s, H, W), torch.tensor([1.0, 6.0, -4.0])
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
        ch09.score_additive(s, H, W1, W2, v), expected, rtol=0, atol=1e-6
    )
    # given key projections are used as they are: tanh(s W1 + H_W2) v
    H_W2 = torch.tensor([[0.5, -1.0, 2.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    torch.testing.assert_close(
        ch09.score_additive(s, H, W1, W2, v, H_W2=H_W2),
        torch.tanh(torch.tensor([1.0, 2.0, 0.0]) + H_W2) @ v,
    )
    # precomputed key projections give the same scores
    torch.testing.assert_close(
        ch09.score_additive(s, H, W1, W2, v, H_W2=H @ W2),
        expected,
        rtol=0,
        atol=1e-6,
    )


@pytest.mark.parametrize("batch", [(), (3,), (2, 4)])
def test_score_shapes(ch09, batch):
    gen = torch.Generator().manual_seed(0)
    d_s, d_k, d_a, n = 5, 4, 6, 7
    s_same = torch.randn(*batch, d_k, generator=gen)
    s = torch.randn(*batch, d_s, generator=gen)
    H = torch.randn(*batch, n, d_k, generator=gen)
    W = torch.randn(d_s, d_k, generator=gen)
    W1 = torch.randn(d_s, d_a, generator=gen)
    W2 = torch.randn(d_k, d_a, generator=gen)
    v = torch.randn(d_a, generator=gen)
    assert ch09.score_dot(s_same, H).shape == (*batch, n)
    assert ch09.score_scaled_dot(s_same, H).shape == (*batch, n)
    assert ch09.score_general(s, H, W).shape == (*batch, n)
    assert ch09.score_additive(s, H, W1, W2, v).shape == (*batch, n)


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
        (
            lambda c, s, H, W, W1, W2, v: c.score_additive(
                s, H, W1, W2, v, H_W2=torch.ones(3, 2)
            ),
            r"H_W2 must have shape \(3, 3\)",
        ),
    ],
)
def test_scores_reject_bad_shapes(ch09, call, message):
    with pytest.raises(ValueError, match=message):
        call(ch09, *tiny())


@pytest.mark.parametrize("seed", range(10))
def test_additive_weights_sum_to_one_and_padding_gets_zero(ch09, seed):
    torch.manual_seed(seed)
    attn = ch09.AdditiveAttention(query_size=5, key_size=4, attn_size=6)
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


def test_attention_module_equals_a_loop_over_keys(ch09):
    """The module against equations (ch9-additive), (ch9-masked-softmax) and
    (ch9-weights-context) written key by key in float64."""
    torch.manual_seed(1)
    attn = ch09.AdditiveAttention(query_size=3, key_size=4, attn_size=5)
    attn = attn.double()
    gen = torch.Generator().manual_seed(2)
    B, n = 3, 6
    s = torch.randn(B, 3, generator=gen, dtype=torch.float64)
    H = torch.randn(B, n, 4, generator=gen, dtype=torch.float64)
    lengths = [6, 2, 4]
    mask = torch.arange(n) < torch.tensor(lengths)[:, None]
    with torch.no_grad():
        context, weights = attn(s, H, mask)
        W1, W2 = attn.W1.weight, attn.W2.weight  # (d_a, d_s), (d_a, d_k)
        v = attn.v.weight[0]
        for b, length in enumerate(lengths):
            e = [
                float(v @ torch.tanh(W1 @ s[b] + W2 @ H[b, i]))
                for i in range(length)
            ]
            top = max(e)
            z = sum(math.exp(x - top) for x in e)
            alpha = [math.exp(x - top) / z for x in e] + [0.0] * (n - length)
            expected = sum(a * h for a, h in zip(alpha, H[b]))
            torch.testing.assert_close(
                weights[b], torch.tensor(alpha, dtype=torch.float64)
            )
            torch.testing.assert_close(context[b], expected)


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
def test_attention_weights_rejects_bad_masks(ch09, mask, message):
    with pytest.raises(ValueError, match=message):
        ch09.attention_weights(torch.zeros(2, 4), mask)


def test_context_vector_rejects_weights_that_do_not_fit(ch09):
    with pytest.raises(ValueError, match="do not fit keys"):
        ch09.context_vector(torch.ones(2, 3) / 3, torch.ones(2, 4, 5))


@pytest.mark.parametrize(
    "seed, min_len, max_len", [(0, 6, 10), (5, 1, 4), (9, 3, 3)]
)
def test_targets_are_the_reversed_inputs(ch09, seed, min_len, max_len):
    V = ch09.Vocab
    src, lengths, tgt = ch09.make_reversal_data(500, min_len, max_len, seed)
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


def test_data_set_depends_on_its_seed_only(ch09):
    # "a data set is fixed by its seed": it must not draw from PyTorch's
    # global generator, so moving that generator changes nothing
    first = ch09.make_reversal_data(50, 2, 6, seed=4)
    torch.manual_seed(12345)
    torch.rand(1000)
    again = ch09.make_reversal_data(50, 2, 6, seed=4)
    other = ch09.make_reversal_data(50, 2, 6, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], other[0])


def test_generator_rejects_bad_lengths(ch09):
    with pytest.raises(ValueError, match="min_len <= max_len"):
        ch09.make_reversal_data(10, 5, 4, 0)
    with pytest.raises(ValueError, match="at least 1"):
        ch09.make_reversal_data(0, 1, 4, 0)


def test_teacher_forcing_shifts_the_targets(ch09):
    V = ch09.Vocab
    src, lengths, tgt = ch09.make_reversal_data(16, 2, 6, seed=1)
    src_b, len_b, tgt_in, tgt_out = ch09.teacher_forcing_batch(
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
    assert torch.equal(tgt_out, tgt[:, : n + 1])


def test_sequence_loss_averages_the_real_tokens_only(ch09):
    P = ch09.Vocab.PAD
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 13, generator=gen, dtype=torch.float64)
    tgt_out = torch.tensor([[5, 2, P], [7, 8, 2]])
    log_p = logits.log_softmax(dim=-1)
    real = [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    expected = -sum(log_p[b, t, tgt_out[b, t]] for b, t in real) / len(real)
    torch.testing.assert_close(ch09.sequence_loss(logits, tgt_out), expected)


def small_model(ch09, attend, seed=0):
    torch.manual_seed(seed)
    return ch09.Seq2Seq(
        vocab_size=ch09.Vocab.SIZE,
        emb_size=8,
        hidden_size=16,
        attn_size=16,
        attend=attend,
    )


def small_batch(ch09):
    src, lengths, tgt = ch09.make_reversal_data(12, 3, 7, seed=2)
    return ch09.teacher_forcing_batch(src, lengths, tgt)


def test_model_shapes_and_padding(ch09):
    model = small_model(ch09, attend=True)
    src_b, len_b, tgt_in, _ = small_batch(ch09)
    with torch.no_grad():
        logits, weights = model(src_b, len_b, tgt_in)
    B, T, n = tgt_in.shape[0], tgt_in.shape[1], src_b.shape[1]
    assert logits.shape == (B, T, ch09.Vocab.SIZE)
    assert weights.shape == (B, T, n)
    padded = (torch.arange(n) >= len_b[:, None])[:, None, :].expand(B, T, n)
    assert (weights[padded] == 0).all()
    torch.testing.assert_close(
        weights.sum(-1), torch.ones(B, T), rtol=0, atol=1e-6
    )
    # filling the padding with digits changes nothing
    noisy = torch.where(
        src_b == ch09.Vocab.PAD, ch09.Vocab.FIRST_DIGIT + 7, src_b
    )
    with torch.no_grad():
        logits_noisy, weights_noisy = model(noisy, len_b, tgt_in)
    assert torch.equal(logits_noisy, logits) and torch.equal(
        weights_noisy, weights
    )
    pred, pred_weights = model.greedy_decode(src_b, len_b, steps=T)
    assert pred.shape == (B, T) and pred_weights.shape == (B, T, n)
    baseline = small_model(ch09, attend=False)
    with torch.no_grad():
        logits_base, weights_base = baseline(src_b, len_b, tgt_in)
    assert (
        logits_base.shape == (B, T, ch09.Vocab.SIZE) and weights_base is None
    )


def test_decoder_attends_with_the_previous_state(ch09):
    """Step t scores s_{t-1} (s_0 = h_n) against the keys, not s_t."""
    model = small_model(ch09, attend=True)
    src_b, len_b, tgt_in, _ = small_batch(ch09)
    with torch.no_grad():
        _, weights = model(src_b, len_b, tgt_in)
        H, mask, h_last = model.encoder(src_b, len_b)
        s = h_last  # s_0 = h_n
        # h_n is the encoder state at the last real position
        for k, n_k in enumerate(len_b.tolist()):
            torch.testing.assert_close(h_last[k], H[k, n_k - 1])
        memory = model.encode(src_b, len_b)
        for t in range(tgt_in.shape[1]):
            _, expected = model.decoder.attention(s, H, mask)
            torch.testing.assert_close(weights[:, t], expected)
            _, s, _ = model.decoder(tgt_in[:, t], s, memory)


def test_teacher_forced_step_sees_no_later_input(ch09):
    model = small_model(ch09, attend=True)
    src_b, len_b, tgt_in, _ = small_batch(ch09)
    t = 2
    changed = tgt_in.clone()
    changed[:, t + 1 :] = ch09.Vocab.FIRST_DIGIT + 4
    with torch.no_grad():
        logits, weights = model(src_b, len_b, tgt_in)
        logits_c, weights_c = model(src_b, len_b, changed)
    assert torch.equal(logits[:, : t + 1], logits_c[:, : t + 1])
    assert torch.equal(weights[:, : t + 1], weights_c[:, : t + 1])
    assert not torch.equal(logits[:, t + 1 :], logits_c[:, t + 1 :])


@pytest.mark.parametrize("attend", [True, False])
def test_greedy_decoding_feeds_back_its_own_tokens(ch09, attend):
    # teacher forcing with the greedy tokens (after the start token) as
    # inputs must reproduce the greedy tokens as the most likely ones
    model = small_model(ch09, attend=attend, seed=3)
    src_b, len_b, tgt_in, _ = small_batch(ch09)
    T = tgt_in.shape[1]
    pred, weights = model.greedy_decode(src_b, len_b, steps=T)
    fed = torch.cat([tgt_in[:, :1], pred[:, :-1]], dim=1)
    assert (fed[:, 0] == ch09.Vocab.BOS).all()
    with torch.no_grad():
        logits, weights_tf = model(src_b, len_b, fed)
    assert torch.equal(logits.argmax(dim=-1), pred)
    if attend:
        torch.testing.assert_close(weights_tf, weights)
    # the decoded tokens vary, so the check above is not about a constant
    assert len(set(pred.flatten().tolist())) > 1


def test_model_rejects_bad_inputs(ch09):
    model = small_model(ch09, attend=True)
    src = torch.full((2, 4), ch09.Vocab.FIRST_DIGIT)
    tgt_in = torch.full((2, 5), ch09.Vocab.BOS)
    with pytest.raises(ValueError, match=r"lengths must lie in 1\.\.4"):
        model(src, torch.tensor([0, 4]), tgt_in)
    with pytest.raises(ValueError, match=r"lengths must lie in 1\.\.4"):
        model(src, torch.tensor([5, 4]), tgt_in)
    with pytest.raises(ValueError, match=r"need src \(B, n\)"):
        model.greedy_decode(src[0], torch.tensor([4]), steps=3)
    with pytest.raises(ValueError, match=r"tgt_in must be \(B, T\)"):
        model(src, torch.tensor([2, 4]), tgt_in[:1])
    with pytest.raises(ValueError, match="steps >= 1"):
        model.greedy_decode(src, torch.tensor([2, 4]), steps=0)


def test_exact_match(ch09):
    P, E = ch09.Vocab.PAD, ch09.Vocab.EOS
    tgt = torch.tensor([[5, 6, E, P], [7, 8, 9, E]])
    pred = torch.tensor([[5, 6, E, 9], [7, 8, 4, E]])
    assert ch09.exact_match(pred, tgt).tolist() == [True, False]
    # the end token must be right too; what comes after it is ignored
    tgt_end, pred_end = torch.tensor([[5, E, P]]), torch.tensor([[5, 6, E]])
    assert ch09.exact_match(pred_end, tgt_end).tolist() == [False]
    with pytest.raises(ValueError, match="differ"):
        ch09.exact_match(pred[:, :3], tgt)


def test_claim_raises_when_a_claim_is_false(ch09, capsys):
    ch09.claim("two is more than one", 2 > 1)
    assert capsys.readouterr().out == "holds: two is more than one\n"
    with pytest.raises(AssertionError, match="does not hold: one is more"):
        ch09.claim("one is more than two", 1 > 2)


def test_mirror_weight_reads_the_anti_diagonal(ch09):
    n = 4
    w = torch.zeros(n + 1, 6)
    w[torch.arange(n), n - 1 - torch.arange(n)] = torch.tensor(
        [1.0, 0.5, 0.25, 0.25]
    )
    w[n] = 1.0  # the end token's row is not counted
    assert ch09.mirror_weight(w, n) == pytest.approx(0.5)


# --- what the text states, against independent references (issue 31) --------


def gru_cell(W_ih, W_hh, b_ih, b_hh, x, h):
    """Equation (ch9-gru), with PyTorch's weight layout (torch.nn.GRUCell's
    documentation): W_ih stacks the input weights of r, z and the candidate
    (transposed), W_hh the state weights, b_ih and b_hh their biases."""
    W_r, W_z, W_h = W_ih.chunk(3)
    U_r, U_z, U_h = W_hh.chunk(3)
    b_ir, b_iz, b_h = b_ih.chunk(3)
    b_hr, b_hz, b_h2 = b_hh.chunk(3)
    r = torch.sigmoid(x @ W_r.T + h @ U_r.T + b_ir + b_hr)
    z = torch.sigmoid(x @ W_z.T + h @ U_z.T + b_iz + b_hz)
    candidate = torch.tanh(x @ W_h.T + b_h + r * (h @ U_h.T + b_h2))
    return (1 - z) * candidate + z * h


def test_encoder_gru_follows_the_gru_equations(ch09):
    """nn.GRU, the encoder, computes equation (ch9-gru) position by position
    from h_0 = 0."""
    model = small_model(ch09, attend=True, seed=6).double()
    src_b, len_b, _, _ = small_batch(ch09)
    gru = model.encoder.gru
    weights = (
        gru.weight_ih_l0,
        gru.weight_hh_l0,
        gru.bias_ih_l0,
        gru.bias_hh_l0,
    )
    with torch.no_grad():
        H, _, _ = model.encoder(src_b, len_b)
        x = model.encoder.embed(src_b)
        h = torch.zeros(len(src_b), gru.hidden_size, dtype=torch.float64)
        for j in range(src_b.shape[1]):
            h = gru_cell(*weights, x[:, j], h)
            torch.testing.assert_close(H[:, j], h, rtol=1e-12, atol=1e-12)


def additive_context(attn, s, H, mask):
    """Equations (ch9-additive) to (ch9-weights-context), key by key."""
    W1, W2, v = attn.W1.weight, attn.W2.weight, attn.v.weight[0]
    contexts = []
    for b in range(H.shape[0]):
        keys = [j for j in range(H.shape[1]) if mask[b, j]]
        e = torch.stack(
            [v @ torch.tanh(W1 @ s[b] + W2 @ H[b, j]) for j in keys]
        )
        alpha = torch.exp(e - e.max()) / torch.exp(e - e.max()).sum()
        contexts.append(sum(a * H[b, j] for a, j in zip(alpha, keys)))
    return torch.stack(contexts)


@pytest.mark.parametrize("attend", [True, False])
def test_decoder_step_follows_the_equations(ch09, attend):
    """s_t = GRU([y_{t-1}, c_t], s_{t-1}) (equation ch9-gru); the readout
    reads [s_t, c_t, y_{t-1}] (equations ch9-decoder-state, ch9-output;
    c_t = h_n without attention)."""
    model = small_model(ch09, attend=attend, seed=5).double()
    src_b, len_b, tgt_in, _ = small_batch(ch09)
    dec = model.decoder
    with torch.no_grad():
        memory = model.encode(src_b, len_b)
        H, _, mask, h_last = memory
        gen = torch.Generator().manual_seed(0)
        s_prev = torch.randn(h_last.shape, generator=gen, dtype=torch.float64)
        y_prev = tgt_in[:, 1]
        logits, s, weights = dec(y_prev, s_prev, memory)
        y = dec.embed.weight[y_prev]
        c = (
            additive_context(dec.attention, s_prev, H, mask)
            if attend
            else h_last
        )
        cell = dec.cell
        s_ref = gru_cell(
            cell.weight_ih,
            cell.weight_hh,
            cell.bias_ih,
            cell.bias_hh,
            torch.cat([y, c], dim=-1),
            s_prev,
        )
        W_o, b_o = dec.out.weight, dec.out.bias
        logits_ref = torch.cat([s_ref, c, y], dim=-1) @ W_o.T + b_o
    torch.testing.assert_close(s, s_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logits, logits_ref, rtol=1e-12, atol=1e-12)
    assert (weights is not None) == attend


def test_greedy_decoding_starts_from_bos_and_k_n(ch09):
    model = small_model(ch09, attend=True, seed=4)
    src_b, len_b, _, _ = small_batch(ch09)
    pred, weights = model.greedy_decode(src_b, len_b, steps=2)
    with torch.no_grad():
        H, mask, h_last = model.encoder(src_b, len_b)
        memory = (H, H @ model.decoder.attention.W2.weight.T, mask, h_last)
        bos = torch.full((len(src_b),), ch09.Vocab.BOS)
        logits, s, w = model.decoder(bos, h_last, memory)
        logits_2, _, w_2 = model.decoder(logits.argmax(-1), s, memory)
    assert torch.equal(pred[:, 0], logits.argmax(-1))
    assert torch.equal(pred[:, 1], logits_2.argmax(-1))
    torch.testing.assert_close(weights[:, 0], w)
    torch.testing.assert_close(weights[:, 1], w_2)


class RecordingOptimizer:
    """Stands in for Adam: records the gradients that step() would use."""

    def __init__(self, params):
        self.params = list(params)
        self.seen = []

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self):
        self.seen.append([p.grad.clone() for p in self.params])


def grad_norm(grads):
    return torch.sqrt(sum((g**2).sum() for g in grads)).item()


class GradScaled(torch.nn.Module):
    """The model with the same logits but gradients multiplied by `scale`."""

    def __init__(self, model, scale):
        super().__init__()
        self.inner, self.scale = model, scale

    def forward(self, src, lengths, tgt_in):
        logits, weights = self.inner(src, lengths, tgt_in)
        fixed = logits.detach()
        return fixed + self.scale * (logits - fixed), weights


def test_train_step_clips_the_gradient_norm_to_one(ch09):
    """Adam takes its step after the gradient norm is clipped to 1."""
    model = small_model(ch09, attend=True, seed=1)
    params = list(model.parameters())
    src, lengths, tgt = ch09.make_reversal_data(12, 3, 7, seed=9)
    batches = [
        small_batch(ch09),
        ch09.teacher_forcing_batch(src, lengths, tgt),
    ]
    for batch in batches:
        # the loss and its raw gradient, computed here
        src_b, len_b, tgt_in, tgt_out = batch
        logits = model(src_b, len_b, tgt_in)[0]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            tgt_out.reshape(-1),
            ignore_index=ch09.Vocab.PAD,
        )
        raw = torch.autograd.grad(loss, params)
        for scale in (4 / grad_norm(raw), 0.5 / grad_norm(raw)):  # norm 4, 0.5
            for p in params:
                p.grad = torch.ones_like(p)  # stale: must be cleared
            opt = RecordingOptimizer(params)
            returned = ch09.train_step(GradScaled(model, scale), opt, batch)
            assert returned == pytest.approx(loss.item(), rel=1e-6)
            (seen,) = opt.seen
            norm = scale * grad_norm(raw)
            factor = scale * min(1.0, 1.0 / norm)
            assert grad_norm(seen) == pytest.approx(min(norm, 1.0), rel=1e-4)
            for g, r in zip(seen, raw):
                torch.testing.assert_close(g, factor * r, rtol=1e-4, atol=1e-7)


def test_train_draws_seeded_batches_and_calls_on_step(ch09, monkeypatch):
    """train: Adam with the given lr, batches drawn from its own seeded
    generator, on_step before the first step and after every step."""
    model = small_model(ch09, attend=False, seed=2)
    data = ch09.make_reversal_data(40, 2, 6, seed=3)
    calls, seen = [], []

    def fake_step(m, optimizer, batch):
        assert m is model and isinstance(optimizer, torch.optim.Adam)
        (group,) = optimizer.param_groups
        assert group["lr"] == 0.25
        assert [id(p) for p in group["params"]] == [
            id(p) for p in model.parameters()
        ]
        seen.append(batch)
        return float(len(seen))

    monkeypatch.setattr(ch09, "train_step", fake_step)
    torch.manual_seed(99)  # the global generator must not matter
    losses = ch09.train(
        model,
        data,
        steps=3,
        batch_size=5,
        lr=0.25,
        seed=7,
        on_step=lambda step, m: calls.append(step),
    )
    assert losses == [1.0, 2.0, 3.0] and calls == [0, 1, 2, 3]
    gen = torch.Generator().manual_seed(7)
    src, lengths, tgt = data
    for batch in seen:
        idx = torch.randint(len(src), (5,), generator=gen)
        n = int(lengths[idx].max())
        assert torch.equal(batch[0], src[idx][:, :n])
        assert torch.equal(batch[1], lengths[idx])
        assert torch.equal(batch[3], tgt[idx][:, : n + 1])


class FixedModel:
    """Stands in for a model: greedy_decode returns given predictions."""

    def __init__(self, pred):
        self.pred = pred

    def greedy_decode(self, src, lengths, steps):
        assert steps == self.pred.shape[1]
        return self.pred, None


def test_accuracy_by_length_counts_exact_matches(ch09):
    """Exact-sequence accuracy, overall and per length, counted by hand."""
    V = ch09.Vocab
    src, lengths, tgt = ch09.make_reversal_data(60, 2, 5, seed=6)
    gen = torch.Generator().manual_seed(1)
    pred = tgt.clone()
    wrong = torch.rand(len(tgt), generator=gen) < 0.4  # spoil some rows
    pred[wrong, 0] = V.FIRST_DIGIT + (pred[wrong, 0] - V.FIRST_DIGIT + 1) % 10
    after_end = torch.rand(len(tgt), generator=gen) < 0.5  # beyond </s>
    pred[after_end, -1] = torch.where(
        tgt[after_end, -1] == V.PAD, V.FIRST_DIGIT, pred[after_end, -1]
    )
    rows = []
    for p_k, t_k, n_k in zip(pred.tolist(), tgt.tolist(), lengths.tolist()):
        rows.append((p_k[: n_k + 1] == t_k[: n_k + 1], n_k))
    overall, per_length = ch09.accuracy_by_length(
        FixedModel(pred), (src, lengths, tgt), range(2, 6)
    )
    assert overall == pytest.approx(sum(ok for ok, _ in rows) / len(rows))
    assert 0 < overall < 1
    for n in range(2, 6):
        hits = [ok for ok, n_k in rows if n_k == n]
        assert per_length[n] == pytest.approx(sum(hits) / len(hits))


def test_every_length_is_drawn(ch09):
    _, lengths, _ = ch09.make_reversal_data(400, 2, 6, seed=0)
    assert sorted(set(lengths.tolist())) == [2, 3, 4, 5, 6]


def test_vocab_labels(ch09):
    V = ch09.Vocab
    labels = [V.label(t) for t in range(V.SIZE)]
    assert labels == ["·", "<s>", "</s>", *map(str, range(10))]
    assert V.SIZE == V.FIRST_DIGIT + 10


def test_loss_table_picks_step_one_and_every_nth(ch09):
    losses = [1.0 / k for k in range(1, 11)]
    lines = ch09.loss_table(losses, 5).splitlines()
    assert [int(line.split()[1]) for line in lines] == [1, 5, 10]
    assert lines[1].split()[-1] == "0.2000"


# --- the data split, the model's seed and the stored run (issue 39) ----------


def test_unseen_drops_exactly_the_strings_seen(ch09):
    data = ch09.make_reversal_data(300, 1, 2, seed=3)  # many repeats
    seen = ch09.make_reversal_data(40, 1, 2, seed=4)
    kept = ch09.unseen(data, seen)
    seen_rows = {tuple(r.tolist()) for r in seen[0]}
    expected = [
        k for k, r in enumerate(data[0]) if tuple(r.tolist()) not in seen_rows
    ]
    assert 0 < len(expected) < len(data[0])
    for part, kept_part in zip(data, kept):
        assert torch.equal(kept_part, part[expected])


def test_new_model_is_seeded(ch09):
    """new_model initialises from seed 0 whatever the global generator did;
    the layers made before the attention (the encoder, the decoder's
    embedding) start equal in both models."""
    torch.manual_seed(123)
    first = ch09.new_model(attend=True)
    torch.rand(50)
    again = ch09.new_model(attend=True)
    baseline = ch09.new_model(attend=False)
    for (name, p), (_, q) in zip(
        first.named_parameters(), again.named_parameters()
    ):
        assert torch.equal(p, q), name
    shared = dict(baseline.named_parameters())
    assert len(shared) == len(list(first.parameters())) - 3  # W1, W2, v
    for name, p in first.named_parameters():
        if name.startswith(("encoder.", "decoder.embed.")):
            assert torch.equal(p, shared[name]), name
    sizes = ch09.SIZES
    assert first.decoder.attention.W1.weight.shape == (
        sizes["attn_size"],
        sizes["hidden_size"],
    )


def test_held_out_loss_is_the_teacher_forced_loss(ch09):
    model = small_model(ch09, attend=True, seed=7)
    data = ch09.make_reversal_data(9, 2, 5, seed=8)
    n = int(data[1].max())
    tgt_out = data[2][:, : n + 1]
    bos = torch.full((9, 1), ch09.Vocab.BOS)
    with torch.no_grad():
        logits, _ = model(
            data[0][:, :n], data[1], torch.cat([bos, tgt_out[:, :-1]], 1)
        )
    real = tgt_out != ch09.Vocab.PAD
    log_p = logits.double().log_softmax(-1)
    picked = log_p.gather(-1, tgt_out[..., None])[..., 0]
    expected = -(picked[real]).mean().item()
    assert ch09.held_out_loss(model, data) == pytest.approx(expected, rel=1e-6)


def test_load_trained_loads_float64_in_eval_mode(ch09, tmp_path):
    original = ch09.new_model(attend=True)
    path = tmp_path / "w.pt"
    torch.save(original.state_dict(), path)
    loaded = ch09.load_trained(path, attend=True)
    assert not loaded.training
    for (name, p), (_, q) in zip(
        original.named_parameters(), loaded.named_parameters()
    ):
        assert q.dtype == torch.float64, name
        assert torch.equal(p.double(), q), name
    with pytest.raises(RuntimeError, match="Unexpected key"):
        ch09.load_trained(path, attend=False)  # the weights of W1, W2, v


@pytest.fixture(scope="module")
def splits(ch09):
    train_data = ch09.make_reversal_data(**ch09.TRAIN_SET)
    candidates = ch09.make_reversal_data(**ch09.HELD_OUT)
    return train_data, ch09.unseen(candidates, train_data)


@pytest.fixture(scope="module")
def stored_log(ch09):
    import pandas as pd

    return pd.read_csv(BOOK / ch09.LOG)


def test_stored_log_covers_the_recipe(ch09, stored_log):
    steps = ch09.RECIPE["steps"]
    for name in ("attention", "baseline"):
        rows = stored_log[stored_log.model == name]
        assert rows.step.tolist() == list(range(1, steps + 1))
        assert rows.loss.notna().all() and (rows.loss > 0).all()
        last = rows.iloc[-1]
        assert last.cpu_s > 0 and last.wall_s > 0
        for column in (
            "acc_6",
            "acc_7",
            "acc_8",
            "acc_9",
            "acc_10",
            "acc_all",
        ):
            assert 0 <= last[column] <= 1
    evaluated = stored_log.dropna(subset=["held_out_loss"])
    assert sorted(zip(evaluated.model, evaluated.step)) == sorted(ch09.WEIGHTS)


def test_stored_weights_reproduce_the_log(ch09, splits, stored_log):
    """Every stored model, loaded as the chapter loads it, reaches the
    held-out loss and the accuracies that the log records."""
    _, test_data = splits
    lengths = range(ch09.HELD_OUT["min_len"], ch09.HELD_OUT["max_len"] + 1)
    for (name, step), path in ch09.WEIGHTS.items():
        model = ch09.load_trained(BOOK / path, attend=name == "attention")
        row = stored_log[
            (stored_log.model == name) & (stored_log.step == step)
        ].iloc[0]
        loss = ch09.held_out_loss(model, test_data)
        assert loss == pytest.approx(row.held_out_loss, rel=1e-9, abs=0)
        if step == ch09.RECIPE["steps"]:
            acc, by_len = ch09.accuracy_by_length(model, test_data, lengths)
            assert acc == pytest.approx(row.acc_all, abs=1e-9)
            for n, a in by_len.items():
                assert a == pytest.approx(row[f"acc_{n}"], abs=1e-9)


def test_models_json_rebuilds_the_stored_models(ch09):
    """book/data/additive_models.json names the chapter's class and its
    constructor arguments: a later chapter rebuilds each model from it."""
    import json

    data = BOOK / "data"
    spec = json.loads((data / "additive_models.json").read_text())
    assert spec["class"] == "Seq2Seq" and spec["vocab"]["class"] == "Vocab"
    assert spec["chapter"] == "book/09_additive_attention.ipynb"
    for key in ("PAD", "BOS", "EOS", "FIRST_DIGIT", "SIZE"):
        assert spec["vocab"][key] == getattr(ch09.Vocab, key)
    assert spec["recipe"] == ch09.RECIPE
    assert spec["train_set"] == ch09.TRAIN_SET
    assert spec["held_out"] == ch09.HELD_OUT
    files = {entry["weights"] for entry in spec["models"].values()}
    assert files == {
        path.removeprefix("data/") for path in ch09.WEIGHTS.values()
    }
    for entry in spec["models"].values():
        model = getattr(ch09, spec["class"])(**entry["init"])
        state = torch.load(data / entry["weights"])
        model.load_state_dict(state)  # strict: every key, every shape
        assert entry["init"]["attend"] == hasattr(model.decoder, "attention")


def test_training_script_runs_the_chapters_recipe(ch09, splits, tmp_path):
    """tools/train/train_additive.py trains with the chapter's own new_model, train
    and RECIPE: its first steps are the chapter's, bit for bit, and what it
    stores loads with the chapter's load_trained."""
    import pandas as pd
    import train_additive

    threads = torch.get_num_threads()
    try:
        train_additive.main(
            ["--steps", "3", "--checkpoint", "2", "--out", str(tmp_path)]
        )
        train_data, test_data = splits
        recipe = ch09.RECIPE | {"steps": 3}
        expected = {
            name: ch09.train(ch09.new_model(attend), train_data, **recipe)
            for name, attend in (("attention", True), ("baseline", False))
        }
    finally:
        torch.set_num_threads(threads)
    log = pd.read_csv(tmp_path / "additive_train_log.csv")
    for name, losses in expected.items():
        assert log[log.model == name].loss.tolist() == losses
    stored = {
        ("attention", 3): "additive_attention.pt",
        ("attention", 2): "additive_attention_step2.pt",
        ("baseline", 3): "additive_baseline.pt",
    }
    for (name, step), file in stored.items():
        model = ch09.load_trained(tmp_path / file, attend=name == "attention")
        row = log[(log.model == name) & (log.step == step)].iloc[0]
        assert ch09.held_out_loss(model, test_data) == row.held_out_loss
    assert train_additive.load_chapter is load_chapter
