"""Shared test helpers: load a chapter's own definitions from its notebook."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from importnb import Notebook

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"

# Chapters import shared helpers (book/plots.py) the way a reader's kernel
# does, from the notebook's own folder.
if str(BOOK) not in sys.path:
    sys.path.insert(0, str(BOOK))


class ChapterLoader(Notebook):
    """importnb's notebook loader, with markdown cells turned into comments.

    importnb normally keeps markdown as string literals; TeX in the prose
    (`\\underbrace`, `\\frac`) is then read as Python escapes and can even
    stop the import. As comments the prose cannot affect the code.
    """

    def markdown(self, text):
        return textwrap.indent(text, "# ")


def load_chapter(filename):
    """Import the functions, classes and imports of a chapter notebook.

    Only definitions are executed (importnb's include_non_defs=False,
                              include_markdown_docstring=False), so the
    tests exercise exactly the code the chapter prints, without re-running
    the chapter's demonstrations.
    """
    return ChapterLoader.load_file(
        str(BOOK / filename),
        main=False,
        include_non_defs=False,
        include_markdown_docstring=False,
    )


@pytest.fixture(scope="session")
def ch01():
    return load_chapter("01_general_attention.ipynb")


@pytest.fixture(scope="session")
def built_site():
    """Build the site once per test session, as `make book` does."""
    jb = Path(sys.executable).parent / "jupyter-book"
    result = subprocess.run(
        [str(jb), "build", str(ROOT), "-W", "-n", "--keep-going"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    return result
