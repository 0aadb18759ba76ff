"""The three parts of tools/bench/bench_attention.py: main (every program at
every T), ablation and tiles (the fast program's variants at the largest T,
each call paired with one of the fused kernel)."""

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


def ceiling_row(args, info):
    """The float32 matrix product's throughput, the figure's ceiling."""
    gflops, median, repeats = matmul_ceiling(args)
    print(f"fp32 matmul {args.matmul_size}: {gflops:.1f} GFLOP/s", flush=True)
    return {
        "implementation": "matmul ceiling",
        "T": args.matmul_size,
        "min_ms": NAN,
        "median_ms": median * 1e3,
        "max_ms": NAN,
        "gflop_per_s": gflops,
        "repeats": repeats,
        "peak_extra_mib": NAN,
        **info,
    }


def rows_at(chapter, T, args, info):
    """Every program at length T: checked, timed, its memory measured."""
    check_equal(chapter, T, args)
    names = [
        n for n in PROGRAMS if not (n == "loop (NumPy)" and T > args.loop_max)
    ]
    calls = {n: make_call(chapter, n, T, args) for n in names}
    timings = time_programs(calls, args)
    del calls
    rows = []
    for name in names:
        fastest, median, slowest, repeats = timings[name]
        peak = NAN if args.no_memory else measure_memory(name, T, args)
        rows.append(
            {
                "implementation": name,
                "T": T,
                "min_ms": fastest * 1e3,
                "median_ms": median * 1e3,
                "max_ms": slowest * 1e3,
                "gflop_per_s": flops(T, args) / median / 1e9,
                "repeats": repeats,
                "peak_extra_mib": peak / 2**20,
                **info,
            }
        )
        print(
            f"T = {T:5d}  {name:38s} {median * 1e3:10.2f} ms "
            f"(min {fastest * 1e3:.2f}) {rows[-1]['gflop_per_s']:7.1f} "
            f"GFLOP/s {peak / 2**20:9.1f} MiB  ({repeats} calls)",
            flush=True,
        )
    return rows


def run_main(chapter, args, info):
    """Every program at every T: the table and the figure of the chapter."""
    rows = [ceiling_row(args, info)]
    for T in args.sizes:
        rows += rows_at(chapter, T, args, info)
    df = write_csv(rows, args.csv)
    if not args.no_plot:
        timed = df[df["implementation"] != "matmul ceiling"]
        plot(timed, rows[0]["gflop_per_s"], args.png)
    print_closing_ratios(df[df["T"] == max(args.sizes)], not args.no_memory)


def run_variants(chapter, args, info):
    """The ablation and the tile sweep, each part it is asked for."""
    parts = {
        "ablation": (ablation_variants(chapter), args.ablation_csv),
        "tiles": (sweep_variants(args), args.tiles_csv),
    }
    T = max(args.sizes)  # checked at the length they are timed at
    for part, (variants, path) in parts.items():
        if part in args.parts:
            check_variants(chapter, T, args, variants)
            rows = time_variants(
                chapter, T, args, variants, (False, True), info
            )
            write_csv(rows, path)
