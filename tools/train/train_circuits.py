"""Chapter 15's trainings (`make train-circuits`): the one- and two-layer
attention-only models of book/circuits.py (`AttnOnly` of circuits.SIZES:
vocab 64, context T = 64, d = 64, H = 4) trained by `circuits.train_induction` on
`repeated_segments` (n random distinct tokens, n drawn per sequence from
16 to 32, the same n tokens again, then fresh tokens), seeds 0, 1 and 2,
each on one thread: Adam, learning rate LR, batches of BATCH fresh
sequences, STEPS steps, evaluated every EVERY steps. LR = 1e-2 was the
fastest of 3e-3, 5e-3 and 1e-2 tried on seed 0's two-layer model with
embed_scale 0.25 (its held-out in-context loss first below 1 nat at step
1,150 with 1e-2, 1,350 with 5e-3, not by step 2,000 with 3e-3).
With embed_scale 1 (nn.Embedding's N(0, 1) for W_E and W_pos) the same
model's in-context loss stayed at ln 64 for 1,000 to 1,500 steps at lr
1e-3, 3e-3 and 1e-2. These probes (seed 0, one run each) are not stored.

Stores the weights (book/data/circuits/induction_L<layers>_seed<seed>.pt,
float32 state_dicts), the log (book/data/circuits_train_log.csv: one row
per model and evaluation: step, training loss, held-out in-context and
other losses and accuracy, each head's prefix-matching and same-token
scores) and a summary (book/data/circuits_train.csv: one row per model
with its parameters, final losses, CPU and wall seconds, threads).

Then MQAR (book/recall.py): each of recall.RECALL's models (MHA, sliding
window, linear attention, Gated DeltaNet, hybrid) at each width of WIDTHS,
trained by `recall.train_recall` on PAIRS_TRAIN pairs (one count drawn per
step, small counts more often) for RECALL_STEPS steps of RECALL_B
sequences, seed 0, one thread; then its accuracy, in float64, on N_HELD
held-out sequences at each count of PAIRS_EVAL (these settings are
recall.py's STEPS, BATCH, LR, PAIRS_TRAIN, PAIRS_EVAL, N_HELD, HELD_SEED).
Each model has the previous-token embedding (shift) but one probe,
recall_linear_noshift_d64: linear attention, d = 64, without it. Stores
the weights (book/data/circuits/recall_<name>_d<d>.pt, with _noshift
after the name for the probe), the summary (book/data/recall_train.csv:
parameters, final loss, numbers held after the longest sequence, CPU and
wall seconds) and the accuracies (book/data/recall_accuracy.csv: name, d,
shift, pairs, right, total, and the smallest gap between the two highest
logits at an answer).

Usage: python tools/train/train_circuits.py [--part induction|recall]
       [--steps N] [--only NAME ...]
"""

import argparse
import copy
import sys
from pathlib import Path

import pandas as pd
import torch

# tools/ holds the shared modules (chapter_loader, measure, stored_models)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chapter_loader import BOOK  # puts book/ on the path
from measure import Stopwatch

import circuits  # book/circuits.py
import recall  # book/recall.py

STEPS = 1600
LR = 1e-2
BATCH = 32
EVERY = 50
SEEDS = (0, 1, 2)
MODELS = {
    f"induction_L{layers}_seed{seed}": (layers, seed)
    for layers in (1, 2)
    for seed in SEEDS
}
OUT = BOOK / "data" / "circuits"
LOG = BOOK / "data" / "circuits_train_log.csv"
SUMMARY = BOOK / "data" / "circuits_train.csv"

WIDTHS = (32, 64)
# book/recall.py's settings (the chapter prints them)
PAIRS_TRAIN, PAIRS_EVAL = recall.PAIRS_TRAIN, recall.PAIRS_EVAL
RECALL_STEPS, RECALL_B, RECALL_LR = recall.STEPS, recall.BATCH, recall.LR
N_HELD, HELD_SEED = recall.N_HELD, recall.HELD_SEED


def recall_model(name, d, shift):
    """The file name of a recall model: recall_<name>_d<d>, with _noshift
    after the name for a model without the previous-token embedding."""
    return f"recall_{name}{'' if shift else '_noshift'}_d{d}"


# file name: (name, d, shift); the last one a probe without PreviousToken
RECALL_MODELS = {
    recall_model(name, d, True): (name, d, True)
    for d in WIDTHS
    for name in recall.RECALL
} | {recall_model("linear", 64, False): ("linear", 64, False)}
RECALL_SUMMARY = BOOK / "data" / "recall_train.csv"
RECALL_ACCURACY = BOOK / "data" / "recall_accuracy.csv"


def build(name):
    """A fresh model of MODELS[name], torch seeded by its seed first."""
    layers, seed = MODELS[name]
    torch.manual_seed(seed)
    return circuits.AttnOnly(layers=layers, **circuits.SIZES), seed


