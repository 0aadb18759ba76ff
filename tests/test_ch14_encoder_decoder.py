"""Chapter 14: the chapter's own functions, against independent references.

- the data: `make_reversal_data`, `unseen`, `label` and the token ids are
  chapter 9's (its notebook's own definitions, loaded the same way);
- `exact_match`, `first_errors` and `row_labels` against loops written here;
- `load_model` and `results_at` on stored models give the rows of the table
  `make train-seq2seq` stored (tools/train/train_seq2seq.py, `by_length`);
- `same_output`: no positions, a shuffled source changes no token; rotary, a
  reversed one does;
- `breakdown`, `looks_at` and `writes` (the attention and token readouts)
  against loops; `alibi_right` against the table's errors; `other_rise`
  against Newcombe's interval built from scipy's Wilson intervals.
"""

import json

import pandas as pd
import pytest
import torch
from conftest import BOOK, load_chapter


@pytest.fixture(scope="module")
def ch14():
    return load_chapter("14_encoder_decoder.ipynb")


@pytest.fixture(scope="module")
def ch09():
    return load_chapter("09_additive_attention.ipynb")


@pytest.fixture(scope="module")
def stored(ch14):
    """The chapter's spec (read by load_model), from book/, and the table."""
    ch14.spec = json.loads(
        (BOOK / "data" / "seq2seq_models.json").read_text(encoding="utf-8")
    )
    table = pd.read_csv(BOOK / "data" / "seq2seq_lengths.csv")
    return table.set_index(["model", "length"])


def test_tokens_are_chapter_9s(ch14, ch09):
    V = ch09.Vocab
    assert (ch14.PAD, ch14.BOS, ch14.EOS, ch14.FIRST_DIGIT) == (
        V.PAD,
        V.BOS,
        V.EOS,
        V.FIRST_DIGIT,
    )
    for token in range(V.SIZE):
        assert ch14.label(token) == V.label(token)


@pytest.mark.parametrize(
    "args", [(50, 1, 4, 3), (7, 6, 10, 0), (30, 11, 11, 111), (5, 2, 20, 9)]
)
def test_data_are_chapter_9s(ch14, ch09, args):
    ours, theirs = (
        ch14.make_reversal_data(*args),
        ch09.make_reversal_data(*args),
    )
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


def test_unseen_is_chapter_9s(ch14, ch09):
    seen = ch09.make_reversal_data(300, 1, 3, 0)
    data = ch09.make_reversal_data(200, 1, 3, 1)  # many repeats
    ours, theirs = ch14.unseen(data, seen), ch09.unseen(data, seen)
    assert 0 < len(ours[0]) < 200
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("args", [(0, 1, 3, 0), (5, 0, 3, 0), (5, 4, 3, 0)])
def test_bad_data_arguments(ch14, args):
    with pytest.raises(ValueError, match="min_len"):
        ch14.make_reversal_data(*args)


def random_predictions(seed):
    """Targets of chapter 9's form and predictions that are often right."""
    gen = torch.Generator().manual_seed(seed)
    ch09 = load_chapter("09_additive_attention.ipynb")
    tgt = ch09.make_reversal_data(40, 1, 6, seed)[2]
    noise = torch.randint(0, 13, tgt.shape, generator=gen)
    flip = torch.rand(tgt.shape, generator=gen) < 0.05
    return torch.where(flip, noise, tgt), tgt


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_match_and_first_errors_against_loops(ch14, seed):
    pred, tgt = random_predictions(seed)
    right, firsts = [], []
    for p, t in zip(pred.tolist(), tgt.tolist()):
        wrong = [i for i, (a, b) in enumerate(zip(p, t)) if b != 0 and a != b]
        right.append(not wrong)
        if wrong:
            firsts.append(wrong[0] + 1)
    assert ch14.exact_match(pred, tgt).tolist() == right
    assert 0 < sum(right) < len(right)
    assert ch14.first_errors(pred, tgt).tolist() == firsts


def test_row_labels(ch14):
    assert ch14.row_labels([5, 2, 0], [5, 6, 0]) == ["2", "</s>≠3", "·"]


def test_load_model_gives_float64_stored_weights(ch14, stored, monkeypatch):
    monkeypatch.chdir(BOOK)  # the chapter's paths are relative to book/
    model = ch14.load_model("learned")
    assert all(w.dtype == torch.float64 for w in model.parameters())
    assert not model.training
    saved = torch.load(BOOK / "data" / "seq2seq" / "learned.pt")
    for name, w in model.state_dict().items():
        assert torch.equal(w, saved[name].double()), name


@pytest.mark.parametrize(
    "positions, n", [("rotary", 6), ("alibi", 8), ("rotary", 11)]
)
def test_results_at_gives_the_stored_rows(
    ch14, ch09, stored, monkeypatch, positions, n
):
    monkeypatch.chdir(BOOK)
    model = ch14.load_model(positions)
    if n <= 10:
        data = ch09.unseen(
            ch09.make_reversal_data(**ch09.HELD_OUT),
            ch09.make_reversal_data(**ch09.TRAIN_SET),
        )
    else:
        data = ch09.make_reversal_data(200, n, n, 100 + n)
    acc, mirror, errors, pred, cross = ch14.results_at(model, data, n)
    row = stored.loc[positions, n]
    assert abs(acc - row.accuracy) < 1e-6
    assert abs(mirror - row.mirror_weight) < 1e-6
    assert len(errors) == row.errors
    assert abs(errors.double().mean() - row.first_error_mean) < 1e-6
    assert pred.shape == (row.strings, data[2].shape[1])
    assert cross.shape == (row.strings, 2, 4, data[2].shape[1], n)


