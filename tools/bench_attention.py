"""Benchmark the attention programs of chapter 8 (book/08_efficient_attention.ipynb).

Three parts (--parts), all with one sequence, 8 heads, d = 64, float32:
- main: every program at several sequence lengths, its time (fastest,
  median and slowest call), throughput and peak extra memory (in a fresh
  process), and the float32 matrix-multiply throughput as the ceiling;
  writes book/data/bench_attention.csv and book/images/bench_attention.png;
- ablation: at the largest length, the fast tiled program with each of its
  changes toggled, each call paired with a call of the fused kernel;
  writes book/data/bench_ablation.csv;
- tiles: the same pairing for a sweep of the fast program's tile sizes;
  writes book/data/bench_tiles.csv.

The programs are imported from the notebook itself (tools/chapter_loader.py),
so the benchmark measures exactly the code the book prints. Every program is
checked against the hand-written PyTorch version before it is timed.

Usage (from the repository's top folder, with the book's virtual environment):
    python tools/bench_attention.py                 # the chapter's benchmark
    python tools/bench_attention.py --threads 2 --sizes 4096 --parts main \
        --no-memory --no-plot --csv book/data/bench_attention_2threads.csv
    python tools/bench_attention.py --sizes 64 128 --max-seconds 0.2   # a quick try
On a busy machine, --clock cpu (one thread) times with the thread's processor
time. Peak memory uses Linux's /proc (VmHWM, clear_refs); elsewhere use
--no-memory.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import chapter_loader
import numpy as np
import torch
from threadpoolctl import threadpool_limits

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "book" / "08_efficient_attention.ipynb"

# name in the CSV -> (function in the notebook, library of its inputs, causal)
PROGRAMS = {
    "loop (NumPy)": ("attention_loop", "numpy", False),
    "NumPy": ("attention_numpy", "numpy", False),
    "PyTorch by hand": ("attention_torch", "torch", False),
    "F.scaled_dot_product_attention": ("attention_sdpa", "torch", False),
    "tiled (ours)": ("tiled_attention", "torch", False),
    "F.scaled_dot_product_attention, causal": (
        "attention_sdpa",
        "torch",
        True,
    ),
    "tiled (ours), causal": ("tiled_attention", "torch", True),
    "fast tiled (ours)": ("fast_attention", "torch", False),
    "fast tiled (ours), causal": ("fast_attention", "torch", True),
}
# the ablation at one T: the fast program as the chapter sets it (LEVERS),
# with each of its four changes toggled in turn, and with the simple
# program's tiles, beside the simple program and the fused kernel
LEVER_NAMES = {
    "base2": "base-2 exponentials",
    "inside": "the shift inside the product",
    "ones": "the sums from a ones column",
    "lazy": "the lazy reference",
}


def ablation_variants(chapter):
    """name -> (function, keywords) of every program of the ablation."""
    variants = {
        "F.scaled_dot_product_attention": ("attention_sdpa", {}),
        "tiled (simple)": ("tiled_attention", {}),
        "fast, as set": ("fast_attention", {}),
    }
    for lever, on in chapter.LEVERS.items():
        name = f"fast, {'without' if on else 'with'} {LEVER_NAMES[lever]}"
        variants[name] = ("fast_attention", {"levers": {lever: not on}})
    variants["fast, the simple version's tiles"] = (
        "fast_attention",
        {"block_q": 128, "block_k": 512},
    )
    return variants


PARTS = ("main", "ablation", "tiles")
NAIVE = "PyTorch by hand"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[256, 512, 1024, 2048, 4096],
        help="sequence lengths T",
    )
    parser.add_argument("--d", type=int, default=64, help="head size")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="threads for PyTorch and for NumPy's BLAS",
    )
    parser.add_argument(
        "--loop-max",
        type=int,
        default=1024,
        help="largest T for the per-query Python loop",
    )
    parser.add_argument("--block-q", type=int, default=128)
    parser.add_argument("--block-k", type=int, default=512)
    parser.add_argument("--min-repeats", type=int, default=3)
    parser.add_argument("--max-repeats", type=int, default=15)
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=3.0,
        help="stop repeating a program at one T after this long "
        "(once it has --min-repeats calls)",
    )
    parser.add_argument(
        "--pairs",
        type=int,
        default=15,
        help="ablation and tile sweep: pairs of calls (the fused kernel, "
        "then the variant) per variant",
    )
    parser.add_argument("--matmul-size", type=int, default=2048)
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=PARTS,
        default=list(PARTS),
        help="main: every program at every T; ablation: the fast program's "
        "changes at the largest T; tiles: its tile sizes at the largest T",
    )
    parser.add_argument(
        "--sweep-q", type=int, nargs="+", default=[64, 128, 256, 512]
    )
    parser.add_argument(
        "--sweep-k", type=int, nargs="+", default=[256, 512, 1024, 2048]
    )
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: elapsed time; cpu: the calling thread's processor time, "
        "which other programs on a busy machine disturb less (one thread "
        "only)",
    )
    parser.add_argument(
        "--no-memory",
        action="store_true",
        help="skip the peak-memory measurement",
    )
    parser.add_argument(
        "--csv",
        type=Path,
        default=ROOT / "book" / "data" / "bench_attention.csv",
    )
    parser.add_argument(
        "--ablation-csv",
        type=Path,
        default=ROOT / "book" / "data" / "bench_ablation.csv",
    )
    parser.add_argument(
        "--tiles-csv",
        type=Path,
        default=ROOT / "book" / "data" / "bench_tiles.csv",
    )
    parser.add_argument(
        "--png",
        type=Path,
        default=ROOT / "book" / "images" / "bench_attention.png",
    )
    parser.add_argument(
        "--child", nargs=2, metavar=("PROGRAM", "T"), help=argparse.SUPPRESS
    )  # internal: one memory measurement
    args = parser.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu measures one thread: use --threads 1")
    return args


def clock(args):
    """The function that reads the clock chosen by --clock."""
    return time.thread_time if args.clock == "cpu" else time.perf_counter


def set_threads(n):
    """Use n threads in PyTorch and in NumPy's BLAS (now, and in children)."""
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(n)  # inherited by the memory-measuring children
    threadpool_limits(n)
    torch.set_num_threads(n)