def train_one(name, steps):
    model, seed = build(name)
    with Stopwatch() as clock:
        log = circuits.train_induction(
            model, steps, seed, B=BATCH, lr=LR, every=EVERY
        )
    last = log[-1]
    print(
        f"{name}: in-context loss {log[0]['in_context_loss']:.3f} -> "
        f"{last['in_context_loss']:.3f}, accuracy {last['in_context_acc']:.3f}; "
        f"{clock.cpu:.1f} s CPU, {clock.wall:.1f} s wall",
        flush=True,
    )
    OUT.mkdir(exist_ok=True)
    torch.save(model.state_dict(), OUT / f"{name}.pt")
    rows = [
        {"name": name, "layers": model.layers, "seed": seed, **r} for r in log
    ]
    summary = {
        "name": name,
        "layers": model.layers,
        "seed": seed,
        "params": sum(p.numel() for p in model.parameters()),
        "steps": steps,
        "lr": LR,
        "batch": BATCH,
        "in_context_loss": last["in_context_loss"],
        "other_loss": last["other_loss"],
        "in_context_acc": last["in_context_acc"],
        "cpu_s": round(clock.cpu, 1),
        "wall_s": round(clock.wall, 1),
        "threads": torch.get_num_threads(),
    }
    return rows, summary


def evaluate_recall(model, kind, d, shift=True):
    """One row per count of PAIRS_EVAL: the right answers of a float64 copy
    of the model on its N_HELD held-out sequences (float64, so that every
    processor finds the same argmaxes; the chapter checks the margin)."""
    model = copy.deepcopy(model).double()
    rows = []
    for N in PAIRS_EVAL:
        gen = torch.Generator().manual_seed(HELD_SEED + N)
        x, y, query = recall.mqar_batch(N_HELD, N, gen)
        right, total = recall.recall_accuracy(model, x, y, query)
        gap = recall.top_gap(model, x, query)  # how far from a tie
        rows.append(
            {"name": kind, "d": d, "shift": shift, "pairs": N}
            | {"right": right, "total": total, "gap": gap}
        )
    return rows


def train_recall_one(name, steps):
    kind, d, shift = RECALL_MODELS[name]
    model = recall.build_recall(kind, d, seed=0, shift=shift)
    with Stopwatch() as clock:
        losses = recall.train_recall(
            model, steps, 0, PAIRS_TRAIN, B=RECALL_B, lr=RECALL_LR
        )
    OUT.mkdir(exist_ok=True)
    torch.save(model.state_dict(), OUT / f"{name}.pt")
    rows = evaluate_recall(model, kind, d, shift)
    summary = {
        "name": kind,
        "d": d,
        "shift": shift,
        "params": sum(p.numel() for p in model.parameters()),
        "steps": steps,
        "final_loss": sum(losses[-50:]) / len(losses[-50:]),
        "held_numbers": recall.held_numbers(model, 4 * max(PAIRS_EVAL) - 1),
        "cpu_s": round(clock.cpu, 1),
        "wall_s": round(clock.wall, 1),
        "threads": torch.get_num_threads(),
    }
    accs = ", ".join(
        f"{r['pairs']}: {r['right'] / r['total']:.2f}" for r in rows
    )
    print(
        f"{name}: loss {summary['final_loss']:.3f}; accuracy by pairs {accs}; "
        f"{clock.cpu:.1f} s CPU, {clock.wall:.1f} s wall",
        flush=True,
    )
    return rows, summary


def merge(path, new, names, key):
    """new's rows, after the stored rows of the models not retrained."""
    if names is None or not path.exists():
        return new
    old = pd.read_csv(path)
    return pd.concat([old[~old[key].isin(names)], new])


def main_recall(args):
    names = [n for n in args.only or RECALL_MODELS if n in RECALL_MODELS]
    if not names:
        return
    steps = args.steps or RECALL_STEPS
    results = [train_recall_one(name, steps) for name in names]
    acc = pd.DataFrame([r for rows, _ in results for r in rows])
    summary = pd.DataFrame([s for _, s in results])
    for frame in (acc, summary):
        frame.insert(
            0,
            "model",
            [
                recall_model(n, d, s)
                for n, d, s in zip(frame.name, frame.d, frame["shift"])
            ],
        )
    only = names if args.only else None
    acc = merge(RECALL_ACCURACY, acc, only, "model")
    summary = merge(RECALL_SUMMARY, summary, only, "model")
    acc.to_csv(RECALL_ACCURACY, index=False)
    summary.to_csv(RECALL_SUMMARY, index=False)
    print(f"{len(summary)} models: {summary.cpu_s.sum():.0f} s CPU in all")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["induction", "recall"])
    parser.add_argument("--steps", type=int)
    parser.add_argument("--only", nargs="+", choices=[*MODELS, *RECALL_MODELS])
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.part != "recall":
        main_induction(args)
    if args.part != "induction":
        main_recall(args)


def main_induction(args):
    names = [n for n in args.only or MODELS if n in MODELS]
    if not names:
        return
    steps = args.steps or STEPS
    results = [train_one(name, steps) for name in names]
    log = pd.DataFrame([row for rows, _ in results for row in rows])
    summary = pd.DataFrame([s for _, s in results])
    if args.only:  # keep the other models' rows
        log = merge(LOG, log, names, "name")  # no file yet: new rows only
        summary = merge(SUMMARY, summary, names, "name")
        order = {n: i for i, n in enumerate(MODELS)}
        log = log.sort_values(
            ["name", "step"],
            key=lambda c: c.map(order) if c.name == "name" else c,
            kind="stable",
        )
        summary = summary.sort_values("name", key=lambda c: c.map(order))
    log.to_csv(LOG, index=False)
    summary.to_csv(SUMMARY, index=False)
    print(f"{len(summary)} models: {summary.cpu_s.sum():.0f} s CPU in all")


if __name__ == "__main__":
    main()
