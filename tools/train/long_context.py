"""Chapter 11's losses past the training length and with an 8-bit cache
(`make long-context`, part of `make train`
after train-gpt, whose weights it reads): too slow for the page, so stored
in book/data/long_context.csv, which the chapter reads and re-checks on a
slice.

Chapter 10's model (book/data/gpt_G4.pt, trained on windows of 128) on the
32,768 characters of chapter 10's validation slice, cut into 32 rows of
1,024 instead of 256 rows of 128. Per row, the mean loss (nats) over the
positions 0-127, 128-255, 256-511 and 512-1,023:

- "none", "w=128", "w=32": the same weights without a window, and with a
  window (one forward pass of the whole row);
- "sink s=.. w=.. cache|absolute": book/caches.py's SinkCache, fed one token
  per call.

And per row of chapter 10's validation slice itself (256 rows of 128), fed
one token per call: "float32" (the growing KVCache) and "int8 token",
"int8 channel" (Int8Cache with per-token or KIVI's per-channel keys).

Usage: python tools/train/long_context.py
"""

import sys
from pathlib import Path

import pandas as pd
import torch

# tools/ holds the shared modules (chapter_loader, measure, stored_models)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cli
from chapter_loader import BOOK  # puts book/ on the path
from stored_models import load_gpt, setup

import caches  # book/caches.py
import transformer  # book/transformer.py

ROW = 1024  # characters per row
RANGES = ((0, 128), (128, 256), (256, 512), (512, 1024))
WINDOWS = (None, 128, 32)
SINKS = ((1, 32), (4, 32), (1, 128), (4, 128))  # (s, w)
SCHEMES = ("cache", "absolute")
INT8 = {"int8 token": "token", "int8 channel": "channel"}
GROUP = 32  # the per-channel keys' group of tokens


def long_rows(ch, val_data):
    """Chapter 10's validation characters as rows of ROW: x, y (N, ROW)."""
    n = ch.VAL_ROWS * ch.VAL_T // ROW
    x = val_data[: n * ROW].view(n, ROW)
    y = val_data[1 : n * ROW + 1].view(n, ROW)
    return x, y


def load(ch, vocab, w=None):
    """Chapter 10's trained weights in a GPT with window w."""
    return load_gpt(ch, vocab, ch.WEIGHTS[4], w=w)


def losses(logits, y):
    """Per-row, per-position cross-entropy (float64), (N, T)."""
    log_p = logits.double().log_softmax(dim=-1)
    return -log_p.gather(-1, y[..., None])[..., 0]


def windowed(model, x, y):
    """Per-row, per-position losses of one forward pass of each row."""
    with torch.no_grad():
        return losses(model(x), y)


def sink(model, x, y, s, w, scheme):
    """Per-row, per-position losses with sink caches, one token per call."""
    made = [caches.SinkCache(s, w, scheme) for _ in model.blocks]
    return losses(caches.stepwise_logits(model, x, made), y)


def quantised(model, x, y, keys):
    """Per-row, per-position losses with Int8Caches (or KVCache if None)."""
    if keys is None:
        made = [transformer.KVCache() for _ in model.blocks]
    else:
        made = [caches.Int8Cache(keys, GROUP) for _ in model.blocks]
    return losses(caches.stepwise_logits(model, x, made), y)


def rows_of(name, per_position, ranges):
    """One record per row and range: the mean loss over the range."""
    return [
        (name, row, a, b, per_position[row, a:b].mean().item())
        for row in range(len(per_position))
        for a, b in ranges
    ]


def main():
    torch.set_num_threads(1)
    ch, chars, _, val_data = setup()
    x, y = long_rows(ch, val_data)
    records = []
    for w in WINDOWS:
        name = "none" if w is None else f"w={w}"
        per = windowed(load(ch, len(chars), w), x, y)
        records += rows_of(name, per, RANGES)
        print(name, [f"{per[:, a:b].mean():.3f}" for a, b in RANGES])
    plain = load(ch, len(chars))
    for s, w in SINKS:
        for scheme in SCHEMES:
            name = f"sink s={s} w={w} {scheme}"
            per = sink(plain, x, y, s, w, scheme)
            records += rows_of(name, per, RANGES)
            print(name, [f"{per[:, a:b].mean():.3f}" for a, b in RANGES])
    x_val, y_val = ch.validation_slice(val_data)
    for name, keys in {"float32": None, **INT8}.items():
        per = quantised(plain, x_val, y_val, keys)
        records += rows_of(name, per, ((0, ch.VAL_T),))
        print(name, f"{per.mean():.5f}")
    table = pd.DataFrame(
        records, columns=["config", "row", "start", "end", "loss"]
    )
    table.to_csv(
        BOOK / "data" / "long_context.csv", index=False, float_format="%.6f"
    )


if __name__ == "__main__":
    cli.help_only(__doc__)  # no options: --help only, before any work
    main()
