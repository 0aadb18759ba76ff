"""Chapter 13's measurements (`make bench`): speed and training of
book/flash.py's tiled attention against PyTorch's fused kernel.

Four parts (--parts); the first three in float32, one sequence, H = 8
heads, d_k = 64, T = 4096 (sizes in Config; --quick: QUICK's):
- speed: the forward (`fast_attention` against
  `F.scaled_dot_product_attention`, SDPA) and the forward plus backward
  (`flash_attention` and SDPA, each followed by `.backward`), without and
  with the causal mask, on one thread; the forward also on two threads.
  `pairs` interleaved pairs (SDPA, then ours) give that many ratios SDPA time /
  our time: their median with its 95 % interval (tools/measure.py), and
  their quartiles -> book/data/bench_flash.csv, as run "1" (the table is
  replaced). Chapter 13 judges its targets over three independent runs:
  after `make bench`, run `make bench PART=ch13 RUN=2` and then RUN=3, which
  append this part's rows with run = k (with BENCH_RUN set and no --parts,
  only this part runs: the other tables hold one run).
- ablation: forward plus backward, one thread, without a mask, `ablation_pairs`
  pairs: the backward with lse_i and Delta_i subtracted from each tile (inside
  off), both passes with exp in place of exp2 (base-2 off), and the tile
  sizes of TILES for both -> book/data/bench_flash_ablation.csv.
- profile: one thread, without a mask, `profile_calls` calls of each
  program (ours and SDPA, forward and forward plus backward): the self
  CPU time per call of each PyTorch operation of at least 0.5 ms
  (torch.profiler) -> book/data/bench_flash_profile.csv.
- train: chapter 10's GPT (its MODEL, data and `gpt.train`), `steps` steps
  from seed 0, with backend "flash" and with backend "sdpa", in float64 and
  in float32 -> the per-step losses in book/data/flash_train.csv.

One thread is timed with the thread's CPU time (the machine may be shared),
two threads with the wall clock; every row carries tools/measure.py's record
(machine, load before and after, busy flag). Fresh times are never
asserted; the chapter reads the CSVs.
Usage: python tools/bench/bench_flash.py [--parts speed ablation profile train]
       python tools/bench/bench_flash.py --quick --out /tmp/dir  # tiny sizes
"""

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

# tools/ holds the shared modules (chapter_loader, measure, stored_models)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import measure
import measure_csv
from chapter_loader import BOOK
from stored_models import setup

import flash  # book/flash.py
import gpt  # book/gpt.py

H, D_K = 8, 64
TILES = ([128, 128], [256, 256], [512, 256], [256, 512], [512, 512])
# the tables, in Config.out (book/data/ unless --out)
SPEED_CSV = "bench_flash.csv"
ABLATION_CSV = "bench_flash_ablation.csv"
PROFILE_CSV = "bench_flash_profile.csv"
TRAIN_CSV = "flash_train.csv"


@dataclass(frozen=True)
class Config:
    """The sizes of a run and the folder of its tables (--quick: tiny)."""

    T: int = 4096
    pairs: int = 15
    ablation_pairs: int = 9
    steps: int = 200
    profile_calls: int = 5
    out: Path = BOOK / "data"


QUICK = Config(T=256, pairs=6, ablation_pairs=6, steps=2, profile_calls=1)


def inputs(T, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, H, T, D_K, generator=gen) for _ in range(3)]


def forward_call(attention, causal, T):
    """A call of attention(Q, K, V, causal) on fixed inputs, no gradient."""
    q, k, v = inputs(T)
    return lambda: attention(q, k, v, causal)


def training_call(attention, causal, T):
    """A call of the forward and the backward of attention(Q, K, V, causal)
    (for dC = 1) on fixed inputs that require gradients."""
    q, k, v = (t.requires_grad_() for t in inputs(T))

    def call():
        for t in (q, k, v):
            t.grad = None
        out = attention(q, k, v, causal)
        out.backward(torch.ones_like(out))

    return call


