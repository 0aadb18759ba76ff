"""The attention explorer in Debian's Chromium: what the browser test
(tests/test_browser.py) checks on every page that shows one.

Explorers are found, not listed: every notebook of the table of contents
whose stored outputs hold one is opened as its built page
(_build/html/<chapter>.html), and every notebook in tests/explorer/ (test
fixtures, not chapters) as a small page that loads the site's own copy of
plotly.js. In each explorer the check picks the last sequence and layer,
hovers over a token, clicks another, switches the head and hovers over a
heatmap row, and asserts after each step that the weights shown (the bar
chart's numbers and the shaded tokens) are the notebook's STORED weights for
that token, read here from the .ipynb file, and that no request left the
machine. Adding an explorer to a chapter needs no change here.

The chapter pages are the ones the browser test opens anyway: it runs these
checks on each page it has loaded, so no page is loaded (and no MathJax
typeset) twice.
"""

import json
import re
import sys

import nbformat
from conftest import BOOK, ROOT, toc_docs

sys.path.insert(0, str(ROOT / "tools" / "build"))
sys.path.insert(0, str(BOOK))
import site_browser

FIXTURES = ROOT / "tests" / "explorer"
PLOTLY = site_browser.HTML / "_static" / "plotly" / "plotly.min.js"
EXPLORER = re.compile(
    r'<div class="attention-explorer" id="(attention-explorer-[0-9a-f]+)">'
    r'.*?<script type="application/json" class="attention-explorer-data">'
    r"(.*?)</script>",
    re.S,
)


def stored_explorers(notebook):
    """[(element id, data)] of the explorers in a notebook's stored outputs,
    in page order."""
    nb = nbformat.read(notebook, as_version=4)
    found = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            html = out.get("data", {}).get("text/html", "")
            html = "".join(html) if isinstance(html, list) else html
            found += [(i, json.loads(d)) for i, d in EXPLORER.findall(html)]
    return found


def chapter_notebooks():
    return [
        ROOT / f"{d}.ipynb"
        for d in toc_docs()
        if (ROOT / f"{d}.ipynb").is_file()
    ]


def fixture_page(notebook, folder):
    """A page with the fixture notebook's stored HTML outputs that loads the
    site's copy of plotly.js, as a chapter page does."""
    nb = nbformat.read(notebook, as_version=4)
    body = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            html = out.get("data", {}).get("text/html")
            if html:
                body.append("".join(html) if isinstance(html, list) else html)
    page = folder / f"{notebook.stem}.html"
    page.write_text(
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8">\n'
        f'<script src="{PLOTLY.as_uri()}"></script></head>\n<body>\n'
        + "\n".join(body)
        + "\n</body></html>\n",
        encoding="utf-8",
    )
    return page


SHOWN = """id => {
  const root = document.getElementById(id);
  const gd = root.querySelector('.ae-plot');
  return {
    sequence: Number(root.dataset.sequence), layer: Number(root.dataset.layer),
    head: Number(root.dataset.head), query: Number(root.dataset.query),
    bars: Array.from(gd.data[0].y),
    labels: Array.from(gd.data[0].text),
    keys: Array.from(root.querySelectorAll('.ae-key')).map(
      k => Number(k.dataset.weight)),
    key_labels: Array.from(root.querySelectorAll('.ae-key .ae-weight')).map(
      k => k.textContent),
  };
}"""

# the page coordinates of the centre of a heatmap row (plotly's axes)
HEATMAP_ROW = """([id, row]) => {
  const gd = document.getElementById(id).querySelector('.ae-plot');
  const box = gd.getBoundingClientRect(), fl = gd._fullLayout;
  return [box.left + fl.xaxis2._offset + fl.xaxis2.d2p(0),
          box.top + fl.yaxis2._offset + fl.yaxis2.d2p(row)];
}"""


def check_shown(page, element_id, data, s, layer, h, q):
    shown = page.evaluate(SHOWN, element_id)
    where = f"{element_id}: sequence {s}, layer {layer}, head {h}, query {q}"
    position = [shown[k] for k in ("sequence", "layer", "head", "query")]
    assert position == [s, layer, h, q], where
    stored = data["sequences"][s]["weights"][layer][h][q]
    assert shown["bars"] == stored, where
    assert shown["keys"] == stored, where
    text = [f"{w:.{data['precision']}f}" for w in stored]
    assert shown["labels"] == text and shown["key_labels"] == text, where
    return stored


def check_explorer(page, element_id, data):
    root = page.locator(f"#{element_id}")
    root.scroll_into_view_if_needed()
    page.wait_for_function(
        "id => { const gd = document.getElementById(id)"
        ".querySelector('.ae-plot'); return gd.data && gd.data.length === 2 }",
        arg=element_id,
        timeout=20000,
    )
    S, L, H = (len(data[k]) for k in ("sequences", "layers", "heads"))
    s, layer = S - 1, L - 1
    if S > 1:
        root.locator("select.ae-sequence").select_option(str(s))
    if L > 1:
        root.locator("select.ae-layer").select_option(str(layer))
    weights = data["sequences"][s]["weights"][layer]
    T_q = len(weights[0])
    # the query to test: the last one whose rows differ between heads 1 and 2
    q = next(
        (
            i
            for i in reversed(range(T_q))
            if H == 1 or weights[0][i] != weights[1][i]
        ),
        T_q - 1,
    )
    tokens = root.locator(".ae-token")
    assert tokens.count() == T_q

    tokens.nth(q).hover()
    before = check_shown(page, element_id, data, s, layer, 0, q)
    if T_q > 1:  # click another token, then hover back
        other = q - 1 if q > 0 else 1
        tokens.nth(other).click()
        moved = check_shown(page, element_id, data, s, layer, 0, other)
        if weights[0][other] != before:
            assert moved != before
        tokens.nth(q).hover()
        check_shown(page, element_id, data, s, layer, 0, q)
    if H > 1:
        root.locator("select.ae-head").select_option("1")
        after = check_shown(page, element_id, data, s, layer, 1, q)
        if weights[1][q] != weights[0][q]:
            assert after != before, "switching the head changed nothing"
    if T_q > 1:  # the heatmap's rows select a query too
        target = 0 if q != 0 else 1
        x, y = page.evaluate(HEATMAP_ROW, [element_id, target])
        page.mouse.move(x, y)
        page.wait_for_function(
            "([id, q]) => document.getElementById(id).dataset.query === q",
            arg=[element_id, str(target)],
            timeout=5000,
        )
        check_shown(
            page, element_id, data, s, layer, 1 if H > 1 else 0, target
        )


def check_explorers_on_page(page, report, explorers):
    """Every explorer of a loaded page (explorers: stored_explorers of its
    notebook, in page order) shows the stored weights as the reader moves
    through it; the page loads its scripts from the machine only."""
    on_page = page.evaluate(
        "() => Array.from(document.querySelectorAll('.attention-explorer'))"
        ".map(e => e.id)"
    )
    assert on_page == [i for i, _ in explorers]
    assert page.evaluate("() => typeof window.Plotly") == "object"
    for element_id, data in explorers:
        check_explorer(page, element_id, data)
    scripts = page.evaluate(
        "() => Array.from(document.scripts).map(s => s.src).filter(Boolean)"
    )
    plotly = [s for s in scripts if s.endswith("/plotly/plotly.min.js")]
    assert len(plotly) == 1 and plotly[0].startswith("file://")
    assert all(s.startswith("file://") for s in scripts), scripts
    assert report["external_requests"] == []
    assert report["console_errors"] == []
    assert report["page_errors"] == []
