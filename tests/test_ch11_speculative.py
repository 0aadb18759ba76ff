"""Chapter 11, speculative decoding (book/speculative.py) and the paged
cache of its exercise (book/11_token_cost.ipynb), against independent
references: greedy decoding that reruns the model on the whole text at every
step, and the contiguous KVCache. Small random models, prompts and sizes the
chapter never prints."""

import pytest
import torch
from conftest import load_chapter

import speculative as spec
from gpt import GPT, Decoder, greedy
from transformer import KVCache

VOCAB = 23


def reference_greedy(model, prompt, n_new):
    """Greedy decoding without a cache: the whole text at every step."""
    tokens = prompt.clone()
    with torch.no_grad():
        for _ in range(n_new):
            logits = model(tokens[None])[0, -1]
            tokens = torch.cat([tokens, logits.argmax().view(1)])
    return tokens


@pytest.fixture(scope="module")
def models():
    """A main model, a windowed copy, a one-layer draft; float64, random."""
    torch.manual_seed(11)
    main = GPT(VOCAB, d=32, H=4, layers=2, d_ff=64, G=2).double()
    windowed = GPT(VOCAB, d=32, H=4, layers=2, d_ff=64, G=2, w=7).double()
    windowed.load_state_dict(main.state_dict())
    draft = GPT(VOCAB, d=16, H=2, layers=1, d_ff=32).double()
    return main, windowed, draft


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(VOCAB, (n,), generator=gen) for n in (1, 5, 12)]


@pytest.fixture(scope="module")
def expected(models, prompts):
    """The reference's 45 tokens for (main or windowed, prompt index)."""
    return {
        (name, i): reference_greedy(model, prompt, 45)
        for name, model in zip(("main", "windowed"), models[:2], strict=True)
        for i, prompt in enumerate(prompts)
    }


def test_greedy_matches_uncached_reference(models, prompts, expected):
    for name, model in zip(("main", "windowed"), models[:2], strict=True):
        for i, prompt in enumerate(prompts):
            tokens = greedy(model, prompt, 45)[0]
            assert torch.equal(tokens, expected[name, i])


@torch.no_grad()
def reference_counts(text, draft, P, n_new, k):
    """(proposed, accepted) of greedy speculative decoding, from the main
    model's greedy text (its first P tokens the prompt) and the draft run
    without a cache: each round the draft proposes up to k tokens, the
    leading ones that equal the main model's text are accepted, and the
    main model adds its own next token."""
    text, proposed, accepted = text.tolist(), 0, 0
    n = P  # tokens kept so far
    while n < P + n_new:
        k_round, guesses = min(k, P + n_new - n - 1), []
        for _ in range(k_round):
            logits = draft(torch.tensor(text[:n] + guesses)[None])[0, -1]
            guesses.append(int(logits.argmax()))
        a = 0
        while a < k_round and guesses[a] == text[n + a]:
            a += 1
        proposed, accepted, n = proposed + k_round, accepted + a, n + a + 1
    return proposed, accepted


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_speculative_is_greedy(models, prompts, expected, k):
    """The text of plain greedy decoding, and the counts of proposed and
    accepted tokens of a reference run with an uncached draft."""
    draft, some_accepted = models[2], 0
    for name, model in zip(("main", "windowed"), models[:2], strict=True):
        for i, prompt in enumerate(prompts):
            tokens, proposed, accepted = spec.speculative(
                model, draft, prompt, 45, k
            )
            assert torch.equal(tokens, expected[name, i])
            counts = reference_counts(
                expected[name, i], draft, len(prompt), 45, k
            )
            assert (proposed, accepted) == counts
            some_accepted += 0 < accepted < proposed
    assert some_accepted  # the draft is partly right somewhere


