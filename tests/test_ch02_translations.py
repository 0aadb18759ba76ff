"""Chapter 2: the R generator port, the R print formatter, the Julia block."""

import json
import re
import shutil
import subprocess

import numpy as np
import pytest
from conftest import BOOK, SOURCE_003_ATTENTION, load_chapter
from numpy.testing import assert_allclose, assert_array_equal

NOTEBOOK = "02_translations.ipynb"
RSCRIPT = shutil.which("Rscript")
needs_r = pytest.mark.skipif(
    RSCRIPT is None,
    reason="Rscript not found: R is not installed, so this comparison with real R "
    "is SKIPPED (the values stored from R 4.2.2 are still checked)",
)


@pytest.fixture(scope="module")
def ch02():
    return load_chapter(NOTEBOOK)


# --- R's set.seed / runif ---------------------------------------------------

# Printed by R 4.2.2 (Debian r-base-core): set.seed(s); sprintf("%a", runif(5))
R_DRAWS = {
    0: [
        "0x1.cb1be53ap-1",
        "0x1.0fe180c4p-2",
        "0x1.7d0e0c2cp-2",
        "0x1.254d093ap-1",
        "0x1.d1009c88p-1",
    ],
    1: [
        "0x1.0fe180c4p-2",
        "0x1.7d0e0c2cp-2",
        "0x1.254d093ap-1",
        "0x1.d1009c88p-1",
        "0x1.9d0b6a9p-3",
    ],
    42: [
        "0x1.d461752ep-1",
        "0x1.dfc8593cp-1",
        "0x1.2501c32p-2",
        "0x1.a9306e66p-1",
        "0x1.4892de6p-1",
    ],
    123456: [
        "0x1.98772fbep-1",
        "0x1.81d348bcp-1",
        "0x1.90a5548p-2",
        "0x1.5dc10a04p-2",
        "0x1.71f71578p-2",
    ],
    -5: [
        "0x1.781cce3p-1",
        "0x1.5bd86cp-2",
        "0x1.8742c03p-3",
        "0x1.4610e6b6p-1",
        "0x1.ec97aa1ep-1",
    ],
    2**31 - 1: [
        "0x1.611c16c6p-1",
        "0x1.f9cac67ep-1",
        "0x1.92f91f3p-3",
        "0x1.d32cfb32p-1",
        "0x1.e381fbdcp-1",
    ],
    -(2**31 - 1): [
        "0x1.1fc0a66ep-1",
        "0x1.26b7601ap-1",
        "0x1.7afade6cp-2",
        "0x1.24c3ea1p-3",
        "0x1.ff72bca8p-1",
    ],
}


@pytest.mark.parametrize("seed", sorted(R_DRAWS))
def test_runif_equals_stored_r_draws_bit_for_bit(ch02, seed):
    u = ch02.r_runif(ch02.r_set_seed(seed), 5)
    assert u.tolist() == [float.fromhex(h) for h in R_DRAWS[seed]]


def test_runif_across_the_state_refill(ch02):
    # set.seed(0); x <- runif(627); sprintf("%a", x[624:627]) in R 4.2.2:
    # draw 625 is the first one after the twister regenerates its 624 words
    u = ch02.r_runif(ch02.r_set_seed(0), 627)
    assert u[623:].tolist() == [
        float.fromhex(h)
        for h in [
            "0x1.8957dbb8p-1",
            "0x1.1786cdb8p-3",
            "0x1.4ca97288p-2",
            "0x1.3dfdb644p-1",
        ]
    ]


def test_runif_printed_by_the_sources(ch02):
    u = ch02.r_runif(ch02.r_set_seed(0), 3)
    assert ch02.r_format_vector(u) == "[1] 0.8966972 0.2655087 0.3721239"


def test_runif_min_equal_max_draws_nothing(ch02):
    # R: set.seed(0); runif(2, 1, 1); runif(1) gives 0.8966972, the first draw
    rng = ch02.r_set_seed(0)
    assert_array_equal(ch02.r_runif(rng, 2, 1.0, 1.0), [1.0, 1.0])
    assert ch02.r_runif(rng, 1)[0] == float.fromhex(R_DRAWS[0][0])


class ZeroBits:
    """A stand-in bit generator whose raw draws are all 0."""

    def random_raw(self, n):
        return np.zeros(n, dtype=np.uint64)


def test_unif_rand_never_returns_zero(ch02):
    # R's fixup: a raw 0 becomes 0.5 * i2_32m1, R's constant for 1 / (2^32 - 1)
    assert (
        ch02.r_unif_rand(ZeroBits(), 2).tolist()
        == [0.5 * 2.328306437080797e-10] * 2
    )


