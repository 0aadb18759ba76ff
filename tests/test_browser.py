"""Every page of the built site, opened in a real browser (Debian's Chromium
through Playwright), renders as intended with no network: math typeset, every
image loaded, tabs and collapsed solutions working, no console errors, no
request leaving the machine; the dark theme follows the reader's setting.

Only what needs a browser is checked in one: one browser for the module, each
page opened once (light), the dark theme on one page (it is the same script on
every page). What the HTML files show without running them (the download
menu's links, figures opaque for dark mode) is read from the files."""

import re
import sys
from html import unescape
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import yaml
from conftest import ROOT, require_system_tool

sys.path.insert(0, str(ROOT / "tools"))
import site_browser


def toc_pages():
    """The pages the table of contents lists, as paths under _build/html."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    files = [toc["root"]]
    for part in toc.get("parts", []):
        files += [chapter["file"] for chapter in part.get("chapters", [])]
    return files


@pytest.fixture(scope="module")
def chromium(built_site):
    require_system_tool(
        site_browser.chromium_binary() is not None,
        "Debian's Chromium (the browser test opens every page in it)",
        "apt-get install chromium",
    )
    assert built_site[0] == 0, "the site did not build"
    with site_browser.browser() as b:
        yield b


def html_path(doc):
    return site_browser.HTML / f"{doc}.html"


@pytest.mark.parametrize("doc", toc_pages())
def test_page_renders_offline(chromium, doc):
    page, report = site_browser.open_page(chromium, html_path(doc))
    try:
        assert report["external_requests"] == []
        assert report["console_errors"] == []
        assert report["page_errors"] == []
        assert (
            page.evaluate("document.documentElement.dataset.theme") == "light"
        )

        # math: every math element typeset by MathJax, no TeX error, no raw TeX
        math = page.evaluate("""() => Array.from(
            document.querySelectorAll('div.math, span.math')).map(e => [
                e.querySelectorAll('mjx-container').length,
                e.querySelectorAll('mjx-merror, [data-mjx-error]').length])""")
        assert all(n > 0 for n, _ in math), "math left untypeset"
        assert all(err == 0 for _, err in math), "MathJax reported a TeX error"
        text = page.inner_text("main")
        assert (
            "$$" not in text
            and "\\frac" not in text
            and "\\begin{" not in text
        )

        # every image loaded
        images = page.evaluate("""() => Array.from(document.images).map(i =>
            [i.getAttribute('src'), i.complete, i.naturalWidth])""")
        for src, complete, width in images:
            assert complete and width > 0, f"image not loaded: {src}"

        check_tabs_and_collapsed_solutions(page)
    finally:
        page.context.close()


def test_dark_theme_follows_the_readers_setting(chromium):
    """The theme's script reads prefers-color-scheme (the same script on every
    page, so one page with figures, tabs and math shows it)."""
    doc = next(d for d in toc_pages() if d.endswith("02_translations"))
    page, report = site_browser.open_page(chromium, html_path(doc), dark=True)
    try:
        assert report["external_requests"] == []
        assert report["console_errors"] == []
        assert (
            page.evaluate("document.documentElement.dataset.theme") == "dark"
        )
        background = page.evaluate(
            "getComputedStyle(document.body).backgroundColor"
        )
        rgb = [int(v) for v in re.findall(r"\d+", background)[:3]]
        assert sum(rgb) < 3 * 100, f"dark theme, light background {background}"
    finally:
        page.context.close()


# Playwright's rule for is_visible() (not hidden by the browser's own check,
# computed visibility "visible", a non-empty box), as a function in the page.
# TABS_AND_SOLUTIONS clicks, in the page itself (one call, not one round trip
# per click), each tab label and each collapsed solution's summary, and
# returns what was visible after each click.
TABS_AND_SOLUTIONS = """() => {
    const visible = e => {
        const box = e.getBoundingClientRect();
        return e.checkVisibility()
            && getComputedStyle(e).visibility === 'visible'
            && box.width > 0 && box.height > 0;
    };
    const tabs = Array.from(document.querySelectorAll('.sd-tab-set')).map(set => {
        const labels = Array.from(set.querySelectorAll(':scope > label'));
        const panels = Array.from(set.querySelectorAll(':scope > .sd-tab-content'));
        return {labels: labels.length, panels: panels.length,
                after: labels.map(l => { l.click(); return panels.map(visible); })};
    });
    const details = Array.from(document.querySelectorAll('details.hide.above-input'));
    const bodies = details.map(d => d.querySelector('.cell_input'));
    const solutions = details.map(d => {
        const before = bodies.map(b => b !== null && visible(b));
        d.querySelector('summary').click();
        return {before, after: bodies.map(b => b !== null && visible(b))};
    });
    return {tabs, solutions};
}"""


def check_tabs_and_collapsed_solutions(page):
    """sphinx-design tabs: clicking each label shows its own panel only;
    collapsed solution cells (tag hide-cell): hidden until clicked, and a
    click opens that one only."""
    result = page.evaluate(TABS_AND_SOLUTIONS)
    for tab_set in result["tabs"]:
        assert tab_set["labels"] == tab_set["panels"] >= 2
        for i, visible in enumerate(tab_set["after"]):
            assert visible == [j == i for j in range(len(visible))]
    for k, solution in enumerate(result["solutions"]):
        # before the click on solution k: solutions 0 .. k-1 open, k closed
        assert solution["before"][: k + 1] == [True] * k + [False]
        assert solution["after"] == [
            j <= k for j in range(len(solution["after"]))
        ]


DOWNLOAD_MENU = re.compile(
    r'<div class="dropdown dropdown-download-buttons">.*?<ul class="dropdown-menu">'
    r"(.*?)</ul>",
    re.S,
)


@pytest.mark.parametrize("doc", toc_pages())
def test_download_links(built_site, doc):
    """Every link of the page's download menu leads to a file of the site; a
    chapter offers its zip (ready to run) and its notebook. (Read from the
    HTML file: the links are static.)"""
    assert built_site[0] == 0, "the site did not build"
    html = html_path(doc).read_text(encoding="utf-8")
    menu = DOWNLOAD_MENU.search(html)
    assert menu, "no download menu"
    hrefs = [unescape(h) for h in re.findall(r'href="([^"]+)"', menu.group(1))]
    assert hrefs, "no download menu"
    for href in hrefs:
        assert urlsplit(href).scheme == "", (
            f"download link leaves the site: {href}"
        )
        path = (html_path(doc).parent / unquote(urlsplit(href).path)).resolve()
        assert path.is_file(), f"download link to a missing file: {href}"
    if (ROOT / f"{doc}.ipynb").is_file():
        name = Path(doc).name
        assert {Path(urlsplit(h).path).name for h in hrefs} >= {
            f"{name}.zip",
            f"{name}.ipynb",
        }


def test_figures_are_opaque_for_dark_mode(built_site):
    """A transparent figure would put black axis labels on a dark page."""
    from PIL import Image

    figures = sorted((site_browser.HTML / "_images").glob("*.png"))
    assert figures, "no figures in the built site"
    for png in figures:
        with Image.open(png) as im:
            rgba = im.convert("RGBA")
            corners = [
                rgba.getpixel((x, y))
                for x in (0, rgba.width - 1)
                for y in (0, rgba.height - 1)
            ]
        assert all(c[3] == 255 for c in corners), (
            f"{png.name} has a transparent background"
        )
