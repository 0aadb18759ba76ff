"""Chapter 15's recall task (book/recall.py): MQAR sequences checked row by
row against the task's definition, `recall_accuracy` against a loop, the
numbers each model's caches hold against the formulas of chapter 12's
states and chapter 10's caches, a few training steps (the loss on the
queried values only, the linear decay of the learning rate),
`window_reach` against a count on sampled sequences and an enumeration of
every query order, the ValueErrors."""

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

import recall
from gpt import Decoder
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
    window_reach,
)
from transformer import allowed_positions


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
    assert falls_below(np.array([2, 4]).tolist(), [0.9, np.float64(0.1)]) == 4


@pytest.mark.parametrize(
    "pairs, accuracies, level, match",
    [
        ([2, 4], [0.9, math.nan], 0.5, "finite"),  # was None: not reached
        ([2, 4], [math.inf, 0.9], 0.5, "finite"),
        ([2, 4], [0.9, None], 0.5, "finite"),
        ([2, 4], [0.9, True], 0.5, "finite"),
        ([2, 4], [0.9, 0.1], math.nan, "level"),
        ([2, 4], [0.9, 0.1], None, "level"),
        ([2, 2], [0.9, 0.1], 0.5, "increase"),
        ([2, 4.0], [0.9, 0.1], 0.5, "integers"),
        (None, [0.9], 0.5, "lists"),
        ([2], 0.9, 0.5, "lists"),
        ([], [], 0.5, "non-empty"),
    ],
)
def test_falls_below_names_bad_input(pairs, accuracies, level, match):
    with pytest.raises(ValueError, match=match):
        falls_below(pairs, accuracies, level)


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


class Recording(torch.optim.Adam):
    """Adam that records its learning rate at each step and, with
    move=False, leaves the weights as they are."""

    move = True

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.lrs = []
        Recording.last = self

    def step(self):
        self.lrs.append([g["lr"] for g in self.param_groups])
        if self.move:
            super().step()


def test_train_recall_decays_the_learning_rate_linearly(monkeypatch):
    monkeypatch.setattr(torch.optim, "Adam", Recording)
    model = build_recall("mha", 16, seed=0)
    train_recall(model, 5, seed=0, pairs=[2], B=2, lr=0.01)
    want = [0.01 * (1 - s / 5) for s in range(5)]  # 0.01 ... 0.002
    assert [lrs[0] for lrs in Recording.last.lrs] == pytest.approx(
        want, rel=1e-12
    )


def test_train_recall_loss_is_on_the_queried_values(monkeypatch):
    """The returned losses of a model that does not move, against the mean
    of -log p(value) at the queried positions of the same batches, drawn
    again from the seed as train_recall draws them."""
    monkeypatch.setattr(torch.optim, "Adam", Recording)
    monkeypatch.setattr(Recording, "move", False)
    model = build_recall("linear", 16, seed=1).double()
    pairs = [2, 5]
    losses = train_recall(model, 4, seed=3, pairs=pairs, B=3)
    gen = torch.Generator().manual_seed(3)
    for loss in losses:
        N = pairs[int(torch.randint(len(pairs), (), generator=gen))]
        x, y, query = mqar_batch(3, N, gen)
        with torch.no_grad():
            logp = model(x).log_softmax(dim=-1)
        nll = [
            -logp[b, t, y[b, t]].item()
            for b in range(3)
            for t in range(x.shape[1])
            if query[b, t]
        ]
        assert len(nll) == 3 * N
        assert loss == pytest.approx(sum(nll) / len(nll), abs=1e-12)


