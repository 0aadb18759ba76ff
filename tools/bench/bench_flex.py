"""Chapter 16's compiled kernels (`make bench PART=ch16`, issue 49).

Five parts (--parts), in float32 on one sequence, H = 8 heads, d_k = 64,
T = 4096 (sizes in Config; --quick: QUICK's tiny sizes, written under
/tmp so that the stored tables stay):
- kernels: compiled FlexAttention (`torch.compile(flex_attention)`,
  inductor's C++ template) without a mask and causal, for each tile size
  of Config.blocks (the BlockMask's BLOCK_SIZE, which the CPU kernel takes
  as its tile); sliding window (w = 256) and 8 documents of T / 8 tokens;
  chapter 8's fast tiled forward (book/flash.py's `fast_attention`) and
  the same compiled with `torch.compile`. Each kernel is compiled first,
  alone, in an empty inductor cache (`torch._inductor.utils.fresh_cache`,
  a folder under /tmp): its compile time is the wall and CPU seconds of
  that first call. Then `rounds` interleaved rounds of every program with
  SDPA (`F.scaled_dot_product_attention`; for the window and the
  documents, SDPA given the same mask as a dense T x T tensor) give the
  paired ratios SDPA time / program time (above 1: the program is
  faster), with their 95 % interval, on one thread (CPU time) and two
  (wall time), each thread count compiling its own kernels; the compiled
  tiled forward also against itself uncompiled. Each compiled result is
  checked in float32 against SDPA's before it is timed.
  -> book/data/bench_flex.csv (part "kernels").
- code: the C++ that inductor generates for compiled causal FlexAttention
  at the measured shape -> book/data/flex_kernel.txt (the chapter shows an
  excerpt: its fused exponential and row sum).
- breaks: the graphs dynamo cuts chapter 8's fast tiled forward into,
  compiled as timed (dynamic=False) with a counting back end (no
  inductor), no mask and causal, and the reasons for the breaks ->
  book/data/flex_graph_breaks.csv.
- profile: `profile_calls` calls of compiled causal FlexAttention and of
  SDPA under torch.profiler, one thread: the self CPU time per call of
  each operation -> book/data/bench_flex_profile.csv.
- decode: chapter 11's greedy decoding from the stored weights
  (book/data/gpt_G4.pt, context 4,096) after a 16-character prompt, at
  each of Config.new_tokens: chapter 11's best eager step (gpt.Decoder,
  every lever, under torch.inference_mode) against book/flex.py's
  `fixed_step` compiled with inductor's cpp_wrapper (the whole step in
  C++ calls; mode="reduce-overhead" is CUDA graphs, nothing on a CPU),
  `decode_rounds` interleaved rounds, one thread: tokens per CPU second
  and the paired ratio; the tokens compared (float32: the first
  divergence and the logit gap of its step), and in float64 at the first
  size, where they must be equal -> book/data/bench_flex.csv (part
  "decode"), and a profile of 64 steps of each -> bench_flex_profile.csv.

Every row carries tools/measure.py's record (machine, load, busy flag).
Inductor needs a C++ compiler (g++); without one the script stops at once
with a message that names it. Fresh times are never asserted; the chapter
reads the tables.
Usage: python tools/bench/bench_flex.py [--parts kernels code profile decode]
       python tools/bench/bench_flex.py --quick  # tiny sizes, under /tmp
"""

import argparse
import math
import shutil
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import (
    create_block_mask,
    flex_attention,
    noop_mask,
)

# tools/ holds the shared modules (chapter_loader, measure, stored_models)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import measure
import measure_csv
from chapter_loader import BOOK
from stored_models import load_gpt, setup

import flash  # book/flash.py
import flex  # book/flex.py
import gpt  # book/gpt.py

PARTS = ("kernels", "code", "breaks", "profile", "decode")
PROMPT = 16


@dataclass(frozen=True)
class Config:
    """The sizes of a run and the folder of its tables (--quick: tiny)."""

    T: int = 4096
    H: int = 8
    d_k: int = 64
    rounds: int = 9
    threads: tuple[int, ...] = (1, 2)
    blocks: tuple[int, ...] = (64, 128, 256)
    window: int = 256
    documents: int = 8
    profile_calls: int = 5
    new_tokens: tuple[int, ...] = (512, 2048)
    decode_rounds: int = 7
    profile_steps: int = 64
    out: Path = BOOK / "data"


QUICK = Config(
    T=256, H=2, d_k=16, rounds=6, threads=(1,), blocks=(64, 128), window=64,
    documents=4, profile_calls=1, new_tokens=(24,), decode_rounds=6,
    profile_steps=4, out=Path("/tmp/bench_flex_quick"),
)  # fmt: skip


