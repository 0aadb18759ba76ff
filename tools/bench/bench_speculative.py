"""Chapter 11's speculative-decoding measurements (`make bench`), float32,
one thread, timed by tools/measure.py in REPEATS interleaved rounds, the
median CPU and wall seconds with their 95 % intervals (none below 6
rounds):

- greedy decoding of NEW_TOKENS tokens after chapter 10's 16-character
  validation prompt by chapter 10's GPT (book/data/gpt_G4.pt): plain cached
  (k = 0) and speculative with the one-layer draft (book/data/gpt_draft.pt)
  for k = 2, 4, 8, with the proposals made and accepted, and each one's
  speed-up over plain decoding (its CPU time / the speculative one's,
  round by round: ratio_median, ratio_lo, ratio_hi);
- the cost of one cached call at a cache of CALL_AT tokens: the main model
  and the draft fed 1 token, the main model fed k + 1 (a verification),
  each timed as a block of CALLS calls.

-> book/data/bench_speculative.csv (one row per measurement, with the
machine and the load). Fresh times are never asserted; chapter 11 asserts
bounds on the stored ones.
Usage: python tools/bench/bench_speculative.py [--quick --csv PATH]
"""

import argparse
import sys
from functools import partial
from pathlib import Path

import pandas as pd
import torch

# tools/ holds the shared modules (chapter_loader, measure, stored_models)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import measure
import measure_csv
from chapter_loader import BOOK  # puts book/ on the path
from stored_models import load_gpt, setup

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from train_gpt_draft import LAYERS  # the draft model's depth

import gpt  # book/gpt.py
import speculative as spec  # book/speculative.py

NEW_TOKENS = 500
PROMPT = 16
KS = (2, 4, 8)
REPEATS = 7  # the fewest rounds with a 95 % interval is 6
CALL_AT, CALLS = 256, 200


@torch.no_grad()
def call_block(model, tokens, T, calls):
    """A block of `calls` cached calls of T tokens after CALL_AT cached
    ones (the cache cropped back after each)."""
    caches = model.new_caches()
    model(tokens[None, :CALL_AT], caches)
    fed = tokens[None, CALL_AT : CALL_AT + T]

    def block():
        for _ in range(calls):
            model(fed, caches)
            for cache in caches:
                cache.crop(CALL_AT)

    return block


def time_columns(timing, name, per=1):
    """The median CPU and wall seconds of `name` (per call of a block of
    `per`), with their intervals."""
    return measure.median_columns(
        "cpu_s", timing.cpu[name], per
    ) | measure.median_columns("wall_s", timing.wall[name], per)


def decoding_rows(model, draft, prompt, new_tokens, machine):
    """Plain greedy decoding and speculative decoding for every k of KS,
    in REPEATS interleaved rounds."""
    calls = {0: lambda: gpt.greedy(model, prompt, new_tokens)}
    for k in KS:
        calls[k] = partial(
            spec.speculative, model, draft, prompt, new_tokens, k
        )
    with torch.no_grad():
        timing = measure.interleave(calls, REPEATS, keep_results=True)
    plain, _ = timing.results[0]
    rows = [
        measure.row(
            {},
            timing,
            machine,
            kind="greedy",
            k=0,
            new_tokens=new_tokens,
            proposed=0,
            accepted=0,
            **time_columns(timing, 0),
        )
    ]
    for k in KS:
        tokens, proposed, accepted = timing.results[k]
        speedup = measure.ratio_columns(timing.cpu[0], timing.cpu[k])
        rows.append(
            measure.row(
                speedup,
                timing,
                machine,
                kind="speculative",
                k=k,
                new_tokens=new_tokens,
                proposed=proposed,
                accepted=accepted,
                same_text=bool(torch.equal(tokens, plain)),
                **time_columns(timing, k),
            )
        )
    return rows


def call_rows(model, draft, tokens, calls, machine):
    """The cost of one cached call: the main model and the draft fed one
    token, the main model fed k + 1, in REPEATS interleaved rounds."""
    programs = {("main call", 1): model, ("draft call", 1): draft}
    programs |= {("main call", k + 1): model for k in KS}
    blocks = {
        key: call_block(m, tokens, key[1], calls)
        for key, m in programs.items()
    }
    timing = measure.interleave(blocks, REPEATS)
    return [
        measure.row(
            {},
            timing,
            machine,
            kind=name,
            k=T - 1 if T > 1 else 0,
            tokens_fed=T,
            **time_columns(timing, (name, T), per=calls),
        )
        for name, T in blocks
    ]


def main(new_tokens, calls, csv):
    torch.set_num_threads(1)
    machine = measure.machine(1)
    ch, chars, _, val_data = setup()
    model = load_gpt(ch, len(chars), ch.WEIGHTS[4])
    draft = load_gpt(ch, len(chars), "data/gpt_draft.pt", layers=LAYERS)
    prompt = val_data[:PROMPT]
    rows = decoding_rows(model, draft, prompt, new_tokens, machine)
    tokens = val_data[: CALL_AT + max(KS) + 1]
    rows += call_rows(model, draft, tokens, calls, machine)
    table = pd.DataFrame(rows)
    table["tokens_per_cpu_s"] = table.new_tokens / table.cpu_s
    for row in rows:
        print(row)
    measure_csv.write_csv(table, csv, run=measure_csv.run_id())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="20 new tokens, blocks of 2 calls"
    )
    parser.add_argument(
        "--csv", type=Path, default=BOOK / "data" / "bench_speculative.csv"
    )
    args = parser.parse_args()
    main(*((20, 2) if args.quick else (NEW_TOKENS, CALLS)), args.csv)
