"""Benchmark the attention programs of chapter 8 (book/08_efficient_attention.ipynb).

Three parts (--parts), all with one sequence, 8 heads, d_k = 64, float32:
- main: every program at several sequence lengths, its time (fastest,
  median and slowest call), throughput and peak extra memory (in a fresh
  process), and the float32 matrix-multiply throughput as the ceiling;
  writes book/data/bench_attention.csv and book/images/bench_attention.png;
- ablation: at the largest length, the fast tiled program with each of its
  changes toggled, each call paired with a call of the fused kernel;
  writes book/data/bench_ablation.csv;
- tiles: the same pairing for a sweep of the fast program's tile sizes;
  writes book/data/bench_tiles.csv.

One concern per file:
    bench_attention.py           this entry point (main)
    bench_attention_args.py      the options as frozen settings per part,
                                 the thread count
    bench_attention_programs.py  the chapter's programs, inputs and checks
    bench_attention_timing.py    the timing (round robin, pairs), by
                                 tools/measure.py
    bench_attention_memory.py    peak extra memory in a fresh process
    bench_attention_output.py    CSV tables, the figure, printed ratios
    bench_attention_parts.py     the parts main, ablation and tiles

The programs are imported from the notebook itself (tools/chapter_loader.py),
so the benchmark measures exactly the code the book prints. Every program is
checked against the hand-written PyTorch version before it is timed.

Usage (from the repository's top folder, with the book's virtual environment):
    python tools/bench/bench_attention.py                 # the chapter's benchmark
    python tools/bench/bench_attention.py --threads 2 --sizes 4096 --parts main \
        --no-memory --no-plot --csv book/data/bench_attention_2threads.csv
    python tools/bench/bench_attention.py --sizes 64 128 --max-seconds 0.2  # quick
    python tools/bench/bench_attention.py --plot-only     # the figure from the CSV
On a busy machine, --clock cpu (one thread) times with the thread's processor
time. Peak memory uses Linux's /proc (VmHWM, clear_refs); elsewhere use
--no-memory.
"""

import os
import sys
from pathlib import Path

# tools/ holds the shared modules (chapter_loader, measure, stored_models)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_attention_args
from bench_attention_args import PARTS, set_threads
from bench_attention_memory import child_measure, measure_memory
from bench_attention_output import machine_columns, plot_from_csv
from bench_attention_parts import run_main, run_variants
from bench_attention_programs import (
    NAIVE,
    PROGRAMS,
    ablation_variants,
    check_equal,
    check_variants,
    load_chapter,
    sweep_variants,
)

__all__ = [
    "NAIVE",
    "PARTS",
    "PROGRAMS",
    "ablation_variants",
    "check_equal",
    "check_variants",
    "child_measure",
    "main",
    "measure_memory",
    "parse_args",
    "sweep_variants",
]


def parse_args(argv=None):
    """The script's options as frozen settings (bench_attention_args.py)."""
    description = __doc__.splitlines()[0]
    return bench_attention_args.parse_args(argv, description)


def main(settings):
    """Run the parts asked for (or, with --child, one memory measurement)."""
    if settings.child:
        child_measure(*settings.child, settings.problem)
        return
    if settings.plot_only:
        plot_from_csv(*settings.plot_only)
        return
    chapter = load_chapter()
    clock = (settings.main or settings.ablation or settings.tiles).clock
    info = machine_columns(settings.problem, clock, chapter)
    print(
        f"{info['machine']}; torch {info['torch']}, numpy {info['numpy']}, "
        f"{settings.problem.threads} thread(s); OPENBLAS_CORETYPE="
        f"{os.environ.get('OPENBLAS_CORETYPE', '(unset)')}",
        flush=True,
    )
    if settings.main:
        run_main(chapter, settings.problem, settings.main, info)
    run_variants(chapter, settings, info)


if __name__ == "__main__":
    SETTINGS = parse_args()
    set_threads(SETTINGS.problem.threads)
    main(SETTINGS)
