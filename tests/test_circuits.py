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

import numpy as np
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


@pytest.mark.parametrize("ablate", [{(0, 1)}, {(1, 2)}, {(0, 1), (1, 2)}])
def test_ablation_equals_reference_without_the_heads(ablate):
    model = model_of(2)
    tokens = tokens_of(model)
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


class Sizes(torch.nn.Module):
    """The model, recording the number of sequences of each call."""

    def __init__(self, model):
        super().__init__()
        self.model, self.calls = model, []

    def forward(self, x, **ablation):
        self.calls.append(len(x))
        return self.model(x, **ablation)


def test_in_context_metrics_in_chunks_equals_all_at_once(monkeypatch):
    """B = 150, not a multiple of CHUNK = 64: the chunks 64, 64, 22 give
    the losses of one call on all 150 (float64, within 1e-12) and the same
    counts; the means are over all the targets, not means of chunk means."""
    assert circuits.CHUNK == 64
    model = model_of(2, vocab=40, context=32)
    gen = torch.Generator().manual_seed(5)
    x, y, ic = repeated_segments(150, 32, 40, gen, min_len=4, max_len=16)
    sizes = Sizes(model)
    got = circuits.in_context_metrics(sizes, x, y, ic, ablate={(1, 0)})
    assert sizes.calls == [64, 64, 22]
    logits = model(x, ablate={(1, 0)})
    losses = F.cross_entropy(logits.transpose(1, 2), y, reduction="none")
    assert got[0] == pytest.approx(losses[ic].mean().item(), abs=1e-12)
    assert got[1] == pytest.approx(losses[~ic].mean().item(), abs=1e-12)
    right = logits.argmax(dim=-1) == y
    assert got[2:] == (int(right[ic].sum()), int(ic.sum()))
    monkeypatch.setattr(circuits, "CHUNK", 150)  # unchunked
    whole = circuits.in_context_metrics(model, x, y, ic, ablate={(1, 0)})
    assert got[:2] == pytest.approx(whole[:2], abs=1e-12)
    assert got[2:] == whole[2:]


def wilson_by_hand(p, n, z=1.959963984540054):
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = (
        z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    )
    return max(0.0, centre - half), min(1.0, centre + half)


def test_sequence_interval_is_wilsons_with_n_sequences():
    from seq2seq import wilson_interval

    for right, total, sequences in [(90, 100, 10), (512, 1024, 8), (0, 60, 6)]:
        got = circuits.sequence_interval(right, total, sequences)
        want = wilson_by_hand(right / total, sequences)
        assert got == pytest.approx(want, abs=1e-12)
        narrow = wilson_interval(right, total)  # n = total: narrower
        assert got[0] <= narrow[0] and got[1] >= narrow[1]
    for right, total in [(7, 10), (0, 5), (5, 5), (300, 512)]:
        assert circuits.sequence_interval(right, total, total) == (
            wilson_interval(right, total)
        )
    assert circuits.sequence_interval(
        np.int64(3), np.int64(9), 3, 0.9
    ) == pytest.approx(wilson_by_hand(3 / 9, 3, 1.6448536269514722), abs=1e-12)


@pytest.mark.parametrize(
    "args, match",
    [
        ((3.0, 9, 3), "integers"),
        ((3, 9, None), "integers"),
        ((True, 9, 3), "integers"),
        ((-1, 9, 3), "right <= total"),
        ((10, 9, 3), "right <= total"),
        ((3, 9, 0), "sequences"),
        ((3, 9, 10), "sequences"),
        ((3, 9, 3, 1.5), "level"),
    ],
)
def test_sequence_interval_names_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        circuits.sequence_interval(*args)


