"""The command line of tools/bench/bench_attention.py: its options, turned
into one small frozen object per part (`Problem`, `MainPart`,
`VariantPart`, joined in `Settings`), and the thread count they set."""

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from threadpoolctl import threadpool_limits

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "book" / "data"
PARTS = ("main", "ablation", "tiles")


def add_problem(parser):
    """The problem size: lengths, heads, head size, batch, threads."""
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[256, 512, 1024, 2048, 4096],
        help="sequence lengths T",
    )
    parser.add_argument("--d", type=int, default=64, help="head size d_k")
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
    parser.add_argument("--block-q", type=int, default=128, help="B_r")
    parser.add_argument("--block-k", type=int, default=512, help="B_c")


def add_timing(parser):
    """How long and how often each program is called, and by which clock."""
    parser.add_argument(
        "--min-repeats",
        type=int,
        default=7,
        help="calls of a program at least (below 6, its row has no 95 %% "
        "interval of the median)",
    )
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


def add_parts(parser):
    """Which parts run, and the tile sweep's shapes."""
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


def add_outputs(parser):
    """Where the tables and the figure go."""
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument(
        "--plot-only",
        action="store_true",
        help="time nothing: redraw --png from the table in --csv",
    )
    outputs = {
        "--csv": DATA / "bench_attention.csv",
        "--ablation-csv": DATA / "bench_ablation.csv",
        "--tiles-csv": DATA / "bench_tiles.csv",
        "--png": ROOT / "book" / "images" / "bench_attention.png",
    }
    for option, default in outputs.items():
        parser.add_argument(option, type=Path, default=default)
    parser.add_argument(
        "--child", nargs=2, metavar=("PROGRAM", "T"), help=argparse.SUPPRESS
    )  # internal: one memory measurement


@dataclass(frozen=True)
class Problem:
    """The inputs (batch, heads, head size), the threads, the simple tiled
    program's tiles and the largest T of the per-query loop."""

    d: int = 64
    heads: int = 8
    batch: int = 1
    threads: int = 1
    loop_max: int = 1024
    block_q: int = 128
    block_k: int = 512


@dataclass(frozen=True)
class MainPart:
    """Every program at every T: the calls per program, the clock, the
    matmul ceiling's size, and the outputs."""

    sizes: tuple[int, ...]
    min_repeats: int
    max_repeats: int
    max_seconds: float
    clock: str
    matmul_size: int
    memory: bool
    plot: bool
    csv: Path
    png: Path


@dataclass(frozen=True)
class VariantPart:
    """The ablation or the tile sweep at length T: pairs of calls (the fused
    kernel, then the variant), the clock, the sweep's tiles, the table."""

    T: int
    pairs: int
    clock: str
    csv: Path
    sweep_q: tuple[int, ...] = ()
    sweep_k: tuple[int, ...] = ()


@dataclass(frozen=True)
class Settings:
    """What the script does: the parts asked for (None: not run), or one
    memory measurement (child), or the figure from a table (plot_only)."""

    problem: Problem
    main: MainPart | None = None
    ablation: VariantPart | None = None
    tiles: VariantPart | None = None
    child: tuple[str, int] | None = None
    plot_only: tuple[Path, Path] | None = None  # (csv, png)


def settings(args):
    """The frozen settings of an argparse namespace."""
    problem = Problem(
        args.d, args.heads, args.batch, args.threads, args.loop_max,
        args.block_q, args.block_k,
    )  # fmt: skip
    if args.child:
        return Settings(problem, child=(args.child[0], int(args.child[1])))
    if args.plot_only:
        return Settings(problem, plot_only=(args.csv, args.png))
    main = MainPart(
        tuple(args.sizes), args.min_repeats, args.max_repeats,
        args.max_seconds, args.clock, args.matmul_size, not args.no_memory,
        not args.no_plot, args.csv, args.png,
    )  # fmt: skip
    T = max(args.sizes)  # the variants are timed at the largest length

    def variants(csv, sweep=((), ())):
        return VariantPart(T, args.pairs, args.clock, csv, *sweep)

    sweep = (tuple(args.sweep_q), tuple(args.sweep_k))
    return Settings(
        problem,
        main=main if "main" in args.parts else None,
        ablation=variants(args.ablation_csv)
        if "ablation" in args.parts
        else None,
        tiles=variants(args.tiles_csv, sweep)
        if "tiles" in args.parts
        else None,
    )


def parse_args(argv=None, description=None):
    """The options, checked (--clock cpu measures one thread only), as
    frozen `Settings`."""
    parser = argparse.ArgumentParser(description=description)
    for add in (add_problem, add_timing, add_parts, add_outputs):
        add(parser)
    args = parser.parse_args(argv)
    if args.plot_only and args.no_plot:
        parser.error("--plot-only draws the figure: drop --no-plot")
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu measures one thread: use --threads 1")
    return settings(args)


def set_threads(n):
    """Use n threads in PyTorch and in NumPy's BLAS (now, and in children)."""
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(n)  # inherited by the memory-measuring children
    threadpool_limits(n)
    torch.set_num_threads(n)
