"""Chapter 12's decoding speeds (`make bench`): greedy decoding of
NEW_TOKENS new tokens after a PROMPT-character prompt, with each model's
own cache (book/gpt.py's `greedy`, caches from `GPT.new_caches()`), for
chapter 10's MHA and MQA (book/data/gpt_G4.pt, gpt_G1.pt) and the variants
of tools/train/train_variants.py (book/data/variants/<name>.pt): GQA, the
width-matched MQA, the window model (its rolling cache), MLA expanded and
absorbed (the same weights, `absorbed=True`: the keys and values never
rebuilt), the hybrid, the sparse model and CLA.

One thread; tokens per CPU second (the machine may be shared); REPEATS
rounds (tools/measure.py's `interleave`) after one untimed warm-up call
of each model, each round decoding with every
model once, so that a drift of the machine hits them all alike; the median
of the rounds with its 95 % interval (none below 6 rounds), each round's
value, and each model's speed against MHA (MHA's CPU time / the model's,
round by round: ratio_median, ratio_lo, ratio_hi), with the machine and the
load -> book/data/bench_variants.csv. Fresh times are never asserted.
Usage: python tools/bench/bench_variants.py [--quick --csv PATH]
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
from chapter_loader import BOOK
from stored_models import load_gpt, setup

import gpt  # book/gpt.py
import variants  # book/variants.py

PROMPT = 16
NEW_TOKENS = 512
REPEATS = 7  # the fewest rounds with a 95 % interval is 6
# name in the CSV: chapter 10's weights (G) or a variant's name
MODELS = {
    "mha": 4,
    "gqa": "gqa",
    "mqa": 1,
    "mqa_wide": "mqa_wide",
    "window": "window",
    "mla": "mla",
    "mla_absorbed": "mla",
    "hybrid": "hybrid",
    "sparse": "sparse",
    "cla": "cla",
}


def load(ch, vocab, name):
    """The model called `name` in MODELS, with its stored weights."""
    source = MODELS[name]
    if isinstance(source, int):  # chapter 10's G = 4 or G = 1
        model = load_gpt(ch, vocab, ch.WEIGHTS[source], G=source)
    else:
        model, _ = variants.build_variant(source, vocab, **ch.MODEL)
        path = BOOK / "data" / "variants" / f"{source}.pt"
        model.load_state_dict(torch.load(path))
    if name == "mla_absorbed":
        for block in model.blocks:
            block.self_attn.absorbed = True
    return model.eval()


def decode(model, prompt, new_tokens):
    with torch.no_grad():
        return gpt.greedy(model, prompt, new_tokens)


def main(new_tokens, csv):
    torch.set_num_threads(1)
    ch, chars, _, val_data = setup()
    models = {name: load(ch, len(chars), name) for name in MODELS}
    prompt = val_data[:PROMPT]
    calls = {  # rounds: every model once per round
        name: partial(decode, model, prompt, new_tokens)
        for name, model in models.items()
    }
    # one untimed call of each first: the first round is not a cold start
    timing = measure.interleave(calls, REPEATS, warmup=1)
    machine = measure.machine(torch.get_num_threads())
    rows = []
    for name, cpu in timing.cpu.items():
        rates = [new_tokens / t for t in cpu]
        print(f"{name}: " + ", ".join(f"{r:.0f}" for r in rates) + " tokens/s")
        median = measure.median_columns("tokens_per_cpu_s", rates)
        versus_mha = measure.ratio_columns(timing.cpu["mha"], cpu)
        rows.append(
            measure.row(
                versus_mha | {"ratio_to": "mha"},
                timing,
                machine,
                name=name,
                new_tokens=new_tokens,
                tokens_per_cpu_s=round(median["tokens_per_cpu_s"], 1),
                **{f"round{i + 1}": round(v, 1) for i, v in enumerate(rates)},
                **measure.interval_only(median),
            )
        )
    measure_csv.write_csv(
        rows, csv, run=measure_csv.run_id(), float_format=None
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 new tokens")
    parser.add_argument(
        "--csv", type=Path, default=BOOK / "data" / "bench_variants.csv"
    )
    args = parser.parse_args()
    main(16 if args.quick else NEW_TOKENS, args.csv)
