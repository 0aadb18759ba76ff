"""Chapter 11's decode-overhead and batching measurements (`make bench`):

- greedy decoding from the stored weights (book/data/gpt_G4.pt, in a GPT
  whose `context` is 4,096) after a 16-character prompt, at 512 and 2,048
  new tokens, for each configuration of CONFIGS: no cache, chapter 10's
  growing cache, the static cache, then book/gpt.py's `Decoder` with one
  more lever switched on per row (cumulative), and torch.inference_mode;
  without a cache only 512 (seven runs) and 1,024 (one run, so no
  interval): 2,048 would take several minutes per run;
- batched greedy decoding (`greedy_batch`, every lever on) of B prompts of
  8 to 39 characters, BATCH_NEW new tokens each, B in BATCHES.

One thread; timed by tools/measure.py: the median of REPEATS runs (the
cached configurations in rounds, each round running every one once, so
that a drift of the machine hits them all alike; the batches too), with
its 95 % interval (none below 6 runs); CPU seconds (the machine may be
shared) and wall seconds; tokens per CPU second (B x new tokens for a
batch); for each lever, its speed-up over the row before (that row's CPU
time / this one's, round by round: ratio_median, ratio_lo, ratio_hi,
ratio_to). Every row carries the machine and the load.
-> book/data/bench_static.csv. Fresh times are never asserted; chapter 11
asserts bounds on the stored ones.
Usage: python tools/bench/bench_static.py [--quick --out DIR]
"""

import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

# tools/ holds the shared modules (chapter_loader, measure, stored_models)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import measure
import measure_csv
from chapter_loader import BOOK
from stored_models import load_gpt, setup

import gpt  # book/gpt.py

PROMPT = 16


@dataclass(frozen=True)
class Config:
    """The sizes of a run (--quick: QUICK's) and the table it writes."""

    new_tokens: tuple[int, ...] = (512, 2048)
    # (new tokens, runs) without a cache: 2,048 is too slow
    # (1,024 runs once, about 41 s: no interval; seven would add 4 minutes)
    uncached: tuple[tuple[int, int], ...] = ((512, 7), (1024, 1))
    repeats: int = 7
    batches: tuple[int, ...] = (1, 4, 16, 64)
    batch_new: int = 256
    csv: Path = BOOK / "data" / "bench_static.csv"


QUICK = Config((16, 32), ((16, 1),), 6, (1, 2), 8)
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


def rows_of(timing, B, n, machine, reference=None):
    """One row per program of `timing`: medians with their intervals and,
    for a lever, its speed-up over the program before it (`reference`
    maps a name to that program's name)."""
    rows = []
    for config, cpu_times in timing.cpu.items():
        cpu = measure.median_columns("cpu_s", cpu_times)
        wall = measure.median_columns("wall_s", timing.wall[config])
        before = (reference or {}).get(config)
        lever = {}
        if before is not None:
            lever = measure.ratio_columns(timing.cpu[before], cpu_times)
            lever["ratio_to"] = before
        print(
            f"{config}, B = {B}, {n} tokens: {cpu['cpu_s']:.3f} s CPU, "
            f"{wall['wall_s']:.3f} s wall"
        )
        rows.append(
            measure.row(
                lever,
                timing,
                machine,
                config=config,
                B=B,
                new_tokens=n,
                runs=len(cpu_times),
                cpu_s=round(cpu["cpu_s"], 4),
                wall_s=round(wall["wall_s"], 4),
                tokens_per_s=round(B * n / cpu["cpu_s"], 1),
                threads=torch.get_num_threads(),
                **measure.interval_only(cpu | wall),
            )
        )
    return rows


def batch_rows(model, val_data, cfg, machine):
    """Batched greedy decoding, every B in turn in each round."""
    decoder = gpt.Decoder(model, 64 + cfg.batch_new)
    calls = {}
    for B in cfg.batches:
        starts = [1000 + 97 * b for b in range(B)]
        prompts = [
            val_data[s : s + 8 + (7 * b) % 32] for b, s in enumerate(starts)
        ]
        calls[B] = partial(gpt.greedy_batch, decoder, prompts, cfg.batch_new)
    with torch.inference_mode():
        timing = measure.interleave(calls, cfg.repeats, warmup=1)
    rows = []
    for B in cfg.batches:
        one = measure.Timing(
            {"batch": timing.wall[B]},
            {"batch": timing.cpu[B]},
            load_before=timing.load_before,
            load_after=timing.load_after,
            cores=timing.cores,
        )
        rows += rows_of(one, B, cfg.batch_new, machine)
    return rows


def main(cfg):
    torch.set_num_threads(1)
    machine = measure.machine(1)
    ch, chars, _, val_data = setup()
    model = load_gpt(ch, len(chars), ch.WEIGHTS[4], context=4096)
    prompt, rows = val_data[:PROMPT], []
    for n, runs in cfg.uncached:
        fn = partial(decode, model, prompt, n, None, False)
        timing = measure.interleave({"no cache": fn}, runs, warmup=1)
        rows += rows_of(timing, 1, n, machine)
    names = list(CONFIGS)
    reference = dict(zip(names[1:], names[:-1]))  # each lever: the row before
    for n in cfg.new_tokens:  # rounds of every config, so drift hits them all
        calls = {
            config: partial(decode, model, prompt, n, how, inference)
            for config, (how, inference) in CONFIGS.items()
        }
        timing = measure.interleave(calls, cfg.repeats, warmup=1)
        rows += rows_of(timing, 1, n, machine, reference)
    rows += batch_rows(model, val_data, cfg, machine)
    measure_csv.write_csv(
        rows, cfg.csv, run=measure_csv.run_id(), float_format=None
    )


if __name__ == "__main__":
    main(measure_csv.quick_or_full(__doc__.splitlines()[0], Config(), QUICK))