def test_value_errors_name_the_problem():
    """C2: None, lists, float counts and NaN give a named ValueError (they
    gave TypeError, AttributeError, NaN or an MKL error)."""
    model = model_of(1)
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    nan = torch.full((4, 4), math.nan)
    tokens = torch.tensor([1, 2, 1, 2])
    held = repeated_segments(2, 32, 40, torch.Generator(), 4, 12)
    layer = RotarySelfAttention(8, 2, causal=True)
    cases = [
        (lambda: drop_step([0], [None], 1.0), "not finite"),
        (lambda: drop_step([0], [1.0], math.nan), "threshold"),
        (lambda: drop_step(None, [1.0], 1.0), "lists"),
        (lambda: circuit_scores(x, [[1]], 4), "W_QK"),
        (lambda: circuit_output([1], x, torch.zeros(3, 12, 12)), "need A"),
        (lambda: circuits.in_context_metrics(None, *held), "nn.Module"),
        (lambda: circuits.in_context_metrics(model, None, *held[1:]), "x"),
        (lambda: circuits.in_context_metrics(model, *held[:2], [1]), "in_c"),
        (
            lambda: circuits.in_context_metrics(
                model, held[0], held[1].double(), held[2]
            ),
            "int64",
        ),
        (lambda: repeated_segments(2, 64, 64.0, torch.Generator()), "vocab"),
        (lambda: repeated_segments(2, 64, None, torch.Generator()), "vocab"),
        (lambda: previous_token(nan), "NaN"),
        (lambda: prefix_matching(nan, tokens), "NaN"),
        (lambda: same_token(nan, tokens), "NaN"),
        (lambda: copying_score(nan), "NaN"),
        (lambda: copying_score(torch.eye(3) * math.inf), "NaN"),
        (lambda: qk_matrix(None, 0, 0), "AttnOnly"),
        (lambda: ov_matrix([1], 0, 0), "AttnOnly"),
        (lambda: path_expansion(None, None), "AttnOnly"),
        (lambda: rotary_scores(None, x, 0), "RotarySelfAttention"),
        (lambda: rotary_scores(layer, None, 0), "x must"),
        (lambda: rotary_scores(layer, x, 0), "x must"),  # d = 12, not 8
        (lambda: circuits.probe_sequence(4, 10.0, torch.Generator()), "voc"),
        (lambda: circuits.probe_sequence(4, 10, None), "Generator"),
        (lambda: circuits.train_induction(None, 1, 0), "AttnOnly"),
        (lambda: circuits.train_induction(model, 1, 0.5), "seed"),
        (lambda: circuits.train_induction(model, 1, 0, lr=math.nan), "lr"),
        (lambda: model(held[0][:, :9], ablate=None), "ablate"),
        (lambda: circuits.mean_on(None, None), "weights"),
        (lambda: circuits.mean_on(torch.eye(3), torch.eye(3)), "keys"),
        (
            lambda: repeated_segments(2, 64, 64, torch.Generator(), start=1),
            "start",
        ),
        (lambda: circuits.t_interval([1.0, 2.0], None), "level"),
        (lambda: circuits.t_interval([1.0, 2.0], math.nan), "level"),
        (lambda: model.pattern(0, None), "x must"),
        (lambda: model.pattern(0, x[..., :4]), "x must"),
        (lambda: model.pattern(1, x), "layer"),
        (lambda: model.head_outputs(0, [1], None), "x must"),
        (
            lambda: circuit_scores(x * math.nan, x.new_ones(12).diag(), 4),
            "NaN",
        ),
        (
            lambda: circuit_scores(x, x.new_ones(12).diag() * math.inf, 4),
            "NaN",
        ),
        (
            lambda: circuit_output(
                x.new_full((2, 3, 5, 5), math.nan), x, x.new_zeros(3, 12, 12)
            ),
            "NaN",
        ),
        (
            lambda: rotary_scores(layer, torch.full((1, 3, 8), math.nan), 0),
            "NaN",
        ),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()


def test_scores_and_circuits_refuse_integer_and_mixed_dtypes():
    """Integer weights or inputs, or float32 beside float64, raise a named
    ValueError (torch's mean and matmul raise RuntimeErrors on them)."""
    eye = torch.eye(4, dtype=torch.int64)
    x = torch.ones(2, 4, 3)
    cases = [
        (lambda: circuits.previous_token(eye), "floating point"),
        (lambda: circuits.prefix_matching(eye, torch.arange(4)), "floating"),
        (lambda: circuits.same_token(eye, torch.arange(4)), "floating"),
        (lambda: circuit_scores(x.long(), torch.eye(3), 1), "floating"),
        (lambda: circuit_scores(x, torch.eye(3).double(), 1), "one floating"),
        (
            lambda: circuit_output(
                torch.ones(2, 1, 4, 4), x.double(), torch.ones(1, 3, 3)
            ),
            "one floating",
        ),
        (
            lambda: rotary_scores(
                RotarySelfAttention(16, 2, causal=True),
                x.new_zeros(1, 3, 16).double(),
                0,
            ),
            "one floating",
        ),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
