"""Chapter 11's draft model (`make train-gpt-draft`): chapter 10's GPT with
one layer instead of two, trained like it (book/gpt.py's `train`, the same
steps, batches and seed) on one thread. Stores its weights
(book/data/gpt_draft.pt, a float32 state_dict) and one log row
(book/data/gpt_draft_train_log.csv: steps, final training loss, validation
loss on chapter 10's validation slice, CPU and wall seconds).

Usage: python tools/train/train_gpt_draft.py [--steps N]
"""

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch

# tools/ holds the shared modules (chapter_loader, measure, stored_models)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chapter_loader import BOOK  # puts book/ on the path
from measure import Stopwatch
from stored_models import setup
from train_gpt import STEPS

import gpt  # book/gpt.py

LAYERS = 1  # the main model has 2


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ch, chars, train_data, val_data = setup()
    x_val, y_val = ch.validation_slice(val_data)
    with Stopwatch() as clock:
        torch.manual_seed(0)
        model = gpt.GPT(len(chars), **{**ch.MODEL, "layers": LAYERS})
        losses = gpt.train(model, train_data, args.steps)
    wall, cpu = clock.wall, clock.cpu
    val = gpt.validation_loss(model, x_val, y_val)
    print(
        f"draft ({LAYERS} layer): train loss {losses[-1]:.3f}, validation "
        f"{val:.4f}; {cpu:.1f} s CPU, {wall:.1f} s wall"
    )
    torch.save(model.state_dict(), BOOK / "data" / "gpt_draft.pt")
    row = {
        "layers": LAYERS,
        "steps": args.steps,
        "train_loss": losses[-1],
        "val_loss": val,
        "threads": torch.get_num_threads(),
        "cpu_s": round(cpu, 1),
        "wall_s": round(wall, 1),
    }
    pd.DataFrame([row]).to_csv(
        BOOK / "data" / "gpt_draft_train_log.csv", index=False
    )


if __name__ == "__main__":
    main()
