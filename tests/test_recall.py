"""Chapter 15's recall task (book/recall.py): MQAR sequences checked row by
row against the task's definition, `recall_accuracy` against a loop, the
numbers each model's caches hold against the formulas of chapter 12's
states and chapter 10's caches, a few training steps, the ValueErrors."""

import math

import pytest
import torch

import recall
from recall import (
    KEYS,
    RECALL,
    VOCAB,
    build_recall,
    falls_below,
    held_numbers,
    mqar_batch,
    recall_accuracy,
    top_gap,
    train_recall,
)


@pytest.mark.parametrize("pairs", [1, 5, KEYS])
def test_mqar_follows_the_definition(pairs):
    gen = torch.Generator().manual_seed(pairs)
    x, y, query = mqar_batch(6, pairs, gen)
    T = 4 * pairs - 1
    assert x.shape == y.shape == query.shape == (6, T)
    for b in range(6):
        seq = torch.cat([x[b], y[b, -1:]]).tolist()
        keys, values = seq[0 : 2 * pairs : 2], seq[1 : 2 * pairs : 2]
        assert len(set(keys)) == pairs and all(0 <= k < KEYS for k in keys)
        assert all(KEYS <= v < VOCAB for v in values)
        asked = seq[2 * pairs :: 2]
        assert sorted(asked) == sorted(keys)  # each key asked once
        for t in range(T):
            if query[b, t]:
                assert x[b, t] in keys
                assert y[b, t] == values[keys.index(x[b, t])]
        assert int(query[b].sum()) == pairs


def test_recall_accuracy_counts_like_a_loop():
    model = build_recall("mha", 16, seed=0)
    gen = torch.Generator().manual_seed(1)
    x, y, query = mqar_batch(5, 3, gen)
    right, total = recall_accuracy(model, x, y, query)
    pred = model(x).argmax(-1)
    want = sum(
        int(pred[b, t] == y[b, t])
        for b in range(5)
        for t in range(x.shape[1])
        if query[b, t]
    )
    assert (right, total) == (want, 15)


def test_top_gap_against_sorting():
    model = build_recall("linear", 16, seed=2)
    gen = torch.Generator().manual_seed(3)
    x, _, query = mqar_batch(4, 5, gen)
    logits = model(x).detach()
    gaps = []
    for b in range(4):
        for t in range(x.shape[1]):
            if query[b, t]:
                ranked = sorted(logits[b, t].tolist(), reverse=True)
                gaps.append(ranked[0] - ranked[1])
    want = min(gaps)
    assert top_gap(model, x, query) == pytest.approx(want, abs=1e-6)
    assert top_gap(model, x, query) > 0


def test_top_gap_of_a_tie_is_zero():
    class Tie(torch.nn.Module):
        def forward(self, x):
            logits = torch.zeros(*x.shape, VOCAB)
            logits[..., 0] = logits[..., 1] = 1.0
            return logits

    x = torch.zeros(2, 3, dtype=torch.int64)
    query = torch.tensor([[False, True, False], [True, True, False]])
    assert top_gap(Tie(), x, query) == 0


def test_falls_below():
    assert falls_below([1, 3, 9], [0.9, 0.7, 0.3]) == 9
    assert (
        falls_below([1, 3, 9], [0.9, 0.4, 0.6]) == 3
    )  # the first, not the last
    assert falls_below([1, 3, 9], [0.9, 0.5, 0.6]) is None  # 0.5 is not below
    assert falls_below([2], [0.8], level=0.9) == 2
    with pytest.raises(ValueError, match="increase"):
        falls_below([3, 1], [0.2, 0.2])
    with pytest.raises(ValueError, match="one each"):
        falls_below([1, 2], [0.2])


@pytest.mark.parametrize("d", [16, 32])
def test_held_numbers_match_the_formulas(d):
    H, L, T, d_k = recall.H, recall.LAYERS, 23, d // recall.H
    kv = 2 * T * d  # keys and values of one layer
    want = {
        "mha": L * kv,
        "window": L * 2 * recall.WINDOW * d,
        "linear": L * H * (d_k * d_k + d_k),  # S and z per head
        "gated_delta": L * H * d_k * d_k,
        "hybrid": H * d_k * d_k + kv,
    }
    assert set(want) == set(RECALL)
    for name, n in want.items():
        model = build_recall(name, d, seed=0)
        assert held_numbers(model, T) == n, name
        assert held_numbers(model.double(), T) == n, name  # numbers, not bytes


def test_the_state_does_not_grow():
    for name in ("linear", "gated_delta"):
        model = build_recall(name, 16, seed=0)
        assert held_numbers(model, 5) == held_numbers(model, 40)
    model = build_recall("mha", 16, seed=0)
    assert held_numbers(model, 40) == 8 * held_numbers(model, 5)