@pytest.mark.parametrize("pairs, w", [(8, 16), (3, 5), (5, 2), (1, 1)])
def test_window_reach_on_sampled_sequences(pairs, w):
    """The share of queried values whose position the query may see in a
    window of w (transformer.allowed_positions, the window of the GPT's
    `w`), counted on 20,000 mqar_batch sequences: within 4 standard
    errors of the mean of the per-sequence shares."""
    B = 20_000
    x, _, query = mqar_batch(B, pairs, torch.Generator().manual_seed(w))
    T = x.shape[1]
    sees = allowed_positions(torch.arange(T), torch.arange(T), w)
    keys = x[:, : 2 * pairs : 2]  # (B, N)
    i = torch.arange(2 * pairs, T, 2)  # the query positions
    assert query[:, i].all() and int(query.sum()) == B * pairs
    m = (x[:, i][:, :, None] == keys[:, None, :]).int().argmax(dim=-1)
    p = 2 * m + 1  # the value's position: after its key
    share = sees[i[None, :].expand(B, -1), p].double().mean(dim=1)  # (B,)
    want = float(window_reach(pairs, w))
    se = share.std().item() / math.sqrt(B)
    assert abs(share.mean().item() - want) <= 4 * se + 1e-12


@pytest.mark.parametrize("N", [1, 2, 3, 4, 5])
def test_window_reach_over_every_query_order(N):
    """Each order of the N queries, equally likely: the layout written out
    as tokens and the value found by searching it."""
    for w in range(1, 4 * N + 2):
        reached = 0
        for order in itertools.permutations(range(N)):
            seq = [t for m in range(N) for t in (("k", m), ("v", m))]
            seq += [t for m in order for t in (("k", m), ("v", m))]
            for i in range(2 * N, 4 * N, 2):  # the query keys
                p = seq.index(("v", seq[i][1]))
                reached += i - w < p <= i  # allowed_positions' window
        want = Fraction(reached, math.factorial(N) * N)
        assert window_reach(N, w) == want, (N, w)


def test_window_reach_values():
    assert window_reach(8, 16) == Fraction(36, 64)
    assert window_reach(8, 1) == 0  # the query key sees only itself
    assert window_reach(8, 4 * 8) == 1  # the whole sequence
    assert window_reach(8, 4 * 8 - 2) == 1  # 4 N - 2: the farthest is 4N-3
    assert window_reach(8, 4 * 8 - 3) == 1 - Fraction(1, 64)
    for bad in (0, 2.0, None, True):
        with pytest.raises(ValueError, match="w must"):
            window_reach(8, bad)
    with pytest.raises(ValueError, match="distinct keys"):
        window_reach(KEYS + 1, 4)
    with pytest.raises(ValueError, match="pairs"):
        window_reach(0, 4)


def test_build_recall_shift():
    for name in ("linear", "mha"):
        plain = build_recall(name, 16, seed=0, shift=False)
        shifted = build_recall(name, 16, seed=0, shift=True)
        assert not isinstance(plain.embed, recall.PreviousToken)
        assert isinstance(plain.embed, torch.nn.Embedding)
        assert not any("previous" in k for k in plain.state_dict())
        assert isinstance(shifted.embed, recall.PreviousToken)
        assert "embed.previous.weight" in shifted.state_dict()
        default = build_recall(name, 16, seed=0)
        assert isinstance(default.embed, recall.PreviousToken) == recall.SHIFT
    x = torch.tensor([[3, 40, 5]])
    assert torch.equal(plain.embed(x), plain.embed.weight[x])  # no P row
    with pytest.raises(ValueError, match="shift"):
        build_recall("mha", 16, 0, shift=1)


