"""`make test-portable`: nbval (strict) over every notebook under CPU code paths
other than this machine's default, to prove that no compared output depends
on the instruction set, the BLAS kernel or the number of threads.

Variants:
- generic: PyTorch's generic kernels (ATEN_CPU_CAPABILITY=default), NumPy's
  OpenBLAS on a generic x86-64 core (OPENBLAS_CORETYPE=Prescott), NumPy's own
  SIMD loops switched off (NPY_DISABLE_CPU_FEATURES), MKL in its compatible
  mode (MKL_CBWR=COMPATIBLE), one thread;
- two-threads: this machine's default code paths with two threads.

Before each run, a probe started with the same environment prints what the
libraries report, and the run stops if a variable did not take effect (the
notebook kernels inherit the same environment). After each run, the time of
each notebook (wall clock, from pytest's JUnit report) and the CPU time of the
whole variant are printed.

Why the two-thread variant was slow (3.5 times the generic one's time,
277 s against 78 s, in issue 26): OpenMP threads that wait for work spin on
a core by default, and with 2 workers of 2 threads on 2 cores they spun on
the cores the working threads needed. Measured on a shared 2-core Xeon
(`make bench-suite`): with 2 workers the variant used 406 s of CPU against
the generic variant's 185 s; with 1 worker, 176 s. Chapter 8 alone (one
worker, two threads): 63.6 s wall and 40 s CPU with spinning threads, 22.6 s
and 14 s with OMP_WAIT_POLICY=PASSIVE (idle threads sleep), against 16.1 s
and 12 s with one thread; its cell that checks the tiled attention on many
small tensors took 44.7 s, 13.2 s and 9.1 s. So the variant sets
OMP_WAIT_POLICY=PASSIVE (where each thread waits, not what it computes),
and `--jobs N` gives it N // 2 workers (at least 1): workers times threads
never exceeds the cores.

Usage: python tools/check/test_portable.py [--jobs N] [--only VARIANT] [NOTEBOOK ...]
"""

import argparse
import collections
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parents[2]

THREADS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")

PROBE = r"""
import json
import numpy
import threadpoolctl
import torch
from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__

blas = [i for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]
print(json.dumps({
    "torch_capability": torch.backends.cpu.get_cpu_capability(),
    "torch_threads": torch.get_num_threads(),
    "torch_mkl": torch.backends.mkl.is_available(),
    "numpy_simd": [f for f in __cpu_dispatch__ if __cpu_features__.get(f)],
    "openblas": [(i.get("architecture"), i["num_threads"]) for i in blas],
}))
"""


def probe(env):
    """What torch, NumPy and OpenBLAS report in a process with `env`."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def by_duration(notebooks):
    """The longest notebooks first (tests/durations.json, as `make test`)."""
    path = ROOT / "tests" / "durations.json"
    known = json.loads(path.read_text("utf-8")) if path.is_file() else {}
    return sorted(notebooks, key=lambda nb: -known.get(Path(nb).name, 60.0))


def notebook_times(junit):
    """{notebook file name: seconds} summed over its cells."""
    times = collections.Counter()
    for case in ElementTree.parse(junit).iter("testcase"):
        name = case.get("classname", "").split(".")[-2:]
        times[".".join(name)] += float(case.get("time", 0))
    return times


def children_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def variants(default):
    """The environment changes of each variant, and what the probe must see."""
    generic = {
        "ATEN_CPU_CAPABILITY": "default",
        "OPENBLAS_CORETYPE": "Prescott",
        "MKL_CBWR": "COMPATIBLE",
        # NumPy refuses to disable a feature it does not dispatch to
        "NPY_DISABLE_CPU_FEATURES": " ".join(default["numpy_simd"]),
        **dict.fromkeys(THREADS, "1"),
    }
    if not generic["NPY_DISABLE_CPU_FEATURES"]:
        del generic["NPY_DISABLE_CPU_FEATURES"]

    def generic_ok(p):
        return (
            p["torch_capability"] == "DEFAULT"
            and p["torch_threads"] == 1
            and p["numpy_simd"] == []
            and all(
                arch in ("Prescott", "Katmai") and n == 1
                for arch, n in p["openblas"]
            )
        )

    def two_threads_ok(p):
        return (
            p["torch_capability"] == default["torch_capability"]
            and p["torch_threads"] == 2
            and all(n == 2 for _, n in p["openblas"])
        )

    # name: (environment changes, check of the probe, threads per worker)
    return {
        "generic": (generic, generic_ok, 1),
        # PASSIVE: an idle OpenMP thread sleeps instead of spinning (see the
        # docstring); the work each thread gets is the same
        "two-threads": (
            {**dict.fromkeys(THREADS, "2"), "OMP_WAIT_POLICY": "PASSIVE"},
            two_threads_ok,
            2,
        ),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--only", action="append", default=[])
    parser.add_argument("notebooks", nargs="*")
    args = parser.parse_args(argv)
    notebooks = by_duration(
        args.notebooks
        or [str(p.relative_to(ROOT)) for p in (ROOT / "book").glob("*.ipynb")]
    )
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in THREADS
        and k
        not in (
            "ATEN_CPU_CAPABILITY",
            "OPENBLAS_CORETYPE",
            "MKL_CBWR",
            "NPY_DISABLE_CPU_FEATURES",
            "OMP_WAIT_POLICY",
        )
    }
    default = probe(clean)
    print(f"this machine's default code paths: {json.dumps(default)}")
    unknown = set(args.only) - set(variants(default))
    if unknown:
        parser.error(f"no variant {', '.join(sorted(unknown))}")
    failed, times = [], {}
    for name, (changes, took_effect, threads) in variants(default).items():
        if args.only and name not in args.only:
            continue
        env = {**clean, **changes}
        seen = probe(env)
        print(
            f"\n=== variant {name}: {' '.join(f'{k}={v}' for k, v in changes.items())}"
        )
        print(f"    the libraries report: {json.dumps(seen)}", flush=True)
        if not took_effect(seen):
            print(f"    the variables of variant {name} did not take effect")
            failed.append(name)
            continue
        junit = Path(tempfile.mkdtemp()) / "nbval.xml"
        command = [sys.executable, "-m", "pytest", "-q", *notebooks]
        command += [f"--junitxml={junit}"]
        # workers x threads <= cores (see the docstring)
        jobs = max(1, args.jobs // threads)
        if jobs > 1:
            command += ["-n", str(jobs), "--dist", "loadscope"]
            command += ["--no-loadscope-reorder"]  # the longest first
        start, cpu = time.perf_counter(), children_cpu()
        result = subprocess.run(command, env=env, cwd=ROOT)
        times[name] = time.perf_counter() - start
        cpu = children_cpu() - cpu
        if junit.is_file():
            for nb, seconds in sorted(notebook_times(junit).items()):
                print(f"    {seconds:6.1f} s  {nb}")
        print(
            f"    variant {name}: nbval took {times[name]:.0f} s"
            f" ({jobs} worker{'s' if jobs > 1 else ''} of {threads}"
            f" thread{'s' if threads > 1 else ''}; CPU {cpu:.0f} s)",
            flush=True,
        )
        if result.returncode != 0:
            failed.append(name)
    print(
        "\ntest-portable: "
        + ", ".join(f"{name} {t:.0f} s" for name, t in times.items())
    )
    if failed:
        print(f"test-portable FAILED: {', '.join(failed)}")
        return 1
    print("test-portable: every stored output reproduced under every variant")
    return 0


if __name__ == "__main__":
    sys.exit(main())
