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
    held_numbers,
    mqar_batch,
    recall_accuracy,
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
        assert held_numbers(build_recall(name, d, seed=0), T) == n, name


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
    with pytest.raises(ValueError, match="some queries"):
        x = torch.zeros(1, 3, dtype=torch.int64)
        recall_accuracy(build_recall("mha", 16, 0), x, x, x.bool())