def sdpa(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def pairs(ours, theirs, rounds, threads):
    """Times (s) of `rounds` interleaved pairs, SDPA first, then ours, by
    tools/measure.py: the thread's CPU time on one thread, else the wall
    clock; (times of ours, times of SDPA, the Timing)."""
    timing = measure.interleave(
        {"sdpa": theirs, "ours": ours}, rounds, cpu_clock=time.thread_time
    )
    t = timing.cpu if threads == 1 else timing.wall
    return t["ours"], t["sdpa"], timing


def row(t_ours, t_theirs, timing, threads, **columns):
    """The ratios SDPA time / our time, pair by pair: median with its 95 %
    interval, quartiles and range; each program's median time (ms) with
    its interval; the machine and the load."""
    r = [b / a for a, b in zip(t_ours, t_theirs)]
    q1, _, q3 = statistics.quantiles(r, n=4, method="inclusive")
    ms = {
        f"{name}_median_ms": [x * 1e3 for x in t]
        for name, t in (("ours", t_ours), ("sdpa", t_theirs))
    }
    spread = {
        "pairs": len(r),
        **measure.ratio_columns(t_theirs, t_ours),
        "ratio_q1": q1,
        "ratio_q3": q3,
        "ratio_min": min(r),
        "ratio_max": max(r),
    }
    for name, values in ms.items():
        spread |= measure.median_columns(name, values)
    return measure.row(spread, timing, measure.machine(threads), **columns)


def speed(cfg):
    """bench_flash.csv: this run ("latest") and the one before ("previous"),
    or, with a run id (RUN=k), this run appended as run k."""
    rows = []
    for threads, passes in (
        (1, ("forward", "forward+backward")),
        (2, ("forward",)),
    ):
        torch.set_num_threads(threads)
        for causal in (False, True):
            for kind in passes:
                make = forward_call if kind == "forward" else training_call
                ours = (
                    flash.fast_attention
                    if kind == "forward"
                    else flash.flash_attention
                )
                times = pairs(
                    make(ours, causal, cfg.T),
                    make(sdpa, causal, cfg.T),
                    cfg.pairs,
                    threads,
                )
                rows.append(
                    row(*times, threads, passes=kind, causal=causal, T=cfg.T)
                )
                print(rows[-1], flush=True)
    path = cfg.out / SPEED_CSV
    run = measure_csv.run_id()
    if run is not None:  # an independent repeat, appended
        measure_csv.write_csv(rows, path, run=run)
    else:  # the first run: the table replaced
        measure_csv.write_csv(pd.DataFrame(rows).assign(run="1"), path)


def ablation(cfg):
    """bench_flash_ablation.csv: what each change of the backward buys."""
    torch.set_num_threads(1)
    variants = {
        "all on": {},
        "inside off": {"inside": False},
        "base-2 off": {"base2": False},
    }
    variants |= {f"{a} x {b}": {"B_r": a, "B_c": b} for a, b in TILES}
    rows = []
    for name, settings in variants.items():

        def ours(q, k, v, causal, settings=settings):
            return Ablated.apply(q, k, v, causal, settings)

        times = pairs(
            training_call(ours, False, cfg.T),
            training_call(sdpa, False, cfg.T),
            cfg.ablation_pairs,
            1,
        )
        rows.append(row(*times, 1, variant=name, causal=False, T=cfg.T))
        print(rows[-1], flush=True)
    measure_csv.write_csv(
        rows, cfg.out / ABLATION_CSV, run=measure_csv.run_id()
    )


class Ablated(torch.autograd.Function):
    """flash.FlashAttention with the backward's settings given."""

    @staticmethod
    def forward(ctx, Q, K, V, causal, settings):
        tile = {k: settings[k] for k in ("B_r", "B_c") if k in settings}
        levers = {"base2": settings.get("base2", flash.LEVERS["base2"])}
        C, lse = flash.fast_attention(
            Q, K, V, causal, **tile, levers=levers, return_lse=True
        )
        ctx.save_for_backward(Q, K, V, C, lse)
        ctx.causal, ctx.settings = causal, settings
        return C

    @staticmethod
    def backward(ctx, dC):
        grads = flash.flash_backward(
            *ctx.saved_tensors, dC, ctx.causal, **ctx.settings
        )
        return *grads, None, None


def train(cfg):
    """flash_train.csv: the loss of every step, flash and sdpa, per dtype."""
    torch.set_num_threads(1)
    ch, chars, train_data, _ = setup()
    columns = {}
    for dtype in (torch.float64, torch.float32):
        for backend in ("sdpa", "flash"):
            torch.manual_seed(0)
            model = gpt.GPT(len(chars), **ch.MODEL, backend=backend)
            losses = gpt.train(model.to(dtype), train_data, cfg.steps)
            name = f"{backend}_{str(dtype).removeprefix('torch.')}"
            columns[name] = losses
            print(name, losses[0], losses[-1], flush=True)
    frame = pd.DataFrame({"step": range(1, cfg.steps + 1)} | columns)
    frame.to_csv(cfg.out / TRAIN_CSV, index=False, float_format="%.17g")


def profile(cfg):
    """bench_flash_profile.csv: where the time of each pass goes."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    torch.set_num_threads(1)
    rows = []
    programs = {
        "forward": (forward_call, flash.fast_attention),
        "forward+backward": (training_call, flash.flash_attention),
    }
    calls = cfg.profile_calls
    load = measure.Timing(
        load_before=measure.load_average(), cores=os.cpu_count() or 1
    )
    for kind, (make, ours) in programs.items():
        for name, call in (
            ("ours", make(ours, False, cfg.T)),
            ("SDPA", make(sdpa, False, cfg.T)),
        ):
            call()  # warm-up
            with profiler(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(calls):
                    call()
            for event in prof.key_averages():
                rows.append({
                    "passes": kind, "program": name, "operation": event.key,
                    "self_cpu_ms_per_call":
                        event.self_cpu_time_total / 1e3 / calls,
                    "calls_per_call": event.count / calls,
                })  # fmt: skip
    load.load_after = measure.load_average()
    rows = [measure.row({}, load, measure.machine(1), **r) for r in rows]
    frame = pd.DataFrame(rows)
    frame = frame[
        frame.self_cpu_ms_per_call >= 0.5
    ]  # the operations that count
    frame = frame.sort_values(["passes", "program", "self_cpu_ms_per_call"],
                              ascending=[True, True, False])  # fmt: skip
    measure_csv.write_csv(
        frame, cfg.out / PROFILE_CSV, run=measure_csv.run_id()
    )


PARTS = {
    "speed": speed,
    "ablation": ablation,
    "profile": profile,
    "train": train,
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=PARTS,
        default=None,
        help="default: all; with BENCH_RUN set (a repeat), speed only",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"tiny sizes ({QUICK}) to prove the script runs; with --out",
    )
    parser.add_argument(
        "--out", type=Path, help="the tables' folder (default: book/data)"
    )
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else Config()
    if args.out:
        cfg = replace(cfg, out=args.out)
    parts = args.parts or (
        ["speed"] if measure_csv.run_id() is not None else list(PARTS)
    )
    for part in parts:
        PARTS[part](cfg)


if __name__ == "__main__":
    main()
