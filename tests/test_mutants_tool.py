"""tools/check/mutants.py, the runner of `make mutants`: a bug is planted in the
code cells only and leaves a valid notebook, a `find` that does not occur
exactly once makes the mutant invalid and stops the run before it starts,
and a shared module's tests are those of every chapter that imports it.
Every planted bug of tools/check/mutants/ still applies to the code as it is (its
`find` occurs exactly once): a change that strands one fails here, in
`make test`. (Whether the tests catch each bug is checked by running
`make mutants`, not here.)"""

import json

import mutants as runner  # tools/check/mutants.py (its tests_for is no test)
import nbformat
import pytest
from mutants import (
    Mutant,
    count_matches,
    invalid,
    load_mutants,
    module_tests,
    patched_text,
    run_mutant,
)


def notebook(*cells):
    """A minimal nbformat 4 notebook of (kind, source) cells."""
    nb = nbformat.v4.new_notebook()
    for kind, source in cells:
        if kind == "code":
            nb.cells.append(nbformat.v4.new_code_cell(source))
        else:
            nb.cells.append(nbformat.v4.new_markdown_cell(source))
    return nb


def write_notebook(path, *cells):
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook(*cells), str(path))


def mutant(file, find, replace="PLANTED", **kw):
    return Mutant("m", file, find, replace, "a planted bug", **kw)


def test_notebook_patch_edits_the_code_cell_only(tmp_path):
    path = tmp_path / "book" / "01_demo.ipynb"
    write_notebook(
        path,
        ("markdown", "We compute `x = 1 + 1` here."),
        ("code", "import numpy as np\nx = 1 + 1\nprint(x)\n"),
        ("markdown", "x = 1 + 1 again in prose"),
    )
    m = mutant("book/01_demo.ipynb", "x = 1 + 1", "x = 1 + 2")
    assert count_matches(tmp_path, m) == 1  # the prose is not counted
    text = patched_text(path.read_text("utf-8"), ".ipynb", m)
    patched = nbformat.reads(text, as_version=4)
    nbformat.validate(patched)
    sources = [cell.source for cell in patched.cells]
    assert sources == [
        "We compute `x = 1 + 1` here.",
        "import numpy as np\nx = 1 + 2\nprint(x)\n",
        "x = 1 + 1 again in prose",
    ]
    # lines stored as a list, each ending in a newline but the last
    assert json.loads(text)["cells"][1]["source"][1] == "x = 1 + 2\n"


def test_find_across_cells_or_twice_is_invalid(tmp_path):
    path = tmp_path / "book" / "01_demo.ipynb"
    write_notebook(path, ("code", "a = 1\n"), ("code", "b = 2\na = 1\n"))
    file = "book/01_demo.ipynb"
    assert count_matches(tmp_path, mutant(file, "a = 1")) == 2
    assert count_matches(tmp_path, mutant(file, "a = 1\nb = 2")) == 0
    assert count_matches(tmp_path, mutant("book/missing.py", "a")) == 0
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_ch01_demo.py").write_text("")
    result = run_mutant(mutant(file, "a = 1"), tmp_path, {}, 10)
    assert result.status == "invalid"
    assert "2 times" in result.detail


def test_module_patch_replaces_one_occurrence():
    m = mutant("book/plots.py", "vmax=1.0", "vmax=2.0")
    assert patched_text("a(vmax=1.0)\n", ".py", m) == "a(vmax=2.0)\n"


