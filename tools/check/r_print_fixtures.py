"""Store what real R's print() shows for the cases of tools/check/r_print_cases.R
as tests/fixtures/r_print_cases.json, so that tests/test_r_print_fixtures.py
checks chapter 2's emulation of R's print format without R.

    python tools/check/r_print_fixtures.py           # run R, write the fixtures
    python tools/check/r_print_fixtures.py --check   # run R, compare, write nothing

Each stored case: its name, "vector" or "matrix", the number of rows, the
doubles as hexadecimal floats (float.hex; column by column for a matrix,
"NA" for R's NA), and R's printed text. Needs Rscript (Debian:
apt-get install r-base-core).
"""

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
R_SCRIPT = ROOT / "tools" / "check" / "r_print_cases.R"
FIXTURES = ROOT / "tests" / "fixtures" / "r_print_cases.json"


def run_r(rscript="Rscript"):
    """R's standard output for r_print_cases.R, and R's version line."""
    out = subprocess.run(
        [rscript, "--vanilla", str(R_SCRIPT)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    version = subprocess.run(
        [rscript, "--vanilla", "-e", "cat(R.version.string)"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout.strip()
    return out, version


def parse(output):
    """The cases in R's output (see the header of r_print_cases.R)."""
    cases, lines = [], iter(output.splitlines())
    for line in lines:
        if not line.startswith("@@case "):
            raise ValueError(f"expected '@@case', got {line!r}")
        name, kind, rows = line.split()[1:]
        values = next(lines).split()
        if values[0] != "@@values":
            raise ValueError(f"{name}: expected '@@values', got {values!r}")
        printed = []
        for text in lines:
            if text == "@@end":
                break
            printed.append(text)
        # sprintf("%a") and float.hex write the same exact double; store
        # Python's spelling (R omits nothing, but writes 0 as "0x0p+0")
        numbers = [
            v if v == "NA" else float.fromhex(v).hex() for v in values[1:]
        ]
        cases.append(
            {
                "name": name,
                "kind": kind,
                "rows": int(rows),
                "values": numbers,
                "printed": "\n".join(printed),
            }
        )
    return cases


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="compare R's output with the stored fixtures; write nothing",
    )
    args = parser.parse_args(argv)
    rscript = shutil.which("Rscript")
    if rscript is None:
        sys.exit("Rscript not found: apt-get install r-base-core")
    output, version = run_r(rscript)
    data = {
        "about": (
            "R's print() of the cases in tools/check/r_print_cases.R, stored by "
            "tools/check/r_print_fixtures.py; values are float.hex doubles "
            "(column by column for a matrix) or NA"
        ),
        "r_version": version,
        "cases": parse(output),
    }
    if args.check:
        stored = json.loads(FIXTURES.read_text(encoding="utf-8"))
        if stored["cases"] != data["cases"]:
            sys.exit(f"R ({version}) differs from {FIXTURES.name}")
        print(f"{len(data['cases'])} cases: R ({version}) agrees")
        return
    FIXTURES.parent.mkdir(exist_ok=True)
    FIXTURES.write_text(
        json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    print(f"{len(data['cases'])} cases from {version} -> {FIXTURES}")


if __name__ == "__main__":
    main()
