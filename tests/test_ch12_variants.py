"""Chapter 12's own code (book/12_variants.ipynb): `numbers_per_token`, the
count of what each trained model's caches hold per token, against the real
caches of freshly built models of the same kinds (`nbytes()` after a
prefill and the copies `extend` adds), at lengths the chapter never prints;
`extend` against a cache filled by the model itself; the published-model
formula's pieces against their configurations' arithmetic."""

import measure  # tools/, on the path by tests/conftest.py
import pytest
import torch
from conftest import LazyChapter

import variants as v
from gpt import GPT

ch12 = LazyChapter("12_variants.ipynb")
VOCAB = 65  # chapter 10's characters
NAMES = [
    "mha",
    "gqa",
    "mqa",
    "mqa_wide",
    "window",
    "mla",
    "cla",
    "hybrid",
    "sparse",
]


def build(name):
    """An untrained model of kind `name`, with chapter 10's sizes."""
    if name in ("mha", "mqa"):
        torch.manual_seed(0)
        model = GPT(
            VOCAB, d=64, H=4, layers=2, d_ff=256, G=4 if name == "mha" else 1
        )
    else:
        model, _ = v.build_variant(name, VOCAB)
    return model.eval()


def tokens(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(VOCAB, (n,), generator=gen)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("T", [1, 31, 33, 700])
def test_the_count_equals_the_real_caches(name, T):
    held = ch12.cache_bytes(build(name), T, tokens(600))
    assert round(4 * T * sum(ch12.numbers_per_token(name, T).values())) == held


@pytest.mark.parametrize(
    "name", ["mha", "window", "mla", "cla", "hybrid", "sparse"]
)
def test_extend_holds_what_the_model_would_have_cached(name):
    """Copies added by `extend` take the bytes that 90 more real tokens take."""
    model, text = build(name), tokens(130, seed=1)
    real = model.new_caches()
    with torch.no_grad():
        model(text[None], real)
    copied = model.new_caches()
    with torch.no_grad():
        model(text[:40][None], copied)
    for cache in copied:
        ch12.extend(cache, 90)
    assert [c.nbytes() for c in copied] == [c.nbytes() for c in real]
    assert [c.length for c in copied] == [c.length for c in real] == [130, 130]


def test_the_count_of_other_sizes():
    """A four-layer MHA of head size 8: 2 L G d_k numbers per token."""
    assert ch12.numbers_per_token("mha", 10, L=4, d_k=8) == {
        "keys and values": 2 * 4 * 4 * 8
    }
    assert ch12.numbers_per_token("cla", 10, L=4, d_k=8) == {
        "keys and values": 2 * 2 * 4 * 8
    }


def test_an_unknown_model_raises():
    with pytest.raises(ValueError, match="unknown model 'gpt2'"):
        ch12.numbers_per_token("gpt2", 10)


# --- paired differences at matched seeds (issue 46) --------------------------


@pytest.mark.parametrize("df", [1, 2])
@pytest.mark.parametrize("p", [0.3, 0.6, 0.9, 0.95, 0.975, 0.995])
def test_t_quantile_equals_scipys(p, df):
    """scipy's stdtrit inverts the t distribution function numerically (its
    incomplete beta function): no closed form shared with the chapter."""
    from scipy.special import stdtrit  # imported here: seconds to import

    assert ch12.t_quantile(p, df) == pytest.approx(stdtrit(df, p), rel=1e-12)


def test_t_quantile_known_values():
    """t(0.975) for 2 d.f.: 0.95 sqrt(2 / 0.0975) = 4.302652729749464 (by
    hand, to 30 digits); for 1 d.f.: tan(0.475 pi) = 12.706204736174705."""
    assert ch12.t_quantile(0.975, 2) == pytest.approx(4.302652729749464, 1e-14)
    assert ch12.t_quantile(0.975, 1) == pytest.approx(
        12.706204736174705, 1e-14
    )


def test_t_interval_by_hand_and_against_measure():
    """Three differences 0.01, 0.03, 0.02: mean 0.02, standard deviation
    0.01, half-width 4.302652729749464 * 0.01 / sqrt(3); and the same as
    tools/measure.py's t_interval (bisection on another closed form) for
    two and three differences."""
    mean, low, high, df = ch12.t_interval([0.01, 0.03, 0.02])
    half = 4.302652729749464 * 0.01 / 3**0.5
    assert df == 2 and mean == pytest.approx(0.02, abs=1e-15)
    assert (low, high) == pytest.approx((0.02 - half, 0.02 + half), abs=1e-14)
    for diffs in ([0.0081, 0.0145], [-0.03, -0.05, -0.041], [0.2, -0.1, 0.05]):
        assert ch12.t_interval(diffs) == pytest.approx(
            measure.t_interval(diffs), abs=1e-12
        )


def test_t_interval_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="1 difference"):
        ch12.t_interval([0.01])
    with pytest.raises(ValueError, match="df = 1 or 2"):
        ch12.t_interval([0.01, 0.02, 0.03, 0.04])
    with pytest.raises(ValueError, match="0 < p < 1"):
        ch12.t_quantile(1.0, 2)


