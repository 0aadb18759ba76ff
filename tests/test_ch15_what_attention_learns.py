"""Chapter 15: the chapter's own functions and stored results, against
references written here, on cases the chapter never prints:

- its WEIGHTS are the models tools/train/train_circuits.py trains and
  stores, loaded by the chapter's `load`;
- the training log's last row of every model (the other targets' loss, each
  head's prefix-matching and same-token scores) from the stored weights,
  the scores by their closed form on the probe (n distinct tokens twice:
  query n + m has its one match at key m + 1, its own earlier token at m);
- `head_scores` on an untrained model against those closed forms and NumPy's
  eigenvalues; `find_heads` and `induction_heads` on hand-built tables;
  `by_offset` and `max_over` on hand-built weights;
  `previous_share` on a model built to attend to the previous position;
  `accuracy` against Wilson's formula written out, n = the sequences.
"""

import math
import os

import numpy as np
import pandas as pd
import pytest
import torch
import train_circuits as tool  # tools/train/train_circuits.py
from conftest import BOOK, load_chapter

import circuits

N = 32  # the probe's distinct tokens: T = 64


@pytest.fixture(scope="module")
def ch15():
    return load_chapter("15_what_attention_learns.ipynb")


@pytest.fixture(scope="module")
def stored(ch15):
    cwd = os.getcwd()
    os.chdir(BOOK)  # the chapter's paths are relative to book/
    try:
        return {key: ch15.load(key) for key in ch15.WEIGHTS}
    finally:
        os.chdir(cwd)


def the_probe():
    gen = torch.Generator().manual_seed(circuits.EVAL_SEED)
    return circuits.probe_sequence(N, 64, gen)


def closed_form(A):
    """Prefix-matching and same-token scores of weights A (..., 2N, 2N) on
    a probe of N distinct tokens repeated once."""
    second = torch.arange(N, 2 * N)
    return (
        A[..., second, second - N + 1].mean(dim=-1),
        A[..., second, second - N].mean(dim=-1),
    )


def test_weights_are_the_training_scripts(ch15):
    names = {f"induction_L{n}_seed{s}": (n, s) for n, s in ch15.WEIGHTS}
    assert names == tool.MODELS
    assert tuple(ch15.SEEDS) == tool.SEEDS
    for path in ch15.WEIGHTS.values():
        assert (BOOK / path).is_file(), path


def test_logged_last_rows_again(stored):
    log = pd.read_csv(BOOK / "data" / "circuits_train_log.csv")
    gen = torch.Generator().manual_seed(circuits.EVAL_SEED)
    held = circuits.repeated_segments(circuits.N_EVAL, 64, 64, gen)
    probe = the_probe()
    for (layers, seed), model in stored.items():
        last = log[(log.layers == layers) & (log.seed == seed)].iloc[-1]
        assert last.step == tool.STEPS
        _, other, _, _ = circuits.in_context_metrics(model, *held)
        assert other == pytest.approx(last.other_loss, abs=1e-4)
        _, A = model(probe[None], return_weights=True)
        prefix, same = closed_form(A[0])  # (layers, H) each
        for i in range(layers):
            for h in range(model.H):
                assert prefix[i, h] == pytest.approx(
                    last[f"prefix_{i}{h}"], abs=1e-4
                )
                assert same[i, h] == pytest.approx(
                    last[f"same_{i}{h}"], abs=1e-4
                )


def test_head_scores_against_closed_forms(ch15):
    ch15.probe = the_probe()
    torch.manual_seed(5)
    model = circuits.AttnOnly(layers=2, **circuits.SIZES).double()
    table = ch15.head_scores(model)
    _, A = model(ch15.probe[None], return_weights=True)
    prefix, _ = closed_form(A[0])
    for i in range(2):
        for h in range(4):
            row = table.loc[f"L{i + 1}H{h + 1}"]
            assert row.prefix == pytest.approx(prefix[i, h].item(), abs=1e-12)
            prev = np.mean([A[0, i, h, t, t - 1].item() for t in range(1, 64)])
            assert row.previous == pytest.approx(prev, abs=1e-12)
            W = model.W_V[i, h] @ model.W_O[i, h]
            M = (model.W_E @ W @ model.W_U).detach().numpy()
            lam = np.linalg.eigvals(M)
            want = lam.sum().real / np.abs(lam).sum()
            assert row.copying == pytest.approx(want, abs=1e-9)


