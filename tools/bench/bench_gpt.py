"""Chapter 10's measurements (`make bench`):

- the full training of the small GPT (G = H = 4, tools/train/train_gpt.py's
  configuration) on one thread: its CPU seconds bound the wall-clock time
  on a quiet core, whatever else the machine runs (wall seconds are
  recorded too) -> book/data/bench_gpt_train.csv (weights not stored);
- greedy generation with and without the KV cache from the stored weights
  (book/data/gpt_G4.pt), after a 16-character prompt, for 128, 256 and 512
  new tokens; on one thread, REPEATS interleaved rounds (every generator
  once per round, tools/measure.py), the median with its interval (none
  below 6 rounds), tokens per CPU second (the machine may be shared), and
  the cache's speed-up (uncached / cached time, round by round) ->
  book/data/bench_gpt_generate.csv.

Every row carries tools/measure.py's record of the machine and the load.
Fresh times are never asserted; chapter 10 asserts bounds on the stored
ones. Usage: python tools/bench/bench_gpt.py [--no-train] [--quick --out DIR]
"""

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

# tools/ holds the shared modules (chapter_loader, measure, stored_models)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import measure
import measure_csv
from chapter_loader import BOOK  # puts book/ on the path
from stored_models import load_gpt, setup

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from train_gpt import STEPS, train_one  # chapter 10's training, timed here

NEW_TOKENS = (128, 256, 512)
PROMPT = 16
REPEATS = 7  # the fewest rounds with a 95 % interval is 6


def bench_training(ch, chars, train_data, steps, out):
    """One full training (one run: no interval), CPU and wall seconds."""
    torch.set_num_threads(1)
    threads = torch.get_num_threads()
    timing = measure.interleave(
        {"train": lambda: train_one(ch, chars, train_data, 4, steps)},
        1,
        warmup=0,
    )
    wall, cpu = timing.wall["train"][0], timing.cpu["train"][0]
    print(f"training, {steps} steps: {wall:.1f} s wall, {cpu:.1f} s CPU")
    row = measure.row(
        {},
        timing,
        measure.machine(threads),
        steps=steps,
        threads=threads,
        wall_s=round(wall, 1),
        cpu_s=round(cpu, 1),
    )
    measure_csv.write_csv(
        [row], out / "bench_gpt_train.csv", run=measure_csv.run_id()
    )


def generation_rows(ch, chars, val_data, new_tokens=NEW_TOKENS):
    """Greedy generation with and without the cache, one row per length and
    generator: median CPU and wall seconds (with their intervals) of
    REPEATS interleaved rounds on one thread, and in the cached rows the
    cache's speed-up, uncached / cached CPU time round by round (also
    chapter 11's measurement, tools/bench/bench_token_cost.py)."""
    torch.set_num_threads(1)
    model = load_gpt(ch, len(chars), ch.WEIGHTS[4])
    prompt = val_data[:PROMPT]
    assert PROMPT + max(new_tokens) <= model.context
    calls = {
        (n, cached): partial(ch.generate, model, prompt, n, cached=cached)
        for n in new_tokens
        for cached in (True, False)
    }
    # one untimed call of each first: the first round is not a cold start
    timing = measure.interleave(calls, REPEATS, warmup=1)
    machine = measure.machine(torch.get_num_threads())
    rows = []
    for n, cached in calls:
        cpu = measure.median_columns("cpu_s", timing.cpu[n, cached])
        wall = measure.median_columns("wall_s", timing.wall[n, cached])
        print(
            f"{n} tokens, cached={cached}: {cpu['cpu_s']:.3f} s CPU, "
            f"{wall['wall_s']:.3f} s wall"
        )
        speedup = (
            measure.ratio_columns(timing.cpu[n, False], timing.cpu[n, True])
            if cached
            else {}
        )
        rows.append(
            measure.row(
                speedup,
                timing,
                machine,
                new_tokens=n,
                cached=cached,
                cpu_s=round(cpu["cpu_s"], 4),
                wall_s=round(wall["wall_s"], 4),
                tokens_per_s=round(n / cpu["cpu_s"], 1),
                **measure.interval_only(cpu | wall),
            )
        )
    return rows


def bench_generation(ch, chars, val_data, new_tokens, out):
    measure_csv.write_csv(
        generation_rows(ch, chars, val_data, new_tokens),
        out / "bench_gpt_generate.csv",
        run=measure_csv.run_id(),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--no-train", action="store_true", help="skip the training time"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="2 training steps, 8 and 16 new tokens (proves the script runs)",
    )
    parser.add_argument(
        "--out", type=Path, default=BOOK / "data", help="the tables' folder"
    )
    args = parser.parse_args()
    ch, chars, train_data, val_data = setup()
    steps, new_tokens = (2, (8, 16)) if args.quick else (STEPS, NEW_TOKENS)
    if not args.no_train:
        bench_training(ch, chars, train_data, steps, args.out)
    bench_generation(ch, chars, val_data, new_tokens, args.out)


if __name__ == "__main__":
    main()
