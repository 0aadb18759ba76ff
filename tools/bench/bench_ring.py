"""Chapter 17's measurements (`make bench PART=ch17`): ring attention across
processes of this machine (book/ring.py), one thread per process, float32,
one sequence of H heads of d_k = d_v = 64 (sizes in Config; --quick: tiny).

Three parts, all rows in book/data/bench_ring.csv (column `part`):
- work: causal ring attention of T tokens on P = 4 ranks, with each split;
  each rank's CPU time for its blocks (`time.thread_time` around them, in
  the rank) over `rounds` interleaved rounds: its median with the 95 %
  order-statistic interval, and its paired ratio to the mean of the four
  ranks of the same round (`to_mean_median`, `_lo`, `_hi`), beside the
  scores it computes (counted).
- overlap: P = 2, causal, zigzag: the parent's wall time of one ring
  forward with the next block sent while the current one is computed and
  without (sent after it), `rounds` interleaved pairs: the paired ratio
  without / with, its median and 95 % interval (tools/measure.py).
- memory: for each T of `lengths` and P = 1, 2 and 4, a fresh pool runs one
  causal ring forward; each rank's peak resident memory before (the
  process after starting) and after.

Every row carries tools/measure.py's record: the machine, the load before
and after, and its busy flag. Fresh numbers are never asserted here.
Usage: python tools/bench/bench_ring.py [--parts work overlap memory]
       python tools/bench/bench_ring.py --quick --csv /tmp/ring.csv
"""

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

# tools/ holds the shared modules (chapter_loader, measure, stored_models)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import measure
import measure_csv
from chapter_loader import BOOK

import ring  # book/ring.py


@dataclass(frozen=True)
class Config:
    """The sizes of a run and its table (--quick: tiny)."""

    T: int = 8192
    H: int = 4
    rounds: int = 7
    lengths: tuple = (4096, 8192, 16384, 32768, 65536)
    csv: Path = BOOK / "data" / "bench_ring.csv"


QUICK = Config(T=256, H=2, rounds=2, lengths=(256, 512))
D = 64


def inputs(T, H, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(3, 1, H, T, D, generator=gen)  # Q, K, V


def work(cfg, pool, machine):
    """Each rank's CPU time for its blocks, per split (P = 4, causal)."""
    Q, K, V = inputs(cfg.T, cfg.H)
    seconds = {s: [[] for _ in range(4)] for s in ring.SPLITS}

    def call(split):
        _, _, counted = ring.ring_attention(pool, Q, K, V, 4, True, split)
        for rank, c in enumerate(counted):
            seconds[split][rank].append(c["compute"])

    calls = {s: (lambda s=s: call(s)) for s in ring.SPLITS}
    timing = measure.interleave(calls, cfg.rounds, threads=4)
    rows = []
    for split in ring.SPLITS:
        scores, blocks = ring.score_counts(cfg.T, 4, split)
        times = [seconds[split][rank][-cfg.rounds :] for rank in range(4)]
        means = [sum(round_) / 4 for round_ in zip(*times)]  # each round's
        for rank in range(4):
            columns = measure.median_columns("compute_s", times[rank])
            to_mean = measure.ratio_columns(times[rank], means)  # paired
            columns |= {
                f"to_mean_{k.removeprefix('ratio_')}": v
                for k, v in to_mean.items()
                if k.startswith("ratio_")
            }
            rows.append(
                measure.row(
                    columns,
                    timing,
                    machine,
                    part="work",
                    split=split,
                    P=4,
                    T=cfg.T,
                    rank=rank,
                    scores=scores[rank],
                    blocks=blocks[rank],
                    rounds=cfg.rounds,
                )
            )
    return rows


def overlap(cfg, pool, machine):
    """Wall time of one forward (P = 2) with and without overlap."""
    Q, K, V = inputs(cfg.T, cfg.H, seed=1)
    calls = {
        name: lambda on=on: ring.ring_attention(
            pool, Q, K, V, 2, True, "zigzag", overlap=on
        )
        for name, on in (("overlap", True), ("no overlap", False))
    }
    timing = measure.interleave(calls, cfg.rounds, threads=2)
    ratio = measure.ratio_columns(
        timing.wall["no overlap"], timing.wall["overlap"]
    )
    medians = {
        **measure.median_columns("overlap_s", timing.wall["overlap"]),
        **measure.median_columns("no_overlap_s", timing.wall["no overlap"]),
    }
    return [
        measure.row(
            ratio | medians,
            timing,
            machine,
            part="overlap",
            split="zigzag",
            P=2,
            T=cfg.T,
        )
    ]


def memory(cfg, machine):
    """Peak resident memory of each rank, a fresh pool per (P, T)."""
    rows = []
    for T in cfg.lengths:
        Q, K, V = inputs(T, 1, seed=2)
        for P in (1, 2, 4):
            with ring.RankPool(P, timeout=600.0) as pool:
                before = pool.run(ring.peak_rss, [()] * P)
                timing = measure.interleave(
                    {
                        "forward": lambda pool=pool, P=P, X=(Q, K, V): (
                            ring.ring_attention(pool, *X, P, True, "zigzag")
                        )
                    },
                    rounds=1,
                    warmup=0,
                    threads=P,
                )
                after = pool.run(ring.peak_rss, [()] * P)
            for rank in range(P):
                rows.append(
                    measure.row(
                        {},
                        timing,
                        machine,
                        part="memory",
                        split="zigzag",
                        P=P,
                        T=T,
                        rank=rank,
                        heads=1,
                        rss_start_bytes=before[rank],
                        rss_peak_bytes=after[rank],
                        qkv_bytes=3 * T // P * D * 4,
                    )
                )
    return rows


PARTS = ("work", "overlap", "memory")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=PARTS)
    parser.add_argument("--quick", action="store_true", help="tiny sizes")
    parser.add_argument("--csv", type=Path, help="the table's path")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else Config()
    if args.csv:
        cfg = replace(cfg, csv=args.csv)
    torch.set_num_threads(1)
    machine = measure.machine(threads=1)  # per process
    rows = []
    if "work" in args.parts or "overlap" in args.parts:
        with ring.RankPool(4, timeout=600.0) as pool:
            if "work" in args.parts:
                rows += work(cfg, pool, machine)
            if "overlap" in args.parts:
                rows += overlap(cfg, pool, machine)
    if "memory" in args.parts:
        rows += memory(cfg, machine)
    measure_csv.write_csv(rows, cfg.csv, run=measure_csv.run_id())


if __name__ == "__main__":
    main()
