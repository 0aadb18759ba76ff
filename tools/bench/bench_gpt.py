"""Chapter 10's measurements (`make bench`):

- the full training of the small GPT (G = H = 4, tools/train/train_gpt.py's
  configuration) on one thread: its CPU seconds bound the wall-clock time
  on a quiet core, whatever else the machine runs (wall seconds are
  recorded too) -> book/data/bench_gpt_train.csv (weights not stored);
- greedy generation with and without the KV cache from the stored weights
  (book/data/gpt_G4.pt), after a 16-character prompt, for 128, 256 and 512
  new tokens; on one thread, the median of REPEATS runs, tokens per CPU
  second (the machine may be shared) -> book/data/bench_gpt_generate.csv.

Fresh times are never asserted; chapter 10 asserts bounds on the stored ones. Usage:
python tools/bench/bench_gpt.py [--no-train]
"""

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import pandas as pd
import torch

# tools/ holds the shared modules (chapter_loader, measure, stored_models)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chapter_loader import BOOK  # puts book/ on the path
from stored_models import load_gpt, setup

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from train_gpt import STEPS, train_one  # chapter 10's training, timed here

NEW_TOKENS = (128, 256, 512)
PROMPT = 16
REPEATS = 3


def timed(fn):
    """(wall seconds, CPU seconds) of one call of fn."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def bench_training(ch, chars, train_data):
    torch.set_num_threads(1)
    threads = torch.get_num_threads()
    wall, cpu = timed(lambda: train_one(ch, chars, train_data, 4, STEPS))
    print(f"training, {STEPS} steps: {wall:.1f} s wall, {cpu:.1f} s CPU")
    row = {
        "steps": STEPS,
        "threads": threads,
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
    }
    pd.DataFrame([row]).to_csv(
        BOOK / "data" / "bench_gpt_train.csv", index=False
    )


def generation_rows(ch, chars, val_data):
    """Greedy generation with and without the cache, one row per length and
    generator: median CPU and wall seconds of REPEATS runs, on one thread
    (also chapter 11's measurement, tools/bench/bench_token_cost.py)."""
    torch.set_num_threads(1)
    model = load_gpt(ch, len(chars), ch.WEIGHTS[4])
    prompt = val_data[:PROMPT]
    assert PROMPT + max(NEW_TOKENS) <= model.context
    rows = []
    for n in NEW_TOKENS:
        for cached in (True, False):
            runs = [
                timed(partial(ch.generate, model, prompt, n, cached=cached))
                for _ in range(REPEATS)
            ]
            wall = statistics.median(r[0] for r in runs)
            cpu = statistics.median(r[1] for r in runs)
            print(
                f"{n} tokens, cached={cached}: {cpu:.3f} s CPU, "
                f"{wall:.3f} s wall"
            )
            rows.append(
                {
                    "new_tokens": n,
                    "cached": cached,
                    "cpu_s": round(cpu, 4),
                    "wall_s": round(wall, 4),
                    "tokens_per_s": round(n / cpu, 1),
                }
            )
    return rows


def bench_generation(ch, chars, val_data):
    pd.DataFrame(generation_rows(ch, chars, val_data)).to_csv(
        BOOK / "data" / "bench_gpt_generate.csv", index=False
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--no-train", action="store_true", help="skip the training time"
    )
    args = parser.parse_args()
    ch, chars, train_data, val_data = setup()
    if not args.no_train:
        bench_training(ch, chars, train_data)
    bench_generation(ch, chars, val_data)


if __name__ == "__main__":
    main()
