"""The stored outputs are really checked: nbval fails when one number changes."""

import json
import shutil
import subprocess
import sys

from conftest import BOOK, ROOT

NOTEBOOK = "01_general_attention.ipynb"
STORED = "0.98522025 1.74174051 0.75652026"


def run_nbval(path):
    """nbval on one notebook, with the flags of pyproject.toml (make test's)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-c",
            str(ROOT / "pyproject.toml"),
            "--rootdir",
            str(ROOT),
            "-q",
            str(path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_changed_stored_number_fails_nbval(tmp_path):
    # the notebook imports book/plots.py from its own folder
    shutil.copy(BOOK / "plots.py", tmp_path / "plots.py")
    nb = json.loads((BOOK / NOTEBOOK).read_text(encoding="utf-8"))

    # the untouched copy passes, so a failure below is caused by the change
    untouched = tmp_path / "untouched" / NOTEBOOK
    untouched.parent.mkdir()
    shutil.copy(BOOK / "plots.py", untouched.parent / "plots.py")
    untouched.write_text(json.dumps(nb), encoding="utf-8")
    result = run_nbval(untouched)
    assert result.returncode == 0, result.stdout[-2000:]

    changed = 0
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            text = "".join(out.get("text", []))
            if out.get("output_type") == "stream" and STORED in text:
                out["text"] = text.replace("0.98522025", "0.98522026", 1)
                changed += 1
                break
        if changed:
            break
    assert changed == 1, "the stored word-1 output was not found"
    copy = tmp_path / NOTEBOOK
    copy.write_text(json.dumps(nb), encoding="utf-8")

    result = run_nbval(copy)
    assert result.returncode != 0, result.stdout[-2000:]
    assert "0.98522026" in result.stdout  # nbval shows the stored line