def check_compiler():
    """Stop with a message naming the missing C++ compiler."""
    if shutil.which("g++") is None and shutil.which("c++") is None:
        sys.exit(
            "bench_flex: torch.compile's inductor needs a C++ compiler and "
            "found none (g++ or c++ on PATH); on Debian: apt-get install g++"
        )


def allow_recompiles():
    """Every kernel here is compiled once; many of them share code, so
    dynamo's limit of recompiles per function must not send one back to
    eager mode."""
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)


def first_call(fn, *args):
    """fn(*args) in an empty inductor cache: (result, wall s, CPU s)."""
    from torch._inductor.utils import fresh_cache

    with fresh_cache(dir="/tmp"), measure.Stopwatch() as clock:
        result = fn(*args)
    return result, clock.wall, clock.cpu


def inputs(cfg, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    shape = (1, cfg.H, cfg.T, cfg.d_k)
    return [torch.randn(*shape, generator=gen, dtype=dtype) for _ in "QKV"]


def masks(cfg):
    """name -> (mask_mod for FlexAttention, dense mask for SDPA or None,
    SDPA's is_causal)."""
    T = cfg.T
    window = flex.sliding_window(cfg.window)
    docs = flex.documents([T // cfg.documents] * cfg.documents)
    return {
        "no mask": (noop_mask, None, False),
        "causal": (flex.causal, None, True),
        f"window {cfg.window}": (window, flex.dense_mask(window, T, T), False),
        f"{cfg.documents} documents": (
            docs,
            flex.dense_mask(docs, T, T),
            False,
        ),
    }


def sdpa_call(Q, K, V, dense, is_causal):
    return F.scaled_dot_product_attention(
        Q, K, V, attn_mask=dense, is_causal=is_causal
    )


def kernel_programs(cfg, Q, K, V):
    """name -> dict(call, reference, compile_s, ...): every program of the
    kernels part, compiled (timed) and checked against SDPA in float32."""
    programs, references = {}, {}
    for name, (mask_mod, dense, is_causal) in masks(cfg).items():
        reference = f"SDPA, {name}" + (
            " (dense mask)" if dense is not None else ""
        )
        references[name] = reference
        programs[reference] = {
            "call": partial(sdpa_call, Q, K, V, dense, is_causal),
            "mask": name,
        }
        expected = programs[reference]["call"]()
        blocks = cfg.blocks if name in ("no mask", "causal") else (128,)
        for block in blocks:
            block_mask = create_block_mask(
                mask_mod, None, None, cfg.T, cfg.T, device="cpu",
                BLOCK_SIZE=block,
            )  # fmt: skip
            compiled = torch.compile(flex_attention, dynamic=False)
            call = partial(compiled, Q, K, V, block_mask=block_mask)
            out, wall, cpu = first_call(call)
            gap = (out - expected).abs().max().item()
            if not gap < 1e-4:
                raise AssertionError(f"compiled flex, {name}, {block}: {gap}")
            computed, full = flex.block_counts(block_mask)
            programs[f"FlexAttention compiled, {name}, tile {block}"] = {
                "call": call, "mask": name, "block": block,
                "compile_s": wall, "compile_cpu_s": cpu, "max_abs_diff": gap,
                "computed_tiles": computed, "full_tiles": full,
                "tiles": flex.grid(cfg.T, cfg.T, block),
            }  # fmt: skip
        if name in ("no mask", "causal"):
            causal = name == "causal"
            eager = partial(flash.fast_attention, Q, K, V, causal)
            programs[f"fast tiled (chapter 8), {name}"] = {
                "call": eager,
                "mask": name,
            }
            compiled = torch.compile(flash.fast_attention, dynamic=False)
            call = partial(compiled, Q, K, V, causal)
            try:
                out, wall, cpu = first_call(call)
            except Exception as error:  # recorded, not hidden
                print(
                    f"fast tiled compiled, {name}: {type(error).__name__}: {error}"
                )
                continue
            gap = (out - expected).abs().max().item()
            if not gap < 1e-4:
                raise AssertionError(f"fast tiled compiled, {name}: {gap}")
            programs[f"fast tiled compiled, {name}"] = {
                "call": call, "mask": name, "compile_s": wall,
                "compile_cpu_s": cpu, "max_abs_diff": gap,
                "also_against": f"fast tiled (chapter 8), {name}",
            }  # fmt: skip
    return programs, references


def kernel_rows(cfg, machine_of):
    """Each thread count compiles its own kernels (inductor's C++ takes
    the thread count it was generated for) and times them."""
    Q, K, V = inputs(cfg)
    rows = []
    for threads in cfg.threads:
        torch.set_num_threads(threads)
        torch._dynamo.reset()  # no kernel of the other thread count
        programs, references = kernel_programs(cfg, Q, K, V)
        machine = machine_of(threads)
        calls = {name: p["call"] for name, p in programs.items()}
        timing = measure.interleave(calls, cfg.rounds, warmup=1)
        clock = timing.cpu if threads == 1 else timing.wall
        for name, p in programs.items():
            reference = references[p["mask"]]
            against = [reference] + (
                [p["also_against"]] if "also_against" in p else []
            )
            for ref in against:
                if ref == name:
                    continue
                comparison = measure.ratio_columns(clock[ref], clock[name])
                info = {
                    k: v
                    for k, v in p.items()
                    if k not in ("call", "also_against")
                }
                rows.append(
                    measure.row(
                        comparison, timing, machine, part="kernels",
                        program=name, reference=ref, T=cfg.T, H=cfg.H,
                        d_k=cfg.d_k, clock="cpu" if threads == 1 else "wall",
                        **info,
                        **measure.median_columns("seconds", clock[name]),
                    )
                )  # fmt: skip
                print(
                    f"{threads} thread(s): {ref} / {name}: "
                    f"{comparison['ratio_median']:.2f}"
                )
    return rows


def kernel_code(cfg):
    """The C++ inductor writes for compiled causal FlexAttention."""
    from torch._inductor.utils import fresh_cache, run_and_get_code

    torch.set_num_threads(1)  # the code of the one-thread kernel
    Q, K, V = inputs(cfg)
    block_mask = create_block_mask(
        flex.causal, None, None, cfg.T, cfg.T, device="cpu"
    )
    compiled = torch.compile(flex_attention, dynamic=False)
    with fresh_cache(dir="/tmp"):
        _, codes = run_and_get_code(compiled, Q, K, V, block_mask=block_mask)
    kernels = [c for c in codes if "exp_reduce_sum_fusion_kernel" in c]
    if not kernels:
        raise AssertionError("no generated code holds the fused exp and sum")
    path = cfg.out / "flex_kernel.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(kernels[0], encoding="utf-8")
    print(f"wrote {path} ({len(kernels[0])} characters)")


def graph_breaks(cfg):
    """Rows (mask, T, rows of tiles, graphs, break reasons): the graphs
    dynamo hands to the compiler for chapter 8's fast tiled forward at the
    measured shape, one thread, compiled as the timed program was
    (`torch.compile(..., dynamic=False)`) with a back end that only counts
    them (no inductor); the reasons from dynamo's graph-break counters."""
    from torch._dynamo.utils import counters

    torch.set_num_threads(1)
    Q, K, V = inputs(cfg)
    rows = []
    for causal in (False, True):
        torch._dynamo.reset()
        counters.clear()
        graphs = []

        def count(graph, example_inputs, graphs=graphs):
            graphs.append(graph)
            return graph.forward

        compiled = torch.compile(
            flash.fast_attention, backend=count, dynamic=False
        )
        compiled(Q, K, V, causal)
        mask = "causal" if causal else "no mask"
        rows.append({
            "mask": mask, "T": cfg.T,
            "rows_of_tiles": math.ceil(cfg.T / flash.FAST_TILE[mask][0]),
            "graphs": len(graphs),
            "reasons": "; ".join(
                sorted(r.splitlines()[0] for r in counters["graph_break"])
            ),
        })  # fmt: skip
    torch._dynamo.reset()
    return rows


def profile_rows(program, call, calls):
    """Self CPU ms per call of each operation of `calls` calls of `call`."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    call()  # compiled already; one call outside the profile
    with profiler(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            call()
    return [
        {
            "program": program,
            "operation": event.key,
            "self_cpu_ms_per_call": event.self_cpu_time_total / 1e3 / calls,
            "calls_per_call": event.count / calls,
        }
        for event in prof.key_averages()
    ]


def kernel_profile(cfg):
    torch.set_num_threads(1)
    torch._dynamo.reset()  # compiled for one thread
    Q, K, V = inputs(cfg)
    block_mask = create_block_mask(
        flex.causal, None, None, cfg.T, cfg.T, device="cpu"
    )
    compiled = torch.compile(flex_attention, dynamic=False)
    rows = profile_rows(
        "FlexAttention compiled, causal",
        partial(compiled, Q, K, V, block_mask=block_mask),
        cfg.profile_calls,
    )
    sdpa = partial(sdpa_call, Q, K, V, None, True)
    return rows + profile_rows("SDPA, causal", sdpa, cfg.profile_calls)


def first_divergence(tokens, reference, logits):
    """(index of the first new token that differs or None, the gap between
    the reference's two largest logits at that step)."""
    differ = (tokens != reference).nonzero()
    if len(differ) == 0:
        return None, float("nan")
    t = int(differ[0])
    top = logits[t - PROMPT].topk(2).values
    return t, float(top[0] - top[1])


def compiled_step():
    """book/flex.py's fixed_step, compiled with inductor's cpp_wrapper."""
    return torch.compile(
        flex.fixed_step, dynamic=False, options={"cpp_wrapper": True}
    )


def decode_rows(cfg, machine):
    torch.set_num_threads(1)
    torch._dynamo.reset()
    ch, chars, _, val_data = setup()
    model = load_gpt(ch, len(chars), ch.WEIGHTS[4], context=4096)
    model64 = load_gpt(ch, len(chars), ch.WEIGHTS[4], context=4096).double()
    prompt, rows, profiles = val_data[:PROMPT], [], []
    for k, n in enumerate(cfg.new_tokens):
        decoder, step = gpt.Decoder(model, PROMPT + n), compiled_step()
        eager = partial(gpt.greedy, decoder, prompt, n)
        compiled = partial(flex.greedy_fixed, decoder, prompt, n, step)
        with torch.inference_mode():
            (tokens, _), compile_wall, compile_cpu = first_call(compiled)
            reference, ref_logits = eager()
        at, gap = first_divergence(tokens, reference, ref_logits)
        checks = {"first_divergence": at, "logit_gap": gap, "dtype": "float32"}
        if k == 0:  # float64: the tokens must be equal
            decoder64 = gpt.Decoder(model64, PROMPT + n)
            with torch.inference_mode():
                ours = flex.greedy_fixed(decoder64, prompt, n, compiled_step())
                theirs = gpt.greedy(decoder64, prompt, n)[0]
            checks["float64_tokens_equal"] = bool(torch.equal(ours[0], theirs))
        calls = {"eager Decoder": eager, "compiled fixed step": compiled}
        with torch.inference_mode():
            timing = measure.interleave(calls, cfg.decode_rounds, warmup=1)
        comparison = measure.ratio_columns(
            timing.cpu["eager Decoder"], timing.cpu["compiled fixed step"]
        )
        for name in calls:
            cpu = measure.median_columns("cpu_s", timing.cpu[name])
            is_compiled = name == "compiled fixed step"
            rows.append(
                measure.row(
                    comparison if is_compiled else {}, timing, machine,
                    part="decode", program=name, reference="eager Decoder",
                    new_tokens=n, tokens_per_cpu_s=n / cpu["cpu_s"],
                    compile_s=compile_wall if is_compiled else None,
                    compile_cpu_s=compile_cpu if is_compiled else None,
                    **cpu, **checks,
                )
            )  # fmt: skip
            print(f"{n} tokens, {name}: {n / cpu['cpu_s']:.0f} tokens/CPU s")
        profiles += decode_profiles(cfg, decoder, step, prompt, n)
    return rows, profiles


def decode_profiles(cfg, decoder, step, prompt, n):
    """Profiles of `profile_steps` steps, compiled and eager, at the
    position after the prompt."""
    one = torch.tensor([[int(prompt[-1])]])
    with torch.inference_mode():
        K_buf, V_buf = flex.new_buffers(decoder)
        rows = profile_rows(
            f"compiled fixed step, {n} tokens",
            partial(step, decoder, one, torch.tensor(PROMPT), K_buf, V_buf),
            cfg.profile_steps,
        )
        caches = decoder.new_caches()
        decoder.step(prompt[None], caches)
        rows += profile_rows(
            f"eager Decoder step, {n} tokens",
            partial(one_step, decoder, one, caches),
            cfg.profile_steps,
        )
    return rows


def one_step(decoder, token, caches):
    """One Decoder step, the caches cropped back so that every call sees
    the same length."""
    n = caches[0].length
    logits = decoder.step(token, caches)
    for cache in caches:
        cache.crop(n)
    return logits


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=PARTS)
    parser.add_argument("--quick", action="store_true", help="tiny sizes")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else Config()
    check_compiler()
    allow_recompiles()
    rows, profiles = [], []
    started = time.perf_counter()
    if "kernels" in args.parts:
        rows += kernel_rows(cfg, measure.machine)
    if "code" in args.parts:
        kernel_code(cfg)
    if "breaks" in args.parts:
        measure_csv.write_csv(
            graph_breaks(cfg), cfg.out / "flex_graph_breaks.csv"
        )
    if "profile" in args.parts:
        profiles += kernel_profile(cfg)
    if "decode" in args.parts:
        more, more_profiles = decode_rows(cfg, measure.machine(1))
        rows += more
        profiles += more_profiles
    run = measure_csv.run_id()
    if rows:
        measure_csv.write_csv(rows, cfg.out / "bench_flex.csv", run=run)
    if profiles:
        measure_csv.write_csv(
            pd.DataFrame(profiles), cfg.out / "bench_flex_profile.csv", run=run
        )
    print(f"bench_flex: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
