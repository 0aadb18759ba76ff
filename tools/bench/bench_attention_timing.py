"""The timing of tools/bench/bench_attention.py, by tools/measure.py:
programs called in turn (`measure.interleave`, a slow program leaving the
rounds after its time budget), and variants called in pairs with the fused
kernel (SDPA, then the variant, in every round), their ratio taken pair by
pair (`measure.ratio_columns`)."""

import time

import measure
import torch
from bench_attention_programs import SDPA, make_inputs, make_variant


def seconds(timing, clock):
    """The per-call times of `timing` by the clock chosen (--clock): the
    calling thread's processor time ("cpu") or the wall clock."""
    return timing.cpu if clock == "cpu" else timing.wall


def cpu_clock(clock):
    """The CPU clock for `measure.interleave`: the thread's with --clock
    cpu (one thread), else the process's."""
    return time.thread_time if clock == "cpu" else time.process_time


def time_programs(calls, part):
    """(per-call seconds by name, the Timing): the programs called in turn
    (round robin), so that a busy machine slows all of them alike; each
    until it has part.max_repeats calls, or part.min_repeats and
    part.max_seconds of wall time."""
    timing = measure.interleave(
        calls,
        part.max_repeats,
        cpu_clock=cpu_clock(part.clock),
        max_seconds=part.max_seconds,
        min_rounds=min(part.min_repeats, part.max_repeats),
    )
    return seconds(timing, part.clock), timing


def matmul_ceiling(n, clock="wall", rounds=15, max_seconds=3.0):
    """(float32 GFLOP/s of an n x n matrix product by its median time, the
    per-call seconds, the Timing)."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    timing = measure.interleave(
        {"matmul": lambda: a @ b},
        rounds,
        cpu_clock=cpu_clock(clock),
        max_seconds=max_seconds,
        min_rounds=min(6, rounds),
    )
    t = seconds(timing, clock)["matmul"]
    median = measure.median_columns("s", t)["s"]
    return 2 * n**3 / median / 1e9, t, timing


def paired_with_sdpa(sdpa, calls, part):
    """(times, times_sdpa, Timing): part.pairs rounds, each calling, for
    every variant, the fused kernel and then the variant; times name ->
    seconds of the variant's calls, times_sdpa name -> those of the fused
    kernel's call just before them. The SDPA row pools all of its calls."""
    pairs = {}
    for name, call in calls.items():
        pairs[(SDPA, name)] = sdpa
        pairs[name] = call
    timing = measure.interleave(
        pairs, part.pairs, cpu_clock=cpu_clock(part.clock)
    )
    t = seconds(timing, part.clock)
    times = {n: t[n] for n in calls}
    times_sdpa = {n: t[(SDPA, n)] for n in calls}
    all_sdpa = [x for ts in times_sdpa.values() for x in ts]
    return (
        {SDPA: all_sdpa} | times,
        {SDPA: all_sdpa} | times_sdpa,
        timing,
    )


def variant_row(name, kwargs, causal, T, t, t_sdpa):
    """One row of the ablation or tile table: times in ms (the median with
    its interval) and the ratios SDPA time / this time, pair by pair: their
    median, its 95 % interval (ratio_lo, ratio_hi) and range."""
    ratios = [a / b for a, b in zip(t_sdpa, t)]
    return {
        "variant": name,
        "tile_q": kwargs.get("B_r"),
        "tile_k": kwargs.get("B_c"),
        "causal": causal,
        "T": T,
        "min_ms": min(t) * 1e3,
        **measure.median_columns("median_ms", [x * 1e3 for x in t]),
        "max_ms": max(t) * 1e3,
        "ratio_of_mins": min(t_sdpa) / min(t),
        **measure.ratio_columns(t_sdpa, t),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "repeats": len(t),
    }


def print_row(row):
    """One line of progress for a variant's row."""
    print(
        f"T = {row['T']} causal={row['causal']!s:5} {row['variant']:34s} "
        f"min {row['min_ms']:8.1f} ms, median {row['median_ms']:8.1f} ms; "
        f"SDPA / this: {row['ratio_median']:.3f} (95 % {row['ratio_lo']:.3f}"
        f" .. {row['ratio_hi']:.3f}; range {row['ratio_min']:.3f} .. "
        f"{row['ratio_max']:.3f}), of mins {row['ratio_of_mins']:.3f}",
        flush=True,
    )


def time_variants(chapter, problem, part, variants, causals, info):
    """Rows of a table: every variant timed at length part.T, each call
    right after a call of the fused kernel, so that both see the same
    machine; the ratio of the two times is taken per pair."""
    T = part.T
    _, tensors = make_inputs(T, problem)
    variants = {n: v for n, v in variants.items() if n != SDPA}
    rows = []
    for causal in causals:
        sdpa = make_variant(chapter, "attention_sdpa", {}, causal, tensors)
        calls = {
            n: make_variant(chapter, f, kw, causal, tensors)
            for n, (f, kw) in variants.items()
        }
        times, times_sdpa, timing = paired_with_sdpa(sdpa, calls, part)
        for name, t in times.items():
            kwargs = variants.get(name, ("", {}))[1]
            row = variant_row(name, kwargs, causal, T, t, times_sdpa[name])
            rows.append(measure.row({}, timing, info, **row))
            print_row(row)
    return rows