def test_vignette_weight_matrices(ch02):
    rng = ch02.r_set_seed(0)
    W = [
        ch02.r_matrix(np.floor(ch02.r_runif(rng, 9, 0, 3)), 3, 3)
        for _ in range(3)
    ]
    assert_array_equal(W[0], [[2, 1, 2], [0, 2, 2], [1, 0, 1]])
    assert_array_equal(W[1], [[1, 0, 2], [0, 2, 1], [0, 1, 2]])
    assert_array_equal(W[2], [[2, 2, 0], [1, 0, 0], [2, 1, 1]])


@pytest.mark.parametrize("seed", [2**31, -(2**31), 1.5, "0", True, None])
def test_set_seed_rejects_what_r_rejects_or_truncates(ch02, seed):
    with pytest.raises(ValueError, match="seed"):
        ch02.r_set_seed(seed)


@pytest.mark.parametrize(
    "args, message",
    [
        ((-1,), "non-negative integer"),
        ((2.0,), "non-negative integer"),
        ((3, 2.0, 1.0), "min <= max"),
        ((3, 0.0, np.inf), "finite"),
    ],
)
def test_runif_rejects_bad_arguments(ch02, args, message):
    with pytest.raises(ValueError, match=message):
        ch02.r_runif(ch02.r_set_seed(0), *args)


R_SEEDS = [
    0,
    1,
    7,
    42,
    2024,
    123456,
    -1,
    -5,
    -987654321,
    2**31 - 1,
    -(2**31 - 1),
]
R_CALLS = [(1, 0, 1), (7, 0, 3), (624, -2.5, 4), (625, 0, 1), (2000, 10, 1e6)]


