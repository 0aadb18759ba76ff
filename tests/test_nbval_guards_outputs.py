"""The stored outputs are really checked: nbval fails when one number changes."""

import configparser
import json
import re
import shutil
import subprocess
import sys
from xml.etree import ElementTree

from conftest import BOOK, ROOT

sys.path.insert(0, str(ROOT / "_ext"))
from site_extras import chapter_files

NOTEBOOK = "01_general_attention.ipynb"
NUMBER = re.compile(r"\d\.\d{4,}")  # a printed number with 4+ decimals


def run_nbval(path, junit):
    """nbval on one notebook, with the flags of pyproject.toml (make test's);
    each cell's outcome is written to the JUnit XML file `junit`."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-c",
            str(ROOT / "pyproject.toml"),
            "--rootdir",
            str(ROOT),
            "-p",
            "no:xdist",
            "-q",
            f"--junitxml={junit}",
            str(path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def copy_helpers(folder):
    for rel in chapter_files(BOOK / NOTEBOOK):
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(BOOK / rel, folder / rel)


def cell_outcomes(junit):
    """{"Cell N": list of failure messages (empty: passed)} from JUnit XML."""
    outcomes = {}
    for case in ElementTree.parse(junit).iter("testcase"):
        outcomes[case.get("name")] = [
            (child.get("message") or "") + (child.text or "")
            for child in case
            if child.tag in ("failure", "error", "skipped")
        ]
    return outcomes


def test_changed_stored_number_fails_nbval(tmp_path):
    """One stored digit changed: nbval fails that cell, and only that cell.

    Every other cell of the same run passes, so the failure is caused by the
    change and nothing else (the untouched chapter passes too: `make test`
    runs nbval on it from its zip)."""
    # the files the chapter needs beside it (those its download zip holds)
    copy_helpers(tmp_path)
    nb = json.loads((BOOK / NOTEBOOK).read_text(encoding="utf-8"))

    # change the last digit of the first printed number with 4+ decimals
    changed = changed_cell = None
    # nbval names the items "Cell 0", "Cell 1", ... by code cell
    code = [cell for cell in nb["cells"] if cell["cell_type"] == "code"]
    for index, cell in enumerate(code):
        for out in cell.get("outputs", []):
            text = "".join(out.get("text", []))
            match = (
                NUMBER.search(text)
                if out.get("output_type") == "stream"
                else None
            )
            if match:
                number = match.group()
                changed = number[:-1] + str((int(number[-1]) + 1) % 10)
                changed_cell = f"Cell {index}"
                out["text"] = (
                    text[: match.start()] + changed + text[match.end() :]
                )
                break
        if changed:
            break
    assert changed, "no printed number found"
    copy = tmp_path / NOTEBOOK
    copy.write_text(json.dumps(nb), encoding="utf-8")

    junit = tmp_path / "nbval.xml"
    result = run_nbval(copy, junit)
    assert result.returncode != 0, result.stdout[-2000:]
    outcomes = cell_outcomes(junit)
    assert len(outcomes) == len(code), result.stdout[-2000:]
    failed = {name: msgs for name, msgs in outcomes.items() if msgs}
    assert list(failed) == [changed_cell], result.stdout[-4000:]
    assert changed in result.stdout  # nbval shows the stored line


def sanitizer_patterns():
    """The regular expressions of tests/nbval_sanitize.cfg."""
    parser = configparser.ConfigParser()
    parser.read(ROOT / "tests" / "nbval_sanitize.cfg", encoding="utf-8")
    return {
        name: re.compile(parser[name]["regex"]) for name in parser.sections()
    }


def compared_outputs():
    """(notebook, cell index, text) of every output nbval compares."""
    for path in sorted(BOOK.glob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        for i, cell in enumerate(cells):
            source = "".join(cell.get("source", []))
            if cell["cell_type"] != "code" or source.startswith(
                "# NBVAL_IGNORE_OUTPUT"
            ):
                continue
            for out in cell.get("outputs", []):
                texts = [out.get("text", "")]
                texts.append(out.get("data", {}).get("text/plain", ""))
                texts.append(out.get("evalue", ""))
                for text in texts:
                    yield path.name, i, "".join(text)


def test_sanitizers_hide_nothing_that_is_compared():
    """The sanitizers exist for what can never reproduce (addresses, paths,
    timings); if one matched a compared output, it could hide a number."""
    patterns = sanitizer_patterns()
    assert set(patterns) == {"memory addresses", "absolute paths", "timings"}
    hits = [
        f"{name} cell {i}: {label} {match.group(0)!r}"
        for name, i, text in compared_outputs()
        for label, pattern in patterns.items()
        for match in pattern.finditer(text)
    ]
    assert hits == []


def test_sanitizer_check_sees_a_timing():
    """The check above is able to fail: a printed timing is seen."""
    patterns = sanitizer_patterns()
    assert patterns["timings"].search("training took 14.5 s")
    assert patterns["absolute paths"].search("read /work/main/book/x.csv")
