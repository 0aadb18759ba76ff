"""Prose length of every chapter: words in markdown cells (runs of letters,
``[A-Za-z]+``), words before the first code cell, and the longest markdown
cell. The limits (CONTRIBUTING.md): at most 250 words before the first code
cell and at most 350 words in one markdown cell in every chapter and
appendix page (book/appendix_*.ipynb); chapters 1-5 at most 3,500 words each
and 15,000 together; chapters 6 onwards (and appendix pages) at most 4,500
each.

Usage: python tools/check/prose_stats.py [NOTEBOOK ...]
"""

import json
import re
import sys
from pathlib import Path

# tools/ holds the shared modules (cli, chapter_loader, measure, ...)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cli

ROOT = Path(__file__).resolve().parents[2]
WORD = re.compile(r"[A-Za-z]+")
BEFORE_CODE, PER_CELL = 250, 350


def words(text):
    """Number of runs of letters in a text."""
    return len(WORD.findall(text))


def prose_stats(path):
    """(total words, words before the first code cell, longest cell's words,
    index of the longest cell) of the markdown cells of one notebook."""
    cells = json.loads(Path(path).read_text(encoding="utf-8"))["cells"]
    total = before = longest = 0
    longest_at, seen_code = None, False
    for i, cell in enumerate(cells):
        if cell["cell_type"] == "code" and "".join(cell["source"]).strip():
            seen_code = True
        if cell["cell_type"] != "markdown":
            continue
        n = words("".join(cell["source"]))
        total += n
        before += 0 if seen_code else n
        if n > longest:
            longest, longest_at = n, i
    return total, before, longest, longest_at


def limit_for(name):
    """The word limit of a chapter by its number."""
    number = int(name[:2]) if name[:2].isdigit() else 0
    return 3500 if 1 <= number <= 5 else 4500


def main(paths):
    book = ROOT / "book"
    paths = paths or [
        *sorted(str(p) for p in book.glob("[0-9]*.ipynb")),
        *sorted(str(p) for p in book.glob("appendix_*.ipynb")),
    ]
    header = (
        f"{'words':>6} {'limit':>6} {'before code':>12} {'longest cell':>13}"
    )
    print(f"{'chapter':32} {header}")
    ok, first_five = True, 0
    for path in paths:
        name = Path(path).name
        total, before, longest, at = prose_stats(path)
        limit = limit_for(name)
        if name[:2] in {"01", "02", "03", "04", "05"}:
            first_five += total
        flags = []
        if total > limit:
            flags.append("words")
        if before > BEFORE_CODE:
            flags.append("before code")
        if longest > PER_CELL:
            flags.append(f"cell {at}")
        ok &= not flags
        mark = "  over: " + ", ".join(flags) if flags else ""
        print(
            f"{name:32} {total:6d} {limit:6d} {before:12d} {longest:8d} (#{at}){mark}"
        )
    print(f"chapters 1-5 together: {first_five} words (limit 15000)")
    ok &= first_five <= 15000
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(cli.notebooks(__doc__)))
