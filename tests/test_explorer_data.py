"""The attention explorer (book/explorer.py) without a browser or a built
site: its input checks (ValueErrors that name the problem), the rounded
weights and names it stores, its plain-text form and the HTML payload the
page carries. tests/test_explorer.py opens the explorers in Chromium."""

import json
import re
import sys

import numpy as np
import pytest
from conftest import BOOK

sys.path.insert(0, str(BOOK))
from explorer import PRECISION, attention_explorer, distance_to_tie

EXPLORER = re.compile(
    r'<div class="attention-explorer" id="(attention-explorer-[0-9a-f]+)">'
    r'.*?<script type="application/json" class="attention-explorer-data">'
    r"(.*?)</script>",
    re.S,
)


def test_weights_are_rounded_and_shapes_kept():
    rng = np.random.default_rng(0)
    E = rng.normal(size=(2, 3, 4, 5, 5))
    A = np.exp(E) / np.exp(E).sum(axis=-1, keepdims=True)
    ex = attention_explorer(A, [list("abcde"), list("vwxyz")])
    got = np.array([s["weights"] for s in ex.data["sequences"]])
    assert got.shape == A.shape
    np.testing.assert_array_equal(got, np.round(A, PRECISION))
    assert repr(ex) == (
        "<attention explorer: 2 sequences, 3 layers, 4 heads; T = 5, 5; "
        "3 decimals>"
    )
    html = ex._repr_html_()
    ids = EXPLORER.findall(html)
    assert len(ids) == 1 and json.loads(ids[0][1]) == ex.data
    assert (
        html
        == attention_explorer(A, [list("abcde"), list("vwxyz")])._repr_html_()
    )
    assert "cdn" not in html.lower() and "http" not in html


def test_sequences_of_different_lengths_and_cross_attention():
    A1 = np.full((1, 1, 2, 3), 1 / 3)
    A2 = np.full((1, 1, 4, 3), 1 / 3)
    ex = attention_explorer(
        [A1, A2],
        [["a", "b"], ["c", "d", "e", "f"]],
        key_tokens=[["x", "y", "z"], ["x", "y", "z"]],
    )
    assert [len(s["queries"]) for s in ex.data["sequences"]] == [2, 4]
    assert ex.data["sequences"][1]["weights"][0][0][3] == [0.333] * 3
    assert "T = 2, 4" in repr(ex)


@pytest.mark.parametrize(
    "weights, tokens, message",
    [
        (np.full((1, 1, 2, 2), 0.5), ["a", "b"], r"shape \(sequences"),
        (np.full((1, 1, 1, 2, 2), 0.5), ["a", "b", "c"], "2 x 2 but there"),
        (np.full((1, 1, 1, 2, 2), 0.6), ["a", "b"], "sums to 1"),
        (np.full((1, 1, 1, 2, 2), np.nan), ["a", "b"], "NaN"),
        (
            np.array([[[[[1.5, -0.5], [0.5, 0.5]]]]]),
            ["a", "b"],
            r"in \[0, 1\]",
        ),
        (np.full((1, 1, 1, 2, 2), 0.5), "ab", "list of strings"),
        (np.full((2, 1, 1, 2, 2), 0.5), ["a", "b"], "1 lists of tokens"),
        (
            [np.full((1, 1, 1, 1), 1.0), np.full((1, 2, 1, 1), 1.0)],
            [["a"], ["b"]],
            "differ in layers or heads",
        ),
    ],
)
def test_bad_input_raises_a_named_value_error(weights, tokens, message):
    with pytest.raises(ValueError, match=message):
        attention_explorer(weights, tokens)


