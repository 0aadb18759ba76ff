"""Write a full-page PNG of every built page, light and dark, into
_build/screenshots/ (`make screenshots`), to look at the site as a reader does."""

import sys
from pathlib import Path

from site_browser import HTML, browser, open_page, site_pages

# tools/ holds the shared modules (cli, chapter_loader, measure, ...)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cli

OUT = HTML.parent / "screenshots"


def main(argv=None):
    cli.help_only(__doc__, argv)
    if not (HTML / "index.html").is_file():
        raise SystemExit("no built site: run `make book` first")
    OUT.mkdir(parents=True, exist_ok=True)
    with browser() as b:
        for path in site_pages():
            for mode in ("light", "dark"):
                page, report = open_page(b, path, dark=(mode == "dark"))
                target = OUT / f"{path.stem}-{mode}.png"
                page.screenshot(path=str(target), full_page=True)
                page.context.close()
                problems = {k: v for k, v in report.items() if v}
                print(
                    f"{target.relative_to(HTML.parent.parent)}"
                    + (f"  PROBLEMS: {problems}" if problems else "")
                )


if __name__ == "__main__":
    main()
