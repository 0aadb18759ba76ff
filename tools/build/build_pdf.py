"""The whole book as one PDF (`make pdf`): _build/pdf/attention-from-scratch.pdf.

1. Jupyter Book's `singlehtml` builder writes every page of the table of
   contents into one HTML page, from the notebooks' stored outputs
   (execution off, as in tools/build/build_site.py), into _build/pdf/.
2. Debian's Chromium (driven by Playwright, as in the browser test; no
   network: every request that would leave the machine is blocked) opens it,
   waits for the offline MathJax the site ships to typeset the math, adds a
   title page and a table of contents, opens collapsed cells (without their
   toggle labels) and prints every tab under its own label (a hidden code
   cell whose code a tab shows is left out, so no code is printed twice),
   and prints it to PDF with page numbers and a bookmark outline.
   The contents' page numbers are found in the printed PDF (pypdf) and
   stamped onto its contents page: the same layout printed again up to the
   end of the contents (the title page and the contents, every text hidden
   but the page numbers), and its page 2 merged onto the book's page 2 (the
   contents fill one page: tests/test_pdf.py finds every title there).

Usage: python tools/build/build_pdf.py [--out PATH]
Needs: Debian's chromium (apt-get install chromium); nothing is downloaded.
"""

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
import unicodedata
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "build"))
import site_browser  # noqa: E402
from build_site import run_jupyter_book  # noqa: E402

WORK = ROOT / "_build" / "pdf"
SINGLE = WORK / "_build" / "singlehtml"
PDF = WORK / "attention-from-scratch.pdf"

# The printed page: A4 and its margins (mm), and the text area in CSS pixels
# (96 per inch), the width at which Chromium lays the page out to print it.
PAGE_MM = (210, 297)
MARGIN_MM = {"top": 18, "bottom": 20, "left": 16, "right": 16}
TEXT_PX = (
    round((PAGE_MM[0] - MARGIN_MM["left"] - MARGIN_MM["right"]) * 96 / 25.4),
    round((PAGE_MM[1] - MARGIN_MM["top"] - MARGIN_MM["bottom"]) * 96 / 25.4),
)
# a block taller than this share of the text area may break across pages
LONG = 1 / 3

# Print layout: the page without the site's navigation, code that wraps
# instead of running off the page, figures that fit, each chapter on a new
# page. (The attention explorer hides itself in print: the static figure
# beside it is what a printed page shows.)
PRINT_CSS = """
@page { size: A4; margin: 18mm 16mm 20mm 16mm; }
html, body { background: white !important; }
.bd-header, .bd-sidebar-primary, .bd-sidebar-secondary, .bd-footer,
.bd-footer-article, .bd-footer-content, .prev-next-area, .header-article,
.bd-header-article, .headerlink, .skip-link, #pst-back-to-top,
.search-button-field, .theme-switch-button, .toggle-details__summary svg,
.copybtn, .bd-search, .sidebar-toggle, #jb-print-docs-body {
  display: none !important; }
/* the theme's print style hides each page's first h1 (its own print header
   repeats it); here that header is hidden, so the titles stay */
.bd-main .bd-content .bd-article h1:first-of-type { display: block !important; }
.bd-main, .bd-content, .bd-article-container, .bd-article, .bd-page-width,
.bd-container, .bd-container__inner {
  max-width: none !important; width: auto !important; margin: 0 !important;
  padding: 0 !important; display: block !important; }
body { font-size: 10.5pt; }
pre, .highlight pre, .output pre {
  white-space: pre-wrap !important; word-break: break-word;
  font-size: 8.5pt; overflow: visible !important; max-height: none !important; }
/* a block shorter than LONG of a page moves whole to the next page; a
   longer one (class pdf-long, set by MARK_LONG) breaks where the page ends,
   at least three lines on each side, so that no page is left with a line of
   code whose output starts overleaf; a cell's code stays with the first
   lines of its output */
div.cell, .cell_input, .cell_output, pre, img, figure, table,
mjx-container[display] { break-inside: avoid; }
.pdf-long { break-inside: auto !important; }
pre { orphans: 3; widows: 3; }
.cell_input { break-after: avoid; }
img { max-width: 100% !important; height: auto !important; }
mjx-container { overflow: visible !important; }
/* tabs: every tab's content, each under its own label (PREPARE copies the
   labels into the contents); no toggle labels: collapsed cells are open */
.sd-tab-set > .sd-tab-content { display: block !important; width: 100%;
  break-inside: avoid; }
.sd-tab-set > label, details > summary { display: none !important; }
.pdf-tab-label { font-weight: bold; margin: 0.6em 0 0.2em 0;
  break-after: avoid; }
.book-chapter { break-before: page; }
h1, h2, h3 { break-after: avoid; }
#pdf-title { display: block !important; padding-top: 80mm;
  text-align: center; break-after: page; }
#pdf-title h1 { font-size: 30pt; margin-bottom: 0.6em; }
#pdf-title p { font-size: 13pt; }
#pdf-contents { break-after: page; }
#pdf-contents ol { list-style: none; padding: 0; font-size: 12pt; }
#pdf-contents li { display: flex; margin: 0.45em 0; }
#pdf-contents li .fill { flex: 1; border-bottom: 1px dotted #888;
  margin: 0 0.4em 0.3em 0.4em; }
#pdf-contents li .page-number { min-width: 2.5em; text-align: right; }
#pdf-contents .contents-title { font-size: 20pt; font-weight: bold;
  margin: 0.6em 0 0.8em 0; }
#pdf-contents a { color: inherit; text-decoration: none; }
"""

