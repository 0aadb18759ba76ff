"""Issue 37's training (`make train-seq2seq`): the encoder-decoder
Transformer of book/seq2seq.py, once per position option, on chapter 9's
reversal task, then every model on lengths past the training ones.

Training: chapter 9's strings and split (its TRAIN_SET, 6 to 10 digits,
and its held-out strings not in the training set), its `train` (Adam,
clipping, batches of 64 strings drawn from seed 0) with its RECIPE's batch
size and learning rate for STEPS steps; each model built from seed 0 with
SIZES, on one thread. The chapter's code is loaded from the notebook
(tools/chapter_loader.py), never copied.

Evaluation, every model in float64 from its stored weights, as the
chapter's `accuracy_by_length` does (greedy decoding, its `exact_match`): lengths 6 to
10 on the chapter's held-out strings, lengths 11 to 20 on LONG_PER_LENGTH
strings per length made by the chapter's `make_reversal_data` (seed
LONG_SEED + length); chapter 9's GRU with additive attention
(book/data/additive_attention.pt, from `make train-additive`) the same way.

Stores in book/data/:
- seq2seq/<positions>.pt: each Transformer's float32 state_dict;
- seq2seq_train_log.csv: one row per model and step, `loss`; each model's
  last row also holds `held_out_loss` (teacher-forced, the chapter's
  `held_out_loss`, float64) and the CPU and wall seconds of its training
  (`cpu_s`, `wall_s`);
- seq2seq_lengths.csv: one row per model and length 6 ... 20: `strings`,
  `accuracy` (exact match), `mirror_weight` (the mean weight that output
  digit t puts on input digit n + 1 - t, `seq2seq.mirror_weight`, on the
  model's own greedy outputs: for a Transformer the last decoder layer's
  cross-attention averaged over heads, what `greedy_decode` returns),
  `mirror_weight_best` (the best single layer and head; the GRU's one map
  for it), `errors` (strings not exactly right), `first_error_mean` and
  `first_error_min` (over those strings, the first output position, from 1,
  whose token is wrong; the end token is position n + 1);
- seq2seq_failure_maps.csv: for each model, the cross-attention map of the
  first string it gets wrong at the shortest length from 11 on where it gets
  one wrong (`failing_map`): one row per decoder layer, output step and
  source position, with the weight (averaged over heads) and the target,
  predicted and source tokens;
- seq2seq_models.json: how to rebuild each model (class, arguments, weights
  file), the recipe, the data (chapter 9's arguments of
  `make_reversal_data`, its count of strings `n` stored as `strings`, the
  name chapter 14 gives it) and the seeds.

`--only` trains (or, with `--evaluate-only`, evaluates) the models named
and merges them into what --out already holds: their rows of the log and
the tables, and their entries of the JSON, replace the stored ones, and
every other model's stay (the GRU is evaluated again each time). A stored
JSON whose recipe, sizes or data differ from this run's stops it: the
models of one JSON share them.

Usage: python tools/train/train_seq2seq.py [--steps N] [--only POSITIONS ...]
[--out DIR] [--evaluate-only]
"""

import argparse
import json
import sys
from pathlib import Path

import pandas as pd
import torch

# tools/ holds the shared modules (chapter_loader, measure, stored_models)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chapter_loader import BOOK, load_chapter  # puts book/ on the path
from measure import Stopwatch

import seq2seq  # book/seq2seq.py

CHAPTER = "09_additive_attention.ipynb"
SIZES = {"d": 64, "H": 4, "d_ff": 256, "layers": [2, 2], "max_len": 10}
STEPS = 2000
LONG_LENGTHS = range(11, 21)
LONG_PER_LENGTH = 200
LONG_SEED = 100
GRU = "additive_attention.pt"  # chapter 9's attention model
LOG, TABLE, SPEC = (
    "seq2seq_train_log.csv",
    "seq2seq_lengths.csv",
    "seq2seq_models.json",
)
MAPS = "seq2seq_failure_maps.csv"
MODELS = ("gru", *seq2seq.POSITIONS)  # the order of the stored rows


def setup():
    """The chapter's code, its training strings, its held-out strings and
    the longer strings, {length: (src, lengths, tgt)}."""
    ch = load_chapter(CHAPTER)
    train_data = ch.make_reversal_data(**ch.TRAIN_SET)
    candidates = ch.make_reversal_data(**ch.HELD_OUT)
    test_data = ch.unseen(candidates, train_data)
    long_data = {
        n: ch.make_reversal_data(LONG_PER_LENGTH, n, n, LONG_SEED + n)
        for n in LONG_LENGTHS
    }
    return ch, train_data, test_data, long_data


