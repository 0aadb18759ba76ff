"""Bad input to every public function of book/r_port.py: a ValueError whose
message names the problem, never an IndexError, AttributeError, TypeError
or a silently wrong print (issue 47). What R prints in a way the port does
not reproduce (NA, wrapped lines, ties decided by powl, matrices beyond
max.print) the port refuses too, tested here and, against R's output, in
test_r_print_fixtures.py.
"""

import inspect
from fractions import Fraction

import numpy as np
import pytest
from conftest import BOOK  # noqa: F401  (puts book/ on sys.path)

import r_port


class ZeroBits(np.random.MT19937):
    """A bit generator whose raw draws are all 0."""

    def random_raw(self, size=None, output=True):
        return np.zeros(size, dtype=np.uint64)


def mt():
    return r_port.r_set_seed(0)


WIDE = np.arange(30) / 7
# (function, arguments, what the message must say)
BAD_INPUT = [
    ("check_seed", (1.5,), "integer"),
    ("check_seed", (2**31,), "32-bit"),
    ("r_seed_words", ("0",), "integer"),
    ("r_set_seed", (None,), "integer"),
    ("r_set_seed", (-(2**31),), "32-bit"),
    ("check_count", (-1,), "non-negative integer"),
    ("check_count", (True,), "non-negative integer"),
    ("check_generator", (np.random.default_rng(0),), "MT19937"),
    ("check_generator", (np.random.PCG64(0),), "MT19937"),
    ("r_unif_rand", (np.random.default_rng(0), 3), "MT19937"),
    ("r_unif_rand", (mt(), 2.0), "non-negative integer"),
    ("r_unif_rand", (mt(), -1), "non-negative integer"),
    ("check_runif", (mt(), 3, "0", 1.0), "min must be a real number"),
    ("check_runif", (mt(), 3, 0.0, None), "max must be a real number"),
    ("check_runif", (mt(), 3, 0.0, [1.0, 2.0]), "max must be a real"),
    ("check_runif", (mt(), 3, 2.0, 1.0), "min <= max"),
    ("check_runif", (mt(), 3, 0, 10**400), "max beyond the largest double"),
    ("check_runif", (mt(), 3, -(10**309), 0), "min beyond the largest"),
    ("r_runif", (None, 3), "MT19937"),
    ("r_runif", (None, 3, 1.0, 1.0), "MT19937"),
    ("r_runif", (mt(), 3, np.nan, 1.0), "finite"),
    ("r_runif", (mt(), 3, False, 1.0), "min must be a real number"),
    ("check_real_array", (["1.5"], "f"), "dtype <U3"),
    ("check_real_array", ([1 + 2j], "f"), "dtype complex128"),
    ("check_real_array", ([True, False], "f"), "dtype bool"),
    ("check_real_array", ([None], "f"), "dtype object"),
    ("check_real_array", (np.ones(2, np.longdouble), "f"), "64 bits"),
    ("check_real_array", ([2**53 + 1], "f"), "not exactly a double"),
    ("check_real_array", ([[1.0], [1.0, 2.0]], "f"), "rectangular"),
    ("check_real_array", ([1.0, np.nan], "f"), "finite"),
    # a masked entry would print its hidden value, where R shows NA
    (
        "check_real_array",
        (np.ma.masked_array([1.0, 2.0], mask=[0, 1]), "f"),
        "1 masked entry",
    ),
    (
        "r_format_vector",
        (np.ma.masked_array([1.0, 2.0], mask=[0, 1]),),
        "r_format_vector got a masked array",
    ),
    (
        "r_format_matrix",
        ([np.ma.masked_array([1.0, 2.0], mask=[1, 1])],),
        "2 masked entries",
    ),
    ("check_numbers", ([], "f"), "non-empty 1-D"),
    ("check_numbers", (np.ones((2, 2)), "f"), "non-empty 1-D"),
    ("check_numbers", ([-np.inf], "f"), "finite"),
    ("check_matrix", (np.ones(3),), "2-D"),
    ("check_matrix", (np.ones((0, 2)),), "2-D"),
    ("check_matrix", ([["a"]],), "real numbers"),
    ("check_matrix", (np.zeros((100000, 1)),), "max.print"),
    ("check_matrix", (np.zeros((25000, 4)),), "max.print"),
    ("check_digits", (0,), "from 1 to 15"),
    ("check_digits", (16,), "from 1 to 15"),
    ("check_digits", (7.0,), "integer"),
    ("check_width", (["[1] 1"], 9, "vector"), "from 10 to 10000"),
    ("check_width", (["[1] 1"], 80.0, "vector"), "width must be an integer"),
    ("check_width", ([], 80, "vector"), "non-empty list of lines"),
    ("check_width", ("[1] 1", 80, "vector"), "non-empty list of lines"),
    ("check_width", (["x" * 81], 80, "vector"), "wider than 80"),
    (
        "check_width",
        (["x" * 80], 80, "matrix"),
        "80 characters wide, and R keeps",
    ),
    ("check_width", (["x"], 80, "array"), "a vector or a matrix"),
    # lines that are not strings: a TypeError from len() before review R3
    ("check_width", ([1, 2], 80, "vector"), "each a str"),
    ("check_width", (np.array(["[1] 1"]), 80, "vector"), "list of lines"),
    ("long_double", ("1/3",), "real number"),
    ("long_double", (True,), "real number"),
    ("long_double", (np.inf,), "finite"),
    ("long_double", (np.float32("nan"),), "finite"),
    ("long_double", (np.longdouble("inf"),), "finite"),
    ("r_power_of_ten", (28,), "table holds 10"),
    ("r_power_of_ten", (-1,), "table holds 10"),
    ("r_power_of_ten", (23.0,), "integer"),
    ("r_power_of_ten", (True,), "integer"),
    ("r_significant", (np.nan,), "finite"),
    ("r_significant", ([1.0, 2.0],), "one number"),
    ("r_significant", ("1",), "real numbers"),
    ("r_significant", (1.0, 22), "from 1 to 15"),
    ("r_layout", ([],), "non-empty 1-D"),
    ("r_layout", ([1.0], 0), "from 1 to 15"),
    ("r_format_column", ([1.0, np.nan],), "finite"),
    ("r_format_column", ([[1.0]],), "non-empty 1-D"),
    ("r_format_column", ([1.0], True), "digits must be an integer"),
    ("r_format_matrix", (np.ones(3),), "2-D"),
    ("r_format_matrix", ([[1.0, np.nan]],), "finite"),
    ("r_format_matrix", (np.ones((2, 12)) / 3,), "R would wrap it"),
    # R 4.2.2 prints this 80-character line as two blocks of columns
    (
        "r_format_matrix",
        ([[1 / 3] * 7 + [1.125]],),
        "80 characters wide, and R keeps",
    ),
    ("r_format_matrix", ([[1.0]], 7, 5), "from 10 to 10000"),
    ("r_format_matrix", ([[1.0]], 16), "from 1 to 15"),
    ("r_format_matrix", ([[True]],), "dtype bool"),
    ("r_format_vector", ([],), "non-empty"),
    ("r_format_vector", ([1.0, np.inf],), "finite"),
    ("r_format_vector", (WIDE,), "wider than 80"),
    ("r_format_vector", (np.ones((2, 2)),), "1-D"),
    ("r_format_vector", ("1",), "real numbers"),
    ("r_format_vector", ([1.0], 7, None), "width must be an integer"),
    ("r_format_vector", ([2**60 + 1],), "not exactly a double"),
    # a structured array: a UFuncTypeError from its mask before review R3
    ("r_format_vector", (np.zeros(2, dtype=[("a", "f8")]),), "real numbers"),
    ("r_format_matrix", (np.zeros((2, 1), dtype=[("a", "f8")]),), "dtype"),
    (
        "check_real_array",
        (np.ma.zeros(2, dtype=[("a", "f8")]), "f"),
        "real numbers",
    ),
]


