"""Shared test fixtures. Chapters are loaded with tools/chapter_loader.py, the
loader that tools/ uses too: a chapter's definitions and its UPPER_CASE
literal constants (the numbers its source printed) are the tests' only source
of chapter code and source numbers."""

import json
import os
import re
import sys
import uuid
from pathlib import Path

import pytest
from filelock import FileLock

# tools/ holds the shared modules (chapter_loader, measure, stored_models);
# its folders by role hold the scripts the tests import.
TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path[:0] = [
    str(TOOLS / part) for part in ("", "build", "bench", "check", "train")
]
from build_site import RECORD, build  # noqa: E402
from chapter_loader import BOOK, ROOT, load_chapter  # noqa: E402

__all__ = [
    "BOOK",
    "ROOT",
    "LazyChapter",
    "load_chapter",
    "require_system_tool",
]


class LazyChapter:
    """A chapter loaded by load_chapter on its first use, for a test file
    that names one at module level: every pytest-xdist worker imports every
    test file to collect it, so a module-level load_chapter ran in each
    worker, while only the one that runs the file needs it (chapters 10 to
    13 cost 7.8 s of CPU per worker to load, measured once on 2026-12-07 on
    the 2-core AMD EPYC at a load of 13). Reading, setting (monkeypatch) and
    deleting an attribute reach the chapter's module itself."""

    def __init__(self, filename):
        object.__setattr__(self, "_filename", filename)
        object.__setattr__(self, "_module", None)

    def _load(self):
        if self._module is None:
            object.__setattr__(self, "_module", load_chapter(self._filename))
        return self._module

    def __getattr__(self, name):
        # pytest looks for its own markers on every module-level name while
        # collecting: those lookups must not load the chapter
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._load(), name)

    def __setattr__(self, name, value):
        setattr(self._load(), name, value)

    def __delattr__(self, name):
        delattr(self._load(), name)


# Seconds each test scope (a notebook, a test file) took in the last
# `make bench-suite` on a 2-core machine; written by tools/bench/bench_suite.py.
DURATIONS = Path(__file__).with_name("durations.json")
# A scope not measured yet: a new chapter is likely among the longest, so it
# starts early; a new test file is likely short.
NEW_NOTEBOOK, NEW_TEST_FILE = 60.0, 5.0


def toc_docs():
    """The documents _toc.yml lists, in order (paths without a suffix)."""
    import yaml

    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    docs = [toc["root"]]
    for part in toc.get("parts", []):
        docs += [chapter["file"] for chapter in part.get("chapters", [])]
    return docs


def scope_key(nodeid):
    """A notebook by its name (run from book/ or from its unpacked zip), a
    test file by its path."""
    path = nodeid.split("::", 1)[0]
    return Path(path).name if path.endswith(".ipynb") else path


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Longest scopes first. pytest-xdist (`--dist loadscope
    --no-loadscope-reorder`, see the Makefile) hands each worker a whole
    notebook or test file in this order, so the long ones start first and
    the short ones fill the gaps at the end. The sort is stable: the cells of
    a notebook and the tests of a file keep their order."""
    known = {}
    if DURATIONS.is_file():
        known = json.loads(DURATIONS.read_text(encoding="utf-8"))

    def cost(item):
        key = scope_key(item.nodeid)
        default = NEW_NOTEBOOK if key.endswith(".ipynb") else NEW_TEST_FILE
        return known.get(key, default)

    items.sort(key=cost, reverse=True)


def r_chunks(notebook):
    """The R code blocks (```r ... ```) of a chapter's markdown cells: the
    source's R code that chapters 3 to 5 show beside their Python."""
    cells = json.loads((BOOK / notebook).read_text(encoding="utf-8"))["cells"]
    text = "".join(
        "".join(c["source"]) for c in cells if c["cell_type"] == "markdown"
    )
    return re.findall(r"```r\n(.*?)```", text, flags=re.S)


def require_system_tool(found, what, install):
    """Skip a test that needs a system program, or fail under CI.

    On a reader's machine a missing R or Chromium skips the test with a reason
    that says what to install. Under CI (`CI=true`) it is a failure, so CI
    can never pass by skipping what it is meant to check.
    """
    if found and not pretend_missing(install):
        return
    message = f"{what} is not installed: install it with `{install}`"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true and {message}", pytrace=False)
    pytest.skip(message)


def pretend_missing(install):
    """True when BOOK_TEST_WITHOUT names a package of `install`: to see what
    a machine without Chromium or R runs, e.g.
    `BOOK_TEST_WITHOUT="chromium r-base-core" make test`."""
    hidden = os.environ.get("BOOK_TEST_WITHOUT", "").split()
    return any(name in install.split() for name in hidden)


@pytest.fixture(scope="session")
def ch01():
    return load_chapter("01_general_attention.ipynb")


def run_id(config):
    """The id of this pytest run, shared by all its pytest-xdist workers (a
    run without xdist, e.g. `-p no:xdist`, gets its own)."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        return workerinput["testrunuid"]
    if not hasattr(config, "_book_run_id"):
        config._book_run_id = uuid.uuid4().hex
    return config._book_run_id


@pytest.fixture(scope="session")
def built_site(pytestconfig):
    """The site in _build/html, built from the stored outputs with warnings
    as errors (tools/build/build_site.py); returns (returncode, log).

    `make test` builds it just before the tests (they also run every chapter
    from its downloaded zip) and says so with BOOK_SITE_BUILT=1. Otherwise the
    first test that needs the site builds it, under a file lock, once for
    all pytest-xdist workers of this run.
    """
    RECORD.parent.mkdir(exist_ok=True)
    with FileLock(str(RECORD.with_suffix(".lock"))):
        data = (
            json.loads(RECORD.read_text("utf-8")) if RECORD.is_file() else {}
        )
        fresh = os.environ.get("BOOK_SITE_BUILT") == "1" and data
        if not fresh and data.get("run") != run_id(pytestconfig):
            build()
            data = json.loads(RECORD.read_text("utf-8"))
            data["run"] = run_id(pytestconfig)
            RECORD.write_text(json.dumps(data), encoding="utf-8")
    return data["returncode"], data["log"]
