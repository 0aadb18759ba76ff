"""What the site offers for download is a chapter that runs on its own.

Each chapter page offers `downloads/<chapter>.zip` (made by _ext/site_extras.py
when the site is built). `make test` unpacks every zip into an empty folder
(tools/build/stage_downloads.py) and runs nbval on the unpacked notebooks, so every
chapter is executed, top to bottom, with nothing around it but what its
download holds. The tests here check the zips themselves."""

import sys
import zipfile

import pytest
import yaml
from conftest import BOOK, ROOT

sys.path.insert(0, str(ROOT / "_ext"))
from site_extras import chapter_files

ZIPS = ROOT / "_build" / "html" / "downloads"
STAGE = ROOT / "_build" / "downloads"


def toc_chapters():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    files = [
        chapter["file"]
        for part in toc["parts"]
        for chapter in part["chapters"]
    ]
    return [
        f.removeprefix("book/")
        for f in files
        if (ROOT / f"{f}.ipynb").is_file()
    ]


CHAPTERS = toc_chapters()


@pytest.fixture(scope="module")
def site(built_site):
    assert built_site[0] == 0, "the site did not build"
    return ZIPS


def test_every_notebook_is_a_chapter_with_a_zip(site):
    notebooks = sorted(p.stem for p in BOOK.glob("*.ipynb"))
    assert notebooks == sorted(CHAPTERS), "a notebook is missing from _toc.yml"
    assert sorted(p.stem for p in site.glob("*.zip")) == sorted(CHAPTERS)


@pytest.mark.parametrize("name", CHAPTERS)
def test_zip_holds_the_chapter_and_what_it_needs(site, name):
    with zipfile.ZipFile(site / f"{name}.zip") as archive:
        members = {
            info.filename.removeprefix(f"{name}/"): archive.read(info)
            for info in archive.infolist()
        }
        top = {info.filename.split("/")[0] for info in archive.infolist()}
    assert top == {name}, (
        "everything sits in one folder named after the chapter"
    )
    notebook = BOOK / f"{name}.ipynb"
    expected = {f"{name}.ipynb", "requirements.txt", "README.txt"}
    expected |= set(chapter_files(notebook))
    assert set(members) == expected
    assert members[f"{name}.ipynb"] == notebook.read_bytes()
    assert (
        members["requirements.txt"] == (ROOT / "requirements.txt").read_bytes()
    )
    for rel in chapter_files(notebook):
        assert members[rel] == (BOOK / rel).read_bytes(), rel
    assert b"pip install -r requirements.txt" in members["README.txt"]


def test_chapter_files_finds_modules_and_data(tmp_path):
    """The file list follows imports (also from a helper module) and paths."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "table.csv").write_text("a\n1\n")
    (tmp_path / "helper.py").write_text("import other\n")
    (tmp_path / "other.py").write_text("X = 1\n")
    (tmp_path / "unused.py").write_text("Y = 2\n")
    cells = [
        "import numpy as np\nfrom helper import thing",
        "t = open('data/table.csv').read()\nname = 'not a file'",
    ]
    nb = {
        "cells": [
            {"cell_type": "code", "source": [c], "metadata": {}} for c in cells
        ]
    }
    path = tmp_path / "ch.ipynb"
    path.write_text(__import__("json").dumps(nb))
    assert chapter_files(path) == ["data/table.csv", "helper.py", "other.py"]


def test_unpacked_downloads_are_exactly_the_zips(site):
    """What nbval runs in `make test` (tools/build/stage_downloads.py) is the zips."""
    if not STAGE.is_dir():
        pytest.skip("no unpacked downloads: `make test` stages them first")
    unpacked = {
        str(p.relative_to(STAGE)): p.read_bytes()
        for p in STAGE.rglob("*")
        if p.is_file()
    }
    zipped = {}
    for path in site.glob("*.zip"):
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                zipped[info.filename] = archive.read(info)
    # nbval may leave nothing behind but caches
    unpacked = {k: v for k, v in unpacked.items() if "__pycache__" not in k}
    assert unpacked == zipped