def scores_table(previous, prefix):
    index = [f"L{i}H{h}" for i in (1, 2) for h in (1, 2, 3, 4)]
    return pd.DataFrame({"previous": previous, "prefix": prefix}, index=index)


def test_find_heads_and_induction_heads(ch15):
    s = scores_table(
        [0.1, 0.2, 0.9, 0.3, 0.95, 0.1, 0.1, 0.1],  # L2H1 is no layer-1 head
        [0.9, 0.01, 0.1, 0.1, 0.2, 0.8, 0.5, 0.6],  # L1H1: layer 1
    )
    assert ch15.find_heads(s) == ("L1H3", "L2H2")
    assert ch15.induction_heads(s) == ["L2H2", "L2H4"]  # above 0.5, not at


def test_by_offset_on_a_built_pattern(ch15):
    T, offsets = 12, torch.tensor([0.1, 0.5, 0.2, 0.15, 0.05])
    A = torch.zeros(T, T, dtype=torch.float64)
    for i in range(T):  # weight w_o on key i - o, the rest on key 0
        for o, w in enumerate(offsets.tolist()):
            if i - o > 0:
                A[i, i - o] += w
        A[i, 0] += 1 - A[i].sum()
    want = [
        sum(A[i, i - o].item() for i in range(o, T)) / (T - o)
        for o in range(5)
    ]
    assert ch15.by_offset(A) == pytest.approx(want, abs=1e-15)


def test_max_over_takes_the_highest_head(ch15):
    ch15.probe = the_probe()
    ch15.index = {
        f"L{a + 1}H{h + 1}": (a, h) for a in range(2) for h in range(4)
    }
    ch15.inductions = {9: ["L2H1", "L2H3"]}
    A = torch.zeros(2, 4, 2 * N, 2 * N, dtype=torch.float64)
    second = torch.arange(N, 2 * N)
    A[1, 0, second, second - N + 1] = 0.3  # L2H1: prefix 0.3
    A[1, 2, second, second - N + 1] = 0.7  # L2H3: prefix 0.7
    A[1, 1, second, second - N + 1] = 0.9  # L2H2: no induction head here
    assert ch15.max_over(circuits.prefix_matching, A, 9) == pytest.approx(0.7)


def test_previous_share_on_a_built_model(ch15):
    ch15.causal = torch.ones(64, 64, dtype=torch.bool).tril()
    model = circuits.AttnOnly(8, 4, 2, 1, 64).double()
    theta = 0.02  # 63 theta < pi: cos((i - 1 - j) theta) peaks at j = i - 1
    angles = theta * torch.arange(64, dtype=torch.float64)
    with torch.no_grad():
        model.W_pos.zero_()
        model.W_pos[:, 0], model.W_pos[:, 1] = angles.cos(), angles.sin()
        c, s = math.cos(theta), math.sin(theta)
        R = torch.tensor([[c, -s], [s, c]], dtype=torch.float64)
        model.W_Q.zero_()
        model.W_K.zero_()
        model.W_Q[0, 0, :2], model.W_K[0, 0, :2] = R, torch.eye(2)
        model.W_Q[0, 1, :2], model.W_K[0, 1, :2] = torch.eye(2), torch.eye(2)
    assert ch15.previous_share(model, 0) == 1.0
    assert ch15.previous_share(model, 1) == 0.0  # it looks at itself


def test_accuracy_counts_sequences(ch15):
    """accuracy: the share of in-context targets right, and Wilson's
    interval for it with n = the number of sequences (not of targets)."""
    torch.manual_seed(0)
    model = circuits.AttnOnly(layers=1, **circuits.SIZES).double()
    gen = torch.Generator().manual_seed(4)
    ch15.sub = circuits.repeated_segments(8, 64, 64, gen)
    p, low, high = ch15.accuracy(model)
    _, _, right, total = circuits.in_context_metrics(model, *ch15.sub)
    z, n, q = 1.959963984540054, 8, right / total
    centre = (q + z * z / (2 * n)) / (1 + z * z / n)
    half = (
        z / (1 + z * z / n) * math.sqrt(q * (1 - q) / n + z * z / (4 * n * n))
    )
    assert total > 8 * 15 and p == q
    assert (low, high) == pytest.approx(
        (max(0.0, centre - half), min(1.0, centre + half)), abs=1e-12
    )
