"""Unpack every chapter zip the built site offers (`_build/html/downloads/`)
into its own empty folder under `_build/downloads/`, exactly as a reader
would after downloading it. `make test` then runs nbval on those copies: each
chapter is executed with nothing around it but what its download holds.

Usage: python tools/build/stage_downloads.py
"""

import shutil
import sys
import zipfile
from pathlib import Path

# tools/ holds the shared modules (cli, chapter_loader, measure, ...)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cli

ROOT = Path(__file__).resolve().parents[2]
ZIPS = ROOT / "_build" / "html" / "downloads"
STAGE = ROOT / "_build" / "downloads"


def main(argv=None):
    cli.help_only(__doc__, argv)
    zips = sorted(ZIPS.glob("*.zip"))
    if not zips:
        print(f"stage_downloads: no chapter zips in {ZIPS.relative_to(ROOT)}")
        return 1
    shutil.rmtree(STAGE, ignore_errors=True)
    STAGE.mkdir(parents=True)
    for path in zips:
        with zipfile.ZipFile(path) as archive:
            archive.extractall(STAGE)
    notebooks = sorted(STAGE.glob("*/*.ipynb"))
    print(
        f"stage_downloads: {len(zips)} chapter zips unpacked into "
        f"{STAGE.relative_to(ROOT)}/ ({len(notebooks)} notebooks)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
