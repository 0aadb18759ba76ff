"""The benchmarks' tables and command line (split from tools/measure.py):
`write_csv` replaces a table or, for an independent repeat (`make bench
RUN=k`), appends its rows with the run's id in a `run` column; `run_id`
reads that id; `quick_or_full` reads a benchmark's --quick and --csv."""

import os
from pathlib import Path


def write_csv(rows, path, run=None, float_format="%.6g"):
    """Write the rows (dicts) as the CSV table `path`, replacing it; with a
    run id (`make bench RUN=k`: an independent repeat), add the column
    `run` and append the rows to the table instead. Returns the table."""
    import pandas as pd  # imported here: the statistics need no pandas

    table = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    if run is not None:
        table["run"] = run
        if path.exists():
            table = pd.concat([pd.read_csv(path), table], ignore_index=True)
    table.to_csv(path, index=False, float_format=float_format)
    print(f"wrote {path}")
    return table


def quick_or_full(description, full, quick, argv=None):
    """The config of a benchmark's run from its command line: `full`, or
    with --quick the tiny `quick` (to prove the script runs); --csv PATH
    replaces its `csv` (a frozen dataclass's field)."""
    import argparse
    import dataclasses

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="tiny sizes")
    parser.add_argument("--csv", type=Path, help=f"the table ({full.csv})")
    args = parser.parse_args(argv)
    config = quick if args.quick else full
    return dataclasses.replace(config, csv=args.csv or config.csv)


def run_id():
    """The run id of an independent repeat: the environment's BENCH_RUN
    (`make bench RUN=k`), or None (the table is replaced)."""
    run = os.environ.get("BENCH_RUN", "").strip()
    return run or None
