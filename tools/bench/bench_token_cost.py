"""Chapter 11's measurements (`make bench`), all in one run on one machine,
on one thread, in CPU seconds (medians: REPEATS runs for prefill and decode,
bench_gpt.REPEATS for generation, matmul_ceiling's own count for the
matmul row; the CSV records each; wall seconds are recorded too, since the
machine may be shared):

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
name -> book/data/bench_token_cost.csv. Its columns T and n are equation
ch11-cost's T and n in the prefill and decode rows; in the generation rows
they hold the prompt's length and the tokens generated (chapter 11's P and
N), in the matmul row T holds MATMUL. Fresh times are never asserted; chapter 11
asserts bounds on the stored ones. Usage: python tools/bench/bench_token_cost.py
"""

import platform
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import pandas as pd
import torch

# tools/ holds the shared modules (chapter_loader, measure, stored_models)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_gpt
from bench_attention import parse_args
from bench_attention_output import cpu_model
from bench_attention_timing import matmul_ceiling
from chapter_loader import BOOK, load_chapter  # puts book/ on the path
from stored_models import setup

import gpt  # book/gpt.py

PREFILL_T = (16, 64, 128, 512)
DECODE_N = (16, 128, 512)
REPLAY_N = 128
BANDWIDTH_MIB = 256
MATMUL = 2048  # as tools/bench/bench_attention.py's ceiling
REPEATS = 5
CSV = BOOK / "data" / "bench_token_cost.csv"


def timed(fn, calls):
    """Median (CPU, wall) seconds per call of fn, over REPEATS runs of
    `calls` calls each."""
    fn()  # warm-up
    runs = []
    for _ in range(REPEATS):
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(calls):
            fn()
        cpu = (time.process_time() - cpu) / calls
        runs.append((cpu, (time.perf_counter() - wall) / calls))
    return (
        statistics.median(r[0] for r in runs),
        statistics.median(r[1] for r in runs),
    )


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


def row(measurement, cpu, wall, calls, T=None, n=None, ops=None, **more):
    return {
        "measurement": measurement,
        "T": T,
        "n": n,
        "ops": ops,
        "cpu_s": cpu,
        "wall_s": wall,
        "calls": calls,
        "repeats": REPEATS,
        **more,
    }


def bench_steps(ch11, model):
    dims = ch11.sizes(model)
    rows = []
    for T in PREFILL_T:
        x = torch.arange(T)[None] % dims["vocab"]
        calls = max(5, 2000 // T)
        cpu, wall = timed(partial(model, x), calls)
        flops, read = ch11.cost(T, 0, **dims)
        rows.append(
            row("prefill", cpu, wall, calls, T=T, n=0, flops=flops, bytes=read)
        )
    for n in DECODE_N:
        calls = 200
        cpu, wall = timed(decode_step(model, n), calls)
        flops, read = ch11.cost(1, n, **dims)
        rows.append(
            row("decode", cpu, wall, calls, T=1, n=n, flops=flops, bytes=read)
        )
    return rows


def bench_operations(ch11, model):
    a, b = torch.randn(1, 1, 64), torch.randn(1, 1, 64)
    calls = 20_000
    cpu, wall = timed(lambda: a + b, calls)
    rows = [row("small operation", cpu, wall, calls, ops=1)]
    step = decode_step(model, REPLAY_N)
    with ch11.OpLog() as log:
        step()
    recorded = log.calls

    def replay():
        for op, args, kwargs in recorded:
            op(*args, **kwargs)

    calls = 200
    cpu, wall = timed(replay, calls)
    ops = len(recorded)
    rows.append(
        row(
            "decode operations",
            cpu / ops,
            wall / ops,
            calls,
            T=1,
            n=REPLAY_N,
            ops=ops,
        )
    )
    return rows


def bench_bandwidth():
    x = torch.ones(BANDWIDTH_MIB * 2**20 // 4)  # float32
    calls = 5
    cpu, wall = timed(x.sum, calls)
    return [row("read bandwidth", cpu, wall, calls, bytes=x.nbytes)]


def bench_matmul():
    """Chapter 8's compute roof, by tools/bench/bench_attention_timing.py's function."""
    args = parse_args(["--matmul-size", str(MATMUL), "--clock", "cpu"])
    gflops, median, repeats = matmul_ceiling(args)
    flops = 2 * MATMUL**3
    assert abs(flops / median / 1e9 - gflops) < 1e-9 * gflops
    return [
        row("matmul ceiling", median, None, 1, T=MATMUL, flops=flops)
        | {"repeats": repeats}
    ]


def bench_generation():
    """Chapter 10's generators, by tools/bench/bench_gpt.py's function."""
    ch10, chars, _, val_data = setup()
    rows = []
    for r in bench_gpt.generation_rows(ch10, chars, val_data):
        name = "generate, " + ("cached" if r["cached"] else "uncached")
        rows.append(
            row(name, r["cpu_s"], r["wall_s"], 1, T=bench_gpt.PROMPT)
            | {"n": r["new_tokens"], "repeats": bench_gpt.REPEATS}
        )
    return rows


def main():
    torch.set_num_threads(1)
    ch11 = load_chapter("11_token_cost.ipynb")
    state = torch.load(BOOK / "data" / "gpt_G4.pt")
    model = gpt.GPT(state["embed.weight"].shape[0], **ch11.MODEL).eval()
    model.load_state_dict(state)
    with torch.no_grad():
        rows = bench_steps(ch11, model) + bench_operations(ch11, model)
    rows += bench_bandwidth() + bench_matmul() + bench_generation()
    table = pd.DataFrame(rows)
    table["gflop_per_s"] = table.flops / table.cpu_s / 1e9
    table["gb_per_s"] = table.bytes / table.cpu_s / 1e9
    table["threads"] = torch.get_num_threads()
    model_name = cpu_model() or platform.processor() or platform.machine()
    table["machine"] = f"{model_name}, {__import__('os').cpu_count()} cores"
    table["torch"] = torch.__version__
    for column in ("T", "n", "ops", "flops", "bytes"):
        table[column] = table[column].astype("Int64")
    table.to_csv(CSV, index=False, float_format="%.6g")
    print(table.drop(columns=["machine", "torch"]).to_string(index=False))


if __name__ == "__main__":
    main()
