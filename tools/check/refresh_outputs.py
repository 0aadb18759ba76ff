"""Re-execute notebooks top to bottom in a fresh kernel and store their outputs.

This is the only way the book's stored outputs are written (``make outputs``).
It records no timings and normalises the metadata, so running it twice on
unchanged notebooks leaves no diff.

Usage: python tools/check/refresh_outputs.py book/01_general_attention.ipynb [...]
"""

import argparse
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]

KERNELSPEC = {
    "display_name": "Python 3 (ipykernel)",
    "language": "python",
    "name": "python3",
}


def merge_streams(outputs):
    """Join consecutive stream outputs of the same name into one.

    The kernel may flush one print() in two messages when the machine is busy;
    merged, the stored text does not depend on that timing.
    """
    merged = []
    for out in outputs:
        if (
            out.get("output_type") == "stream"
            and merged
            and merged[-1].get("output_type") == "stream"
            and merged[-1]["name"] == out["name"]
        ):
            merged[-1]["text"] += out["text"]
        else:
            merged.append(out)
    return merged


def relative_tracebacks(outputs):
    """Show library files in a stored traceback relative to the repository
    (`.venv/lib/...`), not by this machine's absolute path."""
    for out in outputs:
        if out.get("output_type") == "error":
            out["traceback"] = [
                line.replace(f"{ROOT}/", "") for line in out["traceback"]
            ]
    return outputs


def refresh(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        kernel_name="python3",
        timeout=1800,
        record_timing=False,
        resources={"metadata": {"path": str(path.parent.resolve())}},
    )
    client.execute()
    nb.metadata["kernelspec"] = KERNELSPEC
    nb.metadata.pop("widgets", None)
    nb.metadata.pop("jupytext", None)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = relative_tracebacks(merge_streams(cell.outputs))
        cell.metadata.pop("execution", None)
        cell.metadata.pop("ExecuteTime", None)
    nbformat.validate(nb)
    nbformat.write(nb, path)


def parse_args(argv):
    """One or more notebook paths; --help exits 0."""
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("notebooks", nargs="+", metavar="NOTEBOOK.ipynb")
    return parser.parse_args(argv)


def main(argv):
    for name in parse_args(argv).notebooks:
        path = Path(name)
        if path.suffix != ".ipynb" or not path.is_file():
            sys.exit(f"not a notebook: {name}")
        print(f"executing {path} ...", flush=True)
        refresh(path)


if __name__ == "__main__":
    main(sys.argv[1:])
