"""Chapter 16: the chapter's own functions, against independent references
(book/flex.py is tested in tests/test_flex.py).

- `within` passes a gap below its bound, fails one above it, whatever its
  sign, and refuses results of different shapes;
- `bucket` (exercise 1) against T5's bucket written with Python's math on
  integers, for several numbers of buckets;
- `bucket_bias` run by FlexAttention against the bias matrix written out
  with that reference, on shapes the chapter never prints;
- `side` (where an interval lies against a value) against
  tools/measure.py's `verdict`.
"""

import math

import pytest
import torch
from conftest import load_chapter

import flex


@pytest.fixture(scope="module")
def ch16():
    return load_chapter("16_flex_attention.ipynb")


def test_within_passes_below_the_bound(ch16):
    a = torch.zeros(3, 4, dtype=torch.float64)
    assert ch16.within(a + 1e-13, a) == "max |difference| < 1e-12"
    assert ch16.within(a, a + 0.5, bound=1.0) == "max |difference| < 1e+00"


@pytest.mark.parametrize("gap", [1e-11, -1e-11, 1.0, -1.0])
def test_within_fails_above_the_bound(ch16, gap):
    a = torch.zeros(3, 4, dtype=torch.float64)
    b = a.clone()
    b[2, 1] = gap
    with pytest.raises(AssertionError):
        ch16.within(a, b)


def test_within_refuses_other_shapes(ch16):
    with pytest.raises(AssertionError):
        ch16.within(torch.zeros(3, 1), torch.zeros(3))


def t5_bucket(distance, buckets, exact, far):
    """T5's causal bucket of one distance, with Python floats."""
    distance = max(distance, 0)
    if distance < exact:
        return distance
    wide = exact + int(
        math.log(distance / exact) / math.log(far / exact) * (buckets - exact)
    )
    return min(wide, buckets - 1)


@pytest.mark.parametrize(
    ("buckets", "exact", "far"), [(8, 4, 90), (12, 3, 100), (6, 2, 40)]
)
def test_bucket_is_t5s(ch16, buckets, exact, far):
    distance = torch.arange(-5, 400)
    ours = ch16.bucket(distance, buckets, exact, far)
    expected = [t5_bucket(int(d), buckets, exact, far) for d in distance]
    assert ours.tolist() == expected
    assert ours.max() == buckets - 1  # every bucket is reached
    assert sorted(set(expected)) == list(range(buckets))


@pytest.mark.parametrize(("H", "T"), [(3, 150), (1, 40)])
def test_bucket_bias_is_the_explicit_bias(ch16, H, T):
    gen = torch.Generator().manual_seed(3)
    Q, K, V = (
        torch.randn(2, H, T, 8, generator=gen, dtype=torch.float64)
        for _ in range(3)
    )
    table = torch.randn(H, 8, generator=gen, dtype=torch.float64)
    bias = torch.tensor(
        [
            [
                [table[h, t5_bucket(i - j, 8, 4, 90)] for j in range(T)]
                for i in range(T)
            ]
            for h in range(H)
        ],
        dtype=torch.float64,
    )  # (H, T, T)
    scores = Q @ K.transpose(-2, -1) / math.sqrt(8) + bias
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    ours = flex.attend(Q, K, V, flex.causal, ch16.bucket_bias(table))
    torch.testing.assert_close(ours, weights @ V, atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    "lo, hi, value",
    [(1.09, 1.67, 1.0), (1.09, 1.67, 1.5), (1.09, 1.67, 2.0), (0.75, 0.88, 1.0),
     (0.93, 1.15, 1.0), (5.03, 7.13, 2.0), (0.56, 0.63, 0.95), (1.0, 1.2, 1.0),
     (0.8, 1.0, 1.0)],
)  # fmt: skip
def test_side_equals_the_measuring_module(ch16, lo, hi, value):
    """The chapter's `side`, which states a speed-up or a target as met or
    missed, against tools/measure.py's `verdict` (the book's one rule): an
    interval that touches the value cannot tell."""
    import measure

    expected = measure.verdict(lo, hi, value)
    assert ch16.side(lo, hi, value) == expected.replace(
        "cannot be told apart", "cannot tell"
    )