@pytest.mark.parametrize("k", [2, 5])
def test_speculative_with_itself_accepts_all(models, prompts, k):
    """A draft equal to the main model is always right: every proposal is
    accepted and each round adds k + 1 tokens."""
    main, windowed, _ = models
    for model in (main, windowed):
        tokens, proposed, accepted = spec.speculative(
            model, model, prompts[1], 37, k
        )
        assert torch.equal(tokens, reference_greedy(model, prompts[1], 37))
        assert accepted == proposed
        rounds = 37 - accepted
        assert rounds == -(-37 // (k + 1))  # ceil(37 / (k + 1))


def test_windowed_draft(models, prompts):
    main, windowed, _ = models
    tokens, _, _ = spec.speculative(main, windowed, prompts[2], 30, 3)
    assert torch.equal(tokens, reference_greedy(main, prompts[2], 30))


def test_rolling_cache_needs_spare_slots(models, prompts):
    _, windowed, draft = models
    with pytest.raises(ValueError, match="overwritten"):
        spec.speculative(windowed, draft, prompts[2], 60, 4, spare=0)
    spec.speculative(windowed, draft, prompts[2], 60, 4, spare=4)  # enough


def test_caches(models):
    main, windowed, _ = models
    assert all(c.capacity is None for c in main.new_caches(3))
    assert [c.capacity for c in windowed.new_caches(3)] == [10, 10]


def test_bad_input(models, prompts):
    main, _, draft = models
    for k in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="k, the tokens proposed"):
            spec.speculative(main, draft, prompts[0], 5, k)
    with pytest.raises(ValueError, match="empty"):
        spec.speculative(main, draft, torch.tensor([], dtype=torch.long), 5, 2)
    with pytest.raises(ValueError, match="1-d"):
        spec.speculative(main, draft, prompts[1][None], 5, 2)
    for n_new in (0, -1):
        with pytest.raises(ValueError, match="n_new"):
            spec.speculative(main, draft, prompts[1], n_new, 2)
    other = GPT(VOCAB + 1, d=16, H=2, layers=1, d_ff=32).double()
    with pytest.raises(ValueError, match="same vocab"):
        spec.speculative(main, other, prompts[1], 5, 2)
    for bad in (VOCAB, -1):  # a token outside the vocabulary
        prompt = torch.cat([prompts[1], torch.tensor([bad])])
        with pytest.raises(ValueError, match=f"token {bad}, outside"):
            spec.speculative(main, draft, prompt, 5, 2)
    for spare in (-1, 1.5, True):
        with pytest.raises(ValueError, match="spare must be"):
            spec.speculative(main, draft, prompts[1], 5, 2, spare=spare)
    stepper = Decoder(main, 64)  # not a GPT: no cached GPT calls
    with pytest.raises(ValueError, match="model must be a GPT"):
        spec.speculative(stepper, draft, prompts[1], 5, 2)
    with pytest.raises(ValueError, match="draft must be a GPT"):
        spec.speculative(main, stepper, prompts[1], 5, 2)


@pytest.fixture(scope="module")
def paged():
    """The exercise's solution, from chapter 11's notebook."""
    return load_chapter("11_token_cost.ipynb")


def test_paged_cache_equals_contiguous(models, paged):
    main = models[0]
    pool = paged.PagePool(40, G=2, d_k=8, dtype=torch.float64)
    pool.free.reverse()  # any order: here pages handed out from the last
    caches = [paged.PagedCache(pool) for _ in main.blocks]
    rival = [paged.PagedCache(pool) for _ in main.blocks]
    contiguous = [KVCache() for _ in main.blocks]
    gen = torch.Generator().manual_seed(5)
    text = torch.randint(VOCAB, (1, 75), generator=gen)
    with torch.no_grad():
        for start, end in ((0, 16), (16, 17), (17, 33), (33, 50)):
            main(text[:, 50 - end : 50 - start], rival)
            got = main(text[:, start:end], caches)
            expected = main(text[:, start:end], contiguous)
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
        assert len(caches[0].table) == 4  # 50 tokens: pages of 16
        assert caches[0].nbytes() == 4 * 2 * (2 * 16 * 8 * 8)
        free = len(pool.free)
        for cache, other in zip(caches, contiguous, strict=True):
            cache.crop(20)
            other.crop(20)
        assert len(pool.free) == free + 2 * 2  # pages 3 and 4 of each layer
        got = main(text[:, 50:75], caches)  # reuses freed pages
        expected = main(text[:, 50:75], contiguous)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
        for cache in caches:
            cache.crop(0)
        assert caches[0].table == [] and caches[0].nbytes() == 0


def test_paged_cache_bad_input(paged):
    pool = paged.PagePool(2, G=2, d_k=8, dtype=torch.float64)
    cache = paged.PagedCache(pool)
    K = torch.zeros(1, 2, 20, 8, dtype=torch.float64)
    cache.update(K, K)
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(21)
    with pytest.raises(ValueError, match="pages are in use"):
        cache.update(
            torch.zeros(1, 2, 13, 8, dtype=torch.float64), K[:, :, :13]
        )
    with pytest.raises(ValueError, match="one sequence"):
        paged.PagedCache(pool).update(
            K.expand(2, -1, -1, -1), K.expand(2, -1, -1, -1)
        )