def load_chapter():
    return chapter_loader.load_chapter(NOTEBOOK.name)


def make_inputs(T, args, seed=0):
    """float32 q, k, v of shape (batch, heads, T, d), as NumPy and as torch."""
    rng = np.random.default_rng(seed)
    arrays = [
        rng.standard_normal(
            (args.batch, args.heads, T, args.d), dtype=np.float32
        )
        for _ in range(3)
    ]
    return arrays, [torch.from_numpy(a) for a in arrays]


def make_call(chapter, name, T, args):
    """A zero-argument function that runs program `name` at length T."""
    fn_name, lib, causal = PROGRAMS[name]
    fn = getattr(chapter, fn_name)
    arrays, tensors = make_inputs(T, args)
    inputs = arrays if lib == "numpy" else tensors
    kwargs = (
        {"block_q": args.block_q, "block_k": args.block_k}
        if fn_name == "tiled_attention"
        else {}
    )  # the fast program uses its own tiles (FAST_TILE)
    return lambda: fn(*inputs, causal=causal, **kwargs)


def make_variant(chapter, fn_name, kwargs, causal, tensors):
    """A zero-argument call of chapter.fn_name(q, k, v, causal, **kwargs)."""
    fn = getattr(chapter, fn_name)
    return lambda: fn(*tensors, causal=causal, **kwargs)


def flops(T, args):
    """4 T^2 d per head: the same count for every program."""
    return 4 * T**2 * args.d * args.heads * args.batch


# --- peak extra memory, one fresh process per (program, T) -----------------


