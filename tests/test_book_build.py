"""The book builds with Sphinx warnings as errors, and the pages hold what the
chapters promise (numbered equations, figures, offline MathJax)."""

import re
from urllib.parse import unquote, urlsplit

import pytest
from conftest import ROOT

HTML = ROOT / "_build" / "html"


@pytest.fixture(scope="module")
def build(built_site):
    return built_site


def test_build_has_no_warnings(build):
    returncode, log = build
    assert returncode == 0, log[-5000:]
    assert "build succeeded" in log
    assert not re.search(
        r"WARNING|ERROR", re.sub(r"\[IPKernelApp\] WARNING[^\n]*", "", log)
    ), log[-5000:]
    assert (HTML / "index.html").is_file()


def test_mathjax_is_shipped_with_the_site(build):
    """The page loads MathJax from a file of the site, whatever the spelling
    of the tag (Sphinx adds `?v=<checksum>` once the file is in _static)."""
    shipped = HTML / "_static" / "mathjax" / "tex-svg-full.js"
    assert shipped.is_file()
    page_path = HTML / "book" / "01_general_attention.html"
    page = page_path.read_text(encoding="utf-8")
    sources = re.findall(r'<script[^>]*\ssrc="([^"]*mathjax[^"]*)"', page)
    assert len(sources) == 1, sources
    target = urlsplit(sources[0])
    assert not target.scheme and not target.netloc, sources[0]
    assert (page_path.parent / unquote(target.path)).resolve() == shipped
    assert "cdn.jsdelivr.net" not in page


def test_chapter_1_page_has_numbered_equations_and_the_heatmap(build):
    page = (HTML / "book" / "01_general_attention.html").read_text(
        encoding="utf-8"
    )
    # numbered display equations, e.g. <span class="eqno">(1.3)
    numbers = re.findall(r'class="eqno">\(([\d.]+)\)', page)
    assert len(numbers) >= 8, numbers
    # references to equations resolved to links
    assert 'href="#equation-ch1-weights"' in page
    # the heatmap and its source notebook download
    images = re.findall(r'<img[^>]+src="([^"]+\.png)"', page)
    assert images, "no figure on chapter 1's page"
    for src in images:
        assert (HTML / "book" / src).resolve().is_file(), src
    # the bibliography resolved the citations
    assert "Bahdanau" in page and "Vaswani" in page