def new_model(ch, positions):
    """A Transformer of SIZES for chapter 9's vocabulary, from seed 0."""
    torch.manual_seed(0)
    sizes = SIZES | {"layers": tuple(SIZES["layers"])}
    return seq2seq.Seq2Seq(
        ch.Vocab.SIZE, **sizes, positions=positions, bos=ch.Vocab.BOS
    )


def load(ch, positions, out):
    """A stored Transformer in float64, in evaluation mode."""
    model = new_model(ch, positions).double()
    model.load_state_dict(torch.load(out / "seq2seq" / f"{positions}.pt"))
    return model.eval()


def first_errors(pred, tgt):
    """For each wrong row, the first position (from 1) whose token is wrong."""
    wrong = (pred != tgt) & (tgt != 0)  # 0: chapter 9's Vocab.PAD
    rows = wrong.any(dim=1)
    return wrong[rows].float().argmax(dim=1) + 1


@torch.no_grad()
def by_length(ch, model, data, n, transformer):
    """One row of the table: model's results on strings of n digits."""
    src, lengths, tgt = (part[data[1] == n] for part in data)
    src = src[:, :n]
    steps = tgt.shape[1]
    if transformer:
        pred, _, cross, _ = seq2seq.greedy(model, src, lengths, steps)
        maps = seq2seq.mirror_weight(cross, lengths)  # (layers, H)
        mirror = seq2seq.mirror_weight(cross[:, -1].mean(dim=1), lengths)
    else:
        pred, weights = model.greedy_decode(src, lengths, steps)
        maps = mirror = seq2seq.mirror_weight(weights, lengths)
    errors = first_errors(pred, tgt)
    acc = ch.exact_match(pred, tgt).float().mean().item()
    return {
        "length": n,
        "strings": len(src),
        "accuracy": acc,
        "mirror_weight": float(mirror),
        "mirror_weight_best": float(torch.as_tensor(maps).max()),
        "errors": len(errors),
        "first_error_mean": errors.float().mean().item()
        if len(errors)
        else None,
        "first_error_min": errors.min().item() if len(errors) else None,
    }


@torch.no_grad()
def failing_map(ch, model, long_data, transformer):
    """The cross-attention map of the first string the model gets wrong at
    the shortest length past training where it gets one wrong: one row per
    layer, output step and source position (weights averaged over heads;
    the GRU's one map is layer 1), with the target and predicted tokens."""
    for n, (src, lengths, tgt) in long_data.items():
        steps = tgt.shape[1]
        if transformer:
            pred, _, cross, _ = seq2seq.greedy(model, src, lengths, steps)
            maps = cross.mean(dim=2)  # (B, layers, steps, n)
        else:
            pred, weights = model.greedy_decode(src, lengths, steps)
            maps = weights[:, None]  # (B, 1, steps, n)
        wrong = (~ch.exact_match(pred, tgt)).nonzero()
        if len(wrong):
            k = int(wrong[0])
            return [
                {
                    "length": n,
                    "string": k,
                    "layer": layer + 1,
                    "step": t + 1,
                    "position": j + 1,
                    "weight": maps[k, layer, t, j].item(),
                    "target": ch.Vocab.label(tgt[k, t]),
                    "predicted": ch.Vocab.label(pred[k, t]),
                    "source": ch.Vocab.label(src[k, j]),
                }
                for layer in range(maps.shape[1])
                for t in range(steps)
                for j in range(n)
            ]
    return []


def evaluate(ch, models, test_data, long_data):
    """The table: every model at every length 6 ... 20."""
    rows = []
    held = range(ch.HELD_OUT["min_len"], ch.HELD_OUT["max_len"] + 1)
    for name, (model, transformer) in models.items():
        for n in held:
            row = by_length(ch, model, test_data, n, transformer)
            rows.append({"model": name} | row)
        for n, data in long_data.items():
            row = by_length(ch, model, data, n, transformer)
            rows.append({"model": name} | row)
        accs = [r["accuracy"] for r in rows if r["model"] == name]
        print(f"{name:>10}: " + " ".join(f"{a:.2f}" for a in accs))
    return pd.DataFrame(rows)


def data_args(args):
    """Chapter 9's arguments of make_reversal_data, its count of strings n
    named `strings` (chapter 14's name; n is a string's digits there)."""
    return {"strings" if k == "n" else k: v for k, v in args.items()}


