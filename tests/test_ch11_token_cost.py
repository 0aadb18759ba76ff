"""Chapter 11: equation ch11-cost (FLOPs and bytes of a call on T tokens
after n cached ones) equals PyTorch's FLOP counter and the bytes the model's
weights and caches hold, on model sizes the chapter never prints; the
operation log sees every operation; the generation-time model reduces to
the work at zero cost per operation; bad inputs."""

import random

import pytest
import torch
from conftest import LazyChapter
from torch.utils.flop_counter import FlopCounterMode

from gpt import GPT, Decoder

ch11 = LazyChapter("11_token_cost.ipynb")
ch10 = LazyChapter("10_inference.ipynb")  # its sizes and its work count


def random_configs(count, seed=11):
    """Sizes of small GPTs: layers, d, H, G dividing H, d_ff, vocab."""
    rng = random.Random(seed)
    for _ in range(count):
        H = rng.choice([1, 2, 4, 8])
        G = rng.choice([g for g in (1, 2, 4, 8) if H % g == 0])
        d = H * 2 * rng.randint(1, 6)  # even head size, for rotary
        yield {
            "layers": rng.randint(1, 4),
            "d": d,
            "H": H,
            "G": G,
            "d_ff": rng.randint(3, 70),
            "vocab": rng.randint(2, 40),
        }


def model_of(config, seed=0):
    torch.manual_seed(seed)
    sizes = {k: v for k, v in config.items() if k != "vocab"}
    return GPT(config["vocab"], **sizes).eval()


def counted(model, T, n, B=1):
    """PyTorch's FLOP count of a call on T tokens after n cached ones."""
    caches = model.new_caches()
    vocab = model.embed.num_embeddings
    with torch.no_grad():
        if n > 0:
            model(torch.randint(vocab, (B, n)), caches)
        tokens = torch.randint(vocab, (B, T))
        with FlopCounterMode(display=False) as counter:
            model(tokens, caches)
    return counter.get_total_flops(), caches


@pytest.mark.parametrize("config", list(random_configs(12)))
def test_flops_equal_pytorchs_counter(config):
    model = model_of(config)
    dims = ch11.sizes(model)
    rng = random.Random(str(config))
    for _ in range(3):
        T, n = rng.randint(1, 9), rng.choice([0, 1, rng.randint(2, 30)])
        flops, _ = counted(model, T, n)
        assert flops == ch11.cost(T, n, **dims)[0], (T, n)


def test_flops_of_a_batch_are_B_times():
    model = model_of(next(random_configs(1, seed=3)))
    dims = ch11.sizes(model)
    flops, _ = counted(model, 3, 5, B=4)
    assert flops == 4 * ch11.cost(3, 5, **dims)[0]


@pytest.mark.parametrize("config", list(random_configs(6, seed=5)))
def test_bytes_are_the_weights_and_the_cache(config):
    """bytes(T, n): the matrix-product weights of the model (every Linear's
    weight, not biases, norms or the embedding table) and the keys and
    values the caches hold after the call."""
    model = model_of(config)
    dims = ch11.sizes(model)
    weights = sum(
        m.weight.numel()
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
    )
    assert weights == ch11.matmul_weights(**dims)
    for T, n in ((1, 0), (4, 0), (1, 7), (3, 11)):
        _, caches = counted(model, T, n)
        held = sum(cache.nbytes() for cache in caches)
        for nbytes in (2, 4):
            expected = nbytes * weights + held * nbytes // 4  # float32 caches
            assert ch11.cost(T, n, **dims, nbytes=nbytes)[1] == expected


def test_intensity_of_decode_is_2_over_b_when_G_equals_H():
    dims = {"L": 3, "d": 24, "G": 6, "d_k": 4, "d_ff": 50, "vocab": 17}
    for n in (0, 5, 300):
        flops, read = ch11.cost(1, n, **dims, nbytes=2)
        assert flops == read  # 2 / b = 1
        uncached, _ = ch11.cost(n + 1, 0, **dims)
        assert uncached == (n + 1) * ch11.cost(1, n, **dims)[0]


def test_sizes_read_from_the_model():
    model = GPT(13, d=24, H=6, layers=3, d_ff=50, G=2)
    assert ch11.sizes(model) == {
        "L": 3,
        "d": 24,
        "G": 2,
        "d_k": 4,
        "d_ff": 50,
        "vocab": 13,
    }


