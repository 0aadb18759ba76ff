"""Peak extra memory of one call, for tools/bench/bench_attention.py: each
(program, T) runs in a fresh process (Linux only: /proc/self/status and
/proc/self/clear_refs)."""

import json
import subprocess
import sys
from pathlib import Path

from bench_attention_programs import load_chapter, make_call

SCRIPT = Path(__file__).resolve().with_name("bench_attention.py")
ROOT = SCRIPT.parents[2]


def proc_status_kib(field):
    """A field of /proc/self/status, in KiB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child_measure(name, T, problem):
    """Run once in this fresh process; print the peak extra resident bytes."""
    chapter = load_chapter()
    make_call(chapter, name, 16, problem)()  # load code, warm up the libraries
    call = make_call(chapter, name, T, problem)  # inputs exist before baseline
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to now
    before = proc_status_kib("VmRSS")
    result = call()
    peak = proc_status_kib("VmHWM")
    del result
    print(json.dumps({"peak_extra_bytes": (peak - before) * 1024}))


def measure_memory(name, T, problem):
    """Peak extra resident bytes of program `name` at length T, measured by
    the script itself (--child) in a fresh process."""
    options = {
        "--d": problem.d,
        "--heads": problem.heads,
        "--batch": problem.batch,
        "--threads": problem.threads,
        "--block-q": problem.block_q,
        "--block-k": problem.block_k,
    }
    cmd = [sys.executable, str(SCRIPT), "--child", name, str(T)]
    cmd += [str(x) for item in options.items() for x in item]
    out = subprocess.run(
        cmd, capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_extra_bytes"]
