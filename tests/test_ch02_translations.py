"""Chapter 2: the R generator port, the R print formatter, the Julia block,
and the R tabs run by real R.

The R generator and print formatter live in book/r_port.py; they are read
here through the appendix page that shows and checks them
(`appendix_r_internals.ipynb`, fixture `rport`), the rest through the chapter.
Every number a source printed is read from the notebooks (`ch02.VIGNETTE`,
`ch02.R_POST_ATTENTION`, `rport.R_RUNIF_SEED0`, ...): this file holds none.
The few values below that come from R are measurements of R 4.2.2 for inputs
no source uses, kept so that the generator is still checked bit for bit on a
machine without R.
"""

import contextlib
import io
import json
import re
import shutil
import subprocess

import matplotlib
import numpy as np
import pytest
from conftest import BOOK, load_chapter, require_system_tool
from numpy.testing import assert_allclose, assert_array_equal

NOTEBOOK = "02_translations.ipynb"
APPENDIX = "appendix_r_internals.ipynb"
R_INSTALL = "apt-get install r-base-core r-cran-matrixstats"
# the section labels of the chapter, one per source with tabs
R_POST, VIGNETTE, JULIA = "ch2-r-post", "ch2-vignette", "ch2-julia"


@pytest.fixture(scope="module")
def ch02():
    return load_chapter(NOTEBOOK)


@pytest.fixture(scope="module")
def rport():
    """The appendix page on R's generator and print (book/r_port.py)."""
    return load_chapter(APPENDIX)


@pytest.fixture(scope="module")
def rscript():
    """The path of Rscript, with R's matrixStats package (the R post needs
    it). Skips, or fails under CI=true, when either is missing."""
    path = shutil.which("Rscript")
    found = path is not None
    if found:
        probe = subprocess.run(
            [path, "-e", 'cat(requireNamespace("matrixStats", quietly=TRUE))'],
            capture_output=True,
            text=True,
            timeout=120,
        )
        found = probe.stdout.strip() == "TRUE"
    require_system_tool(found, "R (Rscript) with matrixStats", R_INSTALL)
    return path


