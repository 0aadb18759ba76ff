"""Chapter 11's measurements (`make bench`), all in one run on one machine,
on one thread, in CPU seconds, timed by tools/measure.py (medians with
their 95 % intervals, which need at least 6 rounds: REPEATS = 7
interleaved rounds of a block of `calls` calls for prefill, decode and
the operations, bench_gpt.REPEATS = 7 for generation, matmul_ceiling's
own count, 6 to 15, for the matmul row; the CSV records each; wall seconds
are recorded too, since the machine may be shared):

- prefill: chapter 10's stored GPT (book/gpt.py's class, chapter 11's
  sizes MODEL, weights book/data/gpt_G4.pt) called on T tokens, T in
  PREFILL_T;
- decode: the same model called on one token after a cache of n tokens,
  n in DECODE_N (the cache is put back after each call);
- read bandwidth: bytes per second of summing a float32 tensor of
  BANDWIDTH_MIB MiB, far larger than the processor's caches;
- small operation: `a + b` on two tensors of 64 numbers, per call;
- decode operations: the ATen operations of one decode step (n = 128),
  recorded with chapter 11's OpLog and replayed one after the other
  without the model's Python code around them, per operation;
- matmul ceiling: float32 GFLOP/s of a MATMUL x MATMUL matrix product,
  timed by tools/bench/bench_attention_timing.py's function (`matmul_ceiling`,
  chapter 8's compute roof), here on the thread's CPU clock;
- generate: chapter 10's greedy generation with and without the cache
  after a 16-character prompt, 128, 256 and 512 new tokens, timed by
  tools/bench/bench_gpt.py's function (`generation_rows`).

FLOPs and bytes of each step come from chapter 11's equation ch11-cost
(its function `cost`). One row per measurement, each with the machine's
name and the load -> book/data/bench_token_cost.csv. Its columns T and n are equation
ch11-cost's T and n in the prefill and decode rows; in the generation rows
they hold the prompt's length and the tokens generated (chapter 11's P and
N), in the matmul row T holds MATMUL. Fresh times are never asserted; chapter 11
asserts bounds on the stored ones.
Usage: python tools/bench/bench_token_cost.py [--quick --csv PATH]
"""

import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pandas as pd
import torch

# tools/ holds the shared modules (chapter_loader, measure, stored_models)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_gpt
import measure
import measure_csv
from bench_attention_timing import matmul_ceiling
from chapter_loader import BOOK, load_chapter  # puts book/ on the path
from stored_models import setup

import gpt  # book/gpt.py

REPLAY_N = 128
REPEATS = 7  # the fewest rounds with a 95 % interval is 6
MACHINE = measure.machine(1)


@dataclass(frozen=True)
class Config:
    """The sizes of a run (--quick: QUICK's) and its table."""

    prefill_t: tuple[int, ...] = (16, 64, 128, 512)
    decode_n: tuple[int, ...] = (16, 128, 512)
    bandwidth_mib: int = 256
    matmul: int = 2048  # as tools/bench/bench_attention.py's ceiling
    calls: int = 200  # per block: decode, decode operations
    small_calls: int = 20_000  # per block: the small operation
    new_tokens: tuple[int, ...] = bench_gpt.NEW_TOKENS
    prefill_calls: int | None = None  # per block; None: max(5, 2000 // T)
    csv: Path = BOOK / "data" / "bench_token_cost.csv"


QUICK = Config((16,), (16,), 1, 64, 2, 20, (8,), prefill_calls=2)


def blocks(programs):
    """Time programs {key: (fn, calls)}: each a block of `calls` calls of
    fn, the blocks in REPEATS interleaved rounds after one untimed block
    each; key -> the per-call median CPU and wall seconds with their
    intervals, and the Timing."""

    def block(fn, calls):
        def run():
            for _ in range(calls):
                fn()

        return run

    timing = measure.interleave(
        {key: block(*p) for key, p in programs.items()}, REPEATS
    )
    return {
        key: measure.median_columns("cpu_s", timing.cpu[key], calls)
        | measure.median_columns("wall_s", timing.wall[key], calls)
        | {"calls": calls}
        for key, (_, calls) in programs.items()
    }, timing


def decode_step(model, n):
    """A call on one token after a cache of n tokens, the cache put back."""
    caches = model.new_caches()
    model(torch.arange(n)[None] % model.embed.num_embeddings, caches)
    saved = [(c.K, c.V, c.pos, c.length) for c in caches]
    token = torch.tensor([[1]])

    def step():
        model(token, caches)
        for cache, (K, V, pos, length) in zip(caches, saved):
            cache.K, cache.V, cache.pos, cache.length = K, V, pos, length

    return step


