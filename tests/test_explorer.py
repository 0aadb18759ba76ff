"""The attention explorer's files in the built site (no browser): the
fixture notebooks show explorers, and plotly.js ships with the site and is
loaded by exactly the pages that show one. The explorers themselves are
opened in Chromium by tests/test_browser.py (tests/explorer_checks.py), on
the pages that test loads anyway.
"""

from explorer_checks import FIXTURES, PLOTLY, site_browser, stored_explorers


def test_fixture_notebooks_show_explorers():
    """The browser test has something to open before any chapter has one."""
    fixtures = sorted(FIXTURES.glob("*.ipynb"))
    assert fixtures
    for nb in fixtures:
        assert stored_explorers(nb), f"{nb.name} shows no explorer"


def test_plotly_ships_with_the_site_and_only_where_needed(built_site):
    assert built_site[0] == 0, "the site did not build"
    assert PLOTLY.is_file() and PLOTLY.stat().st_size > 1_000_000
    for page in site_browser.site_pages():
        text = page.read_text(encoding="utf-8")
        has = 'class="attention-explorer"' in text
        loads = "_static/plotly/plotly.min.js" in text
        assert has == loads, f"{page.name}: explorer {has}, plotly.js {loads}"
        assert "cdn.plot.ly" not in text