def run_r(rscript, path, code):
    """R's standard output for `code`, run as one Rscript session."""
    path.write_text(code, encoding="utf-8")
    return subprocess.run(
        [rscript, str(path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout


# --- The chapter's cells and tabs -------------------------------------------


def notebook_cells():
    return json.loads((BOOK / NOTEBOOK).read_text(encoding="utf-8"))["cells"]


def tab_sets():
    """(source label, cell index, original language, original code, Python
    code) of every tab set, the label being the last section label above."""
    found, label = [], None
    for i, cell in enumerate(notebook_cells()):
        text = "".join(cell["source"])
        if cell["cell_type"] != "markdown":
            continue
        labels = re.findall(r"^\((ch2-[a-z-]+)\)=$", text, flags=re.M)
        label = labels[-1] if labels else label
        if "{tab-set}" not in text:
            continue
        originals = re.findall(r"```(r|julia)\n(.*?)```", text, flags=re.S)
        python = re.findall(r"```python\n(.*?)```", text, flags=re.S)
        assert len(originals) == len(python) == 1, f"cell {i}: one tab pair"
        found.append((label, i, *originals[0], python[0]))
    return found


@pytest.fixture(scope="module")
def printed():
    """What each code cell of the chapter prints, by cell index, from one
    fresh run of every cell top to bottom (as nbval's kernel runs them). A
    cell tagged raises-exception must raise; every visible assert runs."""
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    namespace = {"__name__": "ch02_run"}
    out = {}
    with contextlib.chdir(BOOK):
        for i, cell in enumerate(notebook_cells()):
            if cell["cell_type"] != "code":
                continue
            code = compile("".join(cell["source"]), f"cell {i}", "exec")
            must_raise = "raises-exception" in cell["metadata"].get("tags", [])
            buffer = io.StringIO()
            with contextlib.redirect_stdout(buffer):
                try:
                    exec(code, namespace)
                except Exception:
                    if not must_raise:
                        raise
                else:
                    assert not must_raise, f"cell {i} did not raise"
            out[i] = buffer.getvalue()
            plt.close("all")
    return out


def source_printouts(ch02, label):
    """The text a source printed, in order, as R writes it to stdout."""
    if label == R_POST:
        return ch02.R_POST_ATTENTION + "\n"
    return "".join(text + "\n" for text in ch02.VIGNETTE.values())


def test_python_tabs_equal_the_cells_that_run():
    cells = notebook_cells()
    sets = tab_sets()
    for _, i, _, _, python in sets:
        following = cells[i + 1]
        assert following["cell_type"] == "code", i
        assert "hide-input" in following["metadata"].get("tags", []), i
        assert "".join(following["source"]).strip() == python.strip(), i
    per_source = [
        sum(label == name for label, *_ in sets)
        for name in (R_POST, VIGNETTE, JULIA)
    ]
    assert per_source == [5, 6, 2]
    assert all(lang == "r" for label, _, lang, *_ in sets if label != JULIA)


@pytest.mark.parametrize("label", [R_POST, VIGNETTE])
def test_python_tabs_print_what_the_source_printed(ch02, printed, label):
    """Run top to bottom, the Python tabs of a source print, together and in
    order, exactly the source's printouts, in R's layout."""
    text = "".join(
        printed[i + 1] for name, i, *_ in tab_sets() if name == label
    )
    assert text == source_printouts(ch02, label)


@pytest.mark.parametrize("label", [R_POST, VIGNETTE])
def test_r_runs_each_tab_and_prints_what_python_prints(
    ch02, printed, rscript, tmp_path, label
):
    """The R code of every tab of a source, extracted from the notebook, run
    in order in one R session: each tab's standard output equals the output
    of the Python cell under it, character for character (a tab that prints
    nothing must be matched by a cell that prints nothing), and together
    they are the source's printouts."""
    tabs = [(i, code) for name, i, _, code, _ in tab_sets() if name == label]
    marker = "@@@ end of tab @@@"
    script = "".join(f'{code}cat("{marker}\\n")\n' for _, code in tabs)
    outputs = run_r(rscript, tmp_path / f"{label}.R", script).split(
        marker + "\n"
    )
    assert outputs[-1] == ""  # nothing after the last tab
    assert len(outputs[:-1]) == len(tabs)
    for (i, code), r_text in zip(tabs, outputs):
        assert r_text == printed[i + 1], f"tab of cell {i}:\n{code}"
    assert "".join(outputs) == source_printouts(ch02, label)


def test_r_post_without_byrow_prints_the_exercise_table(
    ch02, rscript, tmp_path
):
    """Exercise 1's claim: the R post's tabs, run by R with every
    `byrow = TRUE` removed, print exactly `R_WITHOUT_BYROW`."""
    code = "".join(c for name, _, _, c, _ in tab_sets() if name == R_POST)
    without, removed = re.subn(r",\s*byrow = TRUE", "", code)
    assert removed == 3  # W_Q, W_K, W_V
    out = run_r(rscript, tmp_path / "without_byrow.R", without)
    assert out == ch02.R_WITHOUT_BYROW + "\n"
    assert out != ch02.R_POST_ATTENTION + "\n"


@pytest.mark.parametrize("seed", [42, 1])
def test_appendix_w_q_is_what_r_prints(rport, rscript, tmp_path, seed):
    """The appendix's W_Q for set.seed(42) and set.seed(1) (exercise 1):
    the vignette's W_Q line, run by R after that seed, prints the stored
    text."""
    (code,) = [
        c
        for name, _, _, c, _ in tab_sets()
        if name == VIGNETTE and "runif" in c
    ]
    (line,) = [row for row in code.splitlines() if row.startswith("W_Q =")]
    out = run_r(
        rscript, tmp_path / "w_q.R", f"set.seed({seed})\n{line}\nprint(W_Q)\n"
    )
    assert out == getattr(rport, f"R_SEED_{seed}_W_Q") + "\n"


# --- R's set.seed / runif ----------------------------------------------------

# Measured in R 4.2.2 (Debian r-base-core): set.seed(s); sprintf("%a", runif(5))
R_DRAWS = {
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


def seed0_draws(rport):
    """R's set.seed(0); runif(3), as the chapter stores them."""
    return [float.fromhex(h) for h in rport.R_RUNIF_SEED0["sprintf_a"]]


@pytest.mark.parametrize("seed", [0, *R_DRAWS])
def test_runif_equals_stored_r_draws_bit_for_bit(rport, seed):
    if seed == 0:
        expected = seed0_draws(rport)
    else:
        expected = [float.fromhex(h) for h in R_DRAWS[seed]]
    u = rport.r_runif(rport.r_set_seed(seed), len(expected))
    assert u.tolist() == expected


def test_runif_across_the_state_refill(rport):
    # set.seed(0); x <- runif(627); sprintf("%a", x[624:627]) in R 4.2.2:
    # draw 625 is the first one after the twister regenerates its 624 words
    u = rport.r_runif(rport.r_set_seed(0), 627)
    assert u[623:].tolist() == [
        float.fromhex(h)
        for h in [
            "0x1.8957dbb8p-1",
            "0x1.1786cdb8p-3",
            "0x1.4ca97288p-2",
            "0x1.3dfdb644p-1",
        ]
    ]


# Measured in R 4.2.2: set.seed(s); sprintf("%a", runif(n, min, max))
R_DRAWS_SCALED = {
    (7, 4, -2.5, 4.0): [
        "0x1.f6c5c4e84p+1",
        "0x1.5d932fdp-4",
        "-0x1.bf7a98fp+0",
        "-0x1.05f816e48p+1",
    ],
    (-987654321, 3, 10.0, 1e6): [
        "0x1.30c662a02d3cp+16",
        "0x1.76ab090bd05cp+18",
        "0x1.5396b1bdaeecp+19",
    ],
}


@pytest.mark.parametrize("call", list(R_DRAWS_SCALED))
def test_runif_min_max_equal_stored_r_draws(rport, call):
    """runif(n, min, max) is min + (max - min) u, bit for bit as in R."""
    seed, n, low, high = call
    u = rport.r_runif(rport.r_set_seed(seed), n, low, high)
    assert u.tolist() == [float.fromhex(h) for h in R_DRAWS_SCALED[call]]


def lcg_state(seed):
    """R's set.seed, written from RNG_Init in R's src/main/RNG.c: the seed
    modulo 2^32, 50 steps of s = 69069 s + 1, then 625 more kept: the
    position counter (dropped) and the 624 words of the twister's state."""
    s = seed % 2**32
    for _ in range(50):
        s = (69069 * s + 1) % 2**32
    kept = []
    for _ in range(625):
        s = (69069 * s + 1) % 2**32
        kept.append(s)
    return kept


@pytest.mark.parametrize("seed", [0, 1, -5, 2**31 - 1])
def test_set_seed_is_rs_lcg_scramble(rport, seed):
    """The 625 seed words, and the twister state r_set_seed installs: the
    last 624 words, with the position at 624 (twist before the first
    draw)."""
    words = lcg_state(seed)
    assert rport.r_seed_words(seed) == words
    state = rport.r_set_seed(seed).state["state"]
    assert state["key"].tolist() == words[1:]
    assert state["pos"] == 624


def test_unif_rand_is_the_raw_word_times_2_to_the_minus_32(rport):
    """u = y / 2^32 exactly, y the twister's next 32-bit output."""
    raw = np.random.MT19937()
    raw.state = rport.r_set_seed(42).state
    words = raw.random_raw(5)
    u = rport.r_unif_rand(rport.r_set_seed(42), 5)
    assert u.tolist() == [int(y) / 2**32 for y in words]


def test_runif_min_equal_max_draws_nothing(rport):
    # R: set.seed(0); runif(2, 1, 1); runif(1) is set.seed(0)'s first draw
    rng = rport.r_set_seed(0)
    assert_array_equal(rport.r_runif(rng, 2, 1.0, 1.0), [1.0, 1.0])
    assert rport.r_runif(rng, 1)[0] == seed0_draws(rport)[0]


class ZeroBits(np.random.MT19937):
    """An MT19937 bit generator whose raw draws are all 0."""

    def random_raw(self, size=None, output=True):
        return np.zeros(size, dtype=np.uint64)


def test_unif_rand_never_returns_zero(rport):
    # R's fixup: a raw 0 becomes 0.5 * i2_32m1, R's constant for 1 / (2^32 - 1)
    assert (
        rport.r_unif_rand(ZeroBits(), 2).tolist()
        == [0.5 * 2.328306437080797e-10] * 2
    )


@pytest.mark.parametrize("seed", [2**31, -(2**31), 1.5, "0", True, None])
def test_set_seed_rejects_what_r_rejects_or_truncates(rport, seed):
    with pytest.raises(ValueError, match="seed"):
        rport.r_set_seed(seed)


@pytest.mark.parametrize(
    "args, message",
    [
        ((-1,), "non-negative integer"),
        ((2.0,), "non-negative integer"),
        ((3, 2.0, 1.0), "min <= max"),
        ((3, 0.0, np.inf), "finite"),
    ],
)
def test_runif_rejects_bad_arguments(rport, args, message):
    with pytest.raises(ValueError, match=message):
        rport.r_runif(rport.r_set_seed(0), *args)


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


def test_runif_equals_real_r_bit_for_bit(rport, rscript, tmp_path):
    """11 seeds, 3259 draws each in 6 calls of runif, compared with R."""
    lines = []
    for seed in R_SEEDS:
        lines.append(f"set.seed({seed})")
        for n, a, b in R_CALLS:
            lines.append(
                f'cat(sprintf("%a", runif({n}, {a!r}, {b!r})), sep="\\n")'
            )
        lines.append("invisible(runif(3, 2, 2))")  # draws nothing in R
        lines.append('cat(sprintf("%a", runif(2)), sep="\\n")')
    out = run_r(rscript, tmp_path / "draws.R", "\n".join(lines) + "\n")
    r_values = [float.fromhex(h) for h in out.split()]
    ours = []
    for seed in R_SEEDS:
        rng = rport.r_set_seed(seed)
        for n, a, b in R_CALLS:
            ours.extend(rport.r_runif(rng, n, a, b).tolist())
        rport.r_runif(rng, 3, 2.0, 2.0)
        ours.extend(rport.r_runif(rng, 2).tolist())
    assert (
        len(r_values)
        == len(ours)
        == len(R_SEEDS) * (sum(c[0] for c in R_CALLS) + 2)
    )
    assert ours == r_values


# --- R's print ---------------------------------------------------------------


def test_formatter_label_widths_and_negative_zero(rport):
    # R sizes the row labels for nrow + 1 and right-aligns them: print(matrix(
    # (1:9)/4, 9)) already has " [1,]" and ends with " [9,] 2.25"
    column = np.arange(1, 10).reshape(-1, 1) / 4
    lines = rport.r_format_matrix(column).split("\n")
    assert lines[:2] == ["      [,1]", " [1,] 0.25"]
    assert lines[-1] == " [9,] 2.25"
    column = np.arange(1, 12).reshape(-1, 1) / 4
    assert rport.r_format_matrix(column).split("\n")[-1] == "[11,] 2.75"
    # R prints a negative zero as 0
    assert (
        rport.r_format_matrix([[-0.0], [1.0]])
        == "     [,1]\n[1,]    0\n[2,]    1"
    )


@pytest.mark.parametrize(
    "x, text",
    [  # print(x) in R 4.2.2
        ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3], " [1] 3 1 4 1 5 9 2 6 5 3"),
        ([-1, 10], "[1] -1 10"),
        ([1e-10, -3, 2], "[1]  1e-10 -3e+00  2e+00"),
        ([123456789, 0.1], "[1] 123456789.0         0.1"),
        ([-0.0], "[1] 0"),
    ],
)
def test_vector_entries_share_one_width(rport, x, text):
    assert rport.r_format_vector(x) == text


@pytest.mark.parametrize(
    "bad, message",
    [
        (np.ones(3), "2-D"),
        (np.ones((0, 2)), "2-D"),
        ([[1.0, np.nan]], "finite"),
        (np.ones((2, 12)) / 3, "wider than 80"),
    ],
)
def test_formatter_refuses_what_it_cannot_match(rport, bad, message):
    with pytest.raises(ValueError, match=message):
        rport.r_format_matrix(bad)


@pytest.mark.parametrize(
    "bad, message",
    [
        ([], "non-empty"),
        ([1.0, np.inf], "finite"),
        (np.arange(30) / 7, "wider than 80"),
    ],
)
def test_vector_formatter_refuses_what_it_cannot_match(rport, bad, message):
    with pytest.raises(ValueError, match=message):
        rport.r_format_vector(bad)


def random_numbers(rng, kind, shape):
    """Numbers of mixed signs and magnitudes, of one of five kinds."""
    if kind == 0:
        return rng.random(shape)
    if kind == 1:
        return rng.normal(size=shape) * 10.0 ** rng.integers(-6, 7, shape)
    if kind == 2:
        return np.round(rng.normal(size=shape) * 100, rng.integers(0, 4))
    if kind == 3:
        return rng.integers(-20, 20, size=shape) * 10.0 ** rng.integers(0, 4)
    signs = rng.choice([-1.0, 1.0], size=shape)
    return signs * rng.random(shape) * 10.0 ** rng.integers(-3, 4, shape)


def r_prints(rscript, tmp_path, arrays, make):
    """R's print of each array, `make` giving its R expression."""
    separator = "@@@\n"
    script = "".join(
        f'print({make(a)}); cat("{separator.strip()}\\n")\n' for a in arrays
    )
    out = run_r(rscript, tmp_path / "print.R", script).split(separator)
    assert len(out) == len(arrays) + 1
    return [text.rstrip("\n") for text in out[:-1]]


def r_numbers(values):
    """An R vector of exactly these doubles (hexadecimal literals)."""
    return f"c({','.join(float(v).hex() for v in values)})"


def test_formatter_equals_real_r_print(rport, rscript, tmp_path):
    """200 random matrices of mixed signs and magnitudes, printed by R and
    by the port."""
    rng = np.random.default_rng(2)
    mats = [
        random_numbers(
            rng, t % 5, (int(rng.integers(1, 13)), int(rng.integers(1, 4)))
        )
        for t in range(200)
    ]
    texts = r_prints(
        rscript,
        tmp_path,
        mats,
        lambda M: (
            f"matrix({r_numbers(M.flatten(order='F'))}, nrow={M.shape[0]})"
        ),
    )
    for M, text in zip(mats, texts):
        assert rport.r_format_matrix(M) == text, M.tolist()


def test_vector_formatter_equals_real_r_print(rport, rscript, tmp_path):
    """300 random vectors of mixed signs and magnitudes, 1 to 14 entries:
    where R prints one line the port prints the same line; where R wraps
    (wider than 80 characters) the port refuses."""
    rng = np.random.default_rng(3)
    vectors = [
        random_numbers(rng, t % 5, int(rng.integers(1, 15)))
        for t in range(300)
    ]
    texts = r_prints(rscript, tmp_path, vectors, r_numbers)
    one_line = 0
    for x, text in zip(vectors, texts):
        if "\n" in text:
            with pytest.raises(ValueError, match="wider than 80"):
                rport.r_format_vector(x)
        else:
            assert rport.r_format_vector(x) == text, x.tolist()
            one_line += 1
    assert 150 <= one_line <= 250  # R: 188 one-line prints, 112 wrapped


def test_r_matrix_fills_columns_unless_byrow(ch02):
    assert_array_equal(ch02.r_matrix(range(6), 2, 3), [[0, 2, 4], [1, 3, 5]])
    assert_array_equal(
        ch02.r_matrix(range(6), 2, 3, byrow=True), [[0, 1, 2], [3, 4, 5]]
    )
    with pytest.raises(ValueError, match="needs 6 values"):
        ch02.r_matrix(range(5), 2, 3)


@pytest.mark.parametrize("nrow", [3.0, 0, True, "3"])
def test_r_matrix_names_a_size_that_is_not_a_count(ch02, nrow):
    with pytest.raises(ValueError, match="nrow must be an integer >= 1"):
        ch02.r_matrix(range(9), nrow, 3)


def test_r_matrix_refuses_what_r_would_recycle_or_cut(ch02):
    with pytest.raises(ValueError, match="needs 6 values"):
        ch02.r_matrix(range(7), 2, 3)  # R would drop the 7th
    with pytest.raises(ValueError, match=r"1-D array, got shape \(2, 3\)"):
        ch02.r_matrix(np.ones((2, 3)), 2, 3)


def test_fill_figure_numbers_each_cell_in_rs_order(ch02):
    """draw_fill writes k in the cell where r_matrix puts the k-th value:
    down the columns for matrix(values, 3, 3), along the rows with byrow."""
    import matplotlib.pyplot as plt

    for byrow in (False, True):
        fig, ax = plt.subplots()
        ch02.draw_fill(ax, 0.0, byrow, "title")
        cells = {}
        for text in ax.texts:
            if text.get_text().isdigit():
                x, y = text.get_position()
                row, col = round((2.55 - y) / 0.9), round((x - 0.45) / 0.9)
                cells[(row, col)] = int(text.get_text())
        plt.close(fig)
        expected = np.arange(1, 10).reshape(3, 3)
        if not byrow:
            expected = expected.T  # R: 1, 2, 3 down the first column
        assert cells == {
            (i, j): expected[i, j] for i in range(3) for j in range(3)
        }


def test_numbers_in_reads_every_row_of_a_printout(ch01, ch02):
    """The R post's printout read back: four rows, three columns, within
    half a unit of the 7th digit of chapter 1's table (read from chapter 1:
    an independent copy of the source's numbers)."""
    numbers = ch02.numbers_in(ch02.R_POST_ATTENTION)
    assert numbers.shape == (4, 3)
    assert_allclose(numbers, ch01.SOURCE_ATTENTION, rtol=5e-7, atol=0)
    assert_allclose(ch02.CH1_ATTENTION, ch01.SOURCE_ATTENTION, rtol=0, atol=0)


def test_vignette_matrices_give_every_vignette_printout(ch02, rport):
    """R's set.seed(0) draws, floored and filled by column, are the stored
    VIGNETTE_W_DERIVED; with the four words they give the scores, row
    maxima, weights and outputs the vignette prints (read back from its
    printouts), the softmax written out here."""
    rng = rport.r_set_seed(0)
    for name in ("W_Q", "W_K", "W_V"):
        drawn = ch02.r_matrix(np.floor(rport.r_runif(rng, 9, 0.0, 3.0)), 3, 3)
        assert_array_equal(drawn, ch02.VIGNETTE_W_DERIVED[name], name)
    words = ch02.numbers_in(ch02.VIGNETTE["words"])
    assert_array_equal(words, [[1, 0, 0], [0, 1, 0], [1, 1, 0], [0, 0, 1]])
    W_Q, W_K, W_V = (
        np.array(ch02.VIGNETTE_W_DERIVED[n]) for n in ("W_Q", "W_K", "W_V")
    )
    scores = (words @ W_Q) @ (words @ W_K).T
    assert_array_equal(scores, ch02.numbers_in(ch02.VIGNETTE["scores"]))
    maxs = scores.max(axis=1, keepdims=True)
    assert_array_equal(maxs, ch02.numbers_in(ch02.VIGNETTE["maxs"]))
    e = np.exp((scores - maxs) / np.sqrt(3))
    weights = e / e.sum(axis=1, keepdims=True)
    printed = ch02.numbers_in(ch02.VIGNETTE["weights"])
    assert_allclose(weights, printed, rtol=5e-7, atol=0)
    printed = ch02.numbers_in(ch02.VIGNETTE["attention"])
    assert_allclose(weights @ (words @ W_V), printed, rtol=5e-7, atol=0)


# --- The Julia block, tokens as columns -------------------------------------


def julia_inputs(seed, n, d=4, d_v=3, bias=True):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(d, n))
    Q_jl, K_jl = rng.normal(size=(d, d)), rng.normal(size=(d, d))
    V_jl = rng.normal(size=(d_v, d))
    scale = 1.0 if bias else 0.0
    b_Q, b_K = scale * rng.normal(size=(d, 1)), scale * rng.normal(size=(d, 1))
    b_V = scale * rng.normal(size=(d_v, 1))
    return x, Q_jl, b_Q, K_jl, b_K, V_jl, b_V


@pytest.mark.parametrize("seed", range(15))
@pytest.mark.parametrize("bias", [False, True])
def test_julia_block_transposed_equals_chapter_1(ch01, ch02, seed, bias):
    n = 1 + seed % 6
    x, Q_jl, b_Q, K_jl, b_K, V_jl, b_V = julia_inputs(seed, n, bias=bias)
    *_, alpha, z = ch02.attention_block(x, Q_jl, b_Q, K_jl, b_K, V_jl, b_V)
    X = x.T  # rows = tokens
    out, weights = ch01.attention_matrix(
        X @ Q_jl.T + b_Q.T, X @ K_jl.T + b_K.T, X @ V_jl.T + b_V.T
    )
    assert z.shape == (V_jl.shape[0], n)
    assert_allclose(alpha, weights, rtol=0, atol=1e-12)
    assert_allclose(z.T, out, rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", range(10))
def test_source_scaling_is_chapter_1_at_temperature_sqrt_n(ch01, ch02, seed):
    n = 2 + seed % 5
    x, Q_jl, b_Q, K_jl, b_K, V_jl, b_V = julia_inputs(seed, n)
    *_, alpha, z = ch02.attention_block(
        x, Q_jl, b_Q, K_jl, b_K, V_jl, b_V, scale="length(q)"
    )
    X = x.T
    out, weights = ch01.attention_matrix(
        (X @ Q_jl.T + b_Q.T) / np.sqrt(n),
        X @ K_jl.T + b_K.T,
        X @ V_jl.T + b_V.T,
    )
    assert_allclose(alpha, weights, rtol=0, atol=1e-12)
    assert_allclose(z.T, out, rtol=0, atol=1e-12)


def test_julia_softmax_is_over_all_entries(ch02):
    z = np.array([[1000.0, 0.0], [0.0, 1000.0]])
    assert_allclose(
        ch02.softmax(z), [[0.5, 0.0], [0.0, 0.5]], rtol=0, atol=1e-15
    )
    with pytest.raises(ValueError, match="finite"):
        ch02.softmax([1.0, np.nan])


@pytest.mark.parametrize("seed", range(5))
def test_julia_softmax_equals_the_formula_over_all_entries(ch02, seed):
    z = np.random.default_rng(seed).normal(scale=3.0, size=(3, 4))
    expected = np.exp(z) / np.exp(z).sum()
    assert_allclose(ch02.softmax(z), expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("seed", range(5))
def test_linear_transform_adds_the_bias_to_every_column(ch02, seed):
    rng = np.random.default_rng(seed)
    x, W, b = (
        rng.normal(size=(4, 5)),
        rng.normal(size=(3, 4)),
        rng.normal(size=(3, 1)),
    )
    expected = [W @ x[:, j] + b[:, 0] for j in range(5)]  # one token each
    assert_allclose(ch02.linear_transform(x, W, b).T, expected, atol=1e-12)


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


@pytest.mark.parametrize("name", ["x", "W", "b"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_linear_transform_refuses_nan_and_inf(ch02, name, bad):
    """W x + b of a NaN or an infinity would be NaN or inf: a ValueError
    naming the array instead (issue 47)."""
    args = {"x": np.ones((3, 4)), "W": np.ones((2, 3)), "b": np.ones((2, 1))}
    args[name][0, 0] = bad
    with pytest.raises(ValueError, match=f"finite numbers; {name} has"):
        ch02.linear_transform(**args)
    x, W, b = args["x"], args["W"], args["b"]
    with pytest.raises(ValueError, match=f"finite numbers; {name} has"):
        ch02.attention_block(x, W, b, W, b, W, b)  # the same for q, k, v


def test_attention_weights_refuses_bad_input(ch02):
    with pytest.raises(ValueError, match="same d_k"):
        ch02.attention_weights(np.ones((3, 4)), np.ones((2, 4)))
    with pytest.raises(ValueError, match="scale must be"):
        ch02.attention_weights(np.ones((3, 4)), np.ones((3, 4)), scale="n")


def test_complex_input_is_refused_not_cast(ch02):
    """np.asarray(..., dtype=float) would drop a complex array's imaginary
    part (a warning) or raise a TypeError for complex Python numbers: a
    ValueError naming the problem instead (review R3)."""
    z = np.ones((3, 4)) * (1 + 1j)
    with pytest.raises(ValueError, match="got complex ones"):
        ch02.attention_weights(z, np.ones((3, 4)))
    with pytest.raises(ValueError, match="got complex ones"):
        ch02.attention_weights([[1 + 1j, 2], [3, 4]], [[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="got complex ones"):
        ch02.linear_transform(np.ones((3, 4)), np.eye(3) * 1j, np.ones((3, 1)))


def test_chapter_uses_the_appendix_code(ch02, rport):
    """One source of truth: the chapter prints and draws with the very
    functions the appendix shows and checks (book/r_port.py)."""
    for name in ("r_format_matrix", "r_runif", "r_set_seed"):
        assert getattr(ch02, name) is getattr(rport, name), name


def test_appendix_shows_each_function_as_it_is_in_r_port(rport, capsys):
    """The appendix's `show` prints the source of every function it is
    given, exactly as book/r_port.py has it."""
    import inspect

    import r_port

    rport.show(r_port.r_seed_words, r_port.r_set_seed)
    printed = capsys.readouterr().out
    expected = "\n\n".join(
        inspect.getsource(f) for f in (r_port.r_seed_words, r_port.r_set_seed)
    )
    assert printed == expected.rstrip() + "\n"
