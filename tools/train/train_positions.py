"""Chapter 6's full training (`make train-positions`): the four forward-fill
models (no positions, sinusoidal, learned, rotary), each initialised by the
chapter's `new_model` and trained by its `train` (800 steps), on one thread.
Stores their weights (book/data/fill_models.pt: {scheme: float64
state_dict}) and the log (book/data/fill_train_log.csv: one row per model and
step with its loss; in each model's last row the accuracy on the blanks of
the chapter's test set of each length, acc_8 ... acc_64, and the seconds the
training took, wall_s and cpu_s, which the chapter does not print). The
chapter loads the weights and recomputes the logged accuracies at T = 16 and
32; tests/test_ch06_positions.py recomputes all seven lengths.

Usage: python tools/train/train_positions.py [--steps N]
"""

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch

# tools/ holds the shared modules (chapter_loader, measure, stored_models)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chapter_loader import BOOK, load_chapter
from measure import Stopwatch

STEPS = 800  # the default of the chapter's train


def train_all(ch, steps=STEPS):
    """Each scheme's model trained: ({scheme: model}, {scheme: losses},
    {scheme: (wall, cpu) seconds})."""
    models, losses, seconds = {}, {}, {}
    for scheme in ch.SCHEMES:
        model = ch.new_model(scheme)
        with Stopwatch() as clock:
            losses[scheme] = ch.train(model, steps=steps)
        seconds[scheme] = (clock.wall, clock.cpu)
        models[scheme] = model
    return models, losses, seconds


def log_table(ch, models, losses, seconds):
    """The log: a row per model and step; accuracies and seconds last."""
    test_sets = {T: ch.make_test_set(T) for T in ch.TEST_LENGTHS}
    rows = []
    for scheme, model in models.items():
        for step, loss in enumerate(losses[scheme]):
            rows.append({"scheme": scheme, "step": step, "loss": loss})
        for T, (x, y) in test_sets.items():
            rows[-1][f"acc_{T}"] = ch.accuracy(model, x, y)
        rows[-1]["wall_s"], rows[-1]["cpu_s"] = seconds[scheme]
    return pd.DataFrame(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ch = load_chapter("06_positions.ipynb")
    models, losses, seconds = train_all(ch, args.steps)
    log = log_table(ch, models, losses, seconds)
    torch.save(
        {s: m.state_dict() for s, m in models.items()}, BOOK / ch.WEIGHTS
    )
    log.to_csv(BOOK / ch.LOG, index=False)
    for s, row in log.groupby("scheme", sort=False).last().iterrows():
        print(
            f"{s:10}  last loss {row.loss:.4f}, accuracy at T = 16 "
            f"{row.acc_16:.3f}, {row.wall_s:.1f} s wall, {row.cpu_s:.1f} s CPU"
        )


if __name__ == "__main__":
    main()
