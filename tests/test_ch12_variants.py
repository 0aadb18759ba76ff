"""Chapter 12's own code (book/12_variants.ipynb): `numbers_per_token`, the
count of what each trained model's caches hold per token, against the real
caches of freshly built models of the same kinds (`nbytes()` after a
prefill and the copies `extend` adds), at lengths the chapter never prints;
`extend` against a cache filled by the model itself; the published-model
formula's pieces against their configurations' arithmetic."""

import pytest
import torch
from chapter_loader import load_chapter

import variants as v
from gpt import GPT

ch12 = load_chapter("12_variants.ipynb")
VOCAB = 65  # chapter 10's characters
NAMES = [
    "mha",
    "gqa",
    "mqa",
    "mqa_wide",
    "window",
    "mla",
    "cla",
    "hybrid",
    "sparse",
]


def build(name):
    """An untrained model of kind `name`, with chapter 10's sizes."""
    if name in ("mha", "mqa"):
        torch.manual_seed(0)
        model = GPT(
            VOCAB, d=64, H=4, layers=2, d_ff=256, G=4 if name == "mha" else 1
        )
    else:
        model, _ = v.build_variant(name, VOCAB)
    return model.eval()


def tokens(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(VOCAB, (n,), generator=gen)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("T", [1, 31, 33, 700])
def test_the_count_equals_the_real_caches(name, T):
    held = ch12.cache_bytes(build(name), T, tokens(600))
    assert round(4 * T * sum(ch12.numbers_per_token(name, T).values())) == held


@pytest.mark.parametrize(
    "name", ["mha", "window", "mla", "cla", "hybrid", "sparse"]
)
def test_extend_holds_what_the_model_would_have_cached(name):
    """Copies added by `extend` take the bytes that 90 more real tokens take."""
    model, text = build(name), tokens(130, seed=1)
    real = model.new_caches()
    with torch.no_grad():
        model(text[None], real)
    copied = model.new_caches()
    with torch.no_grad():
        model(text[:40][None], copied)
    for cache in copied:
        ch12.extend(cache, 90)
    assert [c.nbytes() for c in copied] == [c.nbytes() for c in real]
    assert [c.length for c in copied] == [c.length for c in real] == [130, 130]


def test_the_count_of_other_sizes():
    """A four-layer MHA of head size 8: 2 L G d_k numbers per token."""
    assert ch12.numbers_per_token("mha", 10, L=4, d_k=8) == {
        "keys and values": 2 * 4 * 4 * 8
    }
    assert ch12.numbers_per_token("cla", 10, L=4, d_k=8) == {
        "keys and values": 2 * 2 * 4 * 8
    }


def test_an_unknown_model_raises():
    with pytest.raises(ValueError, match="unknown model 'gpt2'"):
        ch12.numbers_per_token("gpt2", 10)
