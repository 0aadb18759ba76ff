"""Book-wide conventions that every chapter keeps (CONTRIBUTING.md)."""

import json
import re
import statistics
import sys

import pytest
from conftest import BOOK

NOTEBOOKS = sorted(p.name for p in BOOK.glob("*.ipynb"))
ORIGINAL = re.compile(r"```(\{code-block\}\s+)?(r|julia)\b")
PYTHON = re.compile(r"```python\n(.*?)```", flags=re.S)


def cells_of(name):
    return json.loads((BOOK / name).read_text(encoding="utf-8"))["cells"]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_python_tabs_equal_the_cells_that_run(name):
    """A tab set shows an original (R or Julia) beside its Python translation;
    the Python is exactly the folded code cell that follows and runs."""
    cells = cells_of(name)
    for i, cell in enumerate(cells):
        text = "".join(cell["source"])
        if cell["cell_type"] != "markdown" or "{tab-set}" not in text:
            continue
        assert ORIGINAL.search(text), f"cell {i}: no original (R/Julia) tab"
        blocks = PYTHON.findall(text)
        if not blocks:  # an original shown alone (it cannot be run here)
            continue
        assert len(blocks) == 1, f"cell {i}: one Python tab per tab set"
        following = cells[i + 1]
        assert following["cell_type"] == "code", f"cell {i + 1}"
        assert "hide-input" in following["metadata"].get("tags", []), i + 1
        assert "".join(following["source"]).strip() == blocks[0].strip(), i


def test_tab_check_sees_a_drifted_tab(tmp_path, monkeypatch):
    """The check above can fail: a tab whose code differs from its cell."""
    cells = [
        {
            "cell_type": "markdown",
            "source": [
                "::::{tab-set}\n```r\nx <- 1\n```\n```python\nx = 1\n```\n"
            ],
            "metadata": {},
        },
        {
            "cell_type": "code",
            "source": ["x = 2"],
            "metadata": {"tags": ["hide-input"]},
        },
    ]
    (tmp_path / "nb.ipynb").write_text(json.dumps({"cells": cells}))
    monkeypatch.setattr(sys.modules[__name__], "BOOK", tmp_path)
    with pytest.raises(AssertionError):
        test_python_tabs_equal_the_cells_that_run("nb.ipynb")


def test_teaching_cells_are_short():
    """Issue 17: a median code cell of at most 6 lines and at most 3 cells
    over 40 lines in the whole book, each one a class the text walks through
    (`python tools/cell_stats.py` prints the figures)."""
    from cell_stats import LONG, code_cell_lengths

    every, long_cells = [], []
    for name in NOTEBOOKS:
        cells = cells_of(name)
        for i, n in code_cell_lengths(BOOK / name):
            every.append(n)
            if n > LONG:
                long_cells.append((name, i, "".join(cells[i]["source"])))
    assert statistics.median(every) <= 6
    assert len(long_cells) <= 3, [(name, i) for name, i, _ in long_cells]
    for name, i, source in long_cells:
        assert source.lstrip().startswith("class "), (name, i)


def ignored_cells():
    """(notebook, index) of every cell whose output nbval does not compare."""
    return [
        (name, i)
        for name in NOTEBOOKS
        for i, cell in enumerate(cells_of(name))
        if cell["cell_type"] == "code"
        and "".join(cell["source"]).startswith("# NBVAL_IGNORE_OUTPUT")
    ]


def test_intro_states_which_cells_nbval_ignores():
    """book/intro.md tells the reader how many cells nbval leaves out, and in
    which chapters: the figures must follow the notebooks."""
    text = " ".join((BOOK / "intro.md").read_text(encoding="utf-8").split())
    stated = re.search(
        r"the (\d+) cells, all in chapters (\d+) to (\d+),", text
    )
    assert stated, "intro.md no longer states the ignored cells"
    count, first, last = map(int, stated.groups())
    cells = ignored_cells()
    chapters = sorted({int(name[:2]) for name, _ in cells})
    assert count == len(cells), cells
    assert (first, last) == (chapters[0], chapters[-1]), chapters