def public_functions():
    return sorted(
        name
        for name, f in inspect.getmembers(r_port, inspect.isfunction)
        if f.__module__ == "r_port" and not name.startswith("_")
    )


def test_every_public_function_has_a_bad_input_case():
    assert sorted({name for name, _, _ in BAD_INPUT}) == public_functions()


@pytest.mark.parametrize(
    "name, args, message",
    BAD_INPUT,
    ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD_INPUT)],
)
def test_bad_input_raises_a_value_error_naming_it(name, args, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        getattr(r_port, name)(*args)


@pytest.mark.parametrize(
    "x, text",
    [  # R 4.2.2: print(c(...)) of the doubles these hold
        (np.array([1, -2], dtype=np.int8), "[1]  1 -2"),
        (np.array([0.5], dtype=np.float32), "[1] 0.5"),
        (np.float64(3.0), "[1] 3"),
        (np.ma.masked_array([1.0, 2.0], mask=[0, 0]), "[1] 1 2"),  # no mask
        ([2**53], "[1] 9.007199e+15"),
        (np.array([2**62], dtype=np.uint64), "[1] 4.611686e+18"),
    ],
)
def test_integer_and_narrow_inputs_print_as_their_doubles(x, text):
    assert r_port.r_format_vector(x) == text


def test_good_input_passes_the_checks():
    assert r_port.check_count(np.int64(3)) == 3
    assert r_port.check_digits(np.int32(7)) == 7
    r_port.check_generator(ZeroBits())
    r_port.check_runif(mt(), 0, 1, 1)  # runif(0, 1, 1) is numeric(0) in R
    assert r_port.r_runif(mt(), 0).shape == (0,)
    # R's runif(2, 0, 2^70): an int beyond 2^64 is a double, not an error
    big = r_port.r_runif(mt(), 2, 0, 2**70)
    assert big.tolist() == (2.0**70 * r_port.r_unif_rand(mt(), 2)).tolist()
    # R 4.2.2: print(matrix(0, 99999, 1)) shows every row (one more: not)
    assert r_port.check_matrix(np.zeros((99999, 1))).shape == (99999, 1)
    assert r_port.check_matrix(np.zeros((33333, 3))).shape == (33333, 3)


def test_long_double_keeps_64_bits_ties_to_even():
    """x87's long double: a 64-bit significand, rounding to nearest, ties to
    even (here checked with integers: 2^63 + 1 needs 64 bits)."""
    assert r_port.long_double(2**63 + 1) == 2**63 + 1
    assert r_port.long_double(2**64 + 1) == 2**64  # a tie, to even
    assert r_port.long_double(2**64 + 3) == 2**64 + 4  # a tie, to even
    assert r_port.long_double(-(2**64) - 3) == -(2**64) - 4
    third = Fraction(1, 3)  # 1/3 = 2^-2 * 4/3: the unit is 2^-65
    assert r_port.long_double(third) == Fraction(round(2**65 * third), 2**65)
    assert r_port.long_double(0.1) == Fraction(0.1)  # 53 bits fit in 64


@pytest.mark.parametrize(
    "q", [np.float16(0.1), np.float32(0.1), np.float32(-3e-39)]
)
def test_long_double_takes_narrow_floats_exactly(q):
    """A float16 or float32 holds a double exactly (53 bits fit in 64), so
    long_double returns it unchanged (a TypeError before review R3)."""
    assert r_port.long_double(q) == Fraction(float(q)) != 0


def test_long_double_takes_numpy_longdouble_exactly():
    """np.longdouble: its exact value rounded to 64 bits (on x86-64 it is the
    x87 format itself, so nothing changes; a TypeError before review R3)."""
    q = np.longdouble(1) / 3
    exact = Fraction(*q.as_integer_ratio())
    assert r_port.long_double(q) == r_port.long_double(exact)
    if np.finfo(np.longdouble).nmant == 63:  # x86-64: the x87 format
        assert r_port.long_double(q) == exact != Fraction(float(q))


def test_r_power_of_ten_is_rs_table_of_double_literals():
    """R's tbl in format.c holds the literals 1e00 ... 1e27, doubles: exact
    powers of 10 up to 10^22, the nearest double from 10^23 on (review R3;
    C reads 1e23 as Python does, to the nearest double)."""
    table = [r_port.r_power_of_ten(k) for k in range(28)]
    assert table == [Fraction(float(f"1e{k}")) for k in range(28)]
    assert table[:23] == [Fraction(10) ** k for k in range(23)]
    assert all(table[k] != 10**k for k in range(23, 28))
    assert table[23] == 10**23 - 8388608


def test_rounding_widens_uses_rs_table_at_10_23():
    """1e23 is the double 10^23 - 8388608; R compares it with tbl[23] - 0.5,
    that same double in long double, so roundingwidens is FALSE: R 4.2.2's
    print(1e23) with options(scipen = 100) is "[1]  99999999999999991611392"
    (width 24, one digit more than %.0f prints). Against the exact 10^23 it
    would be TRUE."""
    assert r_port.r_significant(1e23) == (1, 23, False)
    below = np.nextafter(1e23, 0)  # below tbl[23] - 0.5: widens
    assert r_port.r_significant(below) == (1, 23, True)


def test_a_column_width_is_computed_once_per_column(monkeypatch):
    """r_format_matrix pads a column's cells to the column's widest, found
    once per column, not once per cell (that took 73 s for a column of
    20,000 cells: issue 47). Counted through r_port's name `len`: a few per
    cell, not one per cell for every cell."""
    calls = []

    def counting_len(x):
        calls.append(1)
        return len(x)

    monkeypatch.setattr(r_port, "len", counting_len, raising=False)
    text = r_port.r_format_matrix(np.zeros((1000, 2)))
    assert text.count("\n") == 1000
    assert len(calls) < 10 * 2002  # quadratic: over 2,000,000