# Runs in the page: marks each chapter (a document of the single page),
# opens collapsed cells, labels every tab, drops hidden code cells that a tab
# already shows, adds the title page and the contents. Returns the
# chapters' titles, in order.
PREPARE = """([title, subtitle]) => {
  document.querySelectorAll('details').forEach(d => { d.open = true; });
  // each tab's label above its own content
  document.querySelectorAll('.sd-tab-set > label').forEach(label => {
    const content = document.getElementById(label.htmlFor + '-content');
    if (!content || content.querySelector(':scope > .pdf-tab-label')) { return; }
    const name = document.createElement('p');
    name.className = 'pdf-tab-label';
    name.textContent = label.textContent.trim();
    content.prepend(name);
  });
  // a hidden code cell whose code a tab already shows is printed once
  const norm = t => t.replace(/\\s+/g, ' ').trim();
  const inTabs = new Set(Array.from(
    document.querySelectorAll('.sd-tab-content pre'), p => norm(p.textContent)));
  document.querySelectorAll('.cell.tag_hide-input').forEach(cell => {
    const pre = cell.querySelector('.cell_input pre');
    const box = cell.querySelector('details.above-input');
    if (pre && box && inTabs.has(norm(pre.textContent))) { box.remove(); }
  });
  const chapters = [];
  const starts = [document.querySelector('article.bd-article > section')];
  document.querySelectorAll('span[id^="document-"]').forEach(anchor => {
    starts.push(anchor);
  });
  starts.forEach(anchor => {
    if (!anchor) { return; }
    let section = anchor.tagName === 'SECTION' ? anchor
      : anchor.nextElementSibling;
    while (section && section.tagName !== 'SECTION') {
      section = section.nextElementSibling;
    }
    if (!section) { return; }
    const heading = section.querySelector('h1, h2');
    if (!heading || chapters.some(c => c.id === section.id)) { return; }
    if (chapters.length) { section.classList.add('book-chapter'); }
    const text = Array.from(heading.childNodes)
      .filter(n => !(n.classList && n.classList.contains('headerlink')))
      .map(n => n.textContent).join('').trim();
    chapters.push({id: section.id, title: text});
  });
  const main = document.querySelector('main') || document.body;
  const old = document.getElementById('pdf-title');
  if (old) { old.remove(); document.getElementById('pdf-contents').remove(); }
  const cover = document.createElement('section');
  cover.id = 'pdf-title';
  cover.innerHTML = '<h1></h1><p></p>';
  cover.querySelector('h1').textContent = title;
  cover.querySelector('p').textContent = subtitle;
  const contents = document.createElement('section');
  contents.id = 'pdf-contents';
  contents.innerHTML = '<p class="contents-title">Contents</p><ol></ol>';
  chapters.forEach((c, i) => {
    const li = document.createElement('li');
    const a = document.createElement('a');
    a.href = '#' + c.id;
    a.textContent = c.title;
    const fill = document.createElement('span');
    fill.className = 'fill';
    const page = document.createElement('span');
    page.className = 'page-number';
    li.append(a, fill, page);
    contents.querySelector('ol').appendChild(li);
  });
  const article = document.querySelector('article.bd-article') || main;
  article.prepend(cover, contents);
  return chapters.map(c => c.title);
}"""

