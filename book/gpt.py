"""Chapter 10's GPT and its training, in a module for the chapter and tools/.

A character-level GPT built from the decoder block of transformer.py, the
training loop that fits it (`get_batch`, `train`) and the loss that judges
it (`validation_loss`). Chapter 10 imports them from here and prints them;
tools/train_gpt.py trains the stored weights (data/gpt_G4.pt, gpt_G1.pt)
with them, so the parameter names are those of the stored state dicts.
"""

import torch
import torch.nn.functional as F
from torch import nn

from transformer import DecoderBlock, KVCache


class GPT(nn.Module):
    """Embedding, `layers` causal pre-norm blocks, LayerNorm, readout."""

    def __init__(
        self,
        vocab,
        d=64,
        H=4,
        layers=2,
        d_ff=256,
        G=None,
        w=None,
        context=1024,
    ):
        super().__init__()
        self.context, self.w = context, w
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            DecoderBlock(d, H, d_ff, G, w) for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d)
        self.readout = nn.Linear(d, vocab)

    def forward(self, tokens, caches=None, return_weights=False):
        """Next-token logits (B, T, vocab) of tokens (B, T); with
        return_weights, also every block's weights (B, layers, H, T, T_k)."""
        seen = 0 if caches is None else caches[0].length
        if self.w is None and seen + tokens.shape[1] > self.context:
            raise ValueError(
                f"{seen + tokens.shape[1]} tokens exceed the context of "
                f"{self.context}"
            )
        x, weights = self.embed(tokens), []  # (B, T, d)
        for i, block in enumerate(self.blocks):
            cache = None if caches is None else caches[i]
            x, A = block(x, cache=cache, return_weights=True)
            weights.append(A)  # (B, H, T, T_k)
        logits = self.readout(self.norm(x))
        if return_weights:
            return logits, torch.stack(weights, dim=1)
        return logits

    def new_caches(self):
        """One empty KVCache per block (rolling if the model has a window)."""
        return [KVCache(self.w) for _ in self.blocks]


def get_batch(data, B, T, gen):
    """B random windows of T tokens and their next tokens: (x, y), (B, T)."""
    starts = torch.randint(len(data) - T, (B,), generator=gen)
    x = torch.stack([data[s : s + T] for s in starts])
    y = torch.stack([data[s + 1 : s + T + 1] for s in starts])
    return x, y


def train(model, data, steps, B=32, T=128, lr=3e-3, seed=0):
    """AdamW on random windows; returns the loss of every step."""
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * (1 - step / steps)  # linear decay to 0
        x, y = get_batch(data, B, T, gen)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@torch.no_grad()
def validation_loss(model, x, y, rows=64):
    """Mean cross-entropy (nats) of the model on x, y (N, T), `rows` at a time."""
    total = 0.0
    for i in range(0, len(x), rows):
        logits = model(x[i : i + rows]).double()
        total += F.cross_entropy(
            logits.flatten(0, 1), y[i : i + rows].flatten(), reduction="sum"
        ).item()
    return total / y.numel()
