"""Chapter 7's training times (`make bench`): wall-clock and CPU seconds of
1000 epochs of SGD with the post's backpropagation (a), the corrected one
(b) and torch.autograd, on one thread, timed by tools/measure.py (one round,
the three in turn, so no interval: a round costs about 54 s of CPU, the
7 rounds an interval would want about 6 minutes), printed with the
machine and the load. Times are reported, never asserted, and not stored.
--quick: 2 epochs.
"""

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from threadpoolctl import threadpool_limits

# tools/ holds the shared modules (chapter_loader, measure, stored_models)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import measure
from chapter_loader import BOOK, load_chapter


def main(epochs):
    ch = load_chapter("07_sentiment.ipynb")
    ch.torch.set_num_threads(1)
    vocab, vectors = ch.load_glove(10_000)
    table = pd.read_csv(BOOK / "data" / "small.csv", keep_default_na=False)
    dataset, _ = ch.make_dataset(table, vocab, vectors)
    params0 = ch.init_params(np.random.default_rng(12))
    calls = {
        f"train (a) NumPy, {epochs} epochs": lambda: ch.train(
            dataset, params0, ch.backprop_source, epochs=epochs
        ),
        f"train (b) NumPy, {epochs} epochs": lambda: ch.train(
            dataset, params0, ch.backprop_corrected, epochs=epochs
        ),
        f"train torch.autograd, {epochs} epochs": lambda: ch.train_torch(
            dataset, params0, epochs=epochs
        ),
    }
    timing = measure.interleave(calls, 1, warmup=0)
    for label in calls:
        print(
            f"{label:34} {timing.wall[label][0]:5.1f} s wall, "
            f"{timing.cpu[label][0]:5.1f} s CPU",
            flush=True,
        )
    record = measure.row({}, timing, measure.machine(1))
    print(", ".join(f"{k} {v}" for k, v in record.items()), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 epochs")
    epochs = 2 if parser.parse_args().quick else 1000
    with threadpool_limits(1):  # NumPy's BLAS on one thread, as torch's
        main(epochs)