def test_vs_mha_pairs_each_seed_with_mhas_own(monkeypatch):
    """A variant's seed s is compared with MHA's seed s, and only the seeds
    the variant has are paired."""
    val = {"mha": 1.9, "mha_seed1": 1.8, "mha_seed2": 1.85}
    val |= {"gqa": 1.95, "gqa_seed1": 1.86, "gqa_seed2": 1.87, "cla": 1.7}
    val |= {"mqa": 1.91, "mqa_seed1": 1.83}
    monkeypatch.setattr(ch12, "val", val, raising=False)
    assert ch12.vs_mha("gqa") == pytest.approx({0: 0.05, 1: 0.06, 2: 0.02})
    assert ch12.vs_mha("mqa") == pytest.approx({0: 0.01, 1: 0.03})
    assert ch12.vs_mha("cla") == pytest.approx({0: -0.2})


def test_vs_mha_pairs_by_seed_when_a_seed_is_missing(monkeypatch):
    """A variant trained from seeds 0 and 2 only: its seed 2 is paired with
    MHA's seed 2 (2.00 - 1.85), not with MHA's second run, seed 1."""
    val = {"mha": 1.9, "mha_seed1": 1.8, "mha_seed2": 1.85}
    val |= {"gqa": 1.95, "gqa_seed2": 2.0}
    monkeypatch.setattr(ch12, "val", val, raising=False)
    assert dict(ch12.vs_mha("gqa")) == pytest.approx({0: 0.05, 2: 0.15})


def test_t_interval_and_t_quantile_refuse_what_is_not_a_number():
    """A NaN, an infinity, a bool or a non-number among the differences,
    differences that are no list, a level that is no number in (0, 1), or
    a p that is no number, is named in a ValueError (not AttributeError,
    TypeError, a NaN interval or one of zero width)."""
    bad_diffs = ([float("nan"), 1.0], [0.01, float("inf")], [0.01, "x"])
    bad_diffs += ([True, False], [0.01, True], None, "ab", {1: 2, 3: 4})
    for diffs in bad_diffs:
        with pytest.raises(ValueError, match="must be finite numbers"):
            ch12.t_interval(diffs)
    for level in ("x", None, 0, 1, -0.5, True, float("nan"), [0.95]):
        with pytest.raises(ValueError, match="0 < level < 1"):
            ch12.t_interval([0.01, 0.02], level)
    assert ch12.t_interval((0.01, 0.03), 0.5)[3] == 1  # a tuple is fine
    for p in ("x", None, float("nan"), [0.975]):
        with pytest.raises(ValueError, match="0 < p < 1"):
            ch12.t_quantile(p, 1)


@pytest.mark.parametrize("T", [0, -512, 2.5, True, None])
def test_numbers_per_token_refuses_a_bad_length(T):
    """A length that is not a whole number >= 1 is named in a ValueError
    (it divided by zero, or returned negative numbers, for the window)."""
    for name in ("window", "hybrid", "mha"):
        with pytest.raises(ValueError, match="T must be a whole number"):
            ch12.numbers_per_token(name, T)
