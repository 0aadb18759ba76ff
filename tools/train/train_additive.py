"""Chapter 9's full training (`make train-additive`): the GRU encoder-decoder
with additive attention and the same network with a fixed context (the
baseline), each built with the chapter's `new_model` (seed 0) and trained
with its `train` and RECIPE (1000 steps of 64 strings, batches from seed 0)
on its TRAIN_SET, on one thread. The chapter's code is loaded from the
notebook (tools/chapter_loader.py), never copied.

Stores in book/data/:
- additive_attention.pt, additive_baseline.pt: each model's float32
  state_dict after the last step; additive_attention_step100.pt: the
  attention model's after step 100 (--checkpoint), for the chapter's
  snapshot of the alignment at that step;
- additive_train_log.csv: one row per model and step: `loss`, the step's
  training loss. The row of each stored state also holds `held_out_loss`
  (the chapter's `held_out_loss` on its held-out strings, the weights
  loaded with its `load_trained`, in float64); each model's last row also
  holds its exact-sequence accuracy per length and overall (`acc_6` ...
  `acc_10`, `acc_all`, the chapter's `accuracy_by_length`) and the CPU and
  wall seconds of its training (`cpu_s`, `wall_s`; the chapter does not
  print them);
- additive_models.json: how to rebuild each stored model with the chapter's
  own classes (class name, constructor arguments, weights file), for the
  chapters that reuse them.

The chapter loads the weights and checks that they reproduce the log.

Usage: python tools/train/train_additive.py [--steps N] [--checkpoint STEP] [--out DIR]
"""

import argparse
import json
import sys
from pathlib import Path

import pandas as pd
import torch

# tools/ holds the shared modules (chapter_loader, measure, stored_models)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chapter_loader import BOOK, load_chapter
from measure import Stopwatch

CHAPTER = "09_additive_attention.ipynb"
MODELS = {"attention": True, "baseline": False}  # name -> attend
CHECKPOINT = 100  # the attention model is also stored after this step
LOG = "additive_train_log.csv"
SPEC = "additive_models.json"


def weights_file(name, step=None):
    """The weights of a model after the last step, or after `step`."""
    suffix = "" if step is None else f"_step{step}"
    return f"additive_{name}{suffix}.pt"


def setup():
    """The chapter's code, its training strings and its held-out strings."""
    ch = load_chapter(CHAPTER)
    train_data = ch.make_reversal_data(**ch.TRAIN_SET)
    candidates = ch.make_reversal_data(**ch.HELD_OUT)
    return ch, train_data, ch.unseen(candidates, train_data)


def evaluate(ch, path, attend, test_data, accuracy):
    """What the chapter recomputes from stored weights: the held-out loss
    and, for a final model, the exact-sequence accuracy."""
    model = ch.load_trained(path, attend=attend)
    row = {"held_out_loss": ch.held_out_loss(model, test_data)}
    if accuracy:
        lengths = range(ch.HELD_OUT["min_len"], ch.HELD_OUT["max_len"] + 1)
        acc, by_len = ch.accuracy_by_length(model, test_data, lengths)
        row |= {f"acc_{n}": a for n, a in by_len.items()} | {"acc_all": acc}
    return row


def spec(ch, steps, checkpoint):
    """How to rebuild each stored model with the chapter's own classes."""
    init = {"vocab_size": ch.Vocab.SIZE, **ch.SIZES}
    models = {}
    for name, attend in MODELS.items():
        kept = [(name, None, steps)]
        if attend and checkpoint < steps:
            kept.append((f"{name}_step{checkpoint}", checkpoint, checkpoint))
        for key, step, trained_steps in kept:
            models[key] = {
                "weights": weights_file(name, step),
                "init": init | {"attend": attend},
                "steps": trained_steps,
            }
    vocab = ("PAD", "BOS", "EOS", "FIRST_DIGIT", "SIZE")
    return {
        "chapter": f"book/{CHAPTER}",
        "class": "Seq2Seq",
        "rebuild": "Seq2Seq(**init), then load_state_dict(torch.load(weights))",
        "dtype": "float32",
        "vocab": {"class": "Vocab"} | {k: getattr(ch.Vocab, k) for k in vocab},
        "train_set": ch.TRAIN_SET,
        "held_out": ch.HELD_OUT,
        "recipe": ch.RECIPE | {"steps": steps},
        "models": models,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--checkpoint", type=int, default=CHECKPOINT)
    parser.add_argument("--out", type=Path, default=BOOK / "data")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    ch, train_data, test_data = setup()
    steps = args.steps or ch.RECIPE["steps"]
    recipe = ch.RECIPE | {"steps": steps}
    rows = []
    for name, attend in MODELS.items():
        stored = {}  # step -> file

        def keep(step, model, name=name, attend=attend, stored=stored):
            if attend and step == args.checkpoint and step < steps:
                stored[step] = args.out / weights_file(name, step)
                torch.save(model.state_dict(), stored[step])

        model = ch.new_model(attend=attend)
        with Stopwatch() as clock:
            losses = ch.train(model, train_data, **recipe, on_step=keep)
        cpu, wall = clock.cpu, clock.wall
        stored[steps] = args.out / weights_file(name)
        torch.save(model.state_dict(), stored[steps])
        extra = {
            step: evaluate(ch, path, attend, test_data, step == steps)
            for step, path in stored.items()
        }
        extra[steps] |= {"cpu_s": round(cpu, 1), "wall_s": round(wall, 1)}
        for step, loss in enumerate(losses, start=1):
            rows.append({"model": name, "step": step, "loss": loss})
            rows[-1] |= extra.get(step, {})
        final = extra[steps]
        print(
            f"{name}: held-out loss {final['held_out_loss']:.3g}, accuracy "
            f"{final['acc_all']:.3f}; {cpu:.1f} s CPU, {wall:.1f} s wall"
        )
    pd.DataFrame(rows).to_csv(args.out / LOG, index=False)
    text = json.dumps(spec(ch, steps, args.checkpoint), indent=2)
    (args.out / SPEC).write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
