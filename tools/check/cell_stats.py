"""Length of the code cells of every chapter: median lines per code cell and
the cells over 40 lines (the book's teaching cells are short; see
CONTRIBUTING.md). Blank lines at the ends of a cell are not counted.

Usage: python tools/check/cell_stats.py [NOTEBOOK ...]
"""

import json
import statistics
import sys
from pathlib import Path

# tools/ holds the shared modules (cli, chapter_loader, measure, ...)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cli

ROOT = Path(__file__).resolve().parents[2]
LONG = 40


def code_cell_lengths(path):
    """(cell index, number of lines) of every non-empty code cell."""
    cells = json.loads(Path(path).read_text(encoding="utf-8"))["cells"]
    lengths = []
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"]).strip("\n")
        if source.strip():
            lengths.append((i, len(source.splitlines())))
    return lengths


def main(paths):
    paths = paths or sorted(str(p) for p in (ROOT / "book").glob("*.ipynb"))
    every, long_cells = [], []
    for path in paths:
        lengths = code_cell_lengths(path)
        counts = [n for _, n in lengths]
        every += counts
        long_here = [(i, n) for i, n in lengths if n > LONG]
        long_cells += [(Path(path).name, i, n) for i, n in long_here]
        print(
            f"{Path(path).name:32} {len(counts):3d} code cells, median "
            f"{statistics.median(counts):4.1f} lines, longest {max(counts):3d}, "
            f"over {LONG}: {[f'cell {i} ({n})' for i, n in long_here]}"
        )
    print(
        f"whole book: {len(every)} code cells, median "
        f"{statistics.median(every):.1f} lines, {len(long_cells)} over {LONG}"
    )


if __name__ == "__main__":
    main(cli.notebooks(__doc__))
