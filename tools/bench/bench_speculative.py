"""Chapter 11's speculative-decoding measurements (`make bench`), float32,
one thread, the median of REPEATS runs, CPU and wall seconds:

- greedy decoding of NEW_TOKENS tokens after chapter 10's 16-character
  validation prompt by chapter 10's GPT (book/data/gpt_G4.pt): plain cached
  (k = 0) and speculative with the one-layer draft (book/data/gpt_draft.pt)
  for k = 2, 4, 8, with the proposals made and accepted;
- the cost of one cached call at a cache of CALL_AT tokens: the main model
  and the draft fed 1 token, the main model fed k + 1 (a verification).

-> book/data/bench_speculative.csv (one row per measurement, a `machine`
column). Fresh times are never asserted; chapter 11 asserts bounds on the
stored ones. Usage: python tools/bench/bench_speculative.py
"""

import statistics
import sys
import time
from pathlib import Path

import pandas as pd
import torch

# tools/ holds the shared modules (chapter_loader, measure, stored_models)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_attention_output import cpu_model
from chapter_loader import BOOK  # puts book/ on the path
from stored_models import load_gpt, setup

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from train_gpt_draft import LAYERS  # the draft model's depth

import gpt  # book/gpt.py
import speculative as spec  # book/speculative.py

NEW_TOKENS = 500
PROMPT = 16
KS = (2, 4, 8)
REPEATS = 3
CALL_AT, CALLS = 256, 200


def timed(fn):
    """(result, wall seconds, CPU seconds) of one call of fn."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def median_run(fn):
    """(result, median wall, median CPU seconds) of REPEATS calls."""
    runs = [timed(fn) for _ in range(REPEATS)]
    wall = statistics.median(r[1] for r in runs)
    cpu = statistics.median(r[2] for r in runs)
    return runs[0][0], wall, cpu


@torch.no_grad()
def call_cost(model, tokens, T):
    """Median (wall, CPU) seconds of one cached call of T tokens after
    CALL_AT cached ones, over REPEATS blocks of CALLS calls."""
    caches = model.new_caches()
    model(tokens[None, :CALL_AT], caches)
    fed = tokens[None, CALL_AT : CALL_AT + T]

    def block():
        for _ in range(CALLS):
            model(fed, caches)
            for cache in caches:
                cache.crop(CALL_AT)

    _, wall, cpu = median_run(block)
    return wall / CALLS, cpu / CALLS


def main():
    torch.set_num_threads(1)
    ch, chars, _, val_data = setup()
    model = load_gpt(ch, len(chars), ch.WEIGHTS[4])
    draft = load_gpt(ch, len(chars), "data/gpt_draft.pt", layers=LAYERS)
    prompt = val_data[:PROMPT]
    machine = f"{cpu_model()}, {torch.get_num_threads()} thread"
    rows = []

    def row(kind, k, wall, cpu, **extra):
        rows.append(
            {"kind": kind, "k": k, **extra, "cpu_s": cpu, "wall_s": wall}
        )
        print(rows[-1])

    with torch.no_grad():
        (plain, _), wall, cpu = median_run(
            lambda: gpt.greedy(model, prompt, NEW_TOKENS)
        )
    row("greedy", 0, wall, cpu, new_tokens=NEW_TOKENS, proposed=0, accepted=0)
    for k in KS:
        (tokens, proposed, accepted), wall, cpu = median_run(
            lambda k=k: spec.speculative(model, draft, prompt, NEW_TOKENS, k)
        )
        same = bool(torch.equal(tokens, plain))
        row(
            "speculative",
            k,
            wall,
            cpu,
            new_tokens=NEW_TOKENS,
            proposed=proposed,
            accepted=accepted,
            same_text=same,
        )
    tokens = torch.cat([val_data[: CALL_AT + max(KS) + 1]])
    for name, m, T in [("main call", model, 1), ("draft call", draft, 1)] + [
        ("main call", model, k + 1) for k in KS
    ]:
        wall, cpu = call_cost(m, tokens, T)
        row(name, T - 1 if T > 1 else 0, wall, cpu, tokens_fed=T)
    table = pd.DataFrame(rows)
    table["tokens_per_cpu_s"] = table.new_tokens / table.cpu_s
    table["threads"] = torch.get_num_threads()
    table["machine"] = machine
    path = BOOK / "data" / "bench_speculative.csv"
    table.to_csv(path, index=False, float_format="%.6g")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
