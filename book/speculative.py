"""Greedy speculative decoding, chapter 11: a small draft model proposes k
tokens, the main model checks them all in one cached call, and both caches
are cropped back to the accepted prefix with `Cache.crop`.

Leviathan et al. 2023 (section 2.3, Algorithm 1) and Chen et al. 2023
(Algorithm 2) accept the proposals by sampling; with greedy decoding a
proposal is accepted when it is the main model's own argmax, so in exact
arithmetic the text is that of plain greedy decoding (chapter 11 checks it
in float64).
"""

import torch

from gpt import GPT, check_new, check_prompt


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
    check_speculative(model, draft, prompt, n_new, k, spare)
    spare = k if spare is None else spare
    main_caches = model.new_caches(spare)
    draft_caches = draft.new_caches(spare)
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


def check_speculative(model, draft, prompt, n_new, k, spare):
    """Raise ValueError unless `speculative` can run on these arguments: two
    GPTs with one vocabulary, a prompt of token ids in it, n_new and k >= 1,
    spare None or >= 0."""
    for name, net in (("model", model), ("draft", draft)):
        if not isinstance(net, GPT):
            raise ValueError(f"{name} must be a GPT, got {type(net).__name__}")
    check_prompt(prompt)
    check_new(n_new)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(
            f"k, the tokens proposed per round, must be >= 1: {k!r}"
        )
    vocab = model.readout.out_features
    if draft.readout.out_features != vocab:
        raise ValueError("the draft and the main model need the same vocab")
    outside = prompt[(prompt < 0) | (prompt >= vocab)]
    if len(outside):
        raise ValueError(
            f"the prompt holds token {int(outside[0])}, outside the "
            f"vocabulary 0..{vocab - 1}"
        )
    if spare is not None and (
        isinstance(spare, bool) or not isinstance(spare, int) or spare < 0
    ):
        raise ValueError(f"spare must be None or an integer >= 0: {spare!r}")
