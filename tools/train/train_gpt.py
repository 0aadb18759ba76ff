"""Chapter 10's full training (`make train-gpt`): the small GPT with G = H = 4
key/value heads and the same model with G = 1 (multi-query attention), each
trained for STEPS steps on tiny Shakespeare. Stores their weights
(book/data/gpt_G4.pt, book/data/gpt_G1.pt, float32 state_dicts) and the
training log (book/data/gpt_train_log.csv: one row per step, the validation
loss on the chapter's fixed validation slice in each model's last row). The
model and its training are book/gpt.py's, the data and sizes chapter 10's;
the chapter loads the weights and checks that they reach the logged loss.

Usage: python tools/train/train_gpt.py [--steps N]
"""

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch

# tools/ holds the shared modules (chapter_loader, measure, stored_models)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chapter_loader import BOOK  # puts book/ on the path
from stored_models import setup

import gpt  # book/gpt.py

STEPS = 600
GROUPS = (4, 1)  # G = H (multi-head), G = 1 (multi-query)


def train_one(ch, chars, train_data, G, steps):
    """A freshly initialised GPT with G key/value heads, trained."""
    torch.manual_seed(0)
    model = gpt.GPT(len(chars), **ch.MODEL, G=G)
    losses = gpt.train(model, train_data, steps)
    return model, losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    ch, chars, train_data, val_data = setup()
    x_val, y_val = ch.validation_slice(val_data)
    rows = []
    for G in GROUPS:
        model, losses = train_one(ch, chars, train_data, G, args.steps)
        val = gpt.validation_loss(model, x_val, y_val)
        print(f"G = {G}: train loss {losses[-1]:.3f}, validation {val:.4f}")
        torch.save(model.state_dict(), BOOK / "data" / f"gpt_G{G}.pt")
        for step, loss in enumerate(losses):
            last = step == len(losses) - 1
            rows.append((G, step, loss, val if last else float("nan")))
    log = pd.DataFrame(rows, columns=["G", "step", "train_loss", "val_loss"])
    log.to_csv(BOOK / "data" / "gpt_train_log.csv", index=False)


if __name__ == "__main__":
    main()
