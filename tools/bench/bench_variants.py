"""Chapter 12's decoding speeds (`make bench`): greedy decoding of
NEW_TOKENS new tokens after a PROMPT-character prompt, with each model's
own cache (book/gpt.py's `greedy`, caches from `GPT.new_caches()`), for
chapter 10's MHA and MQA (book/data/gpt_G4.pt, gpt_G1.pt) and the variants
of tools/train/train_variants.py (book/data/variants/<name>.pt): GQA, the
width-matched MQA, the window model (its rolling cache), MLA expanded and
absorbed (the same weights, `absorbed=True`: the keys and values never
rebuilt), the hybrid, the sparse model and CLA.

One thread; tokens per CPU second (the machine may be shared); REPEATS
rounds, each round decoding with every model once, so that a drift of the
machine hits them all alike; the median of the rounds and each round's
value -> book/data/bench_variants.csv. Fresh times are never asserted.
Usage: python tools/bench/bench_variants.py
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
import variants  # book/variants.py

PROMPT = 16
NEW_TOKENS = 512
REPEATS = 3
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


def decode(model, prompt):
    with torch.no_grad():
        return gpt.greedy(model, prompt, NEW_TOKENS)


def main():
    torch.set_num_threads(1)
    ch, chars, _, val_data = setup()
    models = {name: load(ch, len(chars), name) for name in MODELS}
    prompt = val_data[:PROMPT]
    rates = {name: [] for name in MODELS}
    for r in range(REPEATS):  # rounds: every model once per round
        for name, model in models.items():
            _, cpu = timed(partial(decode, model, prompt))
            rates[name].append(NEW_TOKENS / cpu)
            print(f"round {r + 1}, {name}: {NEW_TOKENS / cpu:.0f} tokens/s")
    machine = f"{cpu_model()}, torch {torch.__version__}"
    rows = [
        {
            "name": name,
            "new_tokens": NEW_TOKENS,
            "tokens_per_cpu_s": round(statistics.median(values), 1),
            **{f"round{i + 1}": round(v, 1) for i, v in enumerate(values)},
            "threads": torch.get_num_threads(),
            "machine": machine,
        }
        for name, values in rates.items()
    ]
    pd.DataFrame(rows).to_csv(
        BOOK / "data" / "bench_variants.csv", index=False
    )


if __name__ == "__main__":
    main()
