"""Chapter 13's measurements (`make bench`): speed and training of
book/flash.py's tiled attention against PyTorch's fused kernel.

Four parts (--parts); the first three in float32, one sequence, H = 8
heads, d_k = 64, T = 4096:
- speed: the forward (`fast_attention` against
  `F.scaled_dot_product_attention`, SDPA) and the forward plus backward
  (`flash_attention` and SDPA, each followed by `.backward`), without and
  with the causal mask, on one thread; the forward also on two threads.
  PAIRS interleaved pairs (SDPA, then ours) give PAIRS ratios SDPA time /
  our time: their median and quartiles -> book/data/bench_flash.csv.
  The rows of the run before are kept with run = "previous", so that a
  target is checked on two separate runs.
- ablation: forward plus backward, one thread, without a mask, ABLATION_PAIRS
  pairs: the backward with lse_i and Delta_i subtracted from each tile (inside
  off), both passes with exp in place of exp2 (base-2 off), and the tile
  sizes of TILES for both -> book/data/bench_flash_ablation.csv.
- profile: one thread, without a mask, PROFILE_CALLS calls of each
  program (ours and SDPA, forward and forward plus backward): the self
  CPU time per call of each PyTorch operation of at least 0.5 ms
  (torch.profiler) -> book/data/bench_flash_profile.csv.
- train: chapter 10's GPT (its MODEL, data and `gpt.train`), STEPS steps
  from seed 0, with backend "flash" and with backend "sdpa", in float64 and
  in float32 -> the per-step losses in book/data/flash_train.csv.

One thread is timed with the thread's CPU time (the machine may be shared),
two threads with the wall clock. Fresh times are never asserted; the
chapter reads the CSVs.
Usage: python tools/bench/bench_flash.py [--parts speed ablation profile train]
"""

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

# tools/ holds the shared modules (chapter_loader, measure, stored_models)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_attention_output import cpu_model
from chapter_loader import BOOK
from stored_models import setup

import flash  # book/flash.py
import gpt  # book/gpt.py

T, H, D_K = 4096, 8, 64
PAIRS = 15
ABLATION_PAIRS = 9
TILES = ([128, 128], [256, 256], [512, 256], [256, 512], [512, 512])
STEPS = 200
SPEED_CSV = BOOK / "data" / "bench_flash.csv"
ABLATION_CSV = BOOK / "data" / "bench_flash_ablation.csv"
TRAIN_CSV = BOOK / "data" / "flash_train.csv"


def inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, H, T, D_K, generator=gen) for _ in range(3)]


def forward_call(attention, causal):
    """A call of attention(Q, K, V, causal) on fixed inputs, no gradient."""
    q, k, v = inputs()
    return lambda: attention(q, k, v, causal)


def training_call(attention, causal):
    """A call of the forward and the backward of attention(Q, K, V, causal)
    (for dC = 1) on fixed inputs that require gradients."""
    q, k, v = (t.requires_grad_() for t in inputs())

    def call():
        for t in (q, k, v):
            t.grad = None
        out = attention(q, k, v, causal)
        out.backward(torch.ones_like(out))

    return call


