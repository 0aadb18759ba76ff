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
import queue
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mutant_plan import (  # re-exported: the tests import them from here
    MUTANTS,
    ROOT,
    Mutant,
    Result,
    count_matches,
    describe_invalid,
    invalid,
    load_mutants,
    module_tests,
    patched_text,
    select,
    tests_for,
)
from mutant_run import baseline, environment, make_scratch, run_mutant

__all__ = [
    "Mutant",
    "Result",
    "count_matches",
    "invalid",
    "load_mutants",
    "main",
    "module_tests",
    "patched_text",
    "run_mutant",
    "tests_for",
]


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


def parse_args(argv=None):
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
    return args


def left_out(mutants, scratch, env, timeout, start):
    """The baseline: every test file the mutants use, run without a
    mutant. Returns the tests that fail there (a test failing without a
    mutant would make mutants look caught: it is left out of every mutant's
    run, and named again at the end), or None if a file does not run."""
    files = sorted(
        {
            test
            for m in mutants
            if count_matches(ROOT, m) == 1
            for test in tests_for(ROOT, m)
        }
    )
    print(f"Baseline: {len(files)} test file(s) without a mutant ...")
    failed, why, broken = baseline(scratch, files, env, timeout)
    for line in [*broken, *failed, *why]:
        print(f"  without a mutant: {line}")
    if broken:
        print("A test file does not run: no mutant can be judged.")
        return None
    print(f"  done ({time.perf_counter() - start:.0f} s)")
    return failed


def run_all(mutants, scratches, env, args, deselect):
    """Each mutant's Result, `args.jobs` at a time, each job in a scratch
    copy of its own taken from the queue `scratches`."""
    lock = threading.Lock()

    def work(mutant):
        scratch = scratches.get()
        try:
            result = run_mutant(mutant, scratch, env, args.timeout, deselect)
        finally:
            scratches.put(scratch)
        with lock:
            print(
                f"  {result.status:<8} {mutant.id} ({result.seconds:.1f} s)",
                flush=True,
            )
        return result

    print(f"Mutants: {len(mutants)}, {args.jobs} at a time")
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        return list(pool.map(work, mutants))


def main(argv=None):
    args = parse_args(argv)
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
            first = scratches.queue[0]
            deselect = left_out(mutants, first, env, args.timeout, start)
            if deselect is None:
                return 2
        results = run_all(mutants, scratches, env, args, deselect)
    all_caught = report(results, time.perf_counter() - start, args.jobs)
    for test in deselect:
        print(f"WARNING: fails without a mutant, left out: {test}")
    return 0 if all_caught else 1


if __name__ == "__main__":
    sys.exit(main())
