"""Greedy speculative decoding, chapter 11: a small draft model proposes k
tokens, the main model checks them all in one cached call, and both caches
are cropped back to the accepted prefix with `Cache.crop`.

Leviathan et al. 2023 (section 2.3, Algorithm 1) and Chen et al. 2023
(Algorithm 2) accept the proposals by sampling; with greedy decoding a
proposal is accepted when it is the main model's own argmax, so the text is
exactly that of plain greedy decoding.
"""

import torch

from transformer import KVCache


def check_prompt(prompt, n_new):
    """Raise ValueError unless prompt is a non-empty (T,) tensor and n_new >= 0."""
    if prompt.dim() != 1 or len(prompt) == 0:
        raise ValueError(
            f"the prompt must be a non-empty (T,) tensor, got shape "
            f"{tuple(prompt.shape)}"
        )
    if isinstance(n_new, bool) or not isinstance(n_new, int) or n_new < 0:
        raise ValueError(f"n_new must be an integer >= 0, got {n_new!r}")


def new_caches(model, spare=0):
    """One empty KVCache per block of a GPT; a windowed model's rolling
    caches get `spare` slots beyond its window w (w + spare in all)."""
    if model.w is None:
        return [KVCache() for _ in model.blocks]
    return [KVCache(model.w, spare) for _ in model.blocks]


@torch.no_grad()
def greedy(model, prompt, n_new):
    """Plain cached greedy decoding: the prompt (T,) and n_new tokens after it."""
    check_prompt(prompt, n_new)
    caches, tokens = new_caches(model), prompt.tolist()
    step_input = prompt
    for _ in range(n_new):
        logits = model(step_input[None], caches)[0, -1]  # (vocab,)
        tokens.append(int(logits.argmax()))
        step_input = torch.tensor(tokens[-1:])
    return torch.tensor(tokens)


@torch.no_grad()
def speculative(model, draft, prompt, n_new, k, spare=None):
    """Greedy speculative decoding: (tokens (T + n_new,), proposed, accepted).

    Each round the draft proposes k tokens, one cached step each; the main
    model scores the last token and the k proposals in one cached call of
    k + 1 tokens, keeps the proposals up to its first disagreement, and
    adds its own next token. Both models' caches are then cropped to the
    tokens kept. A rolling cache needs k slots beyond its window for that:
    `spare` (default k; fewer lets `crop` raise ValueError).
    """
    check_prompt(prompt, n_new)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(
            f"k, the tokens proposed per round, must be >= 1: {k!r}"
        )
    if draft.readout.out_features != model.readout.out_features:
        raise ValueError("the draft and the main model need the same vocab")
    spare = k if spare is None else spare
    main_caches = new_caches(model, spare)
    draft_caches = new_caches(draft, spare)
    tokens, proposed, accepted = prompt.tolist(), 0, 0
    goal = len(tokens) + n_new
    while len(tokens) < goal:
        k_round = min(k, goal - len(tokens) - 1)  # never past n_new
        guesses = []
        for _ in range(k_round):  # the draft: k cached steps
            fed = (tokens + guesses)[draft_caches[0].length :]  # not cached
            logits = draft(torch.tensor(fed)[None], draft_caches)[0, -1]
            guesses.append(int(logits.argmax()))
        fed = (tokens + guesses)[main_caches[0].length :]  # last + guesses
        logits = model(torch.tensor(fed)[None], main_caches)[0]
        best = logits[-k_round - 1 :].argmax(dim=-1).tolist()  # k_round + 1
        a = 0
        while a < k_round and guesses[a] == best[a]:
            a += 1
        tokens += guesses[:a] + [best[a]]  # the accepted ones and one more
        proposed, accepted = proposed + k_round, accepted + a
        keep = len(tokens) - 1  # every token but the newest is cached
        for cache in main_caches:
            cache.crop(keep)
        for cache in draft_caches:
            cache.crop(min(keep, cache.length))
    return torch.tensor(tokens), proposed, accepted