def spec(ch, steps, trained):
    sizes = SIZES | {"vocab": ch.Vocab.SIZE, "bos": ch.Vocab.BOS}
    return {
        "module": "book/seq2seq.py",
        "class": "Seq2Seq",
        "rebuild": "Seq2Seq(**init), then load_state_dict(torch.load(weights))",
        "dtype": "float32",
        "seed": "torch.manual_seed(0) before Seq2Seq(...)",
        "train_set": data_args(ch.TRAIN_SET),
        "held_out": data_args(ch.HELD_OUT),
        "long": {
            "lengths": [LONG_LENGTHS.start, LONG_LENGTHS.stop - 1],
            "per_length": LONG_PER_LENGTH,
            "seed": f"{LONG_SEED} + length",
            "generator": f"book/{CHAPTER}: make_reversal_data",
        },
        "recipe": ch.RECIPE | {"steps": steps},
        "models": {
            p: {
                "weights": f"seq2seq/{p}.pt",
                "init": sizes | {"positions": p},
            }
            for p in trained
        },
        "gru": {"weights": GRU, "spec": "additive_models.json"},
    }


def merged(path, rows, names):
    """The table stored at path (if any) without the rows of models
    `names`, plus `rows` (a DataFrame with a `model` column), ordered by
    MODELS (each model's rows in their order)."""
    if "model" not in rows:  # no row at all
        rows = pd.DataFrame({"model": []})
    if path.exists():
        stored = pd.read_csv(path)
        rows = pd.concat([stored[~stored.model.isin(names)], rows])
    rank = rows.model.map({m: i for i, m in enumerate(MODELS)}).to_numpy()
    return rows.iloc[rank.argsort(kind="stable")].reset_index(drop=True)


def merged_spec(path, new):
    """The JSON stored at path (if any) with the models of `new` added or
    replaced; SystemExit if the rest of the two differ."""
    if not path.exists():
        return new
    stored = json.loads(path.read_text(encoding="utf-8"))
    rest = {k: v for k, v in new.items() if k != "models"}
    differ = [k for k in rest if stored.get(k) != rest[k]]
    if differ or set(stored) != set(new):
        raise SystemExit(
            f"{path} was written with other settings ({', '.join(differ)}): "
            f"retrain every model, or write to another --out"
        )
    models = stored["models"] | new["models"]
    order = [m for m in MODELS if m in models]
    return stored | {"models": {m: models[m] for m in order}}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--only", nargs="+", default=list(seq2seq.POSITIONS))
    parser.add_argument("--out", type=Path, default=BOOK / "data")
    parser.add_argument("--evaluate-only", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    ch, train_data, test_data, long_data = setup()
    recipe = ch.RECIPE | {"steps": args.steps}
    (args.out / "seq2seq").mkdir(parents=True, exist_ok=True)
    if not args.evaluate_only:  # stop before training if it cannot merge
        merged_spec(args.out / SPEC, spec(ch, args.steps, args.only))
    rows = []
    for positions in [] if args.evaluate_only else args.only:
        model = new_model(ch, positions)
        with Stopwatch() as clock:
            losses = ch.train(model, train_data, **recipe)
        cpu, wall = clock.cpu, clock.wall
        torch.save(
            model.state_dict(), args.out / "seq2seq" / f"{positions}.pt"
        )
        held = ch.held_out_loss(load(ch, positions, args.out), test_data)
        for step, loss in enumerate(losses, start=1):
            rows.append({"model": positions, "step": step, "loss": loss})
        rows[-1] |= {
            "held_out_loss": held,
            "cpu_s": round(cpu, 1),
            "wall_s": round(wall, 1),
        }
        print(
            f"{positions}: held-out loss {held:.3g}; {cpu:.1f} s CPU, "
            f"{wall:.1f} s wall"
        )
    if rows:
        log = merged(args.out / LOG, pd.DataFrame(rows), args.only)
        log.to_csv(args.out / LOG, index=False)
        new = spec(ch, args.steps, args.only)
        text = json.dumps(merged_spec(args.out / SPEC, new), indent=2)
        (args.out / SPEC).write_text(text + "\n", encoding="utf-8")
    models = {
        "gru": (ch.load_trained(BOOK / "data" / GRU, attend=True), False)
    }
    for positions in args.only:
        models[positions] = (load(ch, positions, args.out), True)
    table = evaluate(ch, models, test_data, long_data)
    merged(args.out / TABLE, table, list(models)).to_csv(
        args.out / TABLE, index=False
    )
    maps = [
        {"model": name} | row
        for name, (model, transformer) in models.items()
        for row in failing_map(ch, model, long_data, transformer)
    ]
    maps = merged(args.out / MAPS, pd.DataFrame(maps), list(models))
    maps.to_csv(args.out / MAPS, index=False)


if __name__ == "__main__":
    main()
