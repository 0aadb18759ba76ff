"""Every page of the built site, opened in a real browser (Debian's Chromium
through Playwright), renders as intended with no network: math typeset, every
image loaded, tabs and collapsed solutions working, no console errors, no
request leaving the machine; figures stay readable in dark mode."""

import sys
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


@pytest.mark.parametrize("dark", [False, True], ids=["light", "dark"])
@pytest.mark.parametrize("doc", toc_pages())
def test_page_renders_offline(chromium, doc, dark):
    page, report = site_browser.open_page(chromium, html_path(doc), dark=dark)
    try:
        assert report["external_requests"] == []
        assert report["console_errors"] == []
        assert report["page_errors"] == []
        theme = page.evaluate("document.documentElement.dataset.theme")
        assert theme == ("dark" if dark else "light")

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

        # every image loaded, and figures are opaque (readable on a dark page)
        images = page.evaluate("""() => Array.from(document.images).map(i =>
            [i.getAttribute('src'), i.complete, i.naturalWidth])""")
        for src, complete, width in images:
            assert complete and width > 0, f"image not loaded: {src}"

        if not dark:  # what the reader clicks, once per page
            check_download_links(page, doc)
            check_tabs_and_collapsed_solutions(page)
    finally:
        page.context.close()


def check_tabs_and_collapsed_solutions(page):
    """sphinx-design tabs: clicking each label shows its own panel only;
    collapsed solution cells (tag hide-cell): hidden until clicked."""
    for t in range(page.locator(".sd-tab-set").count()):
        tab_set = page.locator(".sd-tab-set").nth(t)
        labels = tab_set.locator(":scope > label")
        panels = tab_set.locator(":scope > .sd-tab-content")
        assert labels.count() == panels.count() >= 2
        for i in range(labels.count()):
            labels.nth(i).click()
            assert panels.nth(i).is_visible()
            others = [j for j in range(panels.count()) if j != i]
            assert not any(panels.nth(j).is_visible() for j in others)
    for k in range(page.locator("details.hide.above-input").count()):
        details = page.locator("details.hide.above-input").nth(k)
        body = details.locator(".cell_input")
        assert not body.is_visible()
        details.locator("summary").click()
        assert body.is_visible()


def check_download_links(page, doc):
    """Every link of the page's download menu leads to a file of the site; a
    chapter offers its zip (ready to run) and its notebook."""
    hrefs = page.evaluate("""() => Array.from(document.querySelectorAll(
        '.dropdown-download-buttons a')).map(a => a.href)""")
    assert hrefs, "no download menu"
    for href in hrefs:
        assert href.startswith("file://"), href
        path = Path(unquote(urlsplit(href).path))
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