def test_value_errors_name_the_problem():
    """C2: None, lists, float counts and NaN give a named ValueError (they
    gave AttributeError, TypeError or RuntimeError)."""
    model = build_recall("mha", 16, 0)
    plain = recall.PreviousToken(torch.nn.Embedding(4, 2), 4)  # IndexError
    x, y, query = mqar_batch(2, 2, torch.Generator().manual_seed(0))
    cases = [
        (lambda: recall_accuracy(None, x, y, query), "nn.Module"),
        (lambda: recall_accuracy(model, None, y, query), "x must"),
        (lambda: recall_accuracy(model, x, [1], query), "y must"),
        (lambda: recall_accuracy(model, x, y, query.long()), "query must"),
        (lambda: recall_accuracy(model, x, y[:1], query), "one shape"),
        (lambda: top_gap(model, x.tolist(), query), "x must"),
        (lambda: top_gap(model, x, None), "query must"),
        (lambda: top_gap("mha", x, query), "nn.Module"),
        (lambda: build_recall("mha", 16, None), "seed"),
        (lambda: build_recall("mha", 16.0, 0), "d must"),
        (lambda: build_recall(["mha"], 16, 0), "unknown model"),
        (lambda: held_numbers(None, 3), "GPT"),
        (lambda: held_numbers(model, 3.0), "T must"),
        (lambda: train_recall(None, 1, 0, [2]), "nn.Module"),
        (lambda: train_recall(model, 1, None, [2]), "seed"),
        (lambda: train_recall(model, 1, 0, None), "pairs"),
        (lambda: train_recall(model, 1, 0, [2], B=2.0), "B must"),
        (lambda: train_recall(model, 1, 0, [2], lr=math.nan), "lr"),
        (lambda: train_recall(model, 1, 0, [2], lr=None), "lr"),
        (lambda: recall.PreviousToken(None, VOCAB), "nn.Embedding"),
        (lambda: model.embed([[1, 2]]), "tokens must"),
        (lambda: model.embed(torch.tensor([1, 2])), "tokens must"),
        (lambda: plain(torch.tensor([[1, 4]])), "outside the vocabulary"),
        (lambda: mqar_batch(2, 2.0, torch.Generator()), "pairs"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()


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
    with pytest.raises(ValueError, match="increase strictly"):
        falls_below([2, 2], [0.2, 0.2])
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
    rows = tool.evaluate_recall(EvenOracle(), "mha", 8, shift=False)
    for r, N in zip(rows, (1, 4, 6), strict=True):
        gen = torch.Generator().manual_seed(tool.HELD_SEED + N)
        _, y, query = mqar_batch(7, N, gen)
        even = int((y[query] % 2 == 0).sum())
        assert r == {
            "name": "mha",
            "d": 8,
            "shift": False,
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


def test_previous_token_refuses_caches_that_hold_tokens():
    """PreviousToken holds nothing between calls: fed token by token with
    caches, its first token would get a zero row where the token before
    belongs (wrong logits, no error). A model whose caches already hold
    tokens is refused by name; whole sequences from empty caches agree with
    the cache-free call."""
    tokens = torch.tensor([[5, 40, 7, 33, 5, 12]])
    for name in ("mha", "linear"):
        model = build_recall(name, 16, seed=0).eval()
        with torch.no_grad():
            caches = model.new_caches()
            whole = model(tokens, caches=caches)
            torch.testing.assert_close(whole, model(tokens), rtol=0, atol=1e-6)
            with pytest.raises(ValueError, match="predecessor"):
                model(tokens[:, :1], caches=caches)
            caches = model.new_caches()
            model(tokens[:, :3], caches=caches)
            with pytest.raises(ValueError, match="whole sequences"):
                model(tokens[:, 3:4], caches=caches)
        with pytest.raises(ValueError, match="predecessor"):
            Decoder(model, 16)  # chapter 11's: it reads embed.weight alone
        plain = build_recall(name, 16, seed=0, shift=False).eval()
        with torch.no_grad():  # the plain embedding still decodes with caches
            caches = plain.new_caches()
            steps = [
                plain(tokens[:, t : t + 1], caches=caches) for t in range(6)
            ]
            torch.testing.assert_close(
                torch.cat(steps, dim=1), plain(tokens), rtol=0, atol=1e-5
            )


def test_training_script_uses_the_modules_settings():
    import train_circuits as tool

    assert (tool.RECALL_STEPS, tool.RECALL_B, tool.RECALL_LR) == (
        recall.STEPS,
        recall.BATCH,
        recall.LR,
    )
    assert (tool.PAIRS_TRAIN, tool.PAIRS_EVAL) == (
        recall.PAIRS_TRAIN,
        recall.PAIRS_EVAL,
    )
    assert (tool.N_HELD, tool.HELD_SEED) == (recall.N_HELD, recall.HELD_SEED)
    # the values the stored models were trained with
    assert (recall.STEPS, recall.BATCH, recall.LR) == (600, 64, 3e-3)
    assert recall.PAIRS_TRAIN == (2, 2, 2, 4, 4, 8, 16)
    assert recall.PAIRS_EVAL == (2, 4, 8, 16, 32)
    assert (recall.N_HELD, recall.HELD_SEED) == (256, 20_000)


def test_training_script_names_map_back():
    """Every recall model's file name is recall_model of its (name, d,
    shift); the ten models with the previous-token embedding and the one
    linear model without it."""
    import train_circuits as tool

    models = tool.RECALL_MODELS
    assert len(models) == 11
    for file, (name, d, shift) in models.items():
        assert tool.recall_model(name, d, shift) == file
    assert models["recall_linear_noshift_d64"] == ("linear", 64, False)
    assert sum(not shift for _, _, shift in models.values()) == 1
    assert len(set(models.values())) == 11


def test_training_script_writes_shift(tmp_path, monkeypatch):
    """main_recall's tables: a `shift` column in both, and a model column
    that names each model's weights file, the probe's included."""
    import argparse

    import pandas as pd
    import train_circuits as tool

    def fake(name, steps):
        kind, d, shift = tool.RECALL_MODELS[name]
        row = {"name": kind, "d": d, "shift": shift, "pairs": 2}
        return [row | {"right": 1, "total": 2, "gap": 1.0}], {
            "name": kind,
            "d": d,
            "shift": shift,
            "cpu_s": 1.0,
        }

    monkeypatch.setattr(tool, "train_recall_one", fake)
    monkeypatch.setattr(tool, "RECALL_ACCURACY", tmp_path / "acc.csv")
    monkeypatch.setattr(tool, "RECALL_SUMMARY", tmp_path / "train.csv")
    tool.main_recall(argparse.Namespace(only=None, steps=1))
    for path in ("acc.csv", "train.csv"):
        table = pd.read_csv(tmp_path / path)
        assert table.model.tolist() == list(tool.RECALL_MODELS)
        assert table["shift"].tolist() == [
            s for _, _, s in tool.RECALL_MODELS.values()
        ]


def test_training_script_trains_the_probe_without_shift(tmp_path, monkeypatch):
    import train_circuits as tool

    monkeypatch.setattr(tool, "OUT", tmp_path)
    monkeypatch.setattr(tool, "PAIRS_TRAIN", (2,))
    monkeypatch.setattr(tool, "PAIRS_EVAL", (2,))
    monkeypatch.setattr(tool, "N_HELD", 3)
    monkeypatch.setattr(tool, "RECALL_B", 2)
    rows, summary = tool.train_recall_one("recall_linear_noshift_d64", 1)
    assert summary["shift"] is False and rows[0]["shift"] is False
    model = build_recall("linear", 64, seed=0, shift=False)
    state = torch.load(tmp_path / "recall_linear_noshift_d64.pt")
    model.load_state_dict(state)  # strict: no previous-token embedding
    assert not any("previous" in k for k in state)


def test_stored_tables_have_shift():
    import pandas as pd
    from chapter_loader import BOOK

    for name in ("recall_accuracy", "recall_train"):
        table = pd.read_csv(BOOK / "data" / f"{name}.csv")
        assert table["shift"].dtype == bool
        # every model with PreviousToken but the probe without it
        plain = table.model.str.contains("_noshift_")
        assert (table["shift"] == ~plain).all() and plain.any()
        assert set(table.model[plain]) == {"recall_linear_noshift_d64"}
