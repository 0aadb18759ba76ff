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
    (`python tools/check/cell_stats.py` prints the figures)."""
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


def ignored_cells(cells_by_name):
    """(notebook, index) of every cell whose output nbval does not compare."""
    return [
        (name, i)
        for name, cells in cells_by_name.items()
        for i, cell in enumerate(cells)
        if cell["cell_type"] == "code"
        and "".join(cell["source"]).startswith("# NBVAL_IGNORE_OUTPUT")
    ]


# a Python assert, or a call of a chapter's `claim` helper, which asserts
ASSERTS = re.compile(r"^\s*(assert\b|claim\()", flags=re.M)


def unasserted_ignored_cells(cells_by_name, window=2):
    """The ignored cells not followed, within the next `window` code cells
    (a plot or a helper may come first), by a cell that asserts."""
    missing = []
    for name, i in ignored_cells(cells_by_name):
        following = [
            "".join(cell["source"])
            for cell in cells_by_name[name][i + 1 :]
            if cell["cell_type"] == "code"
        ][:window]
        if not any(ASSERTS.search(source) for source in following):
            missing.append((name, i))
    return missing


def test_intro_states_which_cells_nbval_ignores():
    """book/intro.md says which cells nbval leaves out, that each is followed
    by a cell asserting its claims, and which chapters have such cells.
    Checked against the notebooks, whatever their number."""
    text = " ".join((BOOK / "intro.md").read_text(encoding="utf-8").split())
    assert "the cells whose first line is `# NBVAL_IGNORE_OUTPUT`" in text
    assert "each followed by a cell asserting what the text claims" in text
    cells_by_name = {name: cells_of(name) for name in NOTEBOOKS}
    assert unasserted_ignored_cells(cells_by_name) == []
    stated = re.search(
        r"Only chapters ([\d, ]+ and \d+) have such cells", text
    )
    assert stated, "intro.md no longer says which chapters have such cells"
    named = {int(n) for n in re.findall(r"\d+", stated.group(1))}
    having = {int(name[:2]) for name, _ in ignored_cells(cells_by_name)}
    assert named == having, (named, having)


def test_ignored_cell_check_sees_a_cell_without_asserts():
    """The check above can fail: an ignored log followed only by a plot and
    a print, or by nothing."""
    code = [
        {"cell_type": "code", "source": ["# NBVAL_IGNORE_OUTPUT\n", "log()"]},
        {"cell_type": "markdown", "source": ["The loss fell."]},
        {"cell_type": "code", "source": ["plt.plot(losses)"]},
        {"cell_type": "code", "source": ["print(losses[-1])"]},
        {"cell_type": "code", "source": ["assert losses[-1] < 1"]},
    ]
    assert unasserted_ignored_cells({"nb": code}) == [("nb", 0)]
    assert unasserted_ignored_cells({"nb": code[:1]}) == [("nb", 0)]
    assert unasserted_ignored_cells({"nb": code[:2] + code[3:]}) == []
