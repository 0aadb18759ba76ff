"""Open the built site in a real browser: Debian's Chromium driven by Playwright.

Used by tests/test_browser.py (`make test`) and tools/build/screenshots.py
(`make screenshots`). No browser is downloaded: Playwright is pointed at the
binary of Debian's `chromium` package, and every request that would leave the
machine is blocked and recorded.
"""

import shutil
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HTML = ROOT / "_build" / "html"

# The `chromium` on PATH is a wrapper script; Playwright needs the binary.
CANDIDATES = [
    "/usr/lib/chromium/chromium",
    "/usr/lib/chromium-browser/chromium-browser",
]
NO_BROWSER = (
    "No Chromium binary found (looked for {}). Install Debian's browser with "
    "`apt-get install chromium` (.ci/run does this) and run again."
)


def chromium_binary():
    """Path of the real Chromium binary, or None."""
    for path in CANDIDATES:
        if Path(path).is_file():
            return path
    found = shutil.which("chromium")
    return (
        found if found and Path(found).read_bytes()[:2] == b"\x7fE" else None
    )


def site_pages():
    """Every content page of the built site (chapters, intro, bibliography)."""
    return sorted((HTML / "book").glob("*.html"))


@contextmanager
def browser():
    """A headless Chromium, with no network and no background connections."""
    from playwright.sync_api import sync_playwright

    binary = chromium_binary()
    if binary is None:
        raise RuntimeError(NO_BROWSER.format(", ".join(CANDIDATES)))
    with sync_playwright() as pw:
        b = pw.chromium.launch(
            executable_path=binary,
            headless=True,
            args=[
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                "--disable-quic",
                "--allow-file-access-from-files",
            ],
        )
        try:
            yield b
        finally:
            b.close()


def open_page(b, path, dark=False, width=1280, height=900, timeout=30000):
    """Open one built page; return (page, report) where report collects the
    console errors and the requests that tried to leave the machine.
    timeout: milliseconds for the load and for MathJax (the PDF's single
    page of the whole book needs more on a busy machine)."""
    page, report = start_page(b, path, dark, width, height, timeout)
    finish_loading(page, timeout)
    return page, report


def start_page(b, path, dark=False, width=1280, height=900, timeout=30000):
    """Start loading a built page in a context of its own and return at once
    (page, report); finish_loading waits for it."""
    context = b.new_context(
        viewport={"width": width, "height": height},
        color_scheme="dark" if dark else "light",
    )
    page, report = new_tab(context)
    go(page, report, path, timeout)
    return page, report


def new_tab(context):
    """A tab of the context, (page, report): report collects the console
    errors, page errors and requests that tried to leave the machine. A tab
    can open one page after another (go): the scripts it has compiled once
    (MathJax, plotly.js) are compiled faster the next time."""
    page = context.new_page()
    report = {"console_errors": [], "external_requests": [], "page_errors": []}

    def route(r):
        url = r.request.url
        if url.startswith(("file://", "data:", "blob:", "about:")):
            r.continue_()
        else:
            report["external_requests"].append(url)
            r.abort()

    page.route("**/*", route)
    page.on(
        "console",
        lambda m: (
            m.type == "error" and report["console_errors"].append(m.text)
        ),
    )
    page.on("pageerror", lambda e: report["page_errors"].append(str(e)))
    return page, report


def go(page, report, path, timeout=30000):
    """Start loading a built page in the tab and return at once, with the
    tab's report emptied for it."""
    for found in report.values():
        found.clear()
    page.goto(
        Path(path).resolve().as_uri(), wait_until="commit", timeout=timeout
    )


def finish_loading(page, timeout=30000):
    """Wait for the page's load event and, if it has math, for MathJax."""
    page.wait_for_load_state("load", timeout=timeout)
    # MathJax typesets asynchronously: wait for it when the page has math
    page.wait_for_function(
        "() => !document.querySelector('.math') || "
        "(window.MathJax && MathJax.startup && MathJax.startup.promise && "
        " document.querySelectorAll('mjx-container').length > 0)",
        timeout=timeout,
    )
    page.evaluate(
        "() => window.MathJax && MathJax.startup ? MathJax.startup.promise : null"
    )
