"""Running planted bugs (`make mutants`): a scratch copy of the book per job,
pytest on the test files a mutant names, one file at a time until one fails,
and a baseline run of every test file without a mutant (the rules are in
tools/check/mutants.py's docstring)."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mutant_plan import ROOT, Result, count_matches, patched_text, tests_for

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
