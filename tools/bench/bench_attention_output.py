"""What tools/bench/bench_attention.py writes: the machine's description in every
row (tools/measure.py's), the CSV tables, the figure, and the closing ratios
it prints."""

import measure
import measure_csv
import numpy as np
from bench_attention_programs import NAIVE, PROGRAMS, SDPA


def machine_columns(problem, clock, chapter=None):
    """The columns every row carries: the machine and the date
    (tools/measure.py's record), numpy's version, the clock, the problem,
    and the tiles and levers the chapter's fast program runs with
    (FAST_TILE, LEVERS; block_q and block_k are the simple program's)."""
    fast = {}
    if chapter is not None:
        fast = {
            "fast_tile": str(chapter.FAST_TILE),
            "fast_levers": str(chapter.LEVERS),
        }
    return (
        measure.machine(problem.threads)
        | fast
        | {
            "numpy": np.__version__,
            "clock": clock,
            "d": problem.d,
            "heads": problem.heads,
            "batch": problem.batch,
            "block_q": problem.block_q,
            "block_k": problem.block_k,
        }
    )


def write_csv(rows, path):
    """The rows as a CSV table (6 significant digits); with a run id
    (`make bench RUN=k`) appended to the table (tools/measure_csv.py)."""
    return measure_csv.write_csv(rows, path, run=measure_csv.run_id())


def plot_programs(df, ax_speed, ax_mem):
    """One line per program: throughput (left), peak memory (right);
    causal variants dashed, in the colour of their program."""
    colours = {}
    for name in PROGRAMS:
        rows = df[df["implementation"] == name]
        causal = PROGRAMS[name][2]
        style = {
            "marker": "o",
            "label": name,
            "color": colours.get(name.removesuffix(", causal")),
            "linestyle": "--" if causal else "-",
            "markerfacecolor": "white" if causal else None,
        }
        (line,) = ax_speed.plot(rows["T"], rows["gflop_per_s"], **style)
        colours.setdefault(name, line.get_color())
        if rows["peak_extra_mib"].notna().any():
            ax_mem.plot(rows["T"], rows["peak_extra_mib"], **style)


def label_axes(df, ceiling, ax_speed, ax_mem):
    """The ceiling line, the axes' scales, ticks, labels and titles."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax_speed.axhline(
        ceiling, color="black", linestyle=":", label="fp32 matmul ceiling"
    )
    ax_speed.set_ylabel("GFLOP/s (counted as 4 T² d_k per head)")
    ax_speed.set_ylim(bottom=0)
    ax_speed.set_title("Speed")
    ax_mem.set_yscale("log")
    ax_mem.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax_mem.yaxis.set_minor_formatter(NullFormatter())
    ax_mem.set_ylabel("peak extra memory (MiB)")
    ax_mem.set_title("Memory")
    sizes = sorted(df["T"].unique())
    for ax in (ax_speed, ax_mem):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, labels=[str(t) for t in sizes])
        ax.set_xlabel("sequence length T")
        ax.grid(alpha=0.3)


def plot(df, ceiling, path):
    """The chapter's figure: throughput and peak memory against T."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_speed, ax_mem) = plt.subplots(1, 2, figsize=(11, 5))
    plot_programs(df, ax_speed, ax_mem)
    label_axes(df, ceiling, ax_speed, ax_mem)
    fig.legend(
        *ax_speed.get_legend_handles_labels(),
        loc="lower center",
        ncol=3,
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def plot_from_csv(csv, png):
    """The figure again from a stored table, without timing anything."""
    import pandas as pd

    df = pd.read_csv(csv)
    ceiling = df.loc[df["implementation"] == "matmul ceiling", "gflop_per_s"]
    plot(df[df["implementation"] != "matmul ceiling"], ceiling.iloc[0], png)


def print_closing_ratios(df, with_memory):
    """At the largest T: each tiled version's throughput against the fused
    kernel's, as the ratio of median times with the bounds the two 95 %
    intervals allow and their verdict, and the fast version's peak extra
    memory against the naive program's (single readings, no interval)."""
    T = df["T"].max()
    last = df[df["T"] == T].set_index("implementation")
    for name in ("tiled (ours)", "fast tiled (ours)"):
        for suffix in ("", ", causal"):
            sdpa, ours = last.loc[SDPA + suffix], last.loc[name + suffix]
            median = sdpa["median_ms"] / ours["median_ms"]
            low = sdpa["median_ms_lo"] / ours["median_ms_hi"]
            high = sdpa["median_ms_hi"] / ours["median_ms_lo"]
            verdict = (
                "no interval"
                if np.isnan(low) or np.isnan(high)
                else measure.verdict(low, high)
            )
            print(
                f"T = {T}: {name + suffix} / SDPA throughput {median:.2f} "
                f"by median times, bounds [{low:.2f}, {high:.2f}]: {verdict}"
            )
    if with_memory:
        memory = (
            last.loc["fast tiled (ours)", "peak_extra_mib"]
            / last.loc[NAIVE, "peak_extra_mib"]
        )
        print(
            f"T = {T}: fast tiled / naive peak extra memory {memory:.4f} "
            f"(single readings, not a comparison)"
        )
