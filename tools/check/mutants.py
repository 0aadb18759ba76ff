"""Plant each listed bug in a scratch copy of the book and check that tests/
alone catches it: `make mutants` (issue 31).

The bugs are listed in tools/check/mutants/*.toml (one file per chapter or
module), one ``[[mutant]]`` table each::

    [[mutant]]
    id = "plots-vmax"
    file = "book/plots.py"
    find = 'vmin=0.0, vmax=1.0'
    replace = 'vmin=0.0, vmax=None'
    description = "the colour scale follows the data, not 0 to 1"
    # optional: the test files to run, instead of the default ones
    tests = ["tests/test_shared_modules.py"]

`find` must occur exactly once in the file (for a notebook: in its code
cells, each cell matched on its own), the test files a mutant names must
exist, and a mutant that names none must have default ones (below), else
the mutant is INVALID: the run names it, and why, and stops
before running anything (exit status 2). tests/test_mutants_tool.py makes
the same check in `make test`, so a change that strands a mutant fails
there. A mutant is CAUGHT when pytest reports
a failure (exit status 1; a hang past --timeout counts as caught too), and
MISSED when the tests pass.

The tests run by default:
- a chapter notebook book/NN_*.ipynb: tests/test_chNN_*.py;
- another notebook (an appendix): the test files that name it;
- a module book/X.py: the test files that import X, then the tests of every
  chapter that imports X, directly or through another book/ module (found by
  reading the notebooks' and modules' import statements).

They run one file at a time, in that order, until one fails, each with
``-x -q``, without nbval, xdist or pytest's cache, in a copy of
book/, tests/, tools/ and the top-level files made once per job (so the tests'
load_chapter reads the copy's notebooks), with Python's bytecode cache off (a
same-size edit within one second would otherwise reuse a stale .pyc), and
one Hypothesis seed. Before the mutants, every test file they use runs once
unmodified, as the mutants run it: a file that does not run stops the run; a
test that fails there would make mutants look caught, so it is left out of
every mutant's run and named in a warning at the end.

Usage::

    python tools/check/mutants.py                 # every mutant
    python tools/check/mutants.py --only plots-   # ids equal to or starting with
    python tools/check/mutants.py --jobs 2        # two mutants at a time
    python tools/check/mutants.py --list          # list them, check `find`, run none
"""

import argparse
import ast
import functools
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MUTANTS = ROOT / "tools" / "check" / "mutants"
# what a scratch copy holds: the tests need the notebooks, the modules and
# data under book/, the loader and site tools under tools/, and the config
COPIED_DIRS = ("book", "tests", "tools", "_ext")
COPIED_FILES = (
    "pyproject.toml",
    "_config.yml",
    "_toc.yml",
    "requirements.txt",
)
IGNORED = shutil.ignore_patterns(
    "__pycache__", ".ipynb_checkpoints", "_build", ".pytest_cache"
)
PYTEST_FLAGS = [
    "-x",
    "-q",
    # pyproject's addopts switch nbval on; the mutation run wants tests/ only
    "-o",
    "addopts=",
    "-p",
    "no:importnb",
    "-p",
    "no:cacheprovider",
    "-p",
    "no:nbval",
    "-p",
    "no:xdist",
    # the same generated examples in the baseline and in every mutant's run
    "--hypothesis-seed=0",
]
FIELDS = {"id", "file", "find", "replace", "description", "tests"}


@dataclass
class Mutant:
    id: str
    file: str
    find: str
    replace: str
    description: str
    tests: list = field(default_factory=list)
    source: str = ""  # the TOML file that lists it (from the repository)


@dataclass
class Result:
    mutant: Mutant
    status: str  # caught, missed, invalid, error
    seconds: float = 0.0
    detail: str = ""


def load_mutants(path=MUTANTS):
    """The mutants listed in `path` (a TOML file, or a folder of them read in
    name order), checked for their fields and ids unique across files."""
    paths = sorted(path.glob("*.toml")) if path.is_dir() else [path]
    mutants, seen = [], set()
    for one in paths:
        mutants += load_mutant_file(one, seen)
    return mutants


def load_mutant_file(path, seen):
    """The mutants of one TOML file; `seen` collects the ids so far."""
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    unknown = set(data) - {"mutant"}
    if unknown:
        raise ValueError(f"{path.name}: unknown top-level keys {unknown}")
    mutants = []
    path = path.resolve()
    source = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    for i, entry in enumerate(data.get("mutant", [])):
        missing = {"id", "file", "find", "replace", "description"} - set(entry)
        extra = set(entry) - FIELDS
        if missing or extra:
            raise ValueError(
                f"{path.name}: mutant #{i + 1} ({entry.get('id', '?')}): "
                f"missing {sorted(missing)}, unknown {sorted(extra)}"
            )
        if entry["id"] in seen:
            raise ValueError(f"{path.name}: duplicate id {entry['id']!r}")
        if entry["find"] == entry["replace"]:
            raise ValueError(f"{path.name}: {entry['id']}: replace == find")
        seen.add(entry["id"])
        mutants.append(Mutant(**entry, source=str(source)))
    return mutants


