"""The book as one PDF (`make pdf`, tools/build/build_pdf.py): a title page, the
contents, every chapter's title, every figure, and no math left as TeX.

The tests read the PDF that `make pdf` wrote (a build takes minutes, too long
for the test run; CI runs `make pdf` before `make test`). Without Debian's
Chromium, or without a PDF as new as the book's sources, the tests are
skipped with the reason and what to run; under CI (`CI=true`) they fail.
"""

import collections
import json
import os
import re
import shutil
import subprocess
import sys

import nbformat
import pytest
import yaml
from conftest import ROOT, require_system_tool, toc_docs

sys.path.insert(0, str(ROOT / "tools" / "build"))
import build_pdf
import site_browser


def toc_documents():
    docs = toc_docs()
    return [
        next(ROOT.glob(f"{d}.*")) for d in docs if any(ROOT.glob(f"{d}.*"))
    ]


def title_of(path):
    """The first level-1 heading of a notebook or Markdown page."""
    if path.suffix == ".ipynb":
        nb = nbformat.read(path, as_version=4)
        text = "\n".join(
            c.source for c in nb.cells if c.cell_type == "markdown"
        )
    else:
        text = path.read_text(encoding="utf-8")
    match = re.search(r"^# (.+)$", text, re.M)
    assert match, f"{path.name} has no title"
    return re.sub(r"[*_`]", "", match.group(1)).strip()


def files_under(folder):
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )


def sources():
    """What `make pdf` builds the PDF from: a PDF older than any is stale."""
    return [
        *toc_documents(),
        ROOT / "_toc.yml",
        ROOT / "_config.yml",
        ROOT / "book" / "references.bib",  # the bibliography page
        ROOT / "tools" / "build" / "build_pdf.py",  # the print layout
        *files_under(ROOT / "_ext"),  # the site's Sphinx extension
        *files_under(ROOT / "book" / "images"),  # figures the pages include
    ]


@pytest.fixture(scope="session")
def pdf():
    require_system_tool(
        site_browser.chromium_binary() is not None,
        "Debian's Chromium (make pdf prints the book with it)",
        "apt-get install chromium",
    )
    target = build_pdf.PDF
    newest = max(p.stat().st_mtime for p in sources())
    if not target.is_file() or target.stat().st_mtime < newest:
        message = (
            f"{target.relative_to(ROOT)} is missing or older than the book's "
            "sources: run `make pdf` first"
        )
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI=true and {message}", pytrace=False)
        pytest.skip(message)
    from pypdf import PdfReader

    reader = PdfReader(target)
    return reader, page_texts(target, reader)