# Runs in the page laid out at the printed width: marks each block taller
# than `limit` pixels (see LONG) that a style keeps whole (this file's, or
# the theme's, which keeps every highlighted block whole), so that it may
# break across pages. Returns how many it marked.
MARK_LONG = """limit => {
  let marked = 0;
  document.querySelectorAll('article div, article pre, article table, '
    + 'article figure, article section, article details').forEach(e => {
    if (getComputedStyle(e).breakInside.startsWith('avoid')
        && e.getBoundingClientRect().height > limit) {
      e.classList.add('pdf-long');
      marked += 1;
    }
  });
  return marked;
}"""

FOOTER = (
    '<div style="font-size: 8pt; width: 100%; text-align: center; '
    'color: #555;"><span class="pageNumber"></span></div>'
)


def build_single_html():
    """Jupyter Book's singlehtml build from the stored outputs; returns the
    path of the one page."""
    shutil.rmtree(WORK, ignore_errors=True)
    result = run_jupyter_book(
        ["--builder", "singlehtml", "--path-output", str(WORK)], timeout=1200
    )
    if result.returncode != 0:
        print((result.stdout + result.stderr)[-6000:])
        raise SystemExit("build_pdf: the single-page HTML build failed")
    # Sphinx writes the one page as <root document>.html (book/intro.html)
    # with links relative to the output folder: move it there.
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    page = SINGLE / "book.html"
    (SINGLE / f"{toc['root']}.html").replace(page)
    return page