def test_model_sizes_are_chapter_10s():
    assert ch11.MODEL == ch10.MODEL


def test_oplog_records_every_operation():
    a, b = torch.ones(3), torch.ones(3)
    with ch11.OpLog() as log:
        c = (a + b) * 2 + 1
        c.sum()
    names = [str(op) for op, _, _ in log.calls]
    add, mul, total = "aten.add.Tensor", "aten.mul.Tensor", "aten.sum.default"
    assert names == [add, mul, add, total]
    op, args, kwargs = log.calls[0]
    assert torch.equal(op(*args, **kwargs), a + b)


def test_operations_of_decode_do_not_depend_on_the_cache_length():
    model = model_of(next(random_configs(1, seed=8)))
    counts = {len(ch11.operations(model, 1, n)) for n in (1, 9, 40)}
    assert len(counts) == 1
    assert ch11.operations(model, 5, 0, cached=False) == ch11.operations(
        model, 17, 0, cached=False
    )


def test_generation_time_without_overhead_is_the_work():
    """At t_op = 0 and R = 1, the time is the FLOPs of chapter 10's calls:
    twice its multiply-adds, equation ch10-work."""
    dims = {"L": 2, "d": 16, "G": 2, "d_k": 4, "d_ff": 24, "vocab": 9}
    work = {"L": 2, "d": 16, "G": 2, "d_k": 4, "d_ff": 24, "vocab": 9}
    ops = {"prompt": 7, "decode": 5, "uncached": 3}
    for n, P, cached in ((1, 4, True), (9, 3, True), (9, 3, False)):
        t = ch11.generation_time(n, P, cached, 0.0, 1.0, ops, dims)
        assert t == 2 * ch10.work(n, P, cached, **work)
        calls = 1 + (n - 1) * cached if cached else n
        t_ops = ch11.generation_time(
            n, P, cached, 1.0, float("inf"), ops, dims
        )
        per_call = ops["decode"] if cached else ops["uncached"]
        first = ops["prompt"] if cached else per_call
        assert t_ops == first + (calls - 1) * per_call


@pytest.mark.parametrize(
    "T, n, nbytes, match",
    [
        (0, 0, 4, "T must be >= 1"),
        (1, -1, 4, "n must be >= 0"),
        (2.0, 0, 4, "T must be an integer"),
        (1, 0, 0, "nbytes must be >= 1"),
        (True, 0, 4, "T must be an integer"),
    ],
)
def test_bad_inputs(T, n, nbytes, match):
    dims = {"L": 1, "d": 8, "G": 1, "d_k": 4, "d_ff": 8, "vocab": 5}
    with pytest.raises(ValueError, match=match):
        ch11.cost(T, n, **dims, nbytes=nbytes)


@pytest.mark.parametrize(
    "size, value, match",
    [
        ("d_k", float("nan"), "d_k must be an integer"),
        ("L", -2, "L must be >= 1"),
        ("d", None, "d must be an integer"),
        ("G", 0, "G must be >= 1"),
    ],
)
def test_bad_sizes(size, value, match):
    """A size that is not an integer >= 1 gave NaN, negative or silent
    numbers, or a TypeError (review R3)."""
    dims = {"L": 1, "d": 8, "G": 1, "d_k": 4, "d_ff": 8, "vocab": 5}
    with pytest.raises(ValueError, match=match):
        ch11.cost(1, 0, **(dims | {size: value}))


def test_batch_step_adds_the_row_mask_and_scatter_writes_whatever_B():
    """A BatchCache step runs one list of operations for every B; against a
    StaticCache step it adds the per-row mask and the scatter writes, and
    writes no slice (the counts the chapter prints for its own model)."""
    for seed in (3, 8):
        model = model_of(next(random_configs(1, seed=seed)))
        decoder = Decoder(model, 12)
        steps = [ch11.decoder_operations(decoder, B) for B in (1, 3, 7)]
        assert steps[0] == steps[1] == steps[2]
        static = ch11.op_names(ch11.decoder_operations(decoder))
        batch = ch11.op_names(steps[0])
        layers = len(model.blocks)
        assert batch["scatter_"] == 3 * layers and static["scatter_"] == 0
        assert batch["where"] == layers and static["where"] == 0
        assert static["copy_"] == 2 * layers and batch["copy_"] == 0
