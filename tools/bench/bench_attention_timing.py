"""The timing loops of tools/bench/bench_attention.py: programs called in turn
(round robin), and variants called in pairs with the fused kernel."""

import statistics

import torch
from bench_attention_args import clock
from bench_attention_programs import SDPA, make_inputs, make_variant


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


def time_pairs(sdpa, calls, args):
    """Seconds of each call and of the fused kernel's call just before it:
    (times, times_sdpa), each name -> list of --pairs times."""
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
    return {SDPA: all_sdpa} | times, {SDPA: all_sdpa} | times_sdpa


def variant_row(name, kwargs, causal, T, t, t_sdpa):
    """One row of the ablation or tile table: times in ms and the ratios
    SDPA time / this time, pair by pair (median and range)."""
    ratios = [a / b for a, b in zip(t_sdpa, t)]
    return {
        "variant": name,
        "tile_q": kwargs.get("B_r"),
        "tile_k": kwargs.get("B_c"),
        "causal": causal,
        "T": T,
        "min_ms": min(t) * 1e3,
        "median_ms": statistics.median(t) * 1e3,
        "max_ms": max(t) * 1e3,
        "ratio_of_mins": min(t_sdpa) / min(t),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "repeats": len(t),
    }


def print_row(row):
    """One line of progress for a variant's row."""
    print(
        f"T = {row['T']} causal={row['causal']!s:5} {row['variant']:34s} "
        f"min {row['min_ms']:8.1f} ms, median {row['median_ms']:8.1f} ms; "
        f"SDPA / this: {row['ratio_median']:.3f} ({row['ratio_min']:.3f} "
        f".. {row['ratio_max']:.3f}), of mins {row['ratio_of_mins']:.3f}",
        flush=True,
    )


def time_variants(chapter, T, args, variants, causals, info):
    """Rows of a table: every variant timed at length T, each call right
    after a call of the fused kernel, so that both see the same machine; the
    ratio of the two times is taken per pair, its median and spread kept."""
    _, tensors = make_inputs(T, args)
    variants = {n: v for n, v in variants.items() if n != SDPA}
    rows = []
    for causal in causals:
        sdpa = make_variant(chapter, "attention_sdpa", {}, causal, tensors)
        calls = {
            n: make_variant(chapter, f, kw, causal, tensors)
            for n, (f, kw) in variants.items()
        }
        times, times_sdpa = time_pairs(sdpa, calls, args)
        for name, t in times.items():
            kwargs = variants.get(name, ("", {}))[1]
            row = variant_row(name, kwargs, causal, T, t, times_sdpa[name])
            rows.append(row | info)
            print_row(row)
    return rows
