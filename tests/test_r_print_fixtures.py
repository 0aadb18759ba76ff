"""The book's emulation of R's print() (r_format_vector, r_format_matrix)
against what real R printed, stored in tests/fixtures/r_print_cases.json by
tools/r_print_fixtures.py from the cases in tools/r_print_cases.R: ties
between fixed and scientific notation, negative zero, the widths of mixed
vectors and matrix columns, row labels, very large and very small numbers.
These tests need no R. Where R is installed, R's output is compared live
with the stored file as well.

The functions live in book/r_port.py, which chapter 2 and the appendix
import; the test reads them from the appendix, as a reader's kernel does.
"""

import ast
import json
import shutil

import numpy as np
import pytest
from conftest import BOOK, load_chapter, require_system_tool
from r_print_fixtures import FIXTURES, parse, run_r

R_INSTALL = "apt-get install r-base-core r-cran-matrixstats"
FUNCTIONS = ("r_format_vector", "r_format_matrix")


def defining_module(name):
    """The one file under book/ (module or notebook) that defines `name`."""
    found = []
    for path in sorted(BOOK.glob("*.py")) + sorted(BOOK.glob("*.ipynb")):
        if path.suffix == ".py":
            sources = [path.read_text(encoding="utf-8")]
        else:
            cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
            sources = [
                "".join(c["source"]) for c in cells if c["cell_type"] == "code"
            ]
        for source in sources:
            try:
                tree = ast.parse(source)
            except SyntaxError:
                continue
            if any(
                isinstance(node, ast.FunctionDef) and node.name == name
                for node in tree.body
            ):
                found.append(path.name)
    assert found == ["r_port.py"], f"{name} defined in {found}"
    return found[0]


@pytest.fixture(scope="module")
def emulation():
    for name in FUNCTIONS:
        defining_module(name)
    appendix = load_chapter("appendix_r_internals.ipynb")
    for name in FUNCTIONS:
        assert getattr(appendix, name).__module__ == "r_port", name
    return appendix


STORED = json.loads(FIXTURES.read_text(encoding="utf-8"))
CASES = STORED["cases"]


def numbers(case):
    """The case's doubles, bit for bit, NA as NaN; a matrix column-major."""
    x = np.array(
        [np.nan if v == "NA" else float.fromhex(v) for v in case["values"]]
    )
    if case["kind"] == "matrix":
        return x.reshape(case["rows"], -1, order="F")
    return x


def refuses(case):
    """The emulation prints one line and finite numbers only: R's NA and R's
    wrapped lines are refused with a ValueError."""
    return "NA" in case["values"] or (
        case["kind"] == "vector" and "\n" in case["printed"]
    )


def test_fixtures_cover_what_the_emulation_must_get_right():
    names = [case["name"] for case in CASES]
    assert len(names) == len(set(names))
    assert sum(name.startswith("tie_") for name in names) >= 6
    assert sum(name.startswith("neg_zero") for name in names) >= 3
    assert any(case["kind"] == "matrix" for case in CASES)
    assert {"tiny", "huge", "denormal", "max_double"} <= set(names)
    for case in CASES:
        assert numbers(case).size == len(case["values"]) >= 1
    # R printed a negative zero as 0, and the stored input is a negative zero
    (case,) = [c for c in CASES if c["name"] == "neg_zero"]
    assert case["printed"] == "[1] 0"
    assert np.signbit(numbers(case)[0])


@pytest.mark.parametrize(
    "case", [c for c in CASES if not refuses(c)], ids=lambda c: c["name"]
)
def test_emulation_prints_what_r_printed(emulation, case):
    x = numbers(case)
    if case["kind"] == "matrix":
        assert emulation.r_format_matrix(x) == case["printed"]
    else:
        assert emulation.r_format_vector(x) == case["printed"]


@pytest.mark.parametrize(
    "case", [c for c in CASES if refuses(c)], ids=lambda c: c["name"]
)
def test_emulation_refuses_what_it_does_not_print(emulation, case):
    x = numbers(case)
    message = "finite" if "NA" in case["values"] else "wider than 80"
    function = (
        emulation.r_format_matrix
        if case["kind"] == "matrix"
        else emulation.r_format_vector
    )
    with pytest.raises(ValueError, match=message):
        function(x)


def test_live_r_prints_what_is_stored():
    """Where R is installed: R today prints exactly the stored cases (so the
    emulation, checked above against the file, agrees with this R too)."""
    path = shutil.which("Rscript")
    require_system_tool(path is not None, "R (Rscript)", R_INSTALL)
    output, version = run_r(path)
    live = parse(output)
    assert [c["name"] for c in live] == [c["name"] for c in CASES]
    for ours, theirs in zip(live, CASES):
        assert ours == theirs, f"{version}: {ours['name']}"