# --- Patching ----------------------------------------------------------------


def code_cells(notebook):
    return [c for c in notebook["cells"] if c["cell_type"] == "code"]


@functools.lru_cache(maxsize=4)
def code_sources(text):
    """The source of each code cell of a notebook's text (kept for the next
    mutant of the same notebook: parsing a notebook is the slow part)."""
    return tuple("".join(c["source"]) for c in code_cells(json.loads(text)))


def count_matches(root, mutant):
    """How often `find` occurs in the file (a notebook: in its code cells)."""
    path = root / mutant.file
    if not path.is_file():
        return 0
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".ipynb":
        return text.count(mutant.find)
    return sum(source.count(mutant.find) for source in code_sources(text))


def invalid(mutants, root=ROOT):
    """(mutant, why) for each mutant that cannot be planted or judged as
    listed: its `find` does not occur exactly once in its file, a test file
    it names does not exist, or it names none and the default ones (see
    `tests_for`) are none."""
    found = []
    for m in sorted(mutants, key=lambda m: m.file):  # one parse per notebook
        n = count_matches(root, m)
        exists = (root / m.file).is_file()
        if n != 1:
            where = m.file if exists else f"{m.file} (no such file)"
            found.append((m, f"`find` occurs {n} times in {where}"))
        missing = [t for t in m.tests if not (root / t).is_file()]
        if missing:
            found.append((m, f"no test file {', '.join(missing)}"))
        elif exists and not tests_for(root, m):
            found.append((m, "no test file runs it: name its `tests`"))
    return found


def describe_invalid(found):
    """The lines that name each invalid mutant, its TOML file and why."""
    lines = [f"INVALID {m.id} ({m.source}): {why}" for m, why in found]
    lines.append(
        f"{len(found)} planted bug(s) no longer apply: update their `find` "
        "(or tests) to the code as it is now; "
        "`python tools/check/mutants.py --list` checks them all."
    )
    return lines


def patched_text(text, suffix, mutant):
    """The file's text with the mutant's one edit made."""
    if suffix != ".ipynb":
        return text.replace(mutant.find, mutant.replace, 1)
    notebook = json.loads(text)
    for cell in code_cells(notebook):
        source = "".join(cell["source"])
        if mutant.find in source:
            new = source.replace(mutant.find, mutant.replace, 1)
            cell["source"] = new.splitlines(keepends=True)
    # nbformat's layout: one-space indent, non-ASCII kept, final newline
    return json.dumps(notebook, indent=1, ensure_ascii=False) + "\n"


# --- Which tests -------------------------------------------------------------


def imported_modules(path):
    """Top-level names imported by a .py file or a notebook's code cells."""
    if path.suffix == ".ipynb":
        cells = code_cells(json.loads(path.read_text(encoding="utf-8")))
        sources = ["".join(cell["source"]) for cell in cells]
    else:
        sources = [path.read_text(encoding="utf-8")]
    names = set()
    for source in sources:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                if node.level == 0:
                    names.add(node.module.split(".")[0])
    return names


def chapter_tests(root, notebook):
    """tests/test_chNN_*.py for book/NN_*.ipynb; for another notebook, the
    test files that name it."""
    match = re.match(r"(\d\d)_", notebook.name)
    if match:
        return sorted(root.glob(f"tests/test_ch{match.group(1)}_*.py"))
    return sorted(
        p
        for p in root.glob("tests/test_*.py")
        if notebook.name in p.read_text(encoding="utf-8")
    )


@functools.cache  # the files it reads are never patched when it reads them
def import_table(root):
    """What each book/ module, test file and notebook under `root` imports,
    read once (`invalid` asks for every mutant's tests)."""
    book = root / "book"
    return (
        {p.stem: imported_modules(p) for p in book.glob("*.py")},
        {p: imported_modules(p) for p in sorted(root.glob("tests/test_*.py"))},
        {p: imported_modules(p) for p in sorted(book.glob("*.ipynb"))},
    )


