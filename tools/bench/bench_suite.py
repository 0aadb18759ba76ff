"""`make bench-suite`: how long each stage of the test suite takes.

Not a test: nothing here asserts a time. It runs the commands of `make test`
one by one, as `make -n test` lists them (so it follows the Makefile), then
each variant of `make test-portable`, and prints for every stage its wall
time and its CPU time (user + system, of every process it started), then
the time of each notebook under nbval and of each test file (from pytest's
JUnit report), longest first. On a shared machine wall times vary with the
load; CPU times much less.

Options:
  --install DIR        first time a fresh install: a new venv in DIR (which
                       must not exist) and `pip install -r requirements.txt`
  --no-portable        leave out make test-portable's variants
  --jobs N             pytest-xdist workers (default: the Makefile's JOBS)
  --json FILE          also save the figures, to compare runs
  --compare FILE       print the figures of FILE (an earlier --json) beside
  --write-durations    store the seconds per notebook and test file in
                       tests/durations.json (the order in which `make test`
                       starts them: the longest first)
  --root DIR           benchmark another checkout of the book (for example
                       an older commit), with this checkout's .venv

Usage: python tools/bench/bench_suite.py [options]
"""

import argparse
import collections
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from xml.etree import ElementTree

HERE = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(HERE / "tools"))  # the shared modules
import measure  # noqa: E402


def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(command, cwd, env=None, quiet=True):
    """Run a shell command, timed by tools/measure.py (one call; the CPU
    clock: every process it started); return (wall s, CPU s, return code,
    output)."""

    def call():
        return subprocess.run(
            command,
            shell=True,
            cwd=cwd,
            env=env,
            executable="/bin/bash",
            capture_output=quiet,
            text=True,
        )

    timing = measure.interleave(
        {command: call},
        1,
        warmup=0,
        cpu_clock=cpu_seconds,
        keep_results=True,
    )
    result = timing.results[command]
    output = (result.stdout or "") + (result.stderr or "") if quiet else ""
    return (
        timing.wall[command][0],
        timing.cpu[command][0],
        result.returncode,
        output,
    )