def test_same_output(ch14, ch09, stored, monkeypatch):
    monkeypatch.chdir(BOOK)
    src, lengths, _ = ch09.make_reversal_data(20, 7, 7, 5)
    shuffle = torch.tensor([3, 0, 6, 1, 5, 2, 4])
    reverse = torch.arange(6, -1, -1)
    assert ch14.same_output(ch14.load_model("none"), src, lengths, shuffle)
    rotary = ch14.load_model("rotary")
    assert not ch14.same_output(rotary, src, lengths, reverse)


def test_breakdown_against_loops(ch14, ch09):
    """The chapter's `breakdown` of answers to strings of one length:
    right, unreversed (the source as written) and other answers, and the
    wrong ones by first wrong output digit (1, 2, later), by loops."""
    n = 5
    src, _, tgt = ch09.make_reversal_data(60, n, n, 4)
    gen = torch.Generator().manual_seed(4)
    pred = tgt.clone()
    kind = torch.randint(0, 3, (60,), generator=gen)
    at = torch.randint(0, n + 1, (60,), generator=gen)
    for b in range(60):
        if kind[b] == 1:
            pred[b, :n] = src[b, :n]  # written unreversed
        elif kind[b] == 2:
            pred[b, at[b]] = (pred[b, at[b]] + 1) % 13
    counts = {"right": 0, "unreversed": 0, "other": 0}
    firsts = {"at 1": 0, "at 2": 0, "later": 0}
    for p, t, s in zip(pred.tolist(), tgt.tolist(), src.tolist()):
        if p[: n + 1] == t[: n + 1]:
            counts["right"] += 1
            continue
        counts["unreversed" if p[:n] == s[:n] else "other"] += 1
        first = next(i for i in range(n + 1) if p[i] != t[i]) + 1
        firsts[{1: "at 1", 2: "at 2"}.get(first, "later")] += 1
    assert ch14.breakdown(pred, tgt, n) == counts | firsts
    assert min(counts.values()) > 0 and min(firsts.values()) > 0


def test_looks_at_against_loops(ch14):
    """`looks_at` counts, at each output digit asked for, the strings whose
    last layer's mean-of-heads weight is largest on the mirror n + 1 - t
    and on n - t."""
    gen = torch.Generator().manual_seed(6)
    n, B = 6, 50
    cross = torch.rand(B, 2, 3, n + 1, n, generator=gen, dtype=torch.float64)
    cross[:, 0] = 0  # the first layer must not count
    on_mirror, on_left = ch14.looks_at(cross, n, [2, 3, 5])
    want_mirror, want_left = [], []
    for t in (2, 3, 5):
        top = []
        for b in range(B):
            mean = [
                sum(cross[b, 1, h, t - 1, j] for h in range(3))
                for j in range(n)
            ]
            top.append(mean.index(max(mean)) + 1)
        want_mirror.append(top.count(n + 1 - t))
        want_left.append(top.count(n - t))
    assert (on_mirror, on_left) == (want_mirror, want_left)
    assert min(want_mirror + want_left) > 0


def test_writes_against_loops(ch14):
    """`writes` counts, at each output digit asked for, the strings whose
    written digit is the source digit n + 1 - t and n - t (from 1)."""
    gen = torch.Generator().manual_seed(7)
    n, B = 6, 60
    src = torch.randint(3, 7, (B, n), generator=gen)  # repeated digits
    pred = torch.randint(3, 7, (B, n + 1), generator=gen)
    got = ch14.writes(pred, src, n, [1, 2, 3, 6])
    want_mirror, want_left = [], []
    for t in (1, 2, 3, 6):
        want_mirror.append(
            sum(pred[b, t - 1] == src[b, n - t] for b in range(B))
        )
        want_left.append(
            sum(
                t < n and pred[b, t - 1] == src[b, n - t - 1] for b in range(B)
            )
        )
    assert got == (want_mirror, want_left)
    assert want_left[-1] == 0 and min(want_mirror + want_left[:-1]) > 0


def test_alibi_right_and_interval(ch14, stored, monkeypatch):
    """`alibi_right` gives the stored table's right answers (its strings
    less its errors) and strings; `interval` prints 3 decimals."""
    monkeypatch.setattr(ch14, "table", stored, raising=False)
    for n in (6, 11, 20):
        k, strings = ch14.alibi_right(n)
        row = stored.loc["alibi", n]
        assert (k, strings) == (row.strings - row.errors, row.strings)
    assert ch14.alibi_right(11) == (51, 200)
    assert ch14.interval((0.0704, 0.23651)) == "[0.070, 0.237]"


def test_other_rise_against_newcombe(ch14, monkeypatch):
    """`other_rise(a, b)`: Newcombe's interval (method 10, from scipy's
    Wilson intervals) of the share of other answers at b digits minus that
    at a digits."""
    from scipy.stats import binomtest

    kinds = pd.DataFrame({"other": {6: 27, 10: 94}})
    strings = {6: 243, 10: 249}
    monkeypatch.setattr(ch14, "alibi_kinds", kinds, raising=False)
    monkeypatch.setattr(ch14, "targets", lambda n: [0] * strings[n])
    p = {n: kinds.other[n] / strings[n] for n in strings}
    ci = {
        n: binomtest(int(kinds.other[n]), strings[n]).proportion_ci(
            0.95, method="wilson"
        )
        for n in strings
    }
    d = p[10] - p[6]
    low = d - ((p[10] - ci[10].low) ** 2 + (ci[6].high - p[6]) ** 2) ** 0.5
    high = d + ((ci[10].high - p[10]) ** 2 + (p[6] - ci[6].low) ** 2) ** 0.5
    assert ch14.other_rise(6, 10) == pytest.approx((low, high), abs=1e-12)
    assert low > 0