def sdpa(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def ratios(ours, theirs, pairs, clock):
    """Times (s) of `pairs` interleaved calls: SDPA first, then ours."""
    ours(), theirs()  # warm-up
    t_ours, t_theirs = [], []
    for _ in range(pairs):
        for call, record in ((theirs, t_theirs), (ours, t_ours)):
            start = clock()
            call()
            record.append(clock() - start)
    return t_ours, t_theirs


def row(t_ours, t_theirs, **columns):
    """The ratios SDPA time / our time, pair by pair: median, quartiles."""
    r = [b / a for a, b in zip(t_ours, t_theirs)]
    q1, _, q3 = statistics.quantiles(r, n=4, method="inclusive")
    return columns | {
        "pairs": len(r),
        "ratio_median": statistics.median(r),
        "ratio_q1": q1,
        "ratio_q3": q3,
        "ratio_min": min(r),
        "ratio_max": max(r),
        "ours_median_ms": statistics.median(t_ours) * 1e3,
        "sdpa_median_ms": statistics.median(t_theirs) * 1e3,
    }


def machine():
    return {
        "machine": cpu_model(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }


def speed():
    """bench_flash.csv: this run ("latest") and the one before ("previous")."""
    rows = []
    for threads, passes in (
        (1, ("forward", "forward+backward")),
        (2, ("forward",)),
    ):
        torch.set_num_threads(threads)
        clock = time.thread_time if threads == 1 else time.perf_counter
        for causal in (False, True):
            for kind in passes:
                make = forward_call if kind == "forward" else training_call
                ours = (
                    flash.fast_attention
                    if kind == "forward"
                    else flash.flash_attention
                )
                times = ratios(
                    make(ours, causal), make(sdpa, causal), PAIRS, clock
                )
                rows.append(
                    row(
                        *times,
                        threads=threads,
                        passes=kind,
                        causal=causal,
                        T=T,
                    )
                    | machine()
                )
                print(rows[-1], flush=True)
    new = pd.DataFrame(rows).assign(run="latest")
    if SPEED_CSV.exists():
        old = pd.read_csv(SPEED_CSV)
        new = pd.concat([new, old[old.run == "latest"].assign(run="previous")])
    new.to_csv(SPEED_CSV, index=False, float_format="%.6g")


def ablation():
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

        times = ratios(
            training_call(ours, False), training_call(sdpa, False),
            ABLATION_PAIRS, time.thread_time,
        )  # fmt: skip
        rows.append(row(*times, variant=name, causal=False, T=T) | machine())
        print(rows[-1], flush=True)
    pd.DataFrame(rows).to_csv(ABLATION_CSV, index=False, float_format="%.6g")


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


def train():
    """flash_train.csv: the loss of every step, flash and sdpa, per dtype."""
    torch.set_num_threads(1)
    ch, chars, train_data, _ = setup()
    columns = {}
    for dtype in (torch.float64, torch.float32):
        for backend in ("sdpa", "flash"):
            torch.manual_seed(0)
            model = gpt.GPT(len(chars), **ch.MODEL, backend=backend)
            losses = gpt.train(model.to(dtype), train_data, STEPS)
            name = f"{backend}_{str(dtype).removeprefix('torch.')}"
            columns[name] = losses
            print(name, losses[0], losses[-1], flush=True)
    frame = pd.DataFrame({"step": range(1, STEPS + 1)} | columns)
    frame.to_csv(TRAIN_CSV, index=False, float_format="%.17g")


PROFILE_CALLS = 5
PROFILE_CSV = BOOK / "data" / "bench_flash_profile.csv"


def profile():
    """bench_flash_profile.csv: where the time of each pass goes."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    torch.set_num_threads(1)
    rows = []
    programs = {
        "forward": (forward_call, flash.fast_attention),
        "forward+backward": (training_call, flash.flash_attention),
    }
    for kind, (make, ours) in programs.items():
        for name, call in (
            ("ours", make(ours, False)),
            ("SDPA", make(sdpa, False)),
        ):
            call()  # warm-up
            with profiler(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(PROFILE_CALLS):
                    call()
            for event in prof.key_averages():
                rows.append({
                    "passes": kind, "program": name, "operation": event.key,
                    "self_cpu_ms_per_call":
                        event.self_cpu_time_total / 1e3 / PROFILE_CALLS,
                    "calls_per_call": event.count / PROFILE_CALLS,
                } | machine())  # fmt: skip
    frame = pd.DataFrame(rows)
    frame = frame[
        frame.self_cpu_ms_per_call >= 0.5
    ]  # the operations that count
    frame.sort_values(["passes", "program", "self_cpu_ms_per_call"],
                      ascending=[True, True, False]).to_csv(
        PROFILE_CSV, index=False, float_format="%.6g")  # fmt: skip


PARTS = {
    "speed": speed,
    "ablation": ablation,
    "profile": profile,
    "train": train,
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--parts", nargs="+", choices=PARTS, default=list(PARTS)
    )
    for part in parser.parse_args().parts:
        PARTS[part]()


if __name__ == "__main__":
    main()
