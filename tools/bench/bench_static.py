"""Chapter 11's decode-overhead and batching measurements (`make bench`):

- greedy decoding from the stored weights (book/data/gpt_G4.pt, in a GPT
  whose `context` is 4,096) after a 16-character prompt, at 512 and 2,048
  new tokens, for each configuration of CONFIGS: no cache, chapter 10's
  growing cache, the static cache, then book/gpt.py's `Decoder` with one
  more lever switched on per row (cumulative), and torch.inference_mode;
  without a cache only 512 (three runs) and 1,024 (one run): 2,048 would
  take several minutes per run;
- batched greedy decoding (`greedy_batch`, every lever on) of B prompts of
  8 to 39 characters, BATCH_NEW new tokens each, B in BATCHES.

One thread; the median of REPEATS runs (the cached configurations in
rounds, each round running every one once, so that a drift of the machine
hits them all alike); CPU seconds (the machine may be
shared) and wall seconds; tokens per CPU second (B x new tokens for a
batch). Every row names the machine. -> book/data/bench_static.csv.
Fresh times are never asserted; chapter 11 asserts bounds on the stored
ones. Usage: python tools/bench/bench_static.py
"""

import statistics
import sys
from functools import partial
from pathlib import Path

import pandas as pd
import torch

# tools/ holds the shared modules (chapter_loader, measure, stored_models)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_attention_output import cpu_model
from bench_gpt import timed
from chapter_loader import BOOK
from stored_models import load_gpt, setup

import gpt  # book/gpt.py

PROMPT = 16
NEW_TOKENS = (512, 2048)
UNCACHED = ((512, 3), (1024, 1))  # (new tokens, runs): 2,048 is too slow
REPEATS = 5
BATCHES = (1, 4, 16, 64)
BATCH_NEW = 256
# name: (caches or Decoder options, inference_mode); each adds one lever
CONFIGS = {
    "growing cache": ("growing", False),
    "static cache": ("static", False),
    "Decoder: functional step": (
        {"tables": False, "mask": True, "fused": False},
        False,
    ),
    "+ rotary tables": ({"tables": True, "mask": True, "fused": False}, False),
    "+ no mask for one token": (
        {"tables": True, "mask": False, "fused": False},
        False,
    ),
    "+ fused attention": (
        {"tables": True, "mask": False, "fused": True},
        False,
    ),
    "+ inference_mode": ({"tables": True, "mask": False, "fused": True}, True),
}


def decode(model, prompt, n, how, inference):
    """One greedy run: `how` is a cache kind or the Decoder's options."""
    mode = torch.inference_mode() if inference else torch.no_grad()
    with mode:
        if isinstance(how, dict):
            model = gpt.Decoder(model, len(prompt) + n, **how)
            return gpt.greedy(model, prompt, n)
        return gpt.greedy(model, prompt, n, how)


def median_times(fn, runs):
    results = [timed(fn) for _ in range(runs)]
    return (
        statistics.median(r[0] for r in results),
        statistics.median(r[1] for r in results),
    )


def row(config, B, n, runs, wall, cpu):
    print(f"{config}, B = {B}, {n} tokens: {cpu:.3f} s CPU, {wall:.3f} s wall")
    return {
        "config": config,
        "B": B,
        "new_tokens": n,
        "runs": runs,
        "cpu_s": round(cpu, 4),
        "wall_s": round(wall, 4),
        "tokens_per_s": round(B * n / cpu, 1),
        "threads": torch.get_num_threads(),
        "machine": f"{cpu_model()}, torch {torch.__version__}",
    }


def main():
    torch.set_num_threads(1)
    ch, chars, _, val_data = setup()
    model = load_gpt(ch, len(chars), ch.WEIGHTS[4], context=4096)
    prompt, rows = val_data[:PROMPT], []
    for n, runs in UNCACHED:
        fn = partial(decode, model, prompt, n, None, False)
        rows.append(row("no cache", 1, n, runs, *median_times(fn, runs)))
    for n in NEW_TOKENS:  # rounds of every config, so drift hits them all
        runs = {config: [] for config in CONFIGS}
        for _ in range(REPEATS):
            for config, (how, inference) in CONFIGS.items():
                fn = partial(decode, model, prompt, n, how, inference)
                runs[config].append(timed(fn))
        for config, results in runs.items():
            wall = statistics.median(r[0] for r in results)
            cpu = statistics.median(r[1] for r in results)
            rows.append(row(config, 1, n, REPEATS, wall, cpu))
    decoder = gpt.Decoder(model, 64 + BATCH_NEW)
    for B in BATCHES:
        starts = [1000 + 97 * b for b in range(B)]
        prompts = [
            val_data[s : s + 8 + (7 * b) % 32] for b, s in enumerate(starts)
        ]
        fn = partial(gpt.greedy_batch, decoder, prompts, BATCH_NEW)
        with torch.inference_mode():
            times = median_times(fn, REPEATS)
        rows.append(row("batch", B, BATCH_NEW, REPEATS, *times))
    pd.DataFrame(rows).to_csv(BOOK / "data" / "bench_static.csv", index=False)


if __name__ == "__main__":
    main()
