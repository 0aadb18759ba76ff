"""Chapter 12's attention variants trained side by side (`make
train-variants`): every model of book/variants.py's VARIANTS, built by
`build_variant` (the constructor the chapter loads the weights with) and
trained like chapter 10's GPT (tools/train/train_gpt.py's `setup`: the same data,
sizes, STEPS steps, batches, learning-rate schedule and book/gpt.py's
`train`, with the variant's seed for the initialisation and the batches).

Each model trains in a process of its own on one thread, `--jobs` at a
time (`make train-variants JOBS_TRAIN=N`);
its CPU seconds come from measure.Stopwatch in that process (wall
seconds too). Stores the weights (book/data/variants/<name>.pt, float32
state_dicts), the log (book/data/variants_train_log.csv: name, seed, step,
train_loss, and val_loss, the loss on chapter 10's fixed validation slice,
in each model's last row) and a summary (book/data/variants_train.csv: one
row per model with its parameters, losses, CPU and wall seconds).

The sparse model (k = 32 of T = 128 keys) trains in two stages over the
same steps and schedule, its indexer by `indexer_kl` (summed over the
layers, added to the loss through `train`'s extra_loss) with the indexer's
input detached, so that only that loss trains it:
- steps 0 to DENSE_STEPS - 1, dense: k = T, every allowed key is chosen;
- the rest sparse, k = 32: the KL over the chosen keys.
DeepSeek-V3.2-Exp's dense warm-up freezes an already trained model and
trains only the indexer; from scratch there is no trained model to freeze,
so here the cross-entropy trains the model in the dense stage too.

A model at another seed is a name of its own in VARIANTS: mha_seed1, and
<name>_seed1, <name>_seed2 for each of book/variants.py's PAIRED (the
variants chapter 12 compares with MHA seed by seed); its seed sets the
initial weights and the batches, as for MHA's.

Usage: python tools/train/train_variants.py [--jobs N] [--steps N] [--only NAME ...]
(--only retrains some models and replaces their rows in the CSVs, e.g.
--only mla_seed1 mla_seed2).
"""

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import pandas as pd
import torch

# tools/ holds the shared modules (chapter_loader, measure, stored_models)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chapter_loader import BOOK  # puts book/ on the path
from measure import Stopwatch
from stored_models import setup
from train_gpt import STEPS

import gpt  # book/gpt.py
import variants  # book/variants.py

DENSE_STEPS = 100  # the sparse model's dense warm-up
T_TRAIN = 128  # gpt.train's window: k = T_TRAIN selects every key
OUT = BOOK / "data" / "variants"
LOG = BOOK / "data" / "variants_train_log.csv"
SUMMARY = BOOK / "data" / "variants_train.csv"


def params(model):
    return sum(p.numel() for p in model.parameters())


def indexer_loss(model, steps):
    """train's extra_loss for the sparse model: the indexers' KL summed over
    the layers; after step DENSE_STEPS - 1 it makes the layers sparse."""
    layers = [block.self_attn for block in model.blocks]
    for layer in layers:
        layer.k, layer.detach_indexer = T_TRAIN, True  # dense first
    kl = []

    def extra(step, weights):
        total = sum(
            variants.indexer_kl(weights[:, i], layer.index[0], layer.index[2])
            for i, layer in enumerate(layers)
        )
        kl.append(total.item())
        if step + 1 == min(DENSE_STEPS, steps):  # the next steps: sparse
            for layer in layers:
                layer.k = variants.K_SPARSE
        return total

    return extra, kl


def train_variant(name, steps):
    """Train one variant on one thread (in its own process); store its
    weights; return its log rows and summary row."""
    torch.set_num_threads(1)
    ch, chars, train_data, val_data = setup()
    x_val, y_val = ch.validation_slice(val_data)
    with Stopwatch() as clock:
        model, seed = variants.build_variant(name, len(chars), **ch.MODEL)
        extra, kl = (None, None)
        if variants.VARIANTS[name][1].get("attention") is variants.sparse:
            extra, kl = indexer_loss(model, steps)
        losses = gpt.train(
            model, train_data, steps, seed=seed, extra_loss=extra
        )
    wall, cpu = clock.wall, clock.cpu
    val = gpt.validation_loss(model, x_val, y_val)
    note = f", indexer KL {kl[0]:.0f} -> {kl[-1]:.0f}" if kl else ""
    print(
        f"{name} (seed {seed}, {params(model):,} parameters): train loss "
        f"{losses[-1]:.3f}, validation {val:.4f}; {cpu:.1f} s CPU, "
        f"{wall:.1f} s wall{note}",
        flush=True,
    )
    OUT.mkdir(exist_ok=True)
    state = {k: t.float() for k, t in model.state_dict().items()}
    torch.save(state, OUT / f"{name}.pt")
    log = [
        (name, seed, step, loss, val if step == len(losses) - 1 else None)
        for step, loss in enumerate(losses)
    ]
    summary = {
        "name": name,
        "seed": seed,
        "params": params(model),
        "steps": steps,
        "train_loss": losses[-1],
        "val_loss": val,
        "cpu_s": round(cpu, 1),
        "wall_s": round(wall, 1),
        "threads": torch.get_num_threads(),
    }
    return log, summary


def check_width_match(vocab):
    """Print MHA's and mqa_wide's parameter counts; check that the widths
    one below and one above MQA_WIDE_D_FF come no closer to MHA's (the
    count grows with the width; tests/test_variants.py tries 200 to 399)."""
    mha = params(gpt.GPT(vocab))
    wide = params(variants.build_variant("mqa_wide", vocab)[0])
    print(
        f"parameters: MHA {mha:,}, mqa_wide (d_ff = "
        f"{variants.MQA_WIDE_D_FF}) {wide:,}"
    )
    for d_ff in (variants.MQA_WIDE_D_FF - 1, variants.MQA_WIDE_D_FF + 1):
        other = params(gpt.GPT(vocab, G=1, d_ff=d_ff))
        assert abs(other - mha) > abs(wide - mha), (d_ff, other)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--only", nargs="+", choices=list(variants.VARIANTS))
    args = parser.parse_args()
    names = args.only or list(variants.VARIANTS)
    _, chars, _, _ = setup()
    check_width_match(len(chars))
    with (
        Stopwatch() as clock,
        ProcessPoolExecutor(
            args.jobs, mp_context=get_context("spawn"), max_tasks_per_child=1
        ) as pool,
    ):  # one fresh process per model
        results = list(
            pool.map(train_variant, names, [args.steps] * len(names))
        )
    wall = clock.wall
    log = pd.DataFrame(
        [row for rows, _ in results for row in rows],
        columns=["name", "seed", "step", "train_loss", "val_loss"],
    )
    summary = pd.DataFrame([s for _, s in results])
    if args.only:  # keep the other models' rows
        log = pd.concat([pd.read_csv(LOG).query("name not in @names"), log])
        old = pd.read_csv(SUMMARY).query("name not in @names")
        summary = pd.concat([old, summary])
        order = {n: i for i, n in enumerate(variants.VARIANTS)}
        log = log.sort_values(
            ["name", "step"],
            key=lambda c: c.map(order) if c.name == "name" else c,
            kind="stable",
        )
        summary = summary.sort_values("name", key=lambda c: c.map(order))
    log.to_csv(LOG, index=False)
    summary.to_csv(SUMMARY, index=False)
    print(
        f"{len(summary)} models: {summary.cpu_s.sum():.0f} s CPU in all, "
        f"{wall:.0f} s wall for {len(names)} with {args.jobs} jobs"
    )


if __name__ == "__main__":
    main()
