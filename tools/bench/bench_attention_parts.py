"""The three parts of tools/bench/bench_attention.py: main (every program at
every T), ablation and tiles (the fast program's variants at the largest T,
each call paired with one of the fused kernel). Each part gets its own
frozen settings (bench_attention_args.py) and the problem's."""

import measure
import pandas as pd
from bench_attention_memory import measure_memory
from bench_attention_output import plot, print_closing_ratios, write_csv
from bench_attention_programs import (
    PROGRAMS,
    ablation_variants,
    check_equal,
    check_variants,
    flops,
    make_call,
    sweep_variants,
)
from bench_attention_timing import matmul_ceiling, time_programs, time_variants

NAN = float("nan")


def time_columns(t):
    """Fastest, median (with its 95 % interval) and slowest call in ms."""
    ms = [x * 1e3 for x in t]
    return {
        "min_ms": min(ms),
        **measure.median_columns("median_ms", ms),
        "max_ms": max(ms),
    }


def ceiling_row(part, info):
    """The float32 matrix product's throughput, the figure's ceiling."""
    gflops, t, timing = matmul_ceiling(
        part.matmul_size, part.clock, part.max_repeats, part.max_seconds
    )
    print(f"fp32 matmul {part.matmul_size}: {gflops:.1f} GFLOP/s", flush=True)
    return measure.row(
        {},
        timing,
        info,
        implementation="matmul ceiling",
        T=part.matmul_size,
        **time_columns(t) | {"min_ms": NAN, "max_ms": NAN},
        gflop_per_s=gflops,
        repeats=len(t),
        peak_extra_mib=NAN,
    )


def rows_at(chapter, T, problem, part, info):
    """Every program at length T: checked, timed, its memory measured."""
    check_equal(chapter, T, problem)
    names = [
        n
        for n in PROGRAMS
        if not (n == "loop (NumPy)" and T > problem.loop_max)
    ]
    calls = {n: make_call(chapter, n, T, problem) for n in names}
    times, timing = time_programs(calls, part)
    del calls
    rows = []
    for name in names:
        t = times[name]
        columns = time_columns(t)
        median = columns["median_ms"] / 1e3
        peak = measure_memory(name, T, problem) if part.memory else NAN
        rows.append(
            measure.row(
                {},
                timing,
                info,
                implementation=name,
                T=T,
                **columns,
                gflop_per_s=flops(T, problem) / median / 1e9,
                repeats=len(t),
                peak_extra_mib=peak / 2**20,
            )
        )
        print(
            f"T = {T:5d}  {name:38s} {median * 1e3:10.2f} ms "
            f"(min {columns['min_ms']:.2f}) {rows[-1]['gflop_per_s']:7.1f} "
            f"GFLOP/s {peak / 2**20:9.1f} MiB  ({len(t)} calls)",
            flush=True,
        )
    return rows


def run_main(chapter, problem, part, info):
    """Every program at every T: the table and the figure of the chapter."""
    rows = [ceiling_row(part, info)]
    for T in part.sizes:
        rows += rows_at(chapter, T, problem, part, info)
    write_csv(rows, part.csv)
    df = pd.DataFrame(rows)  # this run's rows (RUN=k appends to the table)
    if part.plot:
        timed = df[df["implementation"] != "matmul ceiling"]
        plot(timed, rows[0]["gflop_per_s"], part.png)
    print_closing_ratios(df[df["T"] == max(part.sizes)], part.memory)


def run_variants(chapter, settings, info):
    """The ablation and the tile sweep, each part it is asked for."""
    parts = {
        "ablation": (
            settings.ablation,
            lambda part: ablation_variants(chapter),
        ),
        "tiles": (settings.tiles, sweep_variants),
    }
    for part, make in parts.values():
        if part is None:
            continue
        variants = make(part)
        # checked at the length they are timed at (the largest)
        check_variants(chapter, part.T, settings.problem, variants)
        rows = time_variants(
            chapter, settings.problem, part, variants, (False, True), info
        )
        write_csv(rows, part.csv)