@pytest.mark.parametrize("name", list(RECALL))
def test_a_few_steps_train(name):
    model = build_recall(name, 16, seed=0)
    losses = train_recall(model, 3, seed=0, pairs=[2, 3], B=4)
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)


def test_value_errors():
    with pytest.raises(ValueError, match="distinct keys"):
        mqar_batch(2, KEYS + 1, torch.Generator())
    with pytest.raises(ValueError, match="pairs"):
        mqar_batch(2, 0, torch.Generator())
    with pytest.raises(ValueError, match="Generator"):
        mqar_batch(2, 3, None)
    with pytest.raises(ValueError, match="unknown model"):
        build_recall("mla", 16, 0)
    with pytest.raises(ValueError, match="multiple"):
        build_recall("mha", 20, 0)
    with pytest.raises(ValueError, match="pairs"):
        train_recall(build_recall("mha", 16, 0), 2, 0, pairs=[])
    x = torch.zeros(1, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="some queries"):
        recall_accuracy(build_recall("mha", 16, 0), x, x, x.bool())
    with pytest.raises(ValueError, match="some queries"):
        top_gap(build_recall("mha", 16, 0), x, x.bool())


def test_training_script_evaluates_the_stored_model(tmp_path, monkeypatch):
    """tools/train/train_circuits.py's recall part: the counts it stores are
    those of the weights it stores, on the held-out sequences of each count
    of pairs, in float64; and the training leaves the model in float32."""
    import train_circuits as tool

    monkeypatch.setattr(tool, "OUT", tmp_path)
    monkeypatch.setattr(tool, "PAIRS_TRAIN", (2, 3))
    monkeypatch.setattr(tool, "PAIRS_EVAL", (1, 3))
    monkeypatch.setattr(tool, "N_HELD", 5)
    monkeypatch.setattr(tool, "RECALL_B", 4)
    rows, summary = tool.train_recall_one("recall_gated_delta_d32", 2)
    model = build_recall("gated_delta", 32, seed=0)
    model.load_state_dict(torch.load(tmp_path / "recall_gated_delta_d32.pt"))
    assert next(iter(model.state_dict().values())).dtype == torch.float32
    model = model.double()
    assert [(r["pairs"], r["total"]) for r in rows] == [(1, 5), (3, 15)]
    for r in rows:
        gen = torch.Generator().manual_seed(tool.HELD_SEED + r["pairs"])
        held = mqar_batch(5, r["pairs"], gen)
        assert recall_accuracy(model, *held) == (r["right"], r["total"])
    assert summary["held_numbers"] == held_numbers(model, 4 * 3 - 1)
    assert summary["steps"] == 2 and summary["d"] == 32


class EvenOracle(torch.nn.Module):
    """Answers an asked key with the token after its first occurrence when
    that token is even, else with token 0: right on the even values only."""

    def forward(self, x):
        B, T = x.shape
        logits = torch.zeros(B, T, VOCAB, dtype=torch.float64)
        for b in range(B):
            seq = x[b].tolist()
            for t in range(T):
                first = seq.index(seq[t])
                answer = seq[first + 1] if first < t and first + 1 < T else 0
                logits[b, t, answer if answer % 2 == 0 else 0] = 1.0
        return logits


def test_training_script_counts_on_the_held_out_sequences(monkeypatch):
    import train_circuits as tool

    monkeypatch.setattr(tool, "PAIRS_EVAL", (1, 4, 6))
    monkeypatch.setattr(tool, "N_HELD", 7)
    rows = tool.evaluate_recall(EvenOracle(), "mha", 8)
    for r, N in zip(rows, (1, 4, 6), strict=True):
        gen = torch.Generator().manual_seed(tool.HELD_SEED + N)
        _, y, query = mqar_batch(7, N, gen)
        even = int((y[query] % 2 == 0).sum())
        assert r == {
            "name": "mha",
            "d": 8,
            "pairs": N,
            "right": even,
            "total": 7 * N,
            "gap": 1.0,  # one-hot logits
        }


@pytest.mark.parametrize("name", ["mha", "linear"])
def test_previous_token_adds_the_token_before(name):
    model = build_recall(name, 16, seed=0)
    embed = model.embed
    assert isinstance(embed, recall.PreviousToken)
    tokens = torch.tensor([[5, 40, 7, 33, 5], [0, 63, 1, 2, 3]])
    got = embed(tokens)
    E, P = embed.token.weight, embed.previous.weight
    for b in range(2):
        for t in range(5):  # a loop over positions: E[now] + P[before]
            want = E[tokens[b, t]].clone()
            if t > 0:
                want += P[tokens[b, t - 1]]
            assert torch.equal(got[b, t], want), (b, t)
    assert embed.weight is E