@functools.cache
def module_tests(root, module):
    """The tests of a shared module book/<module>.py: the test files that
    import it first (they are the quickest to fail), then those of every
    chapter that imports it, directly or through another book/ module."""
    modules, test_files, notebooks = import_table(root)
    users = {module}  # the module and every book/ module that uses it
    while True:
        more = {m for m, imports in modules.items() if imports & users}
        if more <= users:
            break
        users |= more
    direct = [p for p, imports in test_files.items() if imports & users]
    chapters = []
    for notebook, imports in notebooks.items():
        if imports & users:
            chapters += [
                p for p in chapter_tests(root, notebook) if p not in direct
            ]
    return direct + chapters


def tests_for(root, mutant):
    """The test files (relative paths) a mutant runs."""
    if mutant.tests:
        return list(mutant.tests)
    path = root / mutant.file
    if path.suffix == ".ipynb":
        found = chapter_tests(root, path)
    else:
        found = module_tests(root, path.stem)
    return [str(p.relative_to(root)) for p in found]


# --- Running -----------------------------------------------------------------


def make_scratch(parent):
    """A copy of what the tests need, in a new folder under `parent`."""
    scratch = Path(tempfile.mkdtemp(prefix="copy-", dir=parent))
    for name in COPIED_DIRS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, scratch / name, ignore=IGNORED)
    for name in COPIED_FILES:
        if (ROOT / name).is_file():
            shutil.copy2(ROOT / name, scratch / name)
    if (ROOT / ".venv").exists():  # for tests that call .venv/bin/...
        (scratch / ".venv").symlink_to((ROOT / ".venv").resolve())
    return scratch


