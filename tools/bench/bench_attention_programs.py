"""The programs that tools/bench/bench_attention.py measures: chapter 8's own
functions (imported from the notebook, so the benchmark times exactly the
code the book prints), their inputs, and the checks that each gives the
naive program's output before it is timed."""

import chapter_loader
import numpy as np
import torch

NOTEBOOK = "08_efficient_attention.ipynb"
NAIVE = "PyTorch by hand"
SDPA = "F.scaled_dot_product_attention"

# name in the CSV -> (function in the notebook, library of its inputs, causal)
PROGRAMS = {
    "loop (NumPy)": ("attention_loop", "numpy", False),
    "NumPy": ("attention_numpy", "numpy", False),
    NAIVE: ("attention_torch", "torch", False),
    SDPA: ("attention_sdpa", "torch", False),
    "tiled (ours)": ("tiled_attention", "torch", False),
    SDPA + ", causal": ("attention_sdpa", "torch", True),
    "tiled (ours), causal": ("tiled_attention", "torch", True),
    "fast tiled (ours)": ("fast_attention", "torch", False),
    "fast tiled (ours), causal": ("fast_attention", "torch", True),
}
# the ablation at one T: the fast program as the chapter sets it (LEVERS),
# with each of its four changes toggled in turn, and with the simple
# program's tiles, beside the simple program and the fused kernel
LEVER_NAMES = {
    "base2": "base-2 exponentials",
    "inside": "the shift inside the product",
    "ones": "the sums from a ones column",
    "lazy": "the lazy reference",
}


def load_chapter():
    """Chapter 8's definitions (tools/chapter_loader.py)."""
    return chapter_loader.load_chapter(NOTEBOOK)


def ablation_variants(chapter):
    """name -> (function, keywords) of every program of the ablation."""
    variants = {
        SDPA: ("attention_sdpa", {}),
        "tiled (simple)": ("tiled_attention", {}),
        "fast, as set": ("fast_attention", {}),
    }
    for lever, on in chapter.LEVERS.items():
        name = f"fast, {'without' if on else 'with'} {LEVER_NAMES[lever]}"
        variants[name] = ("fast_attention", {"levers": {lever: not on}})
    variants["fast, the simple version's tiles"] = (
        "fast_attention",
        {"B_r": 128, "B_c": 512},
    )
    return variants


def sweep_variants(part):
    """The fast program at every tile size of the sweep (a VariantPart)."""
    return {
        f"{B_r} x {B_c}": ("fast_attention", {"B_r": B_r, "B_c": B_c})
        for B_r in part.sweep_q
        for B_c in part.sweep_k
    }


def make_inputs(T, problem, seed=0):
    """float32 Q, K, V of shape (B, H, T, d_k), as NumPy and as torch."""
    rng = np.random.default_rng(seed)
    shape = (problem.batch, problem.heads, T, problem.d)
    arrays = [rng.standard_normal(shape, dtype=np.float32) for _ in range(3)]
    return arrays, [torch.from_numpy(a) for a in arrays]


def make_call(chapter, name, T, problem):
    """A zero-argument function that runs program `name` at length T."""
    fn_name, lib, causal = PROGRAMS[name]
    fn = getattr(chapter, fn_name)
    arrays, tensors = make_inputs(T, problem)
    inputs = arrays if lib == "numpy" else tensors
    kwargs = (
        {"B_r": problem.block_q, "B_c": problem.block_k}
        if fn_name == "tiled_attention"
        else {}
    )  # the fast program uses its own tiles (FAST_TILE)
    return lambda: fn(*inputs, causal=causal, **kwargs)


def make_variant(chapter, fn_name, kwargs, causal, tensors):
    """A zero-argument call of chapter.fn_name(Q, K, V, causal, **kwargs)."""
    fn = getattr(chapter, fn_name)
    return lambda: fn(*tensors, causal=causal, **kwargs)


def flops(T, problem):
    """4 T^2 d_k per head: the same count for every program."""
    return 4 * T**2 * problem.d * problem.heads * problem.batch


def check_equal(chapter, T, problem):
    """Every program gives the naive program's output (float32, atol 1e-4)."""
    _, tensors = make_inputs(T, problem)
    references = {
        causal: chapter.attention_torch(*tensors, causal=causal).numpy()
        for causal in (False, True)
    }
    for name in PROGRAMS:
        if name == "loop (NumPy)" and T > problem.loop_max:
            continue
        reference = references[PROGRAMS[name][2]]
        out = make_call(chapter, name, T, problem)()
        out = out.numpy() if isinstance(out, torch.Tensor) else out
        err = float(np.abs(out - reference).max())
        if not err <= 1e-4:
            raise RuntimeError(
                f"{name} differs from {NAIVE} at T = {T}: {err:.2e}"
            )


def check_variants(chapter, T, problem, variants):
    """Every variant (name -> (function, keywords)) gives the naive
    program's output, causal and not (float32, atol 1e-4)."""
    _, tensors = make_inputs(T, problem)
    for causal in (False, True):
        reference = chapter.attention_torch(*tensors, causal=causal)
        for name, (fn_name, kwargs) in variants.items():
            out = make_variant(chapter, fn_name, kwargs, causal, tensors)()
            err = float((out - reference).abs().max())
            if not err <= 1e-4:
                raise RuntimeError(
                    f"{name} (causal={causal}) differs from {NAIVE} at "
                    f"T = {T}: {err:.2e}"
                )
