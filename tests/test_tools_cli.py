"""tools/cli.py, the command line of the scripts with no options of their
own: --help prints the docstring up to its Usage section and exits 0 before
any work; notebooks come back as given."""

import cli  # tools/, on the path by tests/conftest.py
import pytest

DOC = "Do a thing to the book.\n\nUsage: python tools/x.py [NB ...]\n"


def test_help_prints_the_docstring_up_to_usage_and_exits_0(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.help_only(DOC, ["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert "Do a thing to the book." in out and "Usage: python" not in out


def test_no_options_but_help():
    assert vars(cli.help_only(DOC, [])) == {}
    with pytest.raises(SystemExit) as stop:
        cli.help_only(DOC, ["--quick"])
    assert stop.value.code == 2


def test_notebooks_as_given_or_none():
    assert cli.notebooks(DOC, ["a.ipynb", "b.ipynb"]) == ["a.ipynb", "b.ipynb"]
    assert cli.notebooks(DOC, []) == []
