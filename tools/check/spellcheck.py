"""Spell-check the book's prose with codespell: the markdown cells of every
notebook and the Markdown files (code and outputs are not prose).

Words that are right but unknown to codespell go in .codespell-words
(named in pyproject.toml's [tool.codespell], where all its settings live).
Usage: python tools/check/spellcheck.py   (exit status 1 when a misspelling is found)
"""

import argparse
import io
import json
import sys
import tempfile
from contextlib import redirect_stdout
from pathlib import Path

from codespell_lib import main as codespell

ROOT = Path(__file__).resolve().parents[2]
MARKDOWN = ["README.md", "CONTRIBUTING.md", "book/*.md"]


def parse_args(argv):
    """--help prints the module's docstring and exits 0; no other options."""
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return parser.parse_args(argv)


def prose_files(tmp):
    """Markdown files as they are, plus one file per notebook markdown cell."""
    names = {}
    for pattern in MARKDOWN:
        for path in sorted(ROOT.glob(pattern)):
            names[str(path)] = str(path.relative_to(ROOT))
    for nb_path in sorted((ROOT / "book").glob("*.ipynb")):
        cells = json.loads(nb_path.read_text(encoding="utf-8"))["cells"]
        for i, cell in enumerate(cells):
            if cell["cell_type"] == "markdown":
                target = Path(tmp) / f"{nb_path.stem}.cell{i}.md"
                target.write_text("".join(cell["source"]), encoding="utf-8")
                names[str(target)] = f"book/{nb_path.name} (markdown cell {i})"
    return names


def main(argv=None):
    parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        names = prose_files(tmp)
        out = io.StringIO()
        with redirect_stdout(out):
            # settings (the list of accepted words) in pyproject.toml
            status = codespell("--toml", str(ROOT / "pyproject.toml"), *names)
    report = out.getvalue()
    for path, name in sorted(names.items(), key=lambda kv: -len(kv[0])):
        report = report.replace(path, name)
    print(report, end="")
    print(
        f"codespell: {len(names)} prose files, "
        f"{'no misspellings' if status == 0 else 'misspellings found'}"
    )
    return 1 if status else 0


if __name__ == "__main__":
    sys.exit(main())
