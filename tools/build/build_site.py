"""Build the book's site from the notebooks' stored outputs, with Sphinx
warnings as errors (`make book`, and `make test` before the tests).

Execution is off: `make test` runs nbval, which re-executes every notebook
and proves that a fresh run prints exactly the stored outputs, so executing
them for the site as well would only double the time. `--execute` (what
`make book EXECUTE=1` runs) executes the notebooks instead, through Jupyter
Book's cache (`_build/.jupyter_cache`: a notebook unchanged since its last
execution is not run again), and shows the outputs computed on this machine.
The result is recorded in `_build/site-build.json` for the tests that
inspect the site.

Usage: python tools/build/build_site.py              (exit status: the build's)
       python tools/build/build_site.py --execute    (execute the notebooks too)
       python tools/build/build_site.py --linkcheck  (check the external links)
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "_build" / "site-build.json"


def run_jupyter_book(args, execute=False, timeout=3600):
    """`jupyter-book build` of the book with `args` added, warnings as
    errors, from the stored outputs unless `execute` (then with Jupyter
    Book's cache). The one place that writes the build's configuration:
    _config.yml with the execution mode set and its extension paths made
    absolute (the configuration file moves to a temporary folder)."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    config["execute"]["execute_notebooks"] = "cache" if execute else "off"
    extensions = config["sphinx"]["local_extensions"]
    for name, folder in extensions.items():
        extensions[name] = str(ROOT / folder)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "_config.yml"
        path.write_text(yaml.safe_dump(config), encoding="utf-8")
        jb = Path(sys.executable).parent / "jupyter-book"
        return subprocess.run(
            [str(jb), "build", str(ROOT), "--config", str(path), *args]
            + ["-W", "-n", "--keep-going"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def build(builder="html", execute=False):
    """Run a fresh build; return (returncode, log) and record them.

    The pages and Sphinx's saved environment are removed first (a clean
    build takes seconds): an incremental build would keep pages rendered by
    an older version of the site's extension. The execution cache of
    `make book EXECUTE=1` is kept.
    """
    for folder in ("html", ".doctrees"):
        shutil.rmtree(ROOT / "_build" / folder, ignore_errors=True)
    result = run_jupyter_book(
        ["--builder", builder], execute=execute, timeout=3600
    )
    log = result.stdout + result.stderr
    if builder != "html":
        return result.returncode, log
    RECORD.parent.mkdir(exist_ok=True)
    RECORD.write_text(
        json.dumps({"returncode": result.returncode, "log": log}),
        encoding="utf-8",
    )
    return result.returncode, log


def parse_args(argv):
    """At most one of --execute and --linkcheck; --help exits 0."""
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--execute",
        action="store_true",
        help="execute the notebooks too (cached)",
    )
    group.add_argument(
        "--linkcheck", action="store_true", help="check the external links"
    )
    return parser.parse_args(argv)


def main(argv):
    args = parse_args(argv)
    if args.linkcheck:
        returncode, log = build("linkcheck")
        print(log[-6000:])
        return returncode
    execute = args.execute
    start = time.perf_counter()
    returncode, log = build(execute=execute)
    took = time.perf_counter() - start
    if returncode != 0:
        print(log[-6000:])
        print("build_site: the site did not build (see the log above)")
        return returncode
    how = "executing every notebook" if execute else "from the stored outputs"
    print(f"build_site: built _build/html {how} (-W) in {took:.0f} s")
    print(f"The book is at: {ROOT / '_build' / 'html' / 'index.html'}")
    return returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