def row(measurement, times, timing, T=None, n=None, ops=None, **more):
    """One row: the measurement, its sizes, its times (cpu_s, wall_s with
    their intervals, calls), the rounds, the machine and the load."""
    return measure.row(
        {},
        timing,
        MACHINE,
        measurement=measurement,
        T=T,
        n=n,
        ops=ops,
        **times,
        repeats=REPEATS,
        **more,
    )


def bench_steps(ch11, model, cfg):
    dims = ch11.sizes(model)
    prefill = {
        T: (
            partial(model, torch.arange(T)[None] % dims["vocab"]),
            cfg.prefill_calls or max(5, 2000 // T),
        )
        for T in cfg.prefill_t
    }
    times, timing = blocks(prefill)
    rows = []
    for T in cfg.prefill_t:
        flops, read = ch11.cost(T, 0, **dims)
        rows.append(
            row("prefill", times[T], timing, T=T, n=0, flops=flops, bytes=read)
        )
    decode = {n: (decode_step(model, n), cfg.calls) for n in cfg.decode_n}
    times, timing = blocks(decode)
    for n in cfg.decode_n:
        flops, read = ch11.cost(1, n, **dims)
        rows.append(
            row("decode", times[n], timing, T=1, n=n, flops=flops, bytes=read)
        )
    return rows


def bench_operations(ch11, model, cfg):
    a, b = torch.randn(1, 1, 64), torch.randn(1, 1, 64)
    step = decode_step(model, REPLAY_N)
    with ch11.OpLog() as log:
        step()
    recorded = log.calls

    def replay():
        for op, args, kwargs in recorded:
            op(*args, **kwargs)

    ops = len(recorded)
    times, timing = blocks(
        {
            "small": (lambda: a + b, cfg.small_calls),
            "replay": (replay, cfg.calls),
        }
    )
    per_op = times["replay"] | {
        key: value / ops
        for key, value in times["replay"].items()
        if key.startswith(("cpu_s", "wall_s"))
    }
    return [
        row("small operation", times["small"], timing, ops=1),
        row("decode operations", per_op, timing, T=1, n=REPLAY_N, ops=ops),
    ]


def bench_bandwidth(cfg):
    x = torch.ones(cfg.bandwidth_mib * 2**20 // 4)  # float32
    times, timing = blocks({"sum": (x.sum, 5)})
    return [row("read bandwidth", times["sum"], timing, bytes=x.nbytes)]


def bench_matmul(cfg):
    """Chapter 8's compute roof, by tools/bench/bench_attention_timing.py's
    function, on the thread's CPU clock."""
    gflops, t, timing = matmul_ceiling(cfg.matmul, clock="cpu")
    times = measure.median_columns("cpu_s", t) | {"calls": 1}
    flops = 2 * cfg.matmul**3
    assert abs(flops / times["cpu_s"] / 1e9 - gflops) < 1e-9 * gflops
    return [
        row("matmul ceiling", times, timing, T=cfg.matmul, flops=flops)
        | {"repeats": len(t)}
    ]


def bench_generation(cfg):
    """Chapter 10's generators, by tools/bench/bench_gpt.py's function."""
    ch10, chars, _, val_data = setup()
    rows = []
    for r in bench_gpt.generation_rows(ch10, chars, val_data, cfg.new_tokens):
        name = "generate, " + ("cached" if r.pop("cached") else "uncached")
        n = r.pop("new_tokens")
        del r["tokens_per_s"]
        rows.append(
            {"measurement": name, "T": bench_gpt.PROMPT, "n": n}
            | r
            | {"calls": 1, "repeats": bench_gpt.REPEATS}
        )
    return rows


def main(cfg):
    torch.set_num_threads(1)
    ch11 = load_chapter("11_token_cost.ipynb")
    state = torch.load(BOOK / "data" / "gpt_G4.pt")
    model = gpt.GPT(state["embed.weight"].shape[0], **ch11.MODEL).eval()
    model.load_state_dict(state)
    with torch.no_grad():
        rows = bench_steps(ch11, model, cfg)
        rows += bench_operations(ch11, model, cfg)
    rows += bench_bandwidth(cfg) + bench_matmul(cfg) + bench_generation(cfg)
    table = pd.DataFrame(rows)
    table["gflop_per_s"] = table.flops / table.cpu_s / 1e9
    table["gb_per_s"] = table.bytes / table.cpu_s / 1e9
    for column in ("T", "n", "ops", "flops", "bytes"):
        table[column] = table[column].astype("Int64")
    measure_csv.write_csv(table, cfg.csv, run=measure_csv.run_id())
    shown = ["measurement", "T", "n", "ops", "cpu_s", "cpu_s_lo", "cpu_s_hi"]
    print(table[shown].to_string(index=False))


if __name__ == "__main__":
    main(measure_csv.quick_or_full(__doc__.splitlines()[0], Config(), QUICK))