QUOTES = str.maketrans(
    {"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"'}
)


def squeeze(text):
    """Text without spaces, line breaks and hyphens, to find a title that
    the PDF breaks over two lines."""
    text = unicodedata.normalize("NFKC", text)  # ligatures: "ﬁ" -> "fi"
    text = text.translate(QUOTES)  # the page's typographic quotes
    return re.sub(r"[\s\-\u00ad\u2010]+", "", text)


def chapter_pages(pdf, titles):
    """The 1-based page where each title starts: from the PDF's outline
    (Chromium makes one entry per heading), else the first page after the
    previous title's whose text holds it."""
    from pypdf import PdfReader

    reader = PdfReader(pdf)
    entries = []

    def walk(items):
        for item in items:
            if isinstance(item, list):
                walk(item)
            else:
                page = reader.get_destination_page_number(item)
                entries.append((squeeze(item.title), page + 1))

    walk(reader.outline)
    texts = {}
    pages, start = [], 3  # after the title page and the contents
    for title in titles:
        wanted = squeeze(title)
        found = next(
            (n for t, n in entries if n >= start and wanted in t), None
        )
        if found is None:
            for n in range(start, len(reader.pages) + 1):
                if n not in texts:
                    texts[n] = squeeze(reader.pages[n - 1].extract_text())
                if wanted in texts[n]:
                    found = n
                    break
        pages.append(found if found is not None else "")
        start = found or start
    return pages


# Runs in the page after the book is printed: the contents page alone, with
# only its page numbers visible (the same layout, so they land in place).
NUMBERS_ONLY = """pages => {
  document.querySelectorAll('#pdf-contents .page-number').forEach((e, i) => {
    e.textContent = String(pages[i]);
  });
  const style = document.createElement('style');
  style.textContent = '#pdf-contents ~ * { display: none !important; } '
    + 'body * { visibility: hidden !important; } '
    + '#pdf-contents .page-number { visibility: visible !important; } '
    + 'html, body { background: transparent !important; }';
  document.head.appendChild(style);
}"""


def print_pdf(page, out, footer=FOOTER, background=True):
    page.pdf(
        path=str(out),
        format="A4",
        print_background=background,
        display_header_footer=True,
        header_template="<div></div>",
        footer_template=footer,
        margin={side: f"{mm}mm" for side, mm in MARGIN_MM.items()},
        outline=True,
        tagged=True,
    )


def stamp_contents_page(out, numbers):
    """Merge the numbers-only print onto the PDF's contents page (page 2).

    With Debian's qpdf (`.ci/run` installs it) qpdf overlays it; else pypdf
    does, which parses and rewrites each of the book's objects in Python
    (139,297 in the 451-page PDF). Stamping that PDF on 2026-12-07 on the
    2-core AMD EPYC at a load of 11 to 19 took 42 s of CPU (user and
    system) with pypdf, 18 s with qpdf, each measured once. Either way the
    numbers page is drawn over page 2; the other pages, the outline and the
    tags are kept."""
    qpdf = shutil.which("qpdf")
    if qpdf is None:
        from pypdf import PdfReader, PdfWriter

        writer = PdfWriter(clone_from=PdfReader(out))
        writer.pages[1].merge_page(PdfReader(numbers).pages[1])
        with open(out, "wb") as f:
            writer.write(f)
        return
    stamped = out.with_suffix(".stamped.pdf")
    result = subprocess.run(
        [
            qpdf,
            str(out),
            "--overlay",
            str(numbers),
            "--from=2",
            "--to=2",
            "--",
            str(stamped),
        ],
        capture_output=True,
        text=True,
    )
    # exit status 3: written, with warnings (qpdf repairs what it reads)
    if result.returncode not in (0, 3):
        raise SystemExit(f"build_pdf: qpdf failed: {result.stderr[-2000:]}")
    stamped.replace(out)


def shown(path):
    """How the log names `path`: relative to the repository when inside it,
    else as given (`--out` may point anywhere)."""
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def build(out=PDF):
    if site_browser.chromium_binary() is None:
        raise SystemExit(
            site_browser.NO_BROWSER.format(", ".join(site_browser.CANDIDATES))
        )
    started = time.monotonic()
    html = build_single_html()
    built = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    subtitle = f"{config['author']}, {config['copyright']}"
    with site_browser.browser() as b:
        page, report = site_browser.open_page(
            b, html, width=900, timeout=300000
        )
        typeset = time.monotonic()
        untypeset = page.evaluate(
            "() => Array.from(document.querySelectorAll('div.math, span.math'))"
            ".filter(e => !e.querySelector('mjx-container')).length"
        )
        if untypeset:
            raise SystemExit(f"build_pdf: {untypeset} formulas not typeset")
        page.emulate_media(media="print")
        page.add_style_tag(content=PRINT_CSS)
        titles = page.evaluate(PREPARE, [config["title"], subtitle])
        page.set_viewport_size({"width": TEXT_PX[0], "height": TEXT_PX[1]})
        page.evaluate(MARK_LONG, LONG * TEXT_PX[1])
        print_pdf(page, out)
        printed = time.monotonic()
        pages = chapter_pages(out, titles)
        found = time.monotonic()
        numbers = out.with_suffix(".numbers.pdf")
        page.evaluate(NUMBERS_ONLY, pages)
        # no background: the numbers must not paint over the page's text
        print_pdf(page, numbers, footer="<div></div>", background=False)
        numbered = time.monotonic()
        stamp_contents_page(out, numbers)
        numbers.unlink()
        if report["external_requests"]:
            raise SystemExit(
                "build_pdf: the page tried to reach the network: "
                + ", ".join(report["external_requests"][:5])
            )
        page.context.close()
    record = {"titles": titles, "pages": pages}
    out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    from pypdf import PdfReader

    n = len(PdfReader(out).pages)
    print(
        f"build_pdf: {shown(out)}: {n} pages, "
        f"{out.stat().st_size / 1e6:.1f} MB (HTML {built - started:.0f} s, "
        f"page and math {typeset - built:.0f} s, print "
        f"{printed - typeset:.0f} s, pages found {found - printed:.0f} s, "
        f"numbers printed {numbered - found:.0f} s, stamped "
        f"{time.monotonic() - numbered:.0f} s; all "
        f"{time.monotonic() - started:.0f} s)"
    )
    return out


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PDF)
    args = parser.parse_args(argv)
    build(args.out.resolve())


if __name__ == "__main__":
    main(sys.argv[1:])
