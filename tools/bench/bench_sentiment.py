"""Chapter 7's training times (`make bench`): wall-clock and CPU seconds of
1000 epochs of SGD with the post's backpropagation (a), the corrected one
(b) and torch.autograd, on one thread. Times are reported, never asserted.
"""

import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
from threadpoolctl import threadpool_limits

# tools/ holds the shared modules (chapter_loader, measure, stored_models)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chapter_loader import BOOK, load_chapter


def timed(label, fn):
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    print(
        f"{label:34} {time.perf_counter() - wall:5.1f} s wall, "
        f"{time.process_time() - cpu:5.1f} s CPU",
        flush=True,
    )


def main():
    ch = load_chapter("07_sentiment.ipynb")
    ch.torch.set_num_threads(1)
    vocab, vectors = ch.load_glove(10_000)
    table = pd.read_csv(BOOK / "data" / "small.csv", keep_default_na=False)
    dataset, _ = ch.make_dataset(table, vocab, vectors)
    params0 = ch.init_params(np.random.default_rng(12))
    timed(
        "train (a) NumPy, 1000 epochs",
        lambda: ch.train(dataset, params0, ch.backprop_source),
    )
    timed(
        "train (b) NumPy, 1000 epochs",
        lambda: ch.train(dataset, params0, ch.backprop_corrected),
    )
    timed(
        "train torch.autograd, 1000 epochs",
        lambda: ch.train_torch(dataset, params0),
    )


if __name__ == "__main__":
    with threadpool_limits(1):  # NumPy's BLAS on one thread, as torch's
        main()