def environment(jobs):
    env = dict(os.environ)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["MPLBACKEND"] = "Agg"
    threads = str(max(1, (os.cpu_count() or 1) // jobs))
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env.setdefault(name, threads)
    return env


def run_pytest(scratch, tests, env, timeout, first_only=True, deselect=()):
    """(exit status or None on timeout, output) of pytest on `tests`,
    stopping at the first failure unless first_only is False, without the
    tests (node ids) in `deselect`."""
    flags = PYTEST_FLAGS if first_only else PYTEST_FLAGS[1:]  # drop -x
    left_out = [x for test in deselect for x in ("--deselect", test)]
    process = subprocess.Popen(
        [sys.executable, "-m", "pytest", *flags, *left_out, *tests],
        cwd=scratch,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, ended on timeout
    )
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, _ = process.communicate()
        return None, out
    return process.returncode, out


def first_failure(output):
    """The first failing test's id from pytest's short summary."""
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" - ")[0]
    return ""


def run_mutant(mutant, scratch, env, timeout, deselect=()):
    start = time.perf_counter()
    if count_matches(scratch, mutant) != 1:
        n = count_matches(scratch, mutant)
        return Result(mutant, "invalid", 0.0, f"`find` occurs {n} times")
    tests = tests_for(scratch, mutant)
    missing = [t for t in tests if not (scratch / t).is_file()]
    if not tests or missing:
        return Result(mutant, "invalid", 0.0, f"no test files {missing}")
    path = scratch / mutant.file
    original = path.read_bytes()
    try:
        path.write_text(
            patched_text(original.decode("utf-8"), path.suffix, mutant),
            encoding="utf-8",
        )
        # one file at a time, in order, until one fails: pytest collects
        # (imports) every file it is given before running any test, and a
        # module's own test file, first in the list, usually fails alone
        for test in tests:
            status, output = run_pytest(
                scratch, [test], env, timeout, deselect=deselect
            )
            if status != 0:
                break
    finally:
        path.write_bytes(original)
    seconds = time.perf_counter() - start
    if status is None:
        return Result(mutant, "caught", seconds, f"timeout after {timeout} s")
    if status == 1:
        return Result(mutant, "caught", seconds, first_failure(output))
    if status == 0:
        return Result(mutant, "missed", seconds, " ".join(tests))
    tail = " | ".join(output.strip().splitlines()[-3:])
    return Result(mutant, "error", seconds, f"pytest exit {status}: {tail}")


def baseline(scratch, files, env, timeout):
    """Every test file the mutants use, run once unmodified, each in its own
    pytest process as the mutants run it. Returns (the node ids of failing
    tests, the lines that say why, the files that did not run at all)."""
    failed, why, broken = [], [], []
    for test in files:
        status, output = run_pytest(scratch, [test], env, timeout, False)
        if status == 0:
            continue
        lines = output.splitlines()
        ids = [
            line.split(" ", 1)[1].split(" - ")[0]
            for line in lines
            if line.startswith("FAILED ")
        ]
        if status != 1 or not ids:  # a collection error, a timeout, ...
            exit_status = "timeout" if status is None else f"exit {status}"
            broken.append(f"{test}: pytest {exit_status}")
            why += lines[-10:]
            continue
        failed += ids
        why += [line for line in lines if line.startswith("E ")][:12]
    return failed, why, broken


def select(mutants, only):
    if not only:
        return mutants
    chosen = [
        m
        for m in mutants
        if any(m.id == o or m.id.startswith(o) for o in only)
    ]
    if not chosen:
        raise SystemExit(f"no mutant id equals or starts with {only}")
    return chosen


def report(results, seconds, jobs):
    """Print caught and missed per file; return True if all were caught."""
    by_file = {}
    for r in results:
        by_file.setdefault(r.mutant.file, []).append(r)
    marks = {
        "caught": "caught ",
        "missed": "MISSED ",
        "invalid": "INVALID",
        "error": "ERROR  ",
    }
    for name in sorted(by_file):
        rows = by_file[name]
        caught = sum(r.status == "caught" for r in rows)
        print(f"\n{name}: {caught} of {len(rows)} caught")
        for r in rows:
            print(
                f"  {marks[r.status]} {r.mutant.id:<28} {r.seconds:6.1f} s  "
                f"{r.mutant.description}"
            )
            if r.detail:
                print(f"          {r.detail}")
    counts = {s: sum(r.status == s for r in results) for s in marks}
    ran = [r.seconds for r in results if r.status != "invalid"]
    per = sum(ran) / len(ran) if ran else 0.0
    print(
        f"\nTotal: {counts['caught']} of {len(results)} caught, "
        f"{counts['missed']} missed, {counts['invalid']} invalid, "
        f"{counts['error']} errors; {seconds:.0f} s with {jobs} job(s), "
        f"{per:.1f} s per mutant"
    )
    return counts["caught"] == len(results)


def list_mutants(mutants):
    for m in mutants:
        n = count_matches(ROOT, m)
        valid = "ok" if n == 1 else f"INVALID ({n} matches)"
        tests = ", ".join(Path(t).name for t in tests_for(ROOT, m))
        print(f"{m.id:<28} {m.file:<34} {valid}\n    {m.description}")
        print(f"    tests: {tests}")
    print(f"\n{len(mutants)} mutants")
    found = invalid(mutants)
    if found:
        print("\n".join(describe_invalid(found)))
    return not found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only",
        action="append",
        metavar="ID",
        help="run the mutants whose id equals or starts with ID (repeatable)",
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="mutants run at a time"
    )
    parser.add_argument(
        "--list", action="store_true", help="list the mutants, run none"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600,
        help="seconds one test run may take (default 600)",
    )
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the run of each test set without a mutant",
    )
    parser.add_argument(
        "--file", type=Path, default=MUTANTS, help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    mutants = select(load_mutants(args.file), args.only)
    if args.list:
        return 0 if list_mutants(mutants) else 1
    found = invalid(mutants)
    if found:  # stop before the baseline: minutes saved, no mutant judged
        print("\n".join(describe_invalid(found)))
        print("No mutant was run.")
        return 2

    start = time.perf_counter()
    env = environment(args.jobs)
    with tempfile.TemporaryDirectory(prefix="mutants-") as parent:
        scratches = queue.Queue()
        for _ in range(min(args.jobs, len(mutants))):
            scratches.put(make_scratch(Path(parent)))
        deselect = []
        if not args.no_baseline:
            files = sorted(
                {
                    test
                    for m in mutants
                    if count_matches(ROOT, m) == 1
                    for test in tests_for(ROOT, m)
                }
            )
            print(f"Baseline: {len(files)} test file(s) without a mutant ...")
            failed, why, broken = baseline(
                scratches.queue[0], files, env, args.timeout
            )
            for line in [*broken, *failed, *why]:
                print(f"  without a mutant: {line}")
            if broken:
                print("A test file does not run: no mutant can be judged.")
                return 2
            # a test failing without a mutant would make mutants look
            # caught: it is left out of every mutant's run, and named again
            # at the end
            deselect = failed
            print(f"  done ({time.perf_counter() - start:.0f} s)")

        lock = threading.Lock()

        def work(mutant):
            scratch = scratches.get()
            try:
                result = run_mutant(
                    mutant, scratch, env, args.timeout, deselect
                )
            finally:
                scratches.put(scratch)
            with lock:
                print(
                    f"  {result.status:<8} {mutant.id} "
                    f"({result.seconds:.1f} s)",
                    flush=True,
                )
            return result

        print(f"Mutants: {len(mutants)}, {args.jobs} at a time")
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            results = list(pool.map(work, mutants))
    all_caught = report(results, time.perf_counter() - start, args.jobs)
    for test in deselect:
        print(f"WARNING: fails without a mutant, left out: {test}")
    return 0 if all_caught else 1


if __name__ == "__main__":
    sys.exit(main())
