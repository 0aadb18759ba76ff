"""Chapter 10's data and its stored models, as the benchmarks and the
trainings in tools/bench/ and tools/train/ load them (one loader for all).

- `setup()`: chapter 10's code (loaded from the notebook), its character
  vocabulary and its training and validation splits of tiny Shakespeare;
- `load_gpt(ch, vocab, weights, **changes)`: a `book/gpt.py` GPT of chapter
  10's sizes (with `changes`, such as a longer context, a window or fewer
  layers) holding the stored float32 weights, in eval mode.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chapter_loader import BOOK, load_chapter  # puts book/ on the path

import gpt  # book/gpt.py


def setup():
    """The chapter's code, its vocabulary and its data splits."""
    ch = load_chapter("10_inference.ipynb")
    text = (BOOK / ch.DATA).read_text(encoding="utf-8")
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text])
    n_train = int(0.9 * len(data))
    return ch, chars, data[:n_train], data[n_train:]


def load_gpt(ch, vocab, weights="data/gpt_G4.pt", **changes):
    """A GPT of chapter 10's sizes (`ch.MODEL`, updated by `changes`) with
    the state_dict stored at book/`weights`, in eval mode."""
    path = BOOK / weights
    if not path.is_file():
        raise ValueError(
            f"no stored weights at book/{weights}: run make train"
        )
    model = gpt.GPT(vocab, **{**ch.MODEL, **changes})
    model.load_state_dict(torch.load(path))
    return model.eval()