def make_commands(root, target, *variables):
    """The shell commands `make TARGET` would run, one string each."""
    text = subprocess.run(
        ["make", "-n", "--no-print-directory", target, *variables],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    text = re.sub(r"\\\n\s*", " ", text)
    return [
        line.strip()
        for line in text.splitlines()
        if line.strip()
        and "pip install" not in line
        and " -m venv " not in line
    ]


def stage_of(command):
    if " -m pytest" in command:
        return "pytest (nbval + tests/)"
    for tool in ("build_site", "stage_downloads"):
        if f"tools/{tool}.py" in command:
            return {
                "build_site": "site build",
                "stage_downloads": "unpack zips",
            }[tool]
    if re.search(r"ruff|spellcheck|check-jsonschema", command):
        return "lint"
    return command.split()[0]


def scope(classname):
    """A JUnit class name as a notebook file name or a test file path."""
    parts = classname.split(".")
    if classname.endswith(".ipynb"):
        return ".".join(parts[-2:])
    return "/".join(parts[:2]) + ".py"


def junit_times(path):
    times = collections.Counter()
    for case in ElementTree.parse(path).iter("testcase"):
        times[scope(case.get("classname", ""))] += float(case.get("time", 0))
    return dict(times)


def install(root, folder):
    folder = Path(folder)
    if folder.exists():
        sys.exit(f"bench_suite: {folder} exists; --install needs a new folder")
    python = shutil.which("python3.11") or sys.executable
    command = (
        f"{python} -m venv {folder} && {folder}/bin/python -m pip install -q "
        f"-r requirements.txt"
    )
    return timed(command, root)


def run(args):
    root = Path(args.root).resolve() if args.root else HERE
    results = {
        "machine": machine_line(args.jobs or default_jobs()),
        "stages": {},
        "scopes": {},
    }
    stages = results["stages"]

    def record(name, wall, cpu, code):
        before = stages.get(name, {"wall": 0.0, "cpu": 0.0, "ok": True})
        stages[name] = {
            "wall": before["wall"] + wall,
            "cpu": before["cpu"] + cpu,
            "ok": before["ok"] and code == 0,
        }
        print(
            f"bench_suite: {name}: {wall:.1f} s wall, {cpu:.1f} s CPU"
            + ("" if code == 0 else f" (exit status {code})"),
            flush=True,
        )

    if args.install:
        wall, cpu, code, out = install(root, args.install)
        record("install (fresh venv)", wall, cpu, code)
        if code:
            print(out[-3000:])

    venv = HERE / ".venv"
    if root != HERE and not (root / ".venv").exists():
        (root / ".venv").symlink_to(venv.resolve())
    jobs = [f"JOBS={args.jobs}"] if args.jobs else []
    junit = Path(tempfile.mkdtemp()) / "pytest.xml"
    for command in make_commands(root, "test", *jobs):
        if " -m pytest" in command:
            command += f" --junitxml={junit} -q -p no:cacheprovider"
        wall, cpu, code, out = timed(command, root)
        record(stage_of(command), wall, cpu, code)
        if code:
            print(out[-3000:])
        elif " -m pytest" in command:
            print("    " + out.strip().splitlines()[-1])
    if junit.is_file():
        results["scopes"]["pytest"] = junit_times(junit)

    if not args.no_portable:
        python = venv / "bin" / "python"
        n = args.jobs or default_jobs()
        for variant in ("generic", "two-threads"):
            command = (
                f"{python} tools/check/test_portable.py"
                f" --jobs {n} --only {variant}"
            )
            wall, cpu, code, out = timed(command, root)
            record(f"test-portable {variant}", wall, cpu, code)
            times = re.findall(r"^\s+([\d.]+) s  (\S+\.ipynb)$", out, re.M)
            if times:
                results["scopes"][variant] = {nb: float(t) for t, nb in times}
            if code:
                print(out[-3000:])
    return results


def default_jobs():
    n = os.cpu_count() or 1
    return min(n, 4)


def machine_line(threads):
    """The machine (tools/measure.py's record) and its load now."""
    m = measure.machine(threads)
    return f"{m['machine']}, torch {m['torch']}, load {measure.load_average():.1f}"


def table(results, earlier=None):
    def cell(d, key):
        return f"{d[key]:8.1f}" if d else f"{'':8}"

    head = f"{'stage':34} {'wall s':>8} {'CPU s':>8}"
    if earlier:
        head += f" | {'before':>8} {'CPU':>8}"
        print(f"before: {earlier['machine']}")
    print(f"now:    {results['machine']}\n\n{head}")
    names = list(results["stages"])
    if earlier:
        names += [n for n in earlier["stages"] if n not in names]
    total = collections.Counter()
    for name in names:
        now = results["stages"].get(name)
        line = f"{name:34} {cell(now, 'wall')} {cell(now, 'cpu')}"
        if earlier:
            old = earlier["stages"].get(name)
            line += f" | {cell(old, 'wall')} {cell(old, 'cpu')}"
        print(line)
    for which, res in (("now", results), ("before", earlier)):
        if res:
            total[which] = sum(
                s["wall"]
                for n, s in res["stages"].items()
                if "install" not in n
            )
    print(
        f"{'total without the install':34} {total['now']:8.1f}"
        + (f" {'':8} | {total['before']:8.1f}" if earlier else "")
    )
    for part in ("pytest", "generic", "two-threads"):
        now = results["scopes"].get(part, {})
        old = (earlier or {}).get("scopes", {}).get(part, {})
        if not now and not old:
            continue
        title = {
            "pytest": "make test's pytest, seconds per notebook and test file"
        }
        print(
            f"\n{title.get(part, f'test-portable {part}, seconds per notebook')}"
        )
        keys = sorted(
            set(now) | set(old), key=lambda k: -now.get(k, old.get(k))
        )
        for key in keys:
            line = (
                f"{key:44} {now[key]:8.1f}"
                if key in now
                else f"{key:44} {'':8}"
            )
            if earlier:
                line += f" | {old[key]:8.1f}" if key in old else " |"
            print(line)
        print(
            f"{'sum (both workers)':44} {sum(now.values()):8.1f}"
            + (f" | {sum(old.values()):8.1f}" if earlier else "")
        )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--install", metavar="DIR")
    parser.add_argument("--no-portable", action="store_true")
    parser.add_argument("--jobs", type=int)
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--compare", metavar="FILE")
    parser.add_argument("--write-durations", action="store_true")
    parser.add_argument("--root", metavar="DIR")
    args = parser.parse_args(argv)
    earlier = None
    if args.compare:
        earlier = json.loads(Path(args.compare).read_text(encoding="utf-8"))
    results = run(args)
    print()
    table(results, earlier)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1), "utf-8")
    if args.write_durations and results["scopes"].get("pytest"):
        durations = {
            k: round(v, 1)
            for k, v in sorted(
                results["scopes"]["pytest"].items(), key=lambda kv: -kv[1]
            )
        }
        path = HERE / "tests" / "durations.json"
        path.write_text(json.dumps(durations, indent=1) + "\n", "utf-8")
        print(f"\nbench_suite: wrote {path.relative_to(HERE)}")
    return 0 if all(s["ok"] for s in results["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