def test_precision_rounds_the_stored_weights():
    """`precision` decimals are kept, from 1 to 8; the plain-text form says
    how many."""
    A = np.array([[[[[0.123456789, 0.876543211], [0.5, 0.5]]]]])
    for precision in (1, 2, 5, 8):
        ex = attention_explorer(A, ["a", "b"], precision=precision)
        row = ex.data["sequences"][0]["weights"][0][0][0]
        assert row == [
            round(0.123456789, precision),
            round(0.876543211, precision),
        ]
        assert ex.data["precision"] == precision
        assert repr(ex).endswith(f"; {precision} decimals>")
    for precision in (0, 9, 2.0):
        with pytest.raises(ValueError, match="precision"):
            attention_explorer(A, ["a", "b"], precision=precision)


def test_stored_weights_lie_in_zero_one_without_negative_zero():
    """Rounding noise just outside [0, 1] is accepted and stored clipped, and
    no weight is written as -0.0."""
    A = np.array([[[[[1 + 5e-7, -5e-7], [-0.0, 1.0]]]]])
    ex = attention_explorer(A, ["a", "b"], precision=8)
    m = ex.data["sequences"][0]["weights"][0][0]
    assert m == [[1.0, 0.0], [0.0, 1.0]]
    assert all(np.copysign(1.0, x) == 1.0 for row in m for x in row)
    assert "-0" not in json.dumps(ex.data)
    assert "-0" not in EXPLORER.findall(ex._repr_html_())[0][1]


@pytest.mark.parametrize(
    "rows, message",
    [
        ([[0.5, 0.51], [0.5, 0.5]], "sums to 1"),  # a sum off by 1e-2
        ([[0.5, 0.502], [0.5, 0.5]], "sums to 1"),  # off by 2e-3
        ([[1.0005, 0.0], [0.5, 0.5]], r"in \[0, 1\]"),  # above 1, sum ok
        ([[1.0, -2e-6], [0.5, 0.5]], r"in \[0, 1\]"),  # below 0
    ],
)
def test_weights_must_be_softmax_rows(rows, message):
    with pytest.raises(ValueError, match=message):
        attention_explorer(np.array(rows)[None, None, None], ["a", "b"])
    ok = np.array([[0.5, 0.5004], [1 + 1e-7, 0.0]])  # within the tolerances
    attention_explorer(ok[None, None, None], ["a", "b"])


def test_default_names_and_plain_text_form():
    A = np.full((1, 1, 2, 3, 3), 1 / 3)
    ex = attention_explorer(A, ["x", "y", "z"])
    assert ex.data["title"] == "Attention weights"
    assert ex.data["layers"] == ["layer 1"]
    assert ex.data["heads"] == ["head 1", "head 2"]
    assert ex.data["sequences"][0]["name"] == "sequence 1"
    assert ex.data["sequences"][0]["keys"] == ["x", "y", "z"]
    assert repr(ex) == (
        "<attention explorer: 1 sequence, 1 layer, 2 heads; T = 3; 3 decimals>"
    )
    named = attention_explorer(
        A, ["x", "y", "z"], sequences=["s"], layer_names=[7], head_names="ab"
    )
    assert named.data["layers"] == ["7"] and named.data["heads"] == ["a", "b"]
    with pytest.raises(ValueError, match="1 head names for 2 heads"):
        attention_explorer(A, ["x", "y", "z"], head_names=["a"])


def test_cross_attention_keys_are_the_key_tokens():
    A = np.full((1, 1, 1, 2, 3), 1 / 3)
    ex = attention_explorer(A, ["a", "b"], key_tokens=["k", "l", "m"])
    assert ex.data["sequences"][0]["queries"] == ["a", "b"]
    assert ex.data["sequences"][0]["keys"] == ["k", "l", "m"]
    with pytest.raises(ValueError, match="2 query and 2 key tokens"):
        attention_explorer(A, ["a", "b"])


