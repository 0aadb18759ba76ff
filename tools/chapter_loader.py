"""Load a chapter's own code from its notebook: the one loader that tests/ and
tools/ share.

Only what a chapter *defines* is executed: its imports, functions and classes,
and its UPPER_CASE constants written as literals (for example
``SOURCE_ATTENTION = [[0.98522025, ...]]``, the numbers a source printed).
The chapter's demonstrations, training runs and figures are not re-run, so a
test exercises exactly the code the book prints, and reads each source number
from the one place that states it.

Usage::

    from chapter_loader import load_chapter
    ch01 = load_chapter("01_general_attention.ipynb")
    ch01.softmax(...), ch01.SOURCE_ATTENTION
"""

import ast
import sys
import textwrap
from pathlib import Path

from importnb import Notebook

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"

# Chapters import shared helpers (book/plots.py) the way a reader's kernel
# does, from the notebook's own folder.
if str(BOOK) not in sys.path:
    sys.path.insert(0, str(BOOK))

DEFINITIONS = (
    ast.Import,
    ast.ImportFrom,
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.ClassDef,
)


def is_constant(node):
    """True for `NAME = <literal>` where every target is an UPPER_CASE name."""
    if isinstance(node, ast.Assign):
        targets, value = node.targets, node.value
    elif isinstance(node, ast.AnnAssign) and node.value is not None:
        targets, value = [node.target], node.value
    else:
        return False
    if not all(
        isinstance(t, ast.Name) and t.id.isupper() and not t.id.startswith("_")
        for t in targets
    ):
        return False
    try:
        ast.literal_eval(value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def kept(node):
    """What the loader executes: definitions and literal constants."""
    return isinstance(node, DEFINITIONS) or is_constant(node)


class ChapterLoader(Notebook):
    """importnb's notebook loader, keeping definitions and literal constants.

    Markdown cells become comments: importnb normally keeps them as string
    literals, and TeX in the prose (`\\underbrace`, `\\frac`) would then be
    read as Python escapes and could even stop the import.
    """

    def markdown(self, text):
        return textwrap.indent(text, "# ")

    def visit(self, nodes):
        body = [node for node in nodes.body if kept(node)]
        return ast.Module(body=body, type_ignores=nodes.type_ignores)


def run_chapter(path):
    """Execute every code cell of a notebook top to bottom in a new module,
    as a fresh kernel would, from the notebook's folder, with printed output
    discarded and figures drawn off screen. A cell tagged `raises-exception`
    must raise (its error is the lesson) and the run goes on."""
    import contextlib
    import io
    import json
    import types

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    module = types.ModuleType(path.stem)
    module.__file__ = str(path)
    with contextlib.chdir(path.parent):
        for i, cell in enumerate(cells):
            if cell["cell_type"] != "code":
                continue
            code = compile(
                "".join(cell["source"]), f"{path.name}:cell{i}", "exec"
            )
            expected_error = "raises-exception" in cell["metadata"].get(
                "tags", []
            )
            with contextlib.redirect_stdout(io.StringIO()):
                try:
                    exec(code, module.__dict__)
                except Exception:
                    if not expected_error:
                        raise
                else:
                    if expected_error:
                        raise AssertionError(
                            f"cell {i} of {path.name} did not raise"
                        )
            plt.close("all")
    return module


def load_chapter(filename, run_all=False):
    """Import the definitions and constants of `book/<filename>`.

    With run_all=True every code cell runs instead (see run_chapter), and
    the module holds every variable the chapter computes: for a test that
    needs a chapter's own intermediate results, not a copy of the code that
    makes them.
    """
    path = BOOK / filename
    if not path.is_file():
        raise ValueError(f"no chapter notebook {path.relative_to(ROOT)}")
    if run_all:
        return run_chapter(path)
    return ChapterLoader.load_file(
        str(path),
        main=False,
        include_non_defs=False,
        include_markdown_docstring=False,
    )