def proc_status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child_measure(name, T, args):
    """Run once in this fresh process; print the peak extra resident bytes."""
    chapter = load_chapter()
    make_call(chapter, name, 16, args)()  # load code, warm up the libraries
    call = make_call(
        chapter, name, T, args
    )  # inputs exist before the baseline
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to now
    before = proc_status_kib("VmRSS")
    result = call()
    peak = proc_status_kib("VmHWM")
    del result
    print(json.dumps({"peak_extra_bytes": (peak - before) * 1024}))


def measure_memory(name, T, args):
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        name,
        str(T),
        "--d",
        str(args.d),
        "--heads",
        str(args.heads),
        "--batch",
        str(args.batch),
        "--threads",
        str(args.threads),
        "--block-q",
        str(args.block_q),
        "--block-k",
        str(args.block_k),
    ]
    out = subprocess.run(
        cmd, capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_extra_bytes"]


# --- time ---------------------------------------------------------------------


def time_programs(calls, args):
    """(min, median, max) seconds per call and the number of calls; the
    programs are called in turn (round robin), so that a busy machine slows
    all of them alike."""
    for call in calls.values():
        call()  # warm-up
    times = {name: [] for name in calls}
    active, now = list(calls), clock(args)
    while active:
        for name in list(active):
            start = now()
            calls[name]()
            times[name].append(now() - start)
            n, spent = len(times[name]), sum(times[name])
            if n >= args.max_repeats or (
                n >= args.min_repeats and spent >= args.max_seconds
            ):
                active.remove(name)
    return {
        name: (min(t), statistics.median(t), max(t), len(t))
        for name, t in times.items()
    }


def matmul_ceiling(args):
    """float32 GFLOP/s of an n x n matrix product (median of several)."""
    n = args.matmul_size
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    calls = {"matmul": lambda: a @ b}
    _, median, _, repeats = time_programs(calls, args)["matmul"]
    return 2 * n**3 / median / 1e9, median, repeats


def check_equal(chapter, T, args):
    """Every program gives the naive program's output (float32, atol 1e-4)."""
    _, tensors = make_inputs(T, args)
    references = {
        causal: chapter.attention_torch(*tensors, causal=causal).numpy()
        for causal in (False, True)
    }
    for name in PROGRAMS:
        if name == "loop (NumPy)" and T > args.loop_max:
            continue
        reference = references[PROGRAMS[name][2]]
        out = make_call(chapter, name, T, args)()
        out = out.numpy() if isinstance(out, torch.Tensor) else out
        err = float(np.abs(out - reference).max())
        if not err <= 1e-4:
            raise RuntimeError(
                f"{name} differs from {NAIVE} at T = {T}: {err:.2e}"
            )


def check_variants(chapter, T, args, variants):
    """Every variant (name -> (function, keywords)) gives the naive
    program's output, causal and not (float32, atol 1e-4)."""
    _, tensors = make_inputs(T, args)
    for causal in (False, True):
        reference = chapter.attention_torch(*tensors, causal=causal)
        for name, (fn_name, kwargs) in variants.items():
            out = make_variant(chapter, fn_name, kwargs, causal, tensors)()
            err = float((out - reference).abs().max())
            if not err <= 1e-4:
                raise RuntimeError(
                    f"{name} (causal={causal}) differs from {NAIVE} at "
                    f"T = {T}: {err:.2e}"
                )


def sweep_variants(args):
    """The fast program at every tile size of the sweep."""
    return {
        f"{bq} x {bk}": ("fast_attention", {"block_q": bq, "block_k": bk})
        for bq in args.sweep_q
        for bk in args.sweep_k
    }


def time_variants(chapter, T, args, variants, causals, info):
    """Rows of a table: every variant timed at length T, each call right
    after a call of the fused kernel, so that both see the same machine; the
    ratio of the two times is taken per pair, its median and spread kept."""
    _, tensors = make_inputs(T, args)
    sdpa_name = "F.scaled_dot_product_attention"
    variants = {n: v for n, v in variants.items() if n != sdpa_name}
    rows = []
    for causal in causals:
        sdpa = make_variant(chapter, "attention_sdpa", {}, causal, tensors)
        calls = {
            n: make_variant(chapter, f, kw, causal, tensors)
            for n, (f, kw) in variants.items()
        }
        times = {n: [] for n in calls}
        times_sdpa, now = {n: [] for n in calls}, clock(args)
        for call in (sdpa, *calls.values()):
            call()  # warm-up
        for _ in range(args.pairs):
            for name, call in calls.items():
                for record, f in ((times_sdpa, sdpa), (times, call)):
                    start = now()
                    f()
                    record[name].append(now() - start)
        all_sdpa = [t for ts in times_sdpa.values() for t in ts]
        times = {sdpa_name: all_sdpa} | times
        times_sdpa = {sdpa_name: all_sdpa} | times_sdpa
        for name, t in times.items():
            ratios = [a / b for a, b in zip(times_sdpa[name], t)]
            kwargs = variants.get(name, ("", {}))[1]
            rows.append(
                {
                    "variant": name,
                    "tile_q": kwargs.get("block_q"),
                    "tile_k": kwargs.get("block_k"),
                    "causal": causal,
                    "T": T,
                    "min_ms": min(t) * 1e3,
                    "median_ms": statistics.median(t) * 1e3,
                    "max_ms": max(t) * 1e3,
                    "ratio_of_mins": min(times_sdpa[name]) / min(t),
                    "ratio_median": statistics.median(ratios),
                    "ratio_min": min(ratios),
                    "ratio_max": max(ratios),
                    "repeats": len(t),
                    **info,
                }
            )
            print(
                f"T = {T} causal={causal!s:5} {name:34s} "
                f"min {min(t) * 1e3:8.1f} ms, median "
                f"{statistics.median(t) * 1e3:8.1f} ms; SDPA / this: "
                f"{statistics.median(ratios):.3f} "
                f"({min(ratios):.3f} .. {max(ratios):.3f}), of mins "
                f"{rows[-1]['ratio_of_mins']:.3f}",
                flush=True,
            )
    return rows


def plot(df, ceiling, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig, (ax_speed, ax_mem) = plt.subplots(1, 2, figsize=(11, 5))
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
    ax_speed.axhline(
        ceiling, color="black", linestyle=":", label="fp32 matmul ceiling"
    )
    ax_speed.set_ylabel("GFLOP/s (counted as 4 T² d per head)")
    ax_speed.set_ylim(bottom=0)
    ax_speed.set_title("Speed")
    ax_mem.set_yscale("log")
    ax_mem.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax_mem.yaxis.set_minor_formatter(NullFormatter())
    ax_mem.set_ylabel("peak extra memory (MiB)")
    ax_mem.set_title("Memory")
    for ax in (ax_speed, ax_mem):
        ax.set_xscale("log", base=2)
        ax.set_xticks(
            sorted(df["T"].unique()),
            labels=[str(t) for t in sorted(df["T"].unique())],
        )
        ax.set_xlabel("sequence length T")
        ax.grid(alpha=0.3)
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


def machine_info(args):
    info = {
        "machine": f"{platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores",
        "torch": torch.__version__,
        "numpy": np.__version__,
        "threads": args.threads,
        "clock": args.clock,
        "date": datetime.date.today().isoformat(),
        "d": args.d,
        "heads": args.heads,
        "batch": args.batch,
        "block_q": args.block_q,
        "block_k": args.block_k,
    }
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                line.split(":", 1)[1].strip()
                for line in f
                if line.startswith("model name")
            )
        info["machine"] = f"{model}, {os.cpu_count()} cores"
    except (OSError, StopIteration):
        pass
    return info


def run_main(chapter, args, info):
    """Every program at every T: the table and the figure of the chapter."""
    import pandas as pd

    gflops, median, repeats = matmul_ceiling(args)
    rows = [
        {
            "implementation": "matmul ceiling",
            "T": args.matmul_size,
            "min_ms": float("nan"),
            "median_ms": median * 1e3,
            "max_ms": float("nan"),
            "gflop_per_s": gflops,
            "repeats": repeats,
            "peak_extra_mib": float("nan"),
            **info,
        }
    ]
    print(f"fp32 matmul {args.matmul_size}: {gflops:.1f} GFLOP/s", flush=True)

    for T in args.sizes:
        check_equal(chapter, T, args)
        names = [
            n
            for n in PROGRAMS
            if not (n == "loop (NumPy)" and T > args.loop_max)
        ]
        calls = {n: make_call(chapter, n, T, args) for n in names}
        timings = time_programs(calls, args)
        del calls
        for name in names:
            fastest, median, slowest, repeats = timings[name]
            peak = (
                float("nan")
                if args.no_memory
                else measure_memory(name, T, args) / 2**20
            )
            rows.append(
                {
                    "implementation": name,
                    "T": T,
                    "min_ms": fastest * 1e3,
                    "median_ms": median * 1e3,
                    "max_ms": slowest * 1e3,
                    "gflop_per_s": flops(T, args) / median / 1e9,
                    "repeats": repeats,
                    "peak_extra_mib": peak,
                    **info,
                }
            )
            print(
                f"T = {T:5d}  {name:38s} {median * 1e3:10.2f} ms "
                f"(min {fastest * 1e3:.2f}) "
                f"{rows[-1]['gflop_per_s']:7.1f} GFLOP/s "
                f"{peak:9.1f} MiB  ({repeats} calls)",
                flush=True,
            )

    df = pd.DataFrame(rows)
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.csv, index=False, float_format="%.6g")
    print(f"wrote {args.csv}")
    if not args.no_plot:
        plot(df[df["implementation"] != "matmul ceiling"], gflops, args.png)
        print(f"wrote {args.png}")

    T = max(args.sizes)
    last = df[df["T"] == T].set_index("implementation")
    for name in ("tiled (ours)", "fast tiled (ours)"):
        for suffix, sdpa in (
            ("", "F.scaled_dot_product_attention"),
            (", causal", "F.scaled_dot_product_attention, causal"),
        ):
            median, fastest = (
                last.loc[sdpa, col] / last.loc[name + suffix, col]
                for col in ("median_ms", "min_ms")
            )
            print(
                f"T = {T}: {name + suffix} / SDPA throughput {median:.2f} "
                f"by median times, {fastest:.2f} by fastest calls"
            )
    if not args.no_memory:
        memory = (
            last.loc["fast tiled (ours)", "peak_extra_mib"]
            / last.loc[NAIVE, "peak_extra_mib"]
        )
        print(f"T = {T}: fast tiled / naive peak extra memory {memory:.4f}")


def main(args):
    import pandas as pd

    if args.child:
        child_measure(args.child[0], int(args.child[1]), args)
        return
    chapter = load_chapter()
    info = machine_info(args)
    print(
        f"{info['machine']}; torch {info['torch']}, numpy {info['numpy']}, "
        f"{args.threads} thread(s); OPENBLAS_CORETYPE="
        f"{os.environ.get('OPENBLAS_CORETYPE', '(unset)')}",
        flush=True,
    )
    if "main" in args.parts:
        run_main(chapter, args, info)
    T = max(args.sizes)
    for part, variants, causals, path in (
        (
            "ablation",
            ablation_variants(chapter),
            (False, True),
            args.ablation_csv,
        ),
        ("tiles", sweep_variants(args), (False, True), args.tiles_csv),
    ):
        if part in args.parts:
            check_variants(chapter, min(args.sizes), args, variants)
            rows = time_variants(chapter, T, args, variants, causals, info)
            path.parent.mkdir(parents=True, exist_ok=True)
            pd.DataFrame(rows).to_csv(path, index=False, float_format="%.6g")
            print(f"wrote {path}")


if __name__ == "__main__":
    ARGS = parse_args()
    set_threads(ARGS.threads)
    main(ARGS)