@needs_r
def test_runif_equals_real_r_bit_for_bit(ch02, tmp_path):
    """11 seeds x 5 calls of runif (3257 draws per seed) compared with Rscript."""
    lines = []
    for seed in R_SEEDS:
        lines.append(f"set.seed({seed})")
        for n, a, b in R_CALLS:
            lines.append(
                f'cat(sprintf("%a", runif({n}, {a!r}, {b!r})), sep="\\n")'
            )
        lines.append("invisible(runif(3, 2, 2))")  # draws nothing in R
        lines.append('cat(sprintf("%a", runif(2)), sep="\\n")')
    script = tmp_path / "draws.R"
    script.write_text("\n".join(lines) + "\n")
    out = subprocess.run(
        [RSCRIPT, str(script)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()
    r_values = [float.fromhex(h) for h in out]
    ours = []
    for seed in R_SEEDS:
        rng = ch02.r_set_seed(seed)
        for n, a, b in R_CALLS:
            ours.extend(ch02.r_runif(rng, n, a, b).tolist())
        ch02.r_runif(rng, 3, 2.0, 2.0)
        ours.extend(ch02.r_runif(rng, 2).tolist())
    assert (
        len(r_values)
        == len(ours)
        == len(R_SEEDS) * (sum(c[0] for c in R_CALLS) + 2)
    )
    assert ours == r_values


# --- R's print ---------------------------------------------------------------

# The vignette's printouts (without knitr's "#> ") and the R post's printout
VIGNETTE_TEXT = {
    "words": """\
     [,1] [,2] [,3]
[1,]    1    0    0
[2,]    0    1    0
[3,]    1    1    0
[4,]    0    0    1""",
    "scores": """\
     [,1] [,2] [,3] [,4]
[1,]    6    4   10    5
[2,]    4    6   10    6
[3,]   10   10   20   11
[4,]    3    1    4    2""",
    "maxs": """\
     [,1]
[1,]   10
[2,]   10
[3,]   20
[4,]    4""",
    "weights": """\
            [,1]        [,2]      [,3]        [,4]
[1,] 0.083717538 0.026383741 0.8429010 0.046997679
[2,] 0.025449248 0.080752324 0.8130461 0.080752324
[3,] 0.003072728 0.003072728 0.9883811 0.005473487
[4,] 0.273384789 0.086157735 0.4869837 0.153473823""",
    "attention": """\
         [,1]     [,2]        [,3]
[1,] 2.816517 1.900235 0.046997679
[2,] 2.732294 1.757743 0.080752324
[3,] 2.985308 1.988381 0.005473487
[4,] 2.400826 1.674211 0.153473823""",
}
R_POST_TEXT = """\
          [,1]     [,2]      [,3]
[1,] 0.9852202 1.741741 0.7565203
[2,] 0.9096526 1.409653 0.5000000
[3,] 0.9985123 1.758493 0.7599811
[4,] 0.9956039 1.904073 0.9084692"""

WORDS = np.array([[1, 0, 0], [0, 1, 0], [1, 1, 0], [0, 0, 1]], dtype=float)


def r_pipeline(W_Q, W_K, W_V):
    """The R code of the post and the vignette, step by step, in NumPy."""
    Q, K, V = WORDS @ W_Q, WORDS @ W_K, WORDS @ W_V
    scores = Q @ K.T
    maxs = scores.max(axis=1, keepdims=True)
    z = (scores - maxs) / K.shape[1] ** 0.5
    weights = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    return {
        "words": WORDS,
        "scores": scores,
        "maxs": maxs,
        "weights": weights,
        "attention": weights @ V,
    }


def test_formatter_reproduces_the_vignette_text(ch02):
    rng = ch02.r_set_seed(0)
    W = [
        ch02.r_matrix(np.floor(ch02.r_runif(rng, 9, 0, 3)), 3, 3)
        for _ in range(3)
    ]
    results = r_pipeline(*W)
    for name, expected in VIGNETTE_TEXT.items():
        assert ch02.r_format_matrix(results[name]) == expected, name


def test_formatter_reproduces_the_r_post_text(ch02):
    np.random.seed(42)
    W = [np.random.randint(3, size=(3, 3)) for _ in range(3)]
    assert ch02.r_format_matrix(r_pipeline(*W)["attention"]) == R_POST_TEXT


def test_formatter_scientific_and_negative_columns(ch02):
    # R 4.2.2: print(matrix(c(-1.5, 2, 1e-10, 3), 2))
    text = ch02.r_format_matrix([[-1.5, 1e-10], [2.0, 3.0]])
    assert text == ("     [,1]  [,2]\n[1,] -1.5 1e-10\n[2,]  2.0 3e+00")
    # R sizes the row labels for nrow + 1 and right-aligns them: print(matrix(
    # (1:9)/4, 9)) already has " [1,]" and ends with " [9,] 2.25"
    lines = ch02.r_format_matrix(np.arange(1, 10).reshape(-1, 1) / 4).split(
        "\n"
    )
    assert lines[:2] == ["      [,1]", " [1,] 0.25"]
    assert lines[-1] == " [9,] 2.25"
    lines = ch02.r_format_matrix(np.arange(1, 12).reshape(-1, 1) / 4).split(
        "\n"
    )
    assert lines[-1] == "[11,] 2.75"
    # print(c(3, 1, 4, 1, 5, 9, 2, 6, 5, 3)) in R 4.2.2
    assert (
        ch02.r_format_vector([3, 1, 4, 1, 5, 9, 2, 6, 5, 3])
        == " [1] 3 1 4 1 5 9 2 6 5 3"
    )
    # R prints a negative zero as 0
    assert (
        ch02.r_format_matrix([[-0.0], [1.0]])
        == "     [,1]\n[1,]    0\n[2,]    1"
    )


@pytest.mark.parametrize(
    "bad, message",
    [
        (np.ones(3), "2-D"),
        (np.ones((0, 2)), "2-D"),
        ([[1.0, np.nan]], "finite"),
        (np.ones((2, 12)) / 3, "wider than 80"),
    ],
)
def test_formatter_refuses_what_it_cannot_match(ch02, bad, message):
    with pytest.raises(ValueError, match=message):
        ch02.r_format_matrix(bad)


@needs_r
def test_formatter_equals_real_r_print(ch02, tmp_path):
    """200 random matrices of mixed magnitudes printed by R and by the port."""
    rng = np.random.default_rng(2)
    mats = []
    for t in range(200):
        shape = (int(rng.integers(1, 13)), int(rng.integers(1, 4)))
        kind = t % 4
        if kind == 0:
            M = rng.random(shape)
        elif kind == 1:
            M = rng.normal(size=shape) * 10.0 ** rng.integers(
                -6, 7, size=shape
            )
        elif kind == 2:
            M = np.round(rng.normal(size=shape) * 100, int(rng.integers(0, 4)))
        else:
            M = rng.integers(-20, 20, size=shape).astype(float)
        mats.append(M)
    script = tmp_path / "print.R"
    script.write_text(
        "\n".join(
            f"print(matrix(c({','.join(v.hex() for v in M.flatten(order='F'))}), "
            f'nrow={M.shape[0]})); cat("@@@\\n")'
            for M in mats
        )
        + "\n"
    )
    out = subprocess.run(
        [RSCRIPT, str(script)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    printed = out.split("@@@\n")[:-1]
    assert len(printed) == len(mats)
    for M, text in zip(mats, printed):
        assert ch02.r_format_matrix(M) == text.rstrip("\n"), M.tolist()


def test_r_matrix_fills_columns_unless_byrow(ch02):
    assert_array_equal(ch02.r_matrix(range(6), 2, 3), [[0, 2, 4], [1, 3, 5]])
    assert_array_equal(
        ch02.r_matrix(range(6), 2, 3, byrow=True), [[0, 1, 2], [3, 4, 5]]
    )
    with pytest.raises(ValueError, match="needs 6 values"):
        ch02.r_matrix(range(5), 2, 3)


# --- The Julia block, tokens as columns -------------------------------------


def julia_inputs(seed, n, d=4, d_v=3, bias=True):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(d, n))
    Q, K = rng.normal(size=(d, d)), rng.normal(size=(d, d))
    V = rng.normal(size=(d_v, d))
    scale = 1.0 if bias else 0.0
    Qb, Kb = scale * rng.normal(size=(d, 1)), scale * rng.normal(size=(d, 1))
    Vb = scale * rng.normal(size=(d_v, 1))
    return x, Q, Qb, K, Kb, V, Vb


@pytest.mark.parametrize("seed", range(15))
@pytest.mark.parametrize("bias", [False, True])
def test_julia_block_transposed_equals_chapter_1(ch01, ch02, seed, bias):
    n = 1 + seed % 6
    x, Q, Qb, K, Kb, V, Vb = julia_inputs(seed, n, bias=bias)
    *_, alpha, z = ch02.attention_block(x, Q, Qb, K, Kb, V, Vb)
    X = x.T  # rows = tokens
    out, weights = ch01.attention_matrix(
        X @ Q.T + Qb.T, X @ K.T + Kb.T, X @ V.T + Vb.T
    )
    assert z.shape == (V.shape[0], n)
    assert_allclose(alpha, weights, rtol=0, atol=1e-12)
    assert_allclose(z.T, out, rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", range(10))
def test_source_scaling_is_chapter_1_at_temperature_sqrt_n(ch01, ch02, seed):
    n = 2 + seed % 5
    x, Q, Qb, K, Kb, V, Vb = julia_inputs(seed, n)
    *_, alpha, z = ch02.attention_block(
        x, Q, Qb, K, Kb, V, Vb, scale="length(q)"
    )
    X = x.T
    out, weights = ch01.attention_matrix(
        (X @ Q.T + Qb.T) / np.sqrt(n), X @ K.T + Kb.T, X @ V.T + Vb.T
    )
    assert_allclose(alpha, weights, rtol=0, atol=1e-12)
    assert_allclose(z.T, out, rtol=0, atol=1e-12)


def test_julia_block_on_chapter_1_words(ch02):
    np.random.seed(42)
    W_Q, W_K, W_V = (np.random.randint(3, size=(3, 3)) for _ in range(3))
    zero = np.zeros((3, 1))
    *_, _alpha, z = ch02.attention_block(
        WORDS.T, W_Q.T, zero, W_K.T, zero, W_V.T, zero
    )
    assert_allclose(
        z.T,
        SOURCE_003_ATTENTION,
        rtol=0,
        atol=1e-8,
    )


def test_julia_softmax_is_over_all_entries(ch02):
    z = np.array([[1000.0, 0.0], [0.0, 1000.0]])
    assert_allclose(
        ch02.softmax(z), [[0.5, 0.0], [0.0, 0.5]], rtol=0, atol=1e-15
    )
    with pytest.raises(ValueError, match="finite"):
        ch02.softmax([1.0, np.nan])


@pytest.mark.parametrize(
    "args, message",
    [
        (
            (np.ones((3, 4)), np.ones((3, 3)), np.ones(3)),
            r"column of shape \(3, 1\)",
        ),
        (
            (np.ones((3, 3)), np.ones((3, 3)), np.ones(3)),
            r"column of shape \(3, 1\)",
        ),
        (
            (np.ones((2, 4)), np.ones((3, 3)), np.ones((3, 1))),
            r"got W \(3, 3\) and x",
        ),
    ],
)
def test_linear_transform_refuses_bad_shapes(ch02, args, message):
    with pytest.raises(ValueError, match=message):
        ch02.linear_transform(*args)


def test_attention_weights_refuses_bad_input(ch02):
    with pytest.raises(ValueError, match="same d_k"):
        ch02.attention_weights(np.ones((3, 4)), np.ones((2, 4)))
    with pytest.raises(ValueError, match="scale must be"):
        ch02.attention_weights(np.ones((3, 4)), np.ones((3, 4)), scale="n")


# --- The tabs show the code that runs ---------------------------------------


def test_python_tabs_equal_the_cells_that_run():
    nb = json.loads((BOOK / NOTEBOOK).read_text(encoding="utf-8"))
    cells = nb["cells"]
    checked = 0
    for i, cell in enumerate(cells):
        text = "".join(cell["source"])
        if cell["cell_type"] != "markdown" or "{tab-set}" not in text:
            continue
        blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
        assert len(blocks) == 1, f"cell {i}: one Python tab per tab set"
        following = cells[i + 1]
        assert following["cell_type"] == "code"
        assert "hide-input" in following["metadata"].get("tags", [])
        assert "".join(following["source"]).strip() == blocks[0].strip(), i
        assert re.search(r"```(r|julia)\n", text), f"cell {i}: no original tab"
        checked += 1
    assert checked == 11