def test_a_modules_tests_follow_its_importers(tmp_path):
    book, tests = tmp_path / "book", tmp_path / "tests"
    book.mkdir()
    tests.mkdir()
    (book / "base.py").write_text("import numpy\n")
    (book / "layer.py").write_text("from base import thing\n")
    (book / "top.py").write_text("import layer\n")
    (book / "unused.py").write_text("x = 1\n")
    write_notebook(book / "01_one.ipynb", ("code", "import top\n"))
    write_notebook(book / "02_two.ipynb", ("code", "import numpy as np\n"))
    write_notebook(book / "03_three.ipynb", ("code", "import base\n"))
    for name in ("test_ch01_one", "test_ch02_two", "test_ch03_three"):
        (tests / f"{name}.py").write_text("")
    (tests / "test_shared.py").write_text("import base\n")
    names = [p.name for p in module_tests(tmp_path, "base")]
    # the direct importers first, then each chapter using it, directly or
    # through other modules (01 imports top, which imports layer, base)
    assert names == [
        "test_shared.py",
        "test_ch01_one.py",
        "test_ch03_three.py",
    ]
    assert module_tests(tmp_path, "unused") == []
    chapter = runner.tests_for(tmp_path, mutant("book/02_two.ipynb", "numpy"))
    assert chapter == ["tests/test_ch02_two.py"]
    given = mutant("book/base.py", "numpy", tests=["tests/test_x.py"])
    assert runner.tests_for(tmp_path, given) == ["tests/test_x.py"]


@pytest.mark.parametrize(
    "toml, message",
    [
        (
            '[[mutant]]\nid = "a"\nfile = "f"\nfind = "x"\nreplace = "y"\n',
            "missing",
        ),
        (
            '[[mutant]]\nid = "a"\nfile = "f"\nfind = "x"\nreplace = "x"\n'
            'description = "d"\n',
            "replace == find",
        ),
        (
            '[[mutant]]\nid = "a"\nfile = "f"\nfind = "x"\nreplace = "y"\n'
            'description = "d"\n' * 2,
            "duplicate id",
        ),
    ],
)
def test_mutant_list_is_checked(tmp_path, toml, message):
    path = tmp_path / "mutants.toml"
    path.write_text(toml)
    with pytest.raises(ValueError, match=message):
        load_mutants(path)


def test_every_planted_bug_still_applies():
    """`tools/check/mutants.py --list`'s check (each `find` occurs exactly once in
    its file, each named test file exists, each mutant has a test file to
    run), in seconds, so that the change that strands a mutant fails, not
    the next `make mutants` run."""
    mutants = load_mutants()
    assert len(mutants) >= 100  # the folder was read
    stranded = [f"{m.id} ({m.source}): {why}" for m, why in invalid(mutants)]
    assert not stranded, "planted bugs that no longer apply:\n" + "\n".join(
        stranded
    )


def test_an_invalid_mutant_stops_the_run_before_it_starts(tmp_path, capsys):
    """`make mutants` exits non-zero at once, naming the mutant, its TOML
    file and why, rather than after every other mutant has run."""
    path = tmp_path / "stale.toml"
    path.write_text(
        '[[mutant]]\nid = "stale"\nfile = "book/plots.py"\n'
        'find = "text that book/plots.py does not hold"\nreplace = "x"\n'
        'description = "a mutant whose code has changed"\n'
        '[[mutant]]\nid = "lost-test"\nfile = "book/plots.py"\n'
        'find = "vmin=0.0, vmax=1.0"\nreplace = "x"\n'
        'description = "a mutant whose test file is gone"\n'
        'tests = ["tests/test_no_such_file.py"]\n'
    )
    assert runner.main(["--file", str(path)]) == 2
    out = capsys.readouterr().out
    assert (
        f"INVALID stale ({path}): `find` occurs 0 times in book/plots.py"
    ) in out
    assert f"INVALID lost-test ({path}): no test file" in out
    assert "No mutant was run." in out
    assert "Baseline" not in out


def test_a_mutant_no_test_runs_is_invalid_before_the_run(tmp_path):
    """A module that no test file imports, directly or through a chapter,
    gives a mutant no test to run: `invalid` names it up front (so the run
    stops before it starts), not only the run itself."""
    book, tests = tmp_path / "book", tmp_path / "tests"
    book.mkdir()
    tests.mkdir()
    (book / "lonely.py").write_text("x = 1\n")
    (book / "used.py").write_text("y = 2\n")
    (tests / "test_used.py").write_text("import used\n")
    lonely = mutant("book/lonely.py", "x = 1")
    used = mutant("book/used.py", "y = 2")
    assert runner.tests_for(tmp_path, lonely) == []
    found = invalid([lonely, used], root=tmp_path)
    assert [(m.file, why) for m, why in found] == [
        ("book/lonely.py", "no test file runs it: name its `tests`")
    ]