def page_texts(path, reader):
    """The text of every page: poppler's pdftotext where installed, else
    pypdf (for the 412-page PDF on 2026-12-07, on the 2-core AMD EPYC with
    other work running: 3.7 s of CPU against pypdf's 98 s, measured once)."""
    if shutil.which("pdftotext"):
        out = subprocess.run(
            ["pdftotext", "-enc", "UTF-8", str(path), "-"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        texts = out.split("\f")[: len(reader.pages)]
        assert len(texts) == len(reader.pages)
        return texts
    return [page.extract_text() for page in reader.pages]


def squeeze(text):
    return build_pdf.squeeze(text)


def test_title_page_and_contents(pdf):
    _, texts = pdf
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    assert squeeze(config["title"]) in squeeze(texts[0])
    assert "Contents" in texts[1]
    contents = squeeze(texts[1])
    for path in toc_documents():
        assert squeeze(title_of(path)) in contents, path.name


def test_every_chapter_title_in_order(pdf):
    _, texts = pdf
    body = squeeze(" ".join(texts[2:]))
    at = 0
    for path in toc_documents():
        found = body.find(squeeze(title_of(path)), at)
        assert found >= 0, f"no title of {path.name} after the previous one"
        at = found
    record = json.loads(build_pdf.PDF.with_suffix(".json").read_text())
    pages = record["pages"]
    assert all(isinstance(p, int) for p in pages), pages
    assert pages == sorted(pages) and pages[0] >= 3 and pages[-1] <= len(texts)


def test_contents_page_shows_each_chapters_page_number(pdf):
    """The page numbers stamped onto the contents page (build_pdf's
    stamp_contents_page, after the book is printed) are the pages where the
    chapters start."""
    _, texts = pdf
    record = json.loads(build_pdf.PDF.with_suffix(".json").read_text())
    shown = collections.Counter(
        re.findall(r"(?<![\w.])\d+(?![\w.])", texts[1])
    )
    wanted = collections.Counter(str(n) for n in record["pages"])
    assert not wanted - shown, (
        f"missing on the contents page: {wanted - shown}"
    )


def stored_figures():
    """Image outputs (PNG, JPEG) stored in the notebooks, and images that the
    pages' Markdown shows."""
    count = 0
    for path in toc_documents():
        if path.suffix != ".ipynb":
            continue
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "markdown":
                count += len(
                    re.findall(r"!\[|<img |```\{(figure|image)\}", cell.source)
                )
            for out in cell.get("outputs", []):
                data = out.get("data", {})
                count += "image/png" in data or "image/jpeg" in data
    return count


def pdf_images(reader):
    """The distinct raster images the PDF draws (its image XObjects)."""
    seen = set()
    for page in reader.pages:
        xobjects = page.get("/Resources", {}).get("/XObject", {})
        for name, ref in xobjects.items():
            obj = ref.get_object()
            if obj.get("/Subtype") == "/Image":
                seen.add(getattr(ref, "idnum", name))
    return seen


# A page that shows no figure holds at least this many characters of text
# (three lines of prose), unless it ends a chapter: else a block that did not
# fit left it almost empty (issue 47: a line of code, its output overleaf).
MIN_CHARACTERS = 200


def images_on(page):
    xobjects = page.get("/Resources", {}).get("/XObject", {})
    return sum(
        ref.get_object().get("/Subtype") == "/Image"
        for ref in xobjects.values()
    )


def test_no_page_left_almost_empty(pdf):
    reader, texts = pdf
    starts = json.loads(build_pdf.PDF.with_suffix(".json").read_text())
    last = {n - 1 for n in starts["pages"][1:]} | {len(texts)}
    almost_empty = []
    for n, text in enumerate(texts, start=1):
        if n == 1 or n in last:  # the title page, a chapter's last page
            continue
        lines = text.strip().splitlines()
        if lines and lines[-1].strip() == str(n):  # the page number
            lines = lines[:-1]
        characters = len("".join("".join(lines).split()))
        if characters < MIN_CHARACTERS and not images_on(reader.pages[n - 1]):
            almost_empty.append(f"page {n}: {' | '.join(lines)[:80]!r}")
    assert not almost_empty, "\n".join(almost_empty)


def test_every_figure_is_in_the_pdf(pdf):
    reader, _ = pdf
    figures = stored_figures()
    assert figures > 10
    assert len(pdf_images(reader)) >= figures


def test_no_math_left_as_tex(pdf):
    """TeX markers appear no more often than in the code the book shows."""
    _, texts = pdf
    text = "\n".join(texts)
    code = []
    for path in toc_documents():
        if path.suffix == ".ipynb":
            nb = nbformat.read(path, as_version=4)
            for cell in nb.cells:
                if cell.cell_type == "code":
                    code.append(cell.source)
                    for out in cell.get("outputs", []):
                        code.append(str(out.get("text", "")))
                        code.append(
                            str(out.get("data", {}).get("text/plain", ""))
                        )
    code = "\n".join(code)
    for marker in (
        "$$",
        "\\frac",
        "\\(",
        "\\[",
        "\\begin{",
        "\\alpha",
        "\\exp",
    ):
        assert text.count(marker) <= code.count(marker), marker


TAB_LABEL = re.compile(r"^:::+\{tab-item\}\s*(.+?)\s*$", re.M)


def notebook_cells():
    for path in toc_documents():
        if path.suffix == ".ipynb":
            yield from nbformat.read(path, as_version=4).cells


def tab_code_blocks():
    """The code blocks inside the pages' tabs (squeezed)."""
    blocks = []
    for cell in notebook_cells():
        if cell.cell_type == "markdown" and "{tab-item}" in cell.source:
            blocks += [
                squeeze(b)
                for b in re.findall(r"```\w*\n(.*?)```", cell.source, re.S)
            ]
    return blocks


def test_every_tab_printed_once_under_its_label(pdf):
    """Print has no tabs to click: each tab's content appears, under a line
    of its own that names its language, as often as the pages have tabs."""
    _, texts = pdf
    lines = [line.strip() for t in texts for line in t.splitlines()]
    labels = collections.Counter(
        label
        for cell in notebook_cells()
        if cell.cell_type == "markdown"
        for label in TAB_LABEL.findall(cell.source)
    )
    assert sum(labels.values()) >= 20, labels
    for label, count in labels.items():
        assert lines.count(label) == count, label


def test_no_toggle_label_and_no_code_printed_twice(pdf):
    """Collapsed cells print open and without their "Show/Hide code cell"
    labels; a hidden code cell whose code a tab shows is not printed again."""
    _, texts = pdf
    text = "\n".join(texts)
    for label in ("Hide code cell", "Show code cell", "Toggle hidden"):
        assert label not in text, label
    body = squeeze(text)
    in_tabs = tab_code_blocks()
    twins, shown = [], []
    for cell in notebook_cells():
        hidden = "hide-input" in cell.metadata.get("tags", [])
        if (
            cell.cell_type == "code"
            and hidden
            and squeeze(cell.source) in in_tabs
        ):
            twins.append(cell.source)
        else:
            shown.append(cell.source)
        for out in cell.get("outputs", []):
            shown.append(str(out.get("text", "")))
            shown.append(str(out.get("data", {}).get("text/plain", "")))
    shown = squeeze("\n".join(shown))
    assert len(twins) >= 10
    for code in twins:
        # the start of its longest line: a page break may split the block,
        # and the page may wrap a long line
        lines = [c.split("#")[0] for c in code.splitlines()]
        line = squeeze(max(lines, key=len))[:30]
        assert 1 <= body.count(line) <= shown.count(line), line


def test_a_pdf_older_than_its_layout_or_images_is_stale():
    """The PDF must be newer than the program that prints it, the Sphinx
    extension that builds its HTML and the figures the pages include, not
    only the pages."""
    names = {p.relative_to(ROOT).as_posix() for p in sources()}
    assert {
        "tools/build/build_pdf.py",
        "_ext/site_extras.py",
        "book/images/bench_attention.png",  # chapter 8's figure
        "book/references.bib",
        "_toc.yml",
        "book/intro.md",
    } <= names


def test_the_log_names_an_out_path_outside_the_repository(tmp_path):
    """`build_pdf.py --out PATH` with PATH outside the repository: the log
    names PATH as given (relative_to would raise a ValueError)."""
    assert build_pdf.shown(build_pdf.PDF).as_posix() == (
        "_build/pdf/attention-from-scratch.pdf"
    )
    outside = tmp_path / "book.pdf"
    assert build_pdf.shown(outside) == outside
