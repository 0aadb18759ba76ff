"""Chapter 7's full trainings (`make train-sentiment`), seeded as the chapter
seeds them, on one thread, with the chapter's own functions:

- "a": 1000 epochs with the post's gradients (train_watching), its
  parameters also kept after epochs 100, 500 and 800 ("a_100", ...);
- "b": 1000 epochs with the corrected gradients (train_watching);
- "autograd": 1000 epochs with torch.autograd's gradients (train_torch);
- "held_out": 1000 epochs with the corrected gradients on the 30 reviews
  left after the chapter's stratified hold-out;
- "all": exercise 1, all eight parameters trained for 300 epochs.

Stores every run's parameters in book/data/sentiment_params.npz (float64,
keys "<run>.<parameter>") and the log in book/data/sentiment_train_log.csv:
one row per run and epoch (the epoch's mean loss; for "a" and "b" also the
attention rows whose winner changed, the sharpness and the step of Q and K)
and, in each run's last row, the accuracy on its training reviews (and on
the held-out ones), and the run's CPU and wall seconds. The chapter loads
both and checks that the weights reproduce the log.

Usage: python tools/train/train_sentiment.py
"""

import sys
from pathlib import Path

import numpy as np
import pandas as pd
from threadpoolctl import threadpool_limits

# tools/ holds the shared modules (chapter_loader, measure, stored_models)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cli
from chapter_loader import BOOK, load_chapter
from measure import Stopwatch

WEIGHTS = BOOK / "data" / "sentiment_params.npz"
LOG = BOOK / "data" / "sentiment_train_log.csv"
KEEP = (100, 500, 800)  # run (a)'s parameters kept after these epochs
EXERCISE_EPOCHS = 300  # exercise 1: W and b trained too


def setup():
    """The chapter's code, its data set, its start and its held-out rows."""
    ch = load_chapter("07_sentiment.ipynb")
    vocab, vectors = ch.load_glove(10_000)
    table = pd.read_csv(BOOK / "data" / "small.csv", keep_default_na=False)
    dataset, skipped = ch.make_dataset(table, vocab, vectors)
    assert not skipped  # the row numbers of table and dataset agree
    params0 = ch.init_params(np.random.default_rng(ch.SEED))
    held_out = ch.stratified_hold_out(
        table["sentiments"].to_numpy(),
        ch.HOLD_OUT,
        np.random.default_rng(ch.SPLIT_SEED),
    )
    return ch, dataset, params0, held_out


def runs(ch, dataset, params0, held_out):
    """Each run: (name, training function, its training data, test data)."""
    train_part = [p for i, p in enumerate(dataset) if i not in held_out]
    test_part = [dataset[i] for i in held_out]

    def watching(backprop, keep=()):
        return lambda: ch.train_watching(dataset, params0, backprop, keep=keep)

    def plain(data, **kw):
        return lambda: ch.train(data, params0, ch.backprop_corrected, **kw)

    return [
        ("a", watching(ch.backprop_source, KEEP), dataset, None),
        ("b", watching(ch.backprop_corrected), dataset, None),
        ("autograd", lambda: ch.train_torch(dataset, params0), dataset, None),
        ("held_out", plain(train_part), train_part, test_part),
        (
            "all",
            plain(dataset, epochs=EXERCISE_EPOCHS, frozen=()),
            dataset,
            None,
        ),
    ]


def log_rows(name, record, accuracy, held_out_accuracy, cpu, wall):
    """The log's rows of one run: one per epoch, the totals in the last."""
    rows = pd.DataFrame(
        {"run": name, "epoch": 1 + np.arange(len(record["loss"]))}
    )
    for column in ("loss", "changed", "sharpness", "step"):
        rows[column] = record.get(column, np.nan)
    last = rows.index[-1]
    rows.loc[last, "accuracy"] = accuracy
    rows.loc[last, "held_out_accuracy"] = held_out_accuracy
    rows.loc[last, "cpu_seconds"] = round(cpu, 2)
    rows.loc[last, "wall_seconds"] = round(wall, 2)
    return rows


def main():
    ch, dataset, params0, held_out = setup()
    ch.torch.set_num_threads(1)
    stored, logs = {}, []
    with threadpool_limits(1):
        for name, fn, train_data, test_data in runs(
            ch, dataset, params0, held_out
        ):
            with Stopwatch() as clock:
                params, record = fn()
            cpu, wall = clock.cpu, clock.wall
            if not isinstance(record, dict):  # train and train_torch: losses
                record = {"loss": record}
            for epoch, kept in record.get("kept", {}).items():
                stored |= {f"{name}_{epoch}.{n}": v for n, v in kept.items()}
            stored |= {f"{name}.{n}": v for n, v in params.items()}
            accuracy = ch.accuracy(train_data, params)
            test = ch.accuracy(test_data, params) if test_data else np.nan
            logs.append(log_rows(name, record, accuracy, test, cpu, wall))
            print(
                f"{name:9} loss {record['loss'][-1]:.4f}, accuracy "
                f"{accuracy:.3f}; {cpu:.1f} s CPU, {wall:.1f} s wall",
                flush=True,
            )
    np.savez(WEIGHTS, **stored)
    log = pd.concat(logs, ignore_index=True)
    log["changed"] = log["changed"].astype("Int64")
    log.to_csv(LOG, index=False)


if __name__ == "__main__":
    cli.help_only(__doc__)  # no options: --help only, before any work
    main()
