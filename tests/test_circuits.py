"""Chapter 15's circuits (book/circuits.py), against references written
here, on random untrained models of sizes the chapter never uses:

- `AttnOnly` against a loop over heads through PyTorch's
  scaled_dot_product_attention (causal), with and without ablated heads;
- the QK and OV circuits, the one-layer path expansion and the rotary
  form against the models' own attention, within 1e-12 in float64;
- `rotation` against rotary positions as complex multiplication;
- the head scores on hand-built weights whose answer is known;
- `repeated_segments` against the task's definition, checked row by row;
- `drop_step`, `train_induction` (a few steps) and every ValueError.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import circuits
from circuits import (
    AttnOnly,
    circuit_output,
    circuit_scores,
    copying_score,
    drop_step,
    ov_matrix,
    path_expansion,
    prefix_matching,
    previous_token,
    qk_matrix,
    repeated_segments,
    rotary_scores,
    rotation,
    same_token,
)
from transformer import RotarySelfAttention


def model_of(layers=3, vocab=11, d=12, H=3, context=9, seed=0):
    torch.manual_seed(seed)
    return AttnOnly(vocab, d, H, layers, context).double()


def tokens_of(model, B=2, T=7, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(model.vocab, (B, T), generator=gen)


def reference_logits(model, tokens, ablate=()):
    """Each layer: per head SDPA(x W_Q, x W_K, x W_V, causal) W_O, summed."""
    T = tokens.shape[1]
    x = model.W_E[tokens] + model.W_pos[:T]
    for i in range(model.layers):
        total = torch.zeros_like(x)
        for h in range(model.H):
            if (i, h) in ablate:
                continue
            q, k, v = (x @ W[i, h] for W in (model.W_Q, model.W_K, model.W_V))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            total = total + out @ model.W_O[i, h]
        x = x + total
    return x @ model.W_U


@pytest.mark.parametrize("layers", [1, 3])
def test_model_equals_reference(layers):
    model = model_of(layers)
    tokens = tokens_of(model)
    got = model(tokens)
    torch.testing.assert_close(
        got, reference_logits(model, tokens), rtol=0, atol=1e-12
    )


def test_ablation_equals_reference_without_the_heads():
    model = model_of(2)
    tokens = tokens_of(model)
    ablate = {(0, 1), (1, 2)}
    got = model(tokens, ablate=ablate)
    want = reference_logits(model, tokens, ablate)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert (got - model(tokens)).abs().max() > 1e-3  # it changed something


def test_every_head_ablated_leaves_the_direct_path():
    model = model_of(2)
    tokens = tokens_of(model)
    every = {(i, h) for i in range(2) for h in range(model.H)}
    T = tokens.shape[1]
    direct = (model.W_E[tokens] + model.W_pos[:T]) @ model.W_U
    torch.testing.assert_close(
        model(tokens, ablate=every), direct, rtol=0, atol=1e-12
    )


def test_key_ablation_changes_only_later_keys():
    model = model_of(2)
    tokens = tokens_of(model)
    _, A = model(tokens, return_weights=True)
    _, A_k = model(tokens, key_ablate={(0, 0)}, return_weights=True)
    torch.testing.assert_close(A_k[:, 0], A[:, 0], rtol=0, atol=0)
    assert (A_k[:, 1] - A[:, 1]).abs().max() > 1e-4
    # reference: layer 1's keys from x without head (0, 0), queries from x
    x = model.embed(tokens)
    out = model.head_outputs(0, x, A[:, 0])
    x1 = x + out.sum(1)
    x1_k = x1 - out[:, 0]
    q = torch.einsum("btd,hdk->bhtk", x1, model.W_Q[1])
    k = torch.einsum("btd,hdk->bhtk", x1_k, model.W_K[1])
    s = q @ k.transpose(-2, -1) / math.sqrt(model.d_k)
    T = tokens.shape[1]
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
    torch.testing.assert_close(A_k[:, 1], s.softmax(-1), rtol=0, atol=1e-12)


def test_qk_circuit_gives_the_scores_and_has_rank_d_k():
    model = model_of(2, d=15, H=5)
    x = model.embed(tokens_of(model))
    for i, h in [(0, 0), (1, 4)]:
        W_QK = qk_matrix(model, i, h)
        assert torch.linalg.matrix_rank(W_QK) <= model.d_k
        q, k = x @ model.W_Q[i, h], x @ model.W_K[i, h]
        want = q @ k.transpose(-2, -1) / math.sqrt(model.d_k)
        got = circuit_scores(x, W_QK, model.d_k)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("layer", [0, 1])
def test_ov_circuit_gives_the_layer_output(layer):
    model = model_of(2)
    x = model.embed(tokens_of(model))  # any x (B, T, d) will do
    A = model.pattern(layer, x)
    W_OV = torch.stack([ov_matrix(model, layer, h) for h in range(model.H)])
    want = sum(
        A[:, h] @ (x @ model.W_V[layer, h]) @ model.W_O[layer, h]
        for h in range(model.H)
    )
    got = circuit_output(A, x, W_OV)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(
        got, model.head_outputs(layer, x, A).sum(1), rtol=0, atol=1e-12
    )


def test_in_context_metrics_against_a_loop():
    model = model_of(2, vocab=40, context=32)
    gen = torch.Generator().manual_seed(9)
    x, y, ic = repeated_segments(3, 32, 40, gen, min_len=4, max_len=12)
    loss, other, right, total = circuits.in_context_metrics(model, x, y, ic)
    logits = model(x)
    sums = {True: [], False: []}
    hits = 0
    for b in range(3):
        for t in range(32):
            logp = torch.log_softmax(logits[b, t], dim=-1)
            sums[bool(ic[b, t])].append(-logp[y[b, t]].item())
            right_bt = int(logits[b, t].argmax()) == int(y[b, t])
            hits += int(bool(ic[b, t]) and right_bt)
    assert loss == pytest.approx(sum(sums[True]) / len(sums[True]), abs=1e-12)
    assert other == pytest.approx(
        sum(sums[False]) / len(sums[False]), abs=1e-12
    )
    assert (right, total) == (hits, len(sums[True]))


def test_probe_is_distinct_tokens_twice():
    probe = circuits.probe_sequence(7, 20, torch.Generator().manual_seed(2))
    assert probe.shape == (14,)
    assert probe[:7].tolist() == probe[7:].tolist()
    assert len(set(probe[:7].tolist())) == 7
    with pytest.raises(ValueError, match="vocab"):
        circuits.probe_sequence(21, 20, torch.Generator())


def test_path_expansion_sums_to_the_logits():
    model = model_of(1, vocab=13, d=8, H=2, context=6)
    tokens = tokens_of(model, B=3, T=6)
    direct, heads = path_expansion(model, tokens)
    assert heads.shape == (2, 3, 6, 13)
    total = direct + heads.sum(0)
    torch.testing.assert_close(
        total, reference_logits(model, tokens), rtol=0, atol=1e-12
    )
    with pytest.raises(ValueError, match="one-layer"):
        path_expansion(model_of(2), tokens_of(model_of(2)))


def test_rotation_is_rotary_as_complex_numbers():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 6, generator=gen, dtype=torch.float64)  # (T, d_k)
    omega = 10000.0 ** (-torch.arange(0, 6, 2, dtype=torch.float64) / 6)
    for m in (0, 1, 4, -3):
        z = torch.complex(x[:, 0::2], x[:, 1::2]) * torch.exp(1j * m * omega)
        want = torch.stack([z.real, z.imag], -1).flatten(-2)
        got = x @ rotation(m, 6).T
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(
        rotation(2, 6) @ rotation(-5, 6), rotation(-3, 6), rtol=0, atol=1e-12
    )


def test_rotary_scores_equal_the_layers():
    torch.manual_seed(4)
    layer = RotarySelfAttention(12, 3, causal=True).double()
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    Q, K, _ = layer.heads(x, torch.arange(7))
    _, weights = layer(x)
    for h in range(3):
        want = Q[:, h] @ K[:, h].transpose(-2, -1) / math.sqrt(layer.d_k)
        got = rotary_scores(layer, x, h)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        causal = torch.ones(7, 7, dtype=torch.bool).tril()
        A = got.masked_fill(~causal, -math.inf).softmax(-1)
        torch.testing.assert_close(A, weights[:, h], rtol=0, atol=1e-12)


def test_scores_on_hand_built_weights():
    tokens = torch.tensor([3, 5, 7, 3, 5, 7])
    T = 6
    induction = torch.zeros(T, T)
    for i, j in [(3, 1), (4, 2), (5, 3)]:  # to the token after the match
        induction[i, j] = 1.0
    for i in (0, 1, 2):
        induction[i, i] = 1.0
    assert prefix_matching(induction, tokens).item() == 1.0
    assert same_token(induction, tokens).item() == 0.0
    prev = torch.zeros(T, T)
    prev[0, 0] = 1.0
    prev[torch.arange(1, T), torch.arange(T - 1)] = 1.0
    assert previous_token(prev).item() == 1.0
    assert previous_token(torch.eye(T)).item() == 0.0
    # uniform causal weights: query i gives 1 / (i + 1) to its one match
    uniform = torch.ones(T, T).tril()
    uniform = uniform / uniform.sum(-1, keepdim=True)
    want = sum(1 / (i + 1) for i in (3, 4, 5)) / 3
    assert prefix_matching(uniform, tokens).item() == pytest.approx(
        want, abs=1e-7
    )
    assert same_token(uniform, tokens).item() == pytest.approx(want, abs=1e-7)
    # a head axis: (2, T, T) gives two scores
    both = prefix_matching(torch.stack([induction, uniform]), tokens)
    assert both.shape == (2,)


def test_copying_score_on_known_spectra():
    assert copying_score(torch.eye(4)) == pytest.approx(1.0)
    assert copying_score(-torch.eye(4)) == pytest.approx(-1.0)
    M = torch.diag(torch.tensor([3.0, -1.0]))
    P = torch.tensor([[1.0, 2.0], [0.0, 1.0]])
    assert copying_score(P @ M @ torch.linalg.inv(P)) == pytest.approx(0.5)
    rot = torch.tensor([[0.0, -1.0], [1.0, 0.0]])  # eigenvalues +-i
    assert copying_score(rot) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="nonzero"):
        copying_score(torch.zeros(3, 3))


def copy_of(seq):
    """(s, n) of a sequence that is distinct tokens but for one run of n
    tokens at s repeated at s + n, found from the counts alone."""
    twice = [j for j, t in enumerate(seq) if seq.count(t) == 2]
    n = len(twice) // 2
    return twice[0], n


@pytest.mark.parametrize("start", [False, True])
def test_repeated_segments_follow_the_definition(start):
    gen = torch.Generator().manual_seed(7)
    x, y, ic = repeated_segments(
        60, 30, 40, gen, min_len=4, max_len=9, start=start
    )
    assert x.shape == y.shape == ic.shape == (60, 30)
    lengths, starts = set(), set()
    for b in range(60):
        seq = torch.cat([x[b], y[b, -1:]]).tolist()
        assert seq[1:] == y[b].tolist()
        assert max(seq.count(t) for t in seq) == 2  # distinct but the copy
        s, n = copy_of(seq)
        assert seq[s : s + n] == seq[s + n : s + 2 * n]  # back to back
        assert len(set(seq[s : s + n])) == n
        lengths.add(n)
        starts.add(s)
        want = [s + n <= t <= s + 2 * n - 2 for t in range(30)]
        assert ic[b].tolist() == want
        for t in range(30):
            earlier = [j for j in range(t) if seq[j] == seq[t]]
            if ic[b, t]:
                assert earlier == [t - n] and y[b, t] == seq[t - n + 1]
    assert lengths == set(range(4, 10))
    assert (starts == {0}) != start  # start=True: random starts


def test_segment_offsets_vary():
    """No fixed offset solves the task: the gap between copies (n) varies."""
    gen = torch.Generator().manual_seed(8)
    x, _, ic = repeated_segments(200, 64, 64, gen)
    gaps = set()
    for b in range(200):
        t = int(ic[b].nonzero()[0])
        j = int((x[b, :t] == x[b, t]).nonzero()[0])
        gaps.add(t - j)
    assert gaps == set(range(16, 33))


def test_drop_step():
    assert drop_step([0, 10, 20], [3.0, 0.9, 0.1], 1.0) == 10
    assert drop_step([0, 10], [3.0, 2.0], 1.0) is None
    assert drop_step([0, 10], [1.0, 0.5], 1.0) == 10  # below, not at
    with pytest.raises(ValueError, match="one length"):
        drop_step([0, 10], [1.0], 1.0)
    with pytest.raises(ValueError, match="not finite"):
        drop_step([0, 10], [math.nan, 0.1], 1.0)


def test_train_induction_logs_every_head():
    torch.manual_seed(0)
    model = AttnOnly(64, 16, 2, 2, 64)
    log = circuits.train_induction(model, steps=4, seed=0, B=4, every=3)
    assert [r["step"] for r in log] == [0, 3, 4]
    assert math.isnan(log[0]["train_loss"]) and math.isfinite(
        log[-1]["train_loss"]
    )
    assert {f"prefix_{i}{h}" for i in range(2) for h in range(2)} <= set(
        log[0]
    )
    assert all(0 <= r["in_context_acc"] <= 1 for r in log)


def test_embed_scale_scales_the_first_draws():
    # W_E and W_pos are the first two draws of the seeded generator, times
    # embed_scale; the other weights are unscaled
    for scale in (0.25, 0.5, 1.0):
        torch.manual_seed(7)
        model = AttnOnly(12, 8, 2, 1, 10, embed_scale=scale)
        torch.manual_seed(7)
        W_E, W_pos = torch.randn(12, 8), torch.randn(10, 8)
        W_Q = torch.randn(1, 2, 8, 4) / 8**0.5
        assert torch.equal(model.W_E.data, W_E * scale)
        assert torch.equal(model.W_pos.data, W_pos * scale)
        assert torch.equal(model.W_Q.data, W_Q)
    torch.manual_seed(0)
    default = AttnOnly(64, 64, 4, 2, 64)  # 4,096 entries each: std 0.25
    for W in (default.W_E, default.W_pos):
        assert abs(W.std().item() - 0.25) < 0.01
    for bad in (0, -0.25, math.nan, math.inf, True, "0.25", None):
        with pytest.raises(ValueError, match="embed_scale"):
            AttnOnly(12, 8, 2, 1, 10, embed_scale=bad)


def test_value_errors():
    model = model_of(2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(torch.tensor([[0, 11]]))
    with pytest.raises(ValueError, match="int64"):
        model(torch.tensor([[0.0, 1.0]]))
    with pytest.raises(ValueError, match="context"):
        model(torch.zeros(1, 10, dtype=torch.int64))
    with pytest.raises(ValueError, match="layer, head"):
        model(torch.zeros(1, 3, dtype=torch.int64), ablate={(2, 0)})
    with pytest.raises(ValueError, match="layer, head"):
        model(torch.zeros(1, 3, dtype=torch.int64), key_ablate={(0, 3)})
    with pytest.raises(ValueError, match="layer, head"):
        qk_matrix(model, 0, -1)
    with pytest.raises(ValueError, match="divide"):
        AttnOnly(10, 10, 3)
    with pytest.raises(ValueError, match="vocab"):
        AttnOnly(0, 4, 2)
    with pytest.raises(ValueError, match="T must"):
        repeated_segments(2, 63, 64, torch.Generator())  # T >= 2 max_len
    with pytest.raises(ValueError, match="too small"):
        repeated_segments(2, 64, 48, torch.Generator())
    with pytest.raises(ValueError, match="Generator"):
        repeated_segments(2, 64, 64, 0)
    with pytest.raises(ValueError, match="even"):
        rotation(1, 5)
    with pytest.raises(ValueError, match="W_QK"):
        circuit_scores(torch.zeros(2, 3, 4), torch.zeros(3, 3), 2)
    with pytest.raises(ValueError, match="no query"):
        prefix_matching(torch.eye(3), torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="tokens"):
        prefix_matching(torch.eye(3), torch.tensor([1, 2]))


def test_t_interval_against_scipy():
    from scipy import stats

    for values in ([1.0, 4.0], [250, 300, 475], [0.1, 0.1, 0.4]):
        mean, low, high, df = circuits.t_interval(values)
        assert mean == pytest.approx(sum(values) / len(values))
        n = len(values)
        sem = stats.sem(values)
        want = stats.t.interval(0.95, n - 1, loc=sum(values) / n, scale=sem)
        assert df == n - 1
        assert (low, high) == pytest.approx(want, abs=1e-9)
    with pytest.raises(ValueError, match="2 or 3"):
        circuits.t_interval([1.0])
    with pytest.raises(ValueError, match="finite"):
        circuits.t_interval([1.0, math.nan])
    with pytest.raises(ValueError, match="finite"):
        circuits.t_interval([True, 2.0])


def test_training_script_merges_into_missing_or_stored_tables(tmp_path):
    """tools/train/train_circuits.py --only: the first run has no stored
    table (it crashed on a missing file before merge was used); a later one
    keeps the other models' rows."""
    import pandas as pd
    import train_circuits as tool

    new = pd.DataFrame({"name": ["a"], "x": [1]})
    path = tmp_path / "log.csv"
    assert tool.merge(path, new, ["a"], "name").equals(new)
    pd.DataFrame({"name": ["a", "b"], "x": [0, 2]}).to_csv(path, index=False)
    merged = tool.merge(path, new, ["a"], "name")
    assert sorted(zip(merged.name, merged.x)) == [("a", 1), ("b", 2)]