def test_html_escapes_the_title_and_the_tokens():
    """Text from the caller cannot end the page's JSON block or add markup:
    the title is HTML-escaped and `</` in the JSON written `<\\/`."""
    A = np.full((1, 1, 1, 2, 2), 0.5)
    tokens = ["</script><b>", "&"]
    ex = attention_explorer(A, tokens, title="<i>Q & A</i>")
    page = ex._repr_html_()
    assert "<b>&lt;i&gt;Q &amp; A&lt;/i&gt;</b>" in page
    assert "<b><i>" not in page and "</script><b>" not in page
    found = EXPLORER.findall(page)
    assert len(found) == 1 and json.loads(found[0][1]) == ex.data
    assert ex.data["sequences"][0]["queries"] == tokens
    assert page.count("</script>") == 2  # the JSON block's and the script's


def test_distance_to_tie_against_decimal_rounding():
    """The distance to the nearest rounding tie, checked against an
    independent reference: the midpoints k + 1/2 (in units of the last kept
    decimal) listed explicitly, and Python's round on numbers near a tie."""
    w = np.array([[0.1234, 0.4996], [0.0, 0.2503]])
    ties = (np.arange(0, 1001) + 0.5) / 1000  # every tie at 3 decimals
    expected = np.abs(w.ravel()[:, None] - ties).min()
    assert np.isclose(distance_to_tie(w, 3), expected, rtol=0, atol=1e-15)
    assert np.isclose(distance_to_tie(w, 3), 0.0001, rtol=0, atol=1e-12)
    assert np.isclose(distance_to_tie([w[:1], w[1:]], 2), 0.0016, atol=1e-12)
    assert np.isclose(distance_to_tie(np.array([0.5]), 2), 0.005, atol=1e-15)
    # a weight closer than the distance to a tie rounds the same either side
    x, d = 0.2346, distance_to_tie(np.array([0.2346]), 3)
    assert round(x - 0.9 * d, 3) == round(x + 0.9 * d, 3)
    with pytest.raises(ValueError, match="precision"):
        distance_to_tie(w, 0)
    with pytest.raises(ValueError, match="NaN"):
        distance_to_tie(np.array([np.nan]), 3)
    with pytest.raises(ValueError, match="no array"):
        distance_to_tie([], 3)


def test_caption_and_first_position_options():
    A = np.full((1, 1, 1, 2, 2), 0.5)
    default = attention_explorer(A, ["a", "b"])._repr_html_()
    assert "static figure shows the same weights)" in default
    assert '(position "\n               + (state.q + 1) + ")"' in default
    ex = attention_explorer(
        A, ["a", "b"], figure="the <first> string", first_position=0
    )
    html = ex._repr_html_()
    assert "figure shows the same" not in html
    assert "static figure shows the &lt;first&gt; string)" in html
    assert "static figure shows the &lt;first&gt; string.</noscript>" in html
    assert "(state.q + 0)" in html and "(state.q + 1)" not in html
    assert ex.data == attention_explorer(A, ["a", "b"]).data
    for bad in (
        {"first_position": 2},
        {"first_position": True},
        {"figure": 3},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            attention_explorer(A, ["a", "b"], **bad)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"sequences": 3}, "sequence names must be a list"),
        ({"layer_names": 1}, "layer names must be a list"),
        ({"head_names": None, "layer_names": 2.0}, "layer names must be"),
        ({"precision": True}, "precision"),
        ({"first_position": 0.0}, "first_position"),
    ],
)
def test_options_of_the_wrong_type_raise(options, message):
    """Issue 47: names given as a string or a number, a precision True and
    a first position 0.0 were taken (or failed with a TypeError)."""
    A = np.full((1, 1, 1, 2, 2), 0.5)
    with pytest.raises(ValueError, match=message):
        attention_explorer(A, ["a", "b"], **options)


def test_complex_weights_raise():
    A = np.full((1, 1, 1, 2, 2), 0.5 + 0j)
    with pytest.raises(ValueError, match="real numbers"):
        attention_explorer(A, ["a", "b"])
    with pytest.raises(ValueError, match="real numbers"):
        distance_to_tie(A)
    with pytest.raises(ValueError, match="precision"):
        distance_to_tie(A.real, precision=True)
