"""Shared test helpers: load a chapter's own definitions from its notebook."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
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


# The attention table printed by Cristina's post (chapters 1 and 2 reproduce it)
SOURCE_003_ATTENTION = [
    [0.98522025, 1.74174051, 0.75652026],
    [0.90965265, 1.40965265, 0.5],
    [0.99851226, 1.75849334, 0.75998108],
    [0.99560386, 1.90407309, 0.90846923],
]


def source_004_qkv():
    """Q, K, V of the torch post (chapters 3 and 4), in its statement order:
    seed 89, then x, then the query, key and value layers."""
    import torch
    from torch import nn

    torch.manual_seed(89)
    x = torch.randn((1, 3, 5))
    layers = [nn.Linear(5, 16, bias=False) for _ in range(3)]
    with torch.no_grad():
        return tuple(layer(x) for layer in layers)


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
def built_site(tmp_path_factory):
    """Build the site once per test session, with warnings as errors.

    The pages are built from the notebooks' stored outputs (execution off):
    nbval, earlier in the same `make test`, has re-executed every notebook
    and proved that a fresh run prints exactly those outputs, so executing
    them a second time here would only double the time. `make book` builds
    the same pages by executing the notebooks.
    """
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    config["execute"]["execute_notebooks"] = "off"
    # the configuration file moves: make its relative paths absolute
    extensions = config["sphinx"]["local_extensions"]
    for name, folder in extensions.items():
        extensions[name] = str(ROOT / folder)
    path = tmp_path_factory.mktemp("config") / "_config.yml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    jb = Path(sys.executable).parent / "jupyter-book"
    return subprocess.run(
        [str(jb), "build", str(ROOT), "--config", str(path)]
        + ["-W", "-n", "--keep-going"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
    )
