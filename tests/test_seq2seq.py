"""The encoder-decoder Transformer of book/seq2seq.py (issue 37), against
independent references:

- PyTorch's `nn.TransformerDecoderLayer` and `nn.Transformer` (norm first,
  no dropout), given the same weights, in float64 within 1e-9, with a
  causal target mask and a source padding mask, on several shapes;
- a functional reference written here from the papers' formulas (sinusoids,
  learned positions clamped to their table, rotary pairs as complex
  numbers, ALiBi's bias -m|i - j| with the slopes of Press et al., section
  3), for the whole model under every position option;
- cached greedy decoding against uncached (tokens equal, logits and
  cross-attention weights within 1e-10) and the bytes of each cache;
- the claims of the docstrings (no positions: permuting the source changes
  nothing; padding changes nothing) and every ValueError;
- the stored models of `make train-seq2seq` give their logged rows again.
"""

import json
import math
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
import train_seq2seq as tool  # tools/train/train_seq2seq.py
from conftest import BOOK
from torch import nn

import seq2seq
from seq2seq import (
    POSITIONS,
    CrossDecoderBlock,
    Decoder,
    Encoder,
    Seq2Seq,
    alibi_bias,
    alibi_slopes,
    attend_biased,
    cache_bytes,
    greedy,
    load_torch_weights,
    mirror_weight,
)

# nn.Transformer warns that norm_first turns its nested-tensor path off
pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor")

TOL = 1e-9  # float64, against nn.Transformer and the reference
VOCAB, BOS = 13, 1  # chapter 9's vocabulary size and start token

# (d, H, d_ff, B, T, S, source lengths): odd lengths, padding, one head
SHAPES = [
    (16, 4, 24, 3, 5, 7, [7, 3, 5]),
    (12, 3, 20, 2, 1, 4, [1, 4]),
    (8, 1, 8, 4, 9, 3, [3, 2, 1, 3]),
    (24, 2, 40, 1, 6, 11, [11]),
]


def random(*shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def padding(lengths, S):
    """(B, S): True at a real source position."""
    return torch.arange(S) < torch.tensor(lengths)[:, None]


def causal(T):
    return torch.ones(T, T, dtype=torch.bool).tril()


# --- bad input to every public function (issue 47) ---------------------------
# Each check names the problem in a ValueError; an empty query or target
# sequence gives an empty result. First in the file: a planted bug in a
# check fails here within seconds.


def raises(message, function, *args, **kwargs):
    with pytest.raises(ValueError, match=message):
        function(*args, **kwargs)


def qkv(B=2, H=3, T_q=4, T_k=5, d_k=8, dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    return tuple(
        torch.randn(B, H, T, d_k, generator=gen, dtype=dtype)
        for T in (T_q, T_k, T_k)
    )


def test_alibi_bias_bad_input():
    pos = torch.arange(3)
    raises("integer positions", alibi_bias, 4, pos.double(), pos)
    raises("integer positions", alibi_bias, 4, pos, pos[None])
    raises("integer positions", alibi_bias, 4, [0, 1], pos)
    raises("empty key sequence", alibi_bias, 4, pos, pos[:0])
    raises("float type", alibi_bias, 4, pos, pos, torch.long)
    raises("float type", alibi_bias, 4, pos, pos, "float64")  # not a dtype
    assert alibi_bias(4, pos[:0], pos).shape == (4, 0, 3)  # no query


def test_attend_biased_refuses_mask_or_bias_on_another_device():
    """A mask or bias on another device than Q was a RuntimeError (fresh
    review of issue 47, round 2); now a ValueError naming both devices."""
    Q, K, V = qkv()
    mask = torch.ones(4, 5, dtype=torch.bool, device="meta")
    bias = torch.zeros(4, 5, dtype=torch.float64, device="meta")
    raises("^mask is on meta, Q on cpu$", attend_biased, Q, K, V, mask)
    raises("^bias is on meta, Q on cpu$", attend_biased, Q, K, V, None, bias)
    # causal: its own check raises, else `mask & allowed` mixes devices
    layer = seq2seq.AlibiSelfAttention(8, 2, causal=True)
    square = torch.ones(5, 5, dtype=torch.bool, device="meta")
    raises("^mask is on meta, Q on cpu$", layer, torch.ones(2, 5, 8), square)


def test_attend_biased_bad_input():
    Q, K, V = qkv()
    bias = torch.zeros(3, 4, 5, dtype=torch.float64)
    raises(
        "K is torch.float64 on cpu, Q is torch.float32",
        attend_biased,
        Q.float(),
        K,
        V,
    )
    raises(
        "V is torch.float32 on cpu, Q is torch.float64",
        attend_biased,
        Q,
        K,
        V.float(),
    )
    raises("mixed dtypes: Q", attend_biased, Q, K, V, None, bias.float())
    raises("mismatched batches", attend_biased, Q[:1], K, V)
    raises("mismatched batches", attend_biased, Q, K[:, :2], V)
    raises("same size d_k: Q has 8, K has 4", attend_biased, Q, K[..., :4], V)
    raises("K has 5 rows, V has 4", attend_biased, Q, K, V[:, :, :4])
    raises(
        "at least one key for its", attend_biased, Q, K[:, :, :0], V[:, :, :0]
    )
    raises("got d_k = 0", attend_biased, Q[..., :0], K[..., :0], V, None, bias)
    raises("Q must be a floating-point", attend_biased, Q.long(), K, V)
    raises("bias must be", attend_biased, Q, K, V, None, bias[..., :4])
    raises("mask must be", attend_biased, Q, K, V, torch.ones(4, 5))
    raises("mask must be", attend_biased, Q, K, V, torch.ones(4, 6).bool())
    no_key = torch.ones(4, 5, dtype=torch.bool)
    no_key[2] = False
    raises("no key", attend_biased, Q, K, V, no_key, bias)
    out, weights = attend_biased(Q[:, :, :0], K, V, no_key[:0], bias[:, :0])
    assert out.shape == (2, 3, 0, 8) and weights.shape == (2, 3, 0, 5)


def test_alibi_self_attention_bad_input():
    attention = seq2seq.AlibiSelfAttention(16, 4, causal=True).double()
    x = random(2, 5, 16)
    raises("mixed dtypes: x", attention, x.float())
    raises("x has 8 features", attention, x[..., :8])
    raises(r"x must have shape \(B, T, 16\)", attention, x[0])
    raises("cache must be", attention, x, None, "cache")
    raises("mask must be", attention, x, torch.ones(5, 5))  # float
    raises("mask must be", attention, x, torch.ones(4, 4).bool())
    with torch.no_grad():
        out, weights = attention(x[:, :0])  # no token: no query, no key
    assert out.shape == (2, 0, 16) and weights.shape == (2, 4, 0, 0)


def test_positions_and_sizes_are_checked():
    raises(
        "positions must be None or one of",
        seq2seq.self_attention,
        16,
        4,
        "relative",
        True,
    )
    raises("positions must be None or one of", Encoder, 16, 4, 24, 2, "abs")
    raises("positions must be None or one of", Decoder, 16, 4, 24, 2, "abs")
    raises("layers must be a positive integer", Encoder, 16, 4, 24, 0)
    raises("layers must be a positive integer", Decoder, 16, 4, 24, 1.5)
    raises("d_ff must be a positive integer", CrossDecoderBlock, 16, 4, 0)
    raises("vocab must be a positive integer", Seq2Seq, 0)
    raises("max_len must be a positive integer", Seq2Seq, 13, max_len=0)
    raises("bos=-1 is outside", Seq2Seq, 13, bos=-1)
    raises("bos=13 is outside", Seq2Seq, 13, bos=13)
    raises("layers must be a pair", Seq2Seq, 13, layers=2)
    raises("layers must be a pair", Seq2Seq, 13, layers=(2, 2, 2))
    raises("layers must be a pair", Seq2Seq, 13, layers=(2, 0))


def test_cross_attention_bad_input():
    attention = seq2seq.CrossAttention(16, 4).double()
    memory = random(2, 5, 16)
    kv = attention.keys_values(memory)
    x = random(2, 3, 16, seed=1)
    raises("empty source", attention.keys_values, memory[:, :0])
    raises("mixed dtypes: memory", attention.keys_values, memory.float())
    raises("memory has 8 features", attention.keys_values, memory[..., :8])
    raises("mixed dtypes: x", attention, x.float(), kv)
    raises("mismatched batches", attention, random(3, 3, 16), kv)
    raises("kv must be the pair", attention, x, kv[0])
    raises("kv must be the pair", attention, x, (kv[0], "V"))
    raises("K and V differ", attention, x, (kv[0], kv[1][:, :, :4]))
    raises(
        "K is torch.float32 on cpu, Q is torch.float64",
        attention,
        x,
        (kv[0].float(), kv[1].float()),
    )
    raises(
        "no key", attention, x, kv, torch.zeros(2, 1, 1, 5, dtype=torch.bool)
    )
    with torch.no_grad():
        out, weights = attention(x[:, :0], kv)  # no query: empty
    assert out.shape == (2, 0, 16) and weights.shape == (2, 4, 0, 5)


def test_decoder_block_bad_input():
    block = CrossDecoderBlock(16, 4, 24).double()
    x, memory = random(2, 3, 16), random(2, 5, 16, seed=1)
    raises("x has 8 features", block, x[..., :8], memory)
    raises("mixed dtypes: x", block, x.float(), memory.float())
    raises("mixed dtypes: memory", block, x, memory.float())
    raises("memory has 8 features", block, x, memory[..., :8])
    raises("memory must be a float tensor", block, x, memory[0])
    K, V = block.cross_attn.keys_values(memory)
    raises("empty source", block, x, (K[:, :, :0], V[:, :, :0]))
    raises(
        "cache must be a Cache or None", block, x, memory, None, None, "cache"
    )
    raises("memory_mask must be a boolean", block, x, memory, torch.ones(2, 5))
    raises("target mask", block, x, memory, None, torch.ones(3, 3))
    with torch.no_grad():
        out, _, cross = block(x[:, :0], memory)  # no target token: empty
    assert out.shape == (2, 0, 16) and cross.shape == (2, 4, 0, 5)


def test_stacks_bad_input():
    encoder = Encoder(16, 4, 24, 2, "alibi").double()
    decoder = Decoder(16, 4, 24, 2).double()
    x = random(2, 5, 16)
    raises("empty source", encoder, x[:, :0])
    raises("mixed dtypes: x", encoder, x.float())
    raises("x has 8 features", encoder, x[..., :8])
    raises("padding_mask", encoder, x, torch.ones(2, 4, dtype=torch.bool))
    raises("list of 2 caches", decoder, x, x, None, None, [seq2seq.KVCache()])
    raises("cache must be", decoder, x, x, None, None, [None, "cache"])
    raises("empty source", decoder.memory_kv, x[:, :0])
    with torch.no_grad():
        out, cross = decoder(x[:, :0], x)
    assert out.shape == (2, 0, 16) and cross.shape == (2, 2, 4, 0, 5)


def test_model_bad_input():
    model = new_model("learned")
    src, lengths, tgt_in = source(2, 4, seed=1)
    raises("token ids", model, src.double(), lengths, tgt_in)
    raises(
        "lengths must be a tensor of integers",
        model,
        src,
        lengths.double(),
        tgt_in,
    )
    raises("src must be a tensor", model, src.tolist(), lengths, tgt_in)
    raises("tgt_in must be a tensor", model, src, lengths, tgt_in.tolist())
    raises('side must be "src" or "tgt"', model.table, "source")
    x = torch.zeros(2, 3, 16, dtype=torch.float64)
    raises(
        "x has 8 features", model.add_positions, x[..., :8], 0, model.src_pos
    )
    raises("mixed dtypes: x", model.add_positions, x.float(), 0, model.src_pos)
    raises("start must be", model.add_positions, x, -1, model.src_pos)
    raises("learned positions need", model.add_positions, x, 0, None)
    memory, mask = model.encode(src, lengths)
    raises(
        "caches must be a list of 2",
        model.decode,
        tgt_in,
        memory,
        mask,
        None,
        [],
    )
    raises(
        "memory has 8 features", model.decode, tgt_in, memory[..., :8], mask
    )
    with torch.no_grad():
        logits, cross = model(src, lengths, tgt_in[:, :0])  # no target token
    assert logits.shape == (2, 0, VOCAB) and cross.shape == (2, 2, 4, 0, 4)


def test_greedy_and_caches_bad_input():
    model = new_model("rotary")
    src, lengths, _ = source(2, 4, seed=1)
    raises("model must be a Seq2Seq", greedy, None, src, lengths, 3)
    raises(
        "cached must be True or False", greedy, model, src, lengths, 3, "yes"
    )
    raises("steps >= 1", greedy, model, src, lengths, 2.0)
    *_, caches = greedy(model, src, lengths, 3)
    raises("caches must be what a cached", cache_bytes, None)
    raises(
        "caches must be what a cached", cache_bytes, (caches[0], caches[1][:1])
    )
    raises("cache must be", cache_bytes, (["cache", None], caches[1]))
    K, V = caches[1][0]
    raises("K and V differ", cache_bytes, (caches[0], [(K, V[:, :1])] * 2))


def test_weight_copy_bad_input():
    raises("key must be a parameter name", seq2seq.torch_key, 3)
    block = CrossDecoderBlock(16, 4, 24)
    raises("torch_module must be an nn.Module", load_torch_weights, block, {})
    raises("module must be an nn.Module", load_torch_weights, {}, block)


def test_probes_bad_input():
    lengths = torch.tensor([3, 2])
    tgt = torch.tensor([[5, 4, 3, 2], [4, 3, 2, 0]])
    weights = torch.rand(2, 4, 3, dtype=torch.float64)
    for probe in (
        seq2seq.error_kinds,
        seq2seq.first_wrong,
        seq2seq.error_breakdown,
    ):
        raises(
            "pred must be a \\(B, steps\\) tensor",
            probe,
            tgt.double(),
            tgt,
            lengths,
        )
        raises("mismatched batch sizes: tgt", probe, tgt, tgt[:1], lengths)
        raises("too few for 3 digits", probe, tgt[:, :3], tgt, lengths)
        raises("every string needs a digit", probe, tgt, tgt, lengths - 2)
        raises(
            "lengths must be a 1-D tensor", probe, tgt, tgt, lengths.double()
        )
    position = seq2seq.largest_weight_position
    raises("float tensor \\(B, ..., T, S\\)", position, weights[0], lengths)
    raises("mismatched batch sizes: weights", position, weights, lengths[:1])
    raises("too small for a string of 3", position, weights[..., :2], lengths)
    raises(
        "too small for a string of 3", mirror_weight, weights[:, :2], lengths
    )
    raises("mismatched batch sizes", mirror_weight, weights, lengths[:1])
    raises("no strings", mirror_weight, weights[:0], lengths[:0])
    empty = seq2seq.error_kinds(tgt[:0], tgt[:0], lengths[:0])
    assert empty.shape == (0,)
    nan = weights.clone()
    nan[1, 0, 1] = float("nan")
    for probe in (mirror_weight, position):
        raises("NaN or infinite", probe, nan, lengths)
        raises("NaN or infinite", probe, weights / 0, lengths)


def test_probes_of_no_strings():
    """An empty batch: no kinds, no first errors, zero counts (as
    error_kinds), not an IndexError from argmax over no column."""
    E, L = (
        torch.zeros(0, 3, dtype=torch.long),
        torch.zeros(0, dtype=torch.long),
    )
    assert seq2seq.error_kinds(E, E, L).shape == (0,)
    first = seq2seq.first_wrong(E, E, L)
    assert first.shape == (0,) and first.dtype == torch.long
    assert seq2seq.error_breakdown(E, E, L) == {
        "right": 0,
        "unreversed": 0,
        "other": 0,
        "first": [],
    }


# --- binomial intervals ------------------------------------------------------


def test_wilson_interval_against_scipy():
    from scipy.stats import binomtest

    for k, n in [(72, 249), (51, 200), (0, 200), (200, 200), (1, 3), (5, 7)]:
        for level in (0.95, 0.8):
            ci = binomtest(k, n).proportion_ci(level, method="wilson")
            got = seq2seq.wilson_interval(k, n, level)
            assert got == pytest.approx((ci.low, ci.high), abs=1e-12)


def test_difference_interval_against_newcombe():
    """Newcombe (1998), Statistics in Medicine 17:873-890, Table II,
    method 10, examples (a), (b), (d), (e), and its symmetry."""
    for (k1, n1, k2, n2), expected in [
        ((56, 70, 48, 80), (0.0524, 0.3339)),
        ((9, 10, 3, 10), (0.1705, 0.8090)),
        ((5, 56, 0, 29), (-0.0381, 0.1926)),
        ((0, 10, 0, 20), (-0.1611, 0.2775)),
    ]:
        low, high = seq2seq.difference_interval(k1, n1, k2, n2)
        assert (low, high) == pytest.approx(expected, abs=5e-5)
        back = seq2seq.difference_interval(k2, n2, k1, n1)
        assert back == pytest.approx((-high, -low), abs=1e-12)


def test_intervals_take_numpy_integers():
    """Counts read from a table are NumPy integers (review round 3)."""
    want = seq2seq.wilson_interval(3, 5)
    got = seq2seq.wilson_interval(np.int64(3), np.int32(5))
    assert got == want and all(type(x) is float for x in got)
    want = seq2seq.difference_interval(56, 70, 48, 80)
    got = seq2seq.difference_interval(*np.array([56, 70, 48, 80]))
    assert got == want and all(type(x) is float for x in got)
    for k in (np.float64(3.0), np.bool_(True), torch.tensor(3)):
        raises("need counts", seq2seq.wilson_interval, k, 5)
        raises("need counts", seq2seq.difference_interval, 1, 5, k, 5)


def test_intervals_bad_input():
    for k, n in [(3, 2), (-1, 5), (1, 0), (1.0, 5), (True, 5)]:
        raises("need counts", seq2seq.wilson_interval, k, n)
        raises("need counts", seq2seq.difference_interval, 1, 5, k, n)
    for level in (0, 1, float("nan"), None, "0.95", [0.9], True):
        raises("level must be", seq2seq.wilson_interval, 1, 5, level)
        raises("level must be", seq2seq.difference_interval, 1, 5, 2, 5, level)


# --- the probes of chapter 14, against loops ----------------------------------


def answers(seed):
    """Targets of strings of 1-6 digits (chapter 9's layout: digits, end
    token 2, padding 0) and answers: right, unreversed, or changed at one
    random position, with noise after the end token."""
    gen = torch.Generator().manual_seed(seed)
    B, steps = 60, 8
    lengths = torch.randint(1, 7, (B,), generator=gen)
    src = torch.randint(3, 13, (B, steps), generator=gen)
    tgt = torch.zeros(B, steps, dtype=torch.long)
    pred = torch.randint(0, 13, (B, steps), generator=gen)  # after the end
    kind = torch.randint(0, 3, (B,), generator=gen)
    for b, n in enumerate(lengths.tolist()):
        digits = src[b, :n]
        tgt[b, :n], tgt[b, n] = digits.flip(0), 2
        answer = (digits if kind[b] == 1 else digits.flip(0)).tolist() + [2]
        if kind[b] == 2:
            k = int(torch.randint(0, n + 1, (1,), generator=gen))
            answer[k] = (answer[k] + 1) % 13
        pred[b, : n + 1] = torch.tensor(answer)
    return pred, tgt, lengths, src


@pytest.mark.parametrize("seed", [0, 1])
def test_error_kinds_and_first_wrong_against_loops(seed):
    pred, tgt, lengths, src = answers(seed)
    kinds, firsts = [], []
    for p, t, n, s in zip(
        pred.tolist(), tgt.tolist(), lengths.tolist(), src.tolist()
    ):
        right = t[: n + 1]
        unreversed = s[:n] + [2]
        kinds.append(
            0 if p[: n + 1] == right else 1 if p[: n + 1] == unreversed else 2
        )
        wrong = [i + 1 for i in range(n + 1) if p[i] != right[i]]
        firsts.append(wrong[0] if wrong else 0)
    assert seq2seq.error_kinds(pred, tgt, lengths).tolist() == kinds
    assert seq2seq.first_wrong(pred, tgt, lengths).tolist() == firsts
    assert set(kinds) == {0, 1, 2}
    counts = seq2seq.error_breakdown(pred, tgt, lengths)
    assert [counts[k] for k in ("right", "unreversed", "other")] == [
        kinds.count(k) for k in range(3)
    ]
    assert counts["first"] == [firsts.count(i) for i in range(1, 8)]


def test_largest_weight_position_against_loops():
    gen = torch.Generator().manual_seed(3)
    weights = torch.rand(4, 2, 3, 5, 6, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([6, 2, 4, 1])
    weights[1, ..., 2:] += 1  # padding heavier than every real position
    got = seq2seq.largest_weight_position(weights, lengths)
    assert got.shape == (4, 2, 3, 5)
    for b, n in enumerate(lengths.tolist()):
        for index in torch.cartesian_prod(
            *map(torch.arange, (2, 3, 5))
        ).tolist():
            row = weights[b][tuple(index)][:n].tolist()
            assert got[b][tuple(index)] == row.index(max(row)) + 1


# --- against PyTorch ---------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_decoder_block_equals_torch_layer(shape):
    d, H, d_ff, B, T, S, lengths = shape
    torch.manual_seed(1)
    theirs = nn.TransformerDecoderLayer(
        d, H, d_ff, dropout=0, batch_first=True, norm_first=True
    ).double()
    ours = load_torch_weights(CrossDecoderBlock(d, H, d_ff).double(), theirs)
    x, memory = random(B, T, d, seed=2), random(B, S, d, seed=3)
    real = padding(lengths, S)
    expected = theirs(
        x, memory, tgt_mask=~causal(T), memory_key_padding_mask=~real
    )
    with torch.no_grad():
        out, _, cross = ours(x, memory, real)  # causal by itself
        masked, _, _ = ours(x, memory, real, tgt_mask=causal(T))
        per_row = ours(x, memory, real, causal(T).expand(B, T, T))[0]
    for got in (out, masked, per_row):
        assert (got - expected).abs().max() < TOL
    assert (cross.sum(-1) - 1).abs().max() < 1e-12  # weights sum to 1
    assert (cross.masked_select(~real[:, None, None]) == 0).all()  # padding


def test_decoder_block_equals_torch_layer_with_dropout_off():
    """Chapter 14: "the same block when its dropout does nothing (dropout=0,
    or in evaluation mode)": with dropout 0.1, equal in evaluation mode,
    not in training mode."""
    torch.manual_seed(2)
    theirs = nn.TransformerDecoderLayer(
        16, 4, 24, dropout=0.1, batch_first=True, norm_first=True
    ).double()
    ours = load_torch_weights(CrossDecoderBlock(16, 4, 24).double(), theirs)
    x, memory = random(3, 5, 16, seed=2), random(3, 7, 16, seed=3)
    real = padding([7, 3, 5], 7)
    with torch.no_grad():
        out = ours(x, memory, real)[0]
        args = dict(tgt_mask=~causal(5), memory_key_padding_mask=~real)
        trained = theirs.train()(x, memory, **args)
        evaluated = theirs.eval()(x, memory, **args)
    assert (out - evaluated).abs().max() < TOL
    assert (out - trained).abs().max() > 1e-2


@pytest.mark.parametrize("shape", SHAPES)
def test_stacks_equal_torch_transformer(shape):
    d, H, d_ff, B, T, S, lengths = shape
    torch.manual_seed(4)
    theirs = nn.Transformer(
        d, H, 2, 3, d_ff, dropout=0, batch_first=True, norm_first=True
    ).double()
    encoder = load_torch_weights(
        Encoder(d, H, d_ff, 2).double(), theirs.encoder
    )
    decoder = load_torch_weights(
        Decoder(d, H, d_ff, 3).double(), theirs.decoder
    )
    src, tgt, real = (
        random(B, S, d, seed=5),
        random(B, T, d, seed=6),
        padding(lengths, S),
    )
    expected = theirs(
        src,
        tgt,
        tgt_mask=~causal(T),
        src_key_padding_mask=~real,
        memory_key_padding_mask=~real,
    )
    with torch.no_grad():
        got, cross = decoder(tgt, encoder(src, real), real)
    assert (got - expected).abs().max() < TOL
    assert cross.shape == (B, 3, H, T, S)


@pytest.mark.parametrize("shape", SHAPES)
def test_alibi_stacks_equal_torch_with_float_masks(shape):
    """ALiBi's bias enters nn.Transformer as its float masks (the decoder's
    with -inf above the diagonal): the ALiBi stacks equal it."""
    d, H, d_ff, B, T, S, lengths = shape
    torch.manual_seed(9)
    theirs = nn.Transformer(
        d, H, 2, 2, d_ff, dropout=0, batch_first=True, norm_first=True
    ).double()
    encoder = load_torch_weights(
        Encoder(d, H, d_ff, 2, "alibi"), theirs.encoder
    )
    decoder = load_torch_weights(
        Decoder(d, H, d_ff, 2, "alibi"), theirs.decoder
    )
    src, tgt = random(B, S, d, seed=10), random(B, T, d, seed=11)
    real = padding(lengths, S)
    pad = torch.zeros(B, S, dtype=torch.float64).masked_fill(~real, -math.inf)
    ref_src = (
        torch.tensor(slopes(H), dtype=torch.float64)[:, None, None]
        * -(torch.arange(S)[:, None] - torch.arange(S)[None, :]).abs()
    )
    ref_tgt = (
        torch.tensor(slopes(H), dtype=torch.float64)[:, None, None]
        * -(torch.arange(T)[:, None] - torch.arange(T)[None, :]).abs()
    )
    ref_tgt = ref_tgt.masked_fill(~causal(T), -math.inf)
    expected = theirs(
        src,
        tgt,
        src_mask=ref_src.repeat(B, 1, 1),
        tgt_mask=ref_tgt.repeat(B, 1, 1),
        src_key_padding_mask=pad,
        memory_key_padding_mask=pad,
    )
    with torch.no_grad():
        got, _ = decoder.double()(tgt, encoder.double()(src, real), real)
    assert (got - expected).abs().max() < 1e-13


def test_model_stacks_load_from_torch():
    """Seq2Seq's stacks take nn.Transformer's weights; with the same
    embedded inputs its logits are the readout of nn.Transformer's output."""
    torch.manual_seed(7)
    d, H = 16, 4
    theirs = nn.Transformer(
        d, H, 2, 2, 32, dropout=0, batch_first=True, norm_first=True
    ).double()
    model = Seq2Seq(VOCAB, d, H, 32, positions="sinusoidal").double()
    load_torch_weights(model, theirs)
    src, lengths, tgt_in = source(3, 6, seed=8)
    real = padding(lengths.tolist(), 6)
    pe = seq2seq.sinusoidal_encoding(8, d)
    x_src = model.src_embed(src) + pe[:6]
    x_tgt = model.tgt_embed(tgt_in) + pe[: tgt_in.shape[1]]
    T = tgt_in.shape[1]
    expected = model.readout(
        theirs(
            x_src,
            x_tgt,
            tgt_mask=~causal(T),
            src_key_padding_mask=~real,
            memory_key_padding_mask=~real,
        )
    )
    with torch.no_grad():
        got = model(src, lengths, tgt_in)[0]
    assert (got - expected).abs().max() < TOL


def test_load_torch_weights_refuses_other_shapes():
    theirs = nn.TransformerDecoderLayer(16, 4, 24, batch_first=True)
    with pytest.raises(ValueError, match="shape"):
        load_torch_weights(CrossDecoderBlock(16, 4, 32), theirs)
    with pytest.raises(ValueError, match="parameters differ"):
        load_torch_weights(Encoder(16, 4, 24, 1), theirs)


# --- an independent reference for every position option ---------------------


def layer_norm(x, p, name):
    return F.layer_norm(
        x, x.shape[-1:], p[f"{name}.weight"], p[f"{name}.bias"]
    )


def rotate(x, pos):
    """Rotary positions as complex numbers: pair i of the token at position
    p times exp(i p 10000^(-2i/d_k))."""
    d_k = x.shape[-1]
    theta = 10000.0 ** (-torch.arange(0, d_k, 2, dtype=x.dtype) / d_k)
    turn = torch.polar(
        torch.ones_like(theta), pos[:, None].to(x.dtype) * theta
    )
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(pairs * turn).flatten(-2)


def slopes(H):
    """Press et al.'s slopes: 8 heads 1/2 ... 1/256; H a power of two
    2^(-8k/H); otherwise the next power's every other slope fills in."""
    if H & (H - 1) == 0:
        return [2.0 ** (-8 * k / H) for k in range(1, H + 1)]
    p = 2 ** math.floor(math.log2(H))
    return slopes(p) + slopes(2 * p)[0::2][: H - p]


def ref_attention(
    p, name, xq, xkv, H, allowed, pos=None, rope=False, alibi=False
):
    """Multi-head attention from first principles, head by head, query by
    query: softmax over the allowed keys of q.k / sqrt(d_k) (+ bias)."""
    d = xq.shape[-1]
    d_k = d // H
    W, b = p[f"{name}.in_proj.weight"], p[f"{name}.in_proj.bias"]
    Q = xq @ W[:d].T + b[:d]
    K = xkv @ W[d : 2 * d].T + b[d : 2 * d]
    V = xkv @ W[2 * d :].T + b[2 * d :]
    B, T, S = xq.shape[0], xq.shape[1], xkv.shape[1]
    out = torch.zeros(B, T, d, dtype=xq.dtype)
    m = slopes(H)
    for h in range(H):
        cols = slice(h * d_k, (h + 1) * d_k)
        q, k, v = Q[..., cols], K[..., cols], V[..., cols]
        if rope:
            q, k = rotate(q, pos), rotate(k, pos)
        for i in range(T):
            scores = (k @ q[:, i, :, None])[..., 0] / math.sqrt(d_k)  # (B, S)
            if alibi:
                scores = scores - m[h] * (torch.arange(S) - i).abs()
            scores = scores.masked_fill(~allowed[:, i], float("-inf"))
            out[:, i, cols] = (scores.softmax(-1)[..., None] * v).sum(1)
    return out @ p[f"{name}.out_proj.weight"].T + p[f"{name}.out_proj.bias"]


def ref_ffn(p, name, x):
    h = F.relu(x @ p[f"{name}.linear1.weight"].T + p[f"{name}.linear1.bias"])
    return h @ p[f"{name}.linear2.weight"].T + p[f"{name}.linear2.bias"]


def ref_positions(x, kind, table):
    """Sinusoids sin/cos(p / 10000^(2i/d)) in pairs, or the learned row of
    min(p, rows - 1)."""
    T, d = x.shape[1:]
    pos = torch.arange(T, dtype=x.dtype)[:, None]
    if kind == "sinusoidal":
        pe = torch.zeros(T, d, dtype=x.dtype)
        for i in range(0, d, 2):
            pe[:, i] = torch.sin(pos[:, 0] / 10000 ** (i / d))
            pe[:, i + 1] = torch.cos(pos[:, 0] / 10000 ** (i / d))
        return x + pe
    if kind == "learned":
        return x + table[[min(t, len(table) - 1) for t in range(T)]]
    return x


def reference(model, src, lengths, tgt_in):
    """Logits of the encoder-decoder from its parameters, as specified."""
    p, H, kind = (
        model.state_dict(),
        model.decoder.layers[0].cross_attn.H,
        model.positions,
    )
    rope, alibi = kind == "rotary", kind == "alibi"
    B, S = src.shape
    T = tgt_in.shape[1]
    real = torch.arange(S) < lengths[:, None]
    x = ref_positions(
        p["src_embed.weight"][src], kind, p.get("src_pos.weight")
    )
    see_src = real[:, None, :].expand(B, S, S)
    for n in range(len(model.encoder.layers)):
        e = f"encoder.layers.{n}"
        h = layer_norm(x, p, f"{e}.norm1")
        x = x + ref_attention(
            p, f"{e}.self_attn", h, h, H, see_src, torch.arange(S), rope, alibi
        )
        x = x + ref_ffn(p, e, layer_norm(x, p, f"{e}.norm2"))
    memory = layer_norm(x, p, "encoder.norm")
    y = ref_positions(
        p["tgt_embed.weight"][tgt_in], kind, p.get("tgt_pos.weight")
    )
    see_tgt = causal(T).expand(B, T, T)
    see_mem = real[:, None, :].expand(B, T, S)
    for n in range(len(model.decoder.layers)):
        e = f"decoder.layers.{n}"
        h = layer_norm(y, p, f"{e}.norm1")
        y = y + ref_attention(
            p, f"{e}.self_attn", h, h, H, see_tgt, torch.arange(T), rope, alibi
        )
        y = y + ref_attention(
            p,
            f"{e}.cross_attn",
            layer_norm(y, p, f"{e}.norm2"),
            memory,
            H,
            see_mem,
        )
        y = y + ref_ffn(p, e, layer_norm(y, p, f"{e}.norm3"))
    y = layer_norm(y, p, "decoder.norm")
    return y @ p["readout.weight"].T + p["readout.bias"]


def source(B, S, seed, T=None):
    """Random digit strings (ids 3-12) of lengths 1..S with padding 0, and
    a random target input starting with BOS."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, S + 1, (B,), generator=gen)
    lengths[0] = S
    src = torch.randint(3, VOCAB, (B, S), generator=gen)
    src[torch.arange(S) >= lengths[:, None]] = 0
    tgt_in = torch.randint(2, VOCAB, (B, T or S + 1), generator=gen)
    tgt_in[:, 0] = BOS
    return src, lengths, tgt_in


def new_model(positions, seed=0, d=16, H=4, layers=(2, 2), max_len=4):
    torch.manual_seed(seed)
    model = Seq2Seq(VOCAB, d, H, 24, layers, positions, max_len, BOS)
    return model.double().eval()


@pytest.mark.parametrize("positions", POSITIONS)
def test_model_equals_reference(positions):
    """Lengths past the learned tables (max_len 4) included: their positions
    take the last row."""
    for seed, (B, S, H, layers) in enumerate(
        [(3, 7, 4, (2, 2)), (2, 3, 2, (1, 3))]
    ):
        model = new_model(positions, seed, H=H, layers=layers)
        src, lengths, tgt_in = source(B, S, seed)
        with torch.no_grad():
            got = model(src, lengths, tgt_in)[0]
        expected = reference(model, src, lengths, tgt_in)
        assert (got - expected).abs().max() < TOL, positions


@pytest.mark.parametrize("shift", [0, 1, 2, -1])
def test_copies_source_against_loops(shift):
    """Output digit t of a string of n digits copies source digit
    n + 1 - t - shift (from 1) where that digit exists: by loops."""
    gen = torch.Generator().manual_seed(8)
    B, S, steps = 40, 7, 9
    lengths = torch.randint(1, S + 1, (B,), generator=gen)
    src = torch.randint(3, 6, (B, S), generator=gen)  # few digits: repeats
    pred = torch.randint(3, 6, (B, steps), generator=gen)
    got = seq2seq.copies_source(pred, src, lengths, shift)
    m = int(lengths.max())
    assert got.shape == (B, m) and got.dtype == torch.bool
    for b, n in enumerate(lengths.tolist()):
        for t in range(1, m + 1):
            j = n + 1 - t - shift
            want = t <= n and 1 <= j <= n and pred[b, t - 1] == src[b, j - 1]
            assert got[b, t - 1] == want, (b, t)
    assert got.any() and not got.all()


def test_copies_source_of_a_reversal():
    """A right answer copies every mirror; the answer for the string
    without its last digit copies the digit left of each mirror."""
    src = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 0]])
    lengths = torch.tensor([4, 3])
    right = torch.tensor([[6, 5, 4, 3, 2], [9, 8, 7, 2, 0]])
    shorter = torch.tensor([[5, 4, 3, 2, 0], [8, 7, 2, 0, 0]])
    mirror = seq2seq.copies_source(right, src, lengths)
    assert mirror.tolist() == [[True] * 4, [True] * 3 + [False]]
    left = seq2seq.copies_source(shorter, src, lengths, 1)
    assert left.tolist() == [[True] * 3 + [False], [True] * 2 + [False] * 2]
    assert not seq2seq.copies_source(shorter, src, lengths).any()
    assert not seq2seq.copies_source(right, src, lengths, 1).any()


def test_copies_source_bad_input():
    src, lengths = torch.tensor([[3, 4, 5]]), torch.tensor([3])
    copies = seq2seq.copies_source
    raises("pred must be a \\(B, steps\\)", copies, src.double(), src, lengths)
    raises("src must be a \\(B, steps\\)", copies, src, src[0], lengths)
    raises(
        "one row per length \\(1\\)", copies, src, src.repeat(2, 1), lengths
    )
    raises("src has 2 columns, fewer than 3", copies, src, src[:, :2], lengths)
    raises("pred has 2 columns", copies, src[:, :2], src, lengths)
    raises("every string needs a digit", copies, src, src, lengths - 3)
    for shift in (1.0, True, None):
        raises("shift must be an integer", copies, src, src, lengths, shift)
    none = torch.zeros(0, 3, dtype=torch.long)
    assert copies(none, none, lengths[:0]).shape == (0, 0)


# --- ALiBi and learned positions ---------------------------------------------


def test_alibi_slopes_are_the_papers():
    """Section 3: 8 heads, 1/2 ... 1/256; other counts by the authors' rule."""
    assert alibi_slopes(8).tolist() == [2.0**-k for k in range(1, 9)]
    assert alibi_slopes(4).tolist() == [2.0**-k for k in (2, 4, 6, 8)]
    for H in (1, 2, 3, 5, 6, 12, 16):
        assert torch.allclose(
            alibi_slopes(H),
            torch.tensor(slopes(H), dtype=torch.float64),
            rtol=1e-14,
            atol=0,
        )
    for bad in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match="H must be"):
            alibi_slopes(bad)
    for dtype in (torch.int64, torch.bool, torch.complex128, "float64"):
        raises("dtype must be a float type", alibi_slopes, 4, dtype)
    assert alibi_slopes(4, torch.float32).dtype == torch.float32


def test_alibi_bias_is_minus_slope_times_distance():
    H, pos_q, pos_k = 4, torch.tensor([0, 3, 5]), torch.arange(7)
    bias = alibi_bias(H, pos_q, pos_k)
    m = slopes(H)
    for h in range(H):
        for a, i in enumerate(pos_q.tolist()):
            for j in pos_k.tolist():
                assert bias[h, a, j] == -m[h] * abs(i - j)


def test_learned_positions_past_the_table_take_the_last_row():
    model = new_model("learned", max_len=4)
    assert (
        model.src_pos.num_embeddings == 4 and model.tgt_pos.num_embeddings == 5
    )
    x = torch.zeros(1, 9, 16, dtype=torch.float64)
    for table in (model.src_pos, model.tgt_pos):
        rows = table.weight.detach()
        got = model.add_positions(x, 0, table)[0].detach()
        last = len(rows) - 1
        assert torch.equal(got[:last], rows[:last])
        assert (got[last:] == rows[last]).all()
        step = model.add_positions(x[:, :2], 7, table)[0].detach()  # cached
        assert (step == rows[last]).all()


# --- cached decoding ---------------------------------------------------------


@pytest.mark.parametrize("positions", POSITIONS)
def test_cached_greedy_equals_uncached(positions):
    model = new_model(positions, seed=3)
    src, lengths, _ = source(4, 7, seed=9)
    tokens, logits, cross, none = greedy(model, src, lengths, 10, cached=False)
    tokens_c, logits_c, cross_c, _ = greedy(model, src, lengths, 10)
    assert none is None
    assert torch.equal(tokens, tokens_c)
    assert (logits - logits_c).abs().max() < 1e-10
    assert (cross - cross_c).abs().max() < 1e-10
    tgt_in = torch.cat([torch.full((4, 1), BOS), tokens[:, :-1]], dim=1)
    with torch.no_grad():
        forced, forced_cross = model(src, lengths, tgt_in)
    assert (forced - logits).abs().max() < 1e-10  # teacher-forced the same
    assert (forced_cross - cross).abs().max() < 1e-10
    assert torch.equal(tokens, logits.argmax(-1))
    pred, weights = model.greedy_decode(src, lengths, 10)
    assert torch.equal(pred, tokens)
    assert (weights - cross[:, -1].mean(dim=1)).abs().max() < 1e-15


def test_cache_bytes():
    """Self-attention: 2 B H t d_k float64 numbers per layer after t tokens;
    cross-attention: 2 B H S d_k, the source's keys and values."""
    model = new_model("rotary", d=16, H=4, layers=(1, 3))
    B, S, steps = 2, 5, 6
    src, lengths, _ = source(B, S, seed=4)
    *_, caches = greedy(model, src, lengths, steps)
    sizes = cache_bytes(caches)
    assert sizes == {
        "self": [2 * B * 4 * steps * 4 * 8] * 3,
        "cross": [2 * B * 4 * S * 4 * 8] * 3,
    }


# --- claims of the docstrings ------------------------------------------------


@pytest.mark.parametrize("positions", POSITIONS)
def test_padding_changes_nothing(positions):
    model = new_model(positions, seed=5)
    src, lengths, tgt_in = source(3, 6, seed=6)
    noisy = torch.where(src == 0, torch.randint(3, VOCAB, src.shape), src)
    assert not torch.equal(noisy, src)
    with torch.no_grad():
        a, b = model(src, lengths, tgt_in), model(noisy, lengths, tgt_in)
    assert (a[0] - b[0]).abs().max() < 1e-12
    assert (a[1] - b[1]).abs().max() < 1e-12


def test_without_positions_the_source_order_is_invisible():
    """positions="none": a permutation of the real source tokens changes no
    logit (a reversal and its string look alike); with any other option it
    does."""
    src, lengths, tgt_in = source(1, 7, seed=7)
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(0))
    for positions in POSITIONS:
        model = new_model(positions, seed=8)
        with torch.no_grad():
            change = (
                model(src, lengths, tgt_in)[0]
                - model(src[:, perm], lengths, tgt_in)[0]
            )
        if positions == "none":
            assert change.abs().max() < 1e-12
        else:
            assert change.abs().max() > 1e-3, positions


def test_mirror_weight_pools_chapter_9s_measure():
    gen = torch.Generator().manual_seed(1)
    weights = torch.rand(2, 3, 6, 5, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([5, 2])
    got = mirror_weight(weights, lengths)  # (3,)
    for h in range(3):
        picks = [weights[0, h, t, 4 - t] for t in range(5)]
        picks += [weights[1, h, t, 1 - t] for t in range(2)]
        assert abs(got[h] - sum(picks) / 7) < 1e-15


# --- bad input -----------------------------------------------------------------


def test_value_errors():
    model = new_model("sinusoidal")
    src, lengths, tgt_in = source(2, 4, seed=1)
    cases = [
        (
            "outside the vocabulary",
            (src.clone().fill_(VOCAB), lengths, tgt_in),
        ),
        ("outside the vocabulary", (src, lengths, tgt_in - 3)),
        (
            "empty source",
            (src[:, :0], torch.zeros(2, dtype=torch.long), tgt_in),
        ),
        ("empty source", (src, torch.tensor([4, 0]), tgt_in)),
        ("batch sizes: src has 2 rows, tgt_in 1", (src, lengths, tgt_in[:1])),
        ("mismatched batch sizes", (src, lengths[:1], tgt_in)),
    ]
    for message, args in cases:
        with pytest.raises(ValueError, match=message):
            model(*args)
    T = tgt_in.shape[1]
    for mask in (
        causal(T + 1),
        causal(T)[None].expand(3, T, T),
        causal(T).float(),
    ):
        with pytest.raises(ValueError, match="target mask"):
            model(src, lengths, tgt_in, tgt_mask=mask)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        greedy(model, src + VOCAB, lengths, 3)
    with pytest.raises(ValueError, match="steps"):
        greedy(model, src, lengths, 0)
    with pytest.raises(ValueError, match="positions must be one of"):
        Seq2Seq(VOCAB, positions="relative")
    block = CrossDecoderBlock(16, 4, 24).double()
    x, memory = random(2, 3, 16), random(3, 5, 16)
    for rows in ((x, memory), (random(4, 3, 16), memory)):  # 2, 4 for 3
        with pytest.raises(ValueError, match="mismatched batch sizes"):
            block(*rows)
    with pytest.raises(ValueError, match="empty source"):
        block(x, memory[:2, :0])
    with pytest.raises(ValueError, match="empty source"):
        block(x, memory[:2], torch.zeros(2, 5, dtype=torch.bool))
    one_empty = torch.tensor([[True] * 5, [False] * 5])
    with pytest.raises(ValueError, match="empty source"):
        block(x, memory[:2], one_empty)
    with pytest.raises(ValueError, match="target mask"):
        block(x, memory[:2], tgt_mask=causal(4))


def test_target_mask_restricts_the_causal_mask():
    """A causal tgt_mask changes nothing; a diagonal one (each token sees
    only itself) changes every logit after the first position's."""
    model = new_model("rotary", seed=2)
    src, lengths, tgt_in = source(2, 5, seed=3)
    T = tgt_in.shape[1]
    eye = torch.eye(T, dtype=torch.bool)
    with torch.no_grad():
        plain = model(src, lengths, tgt_in)[0]
        same = model(src, lengths, tgt_in, tgt_mask=causal(T))[0]
        alone = model(src, lengths, tgt_in, tgt_mask=eye)[0]
    assert (plain - same).abs().max() < 1e-15
    assert (plain[:, 0] - alone[:, 0]).abs().max() < 1e-12
    assert (plain[:, 1:] - alone[:, 1:]).abs().amax(-1).min() > 1e-6


# --- the stored models (make train-seq2seq) ------------------------------------


def test_stored_models_reproduce_their_rows():
    """Rebuilt from book/data/seq2seq_models.json and evaluated again, two
    stored Transformers give their rows of seq2seq_lengths.csv (length 10,
    held out; length 11, past training)."""
    spec = json.loads((BOOK / "data" / tool.SPEC).read_text())
    table = pd.read_csv(BOOK / "data" / tool.TABLE)
    ch, _, test_data, long_data = tool.setup()
    for name, n, data in (
        ("rotary", 11, long_data[11]),
        ("alibi", 10, test_data),
    ):
        entry = spec["models"][name]
        init = entry["init"] | {"layers": tuple(entry["init"]["layers"])}
        model = Seq2Seq(**init).double()
        model.load_state_dict(torch.load(BOOK / "data" / entry["weights"]))
        row = tool.by_length(ch, model.eval(), data, n, transformer=True)
        logged = table[(table.model == name) & (table.length == n)].iloc[0]
        for key, value in row.items():
            assert value == pytest.approx(logged[key], abs=1e-12), key


def test_the_tool_writes_the_stored_json():
    """tools/train/train_seq2seq.py's spec, for the stored models, is the stored
    seq2seq_models.json (so that --only can merge into it)."""
    spec = json.loads((BOOK / "data" / tool.SPEC).read_text())
    ch = tool.load_chapter(tool.CHAPTER)
    assert tool.spec(ch, tool.STEPS, POSITIONS) == spec
    assert spec["train_set"]["strings"] == ch.TRAIN_SET["n"]


def few(data, per_length):
    """The first strings of each length of data (src, lengths, tgt)."""
    keep = torch.zeros(len(data[1]), dtype=torch.bool)
    for n in data[1].unique():
        keep[(data[1] == n).nonzero()[:per_length, 0]] = True
    return tuple(part[keep] for part in data)


def test_only_merges_into_the_stored_results(tmp_path, monkeypatch):
    """`--only` trains the models it names and keeps every other model's
    rows in the log and both tables and its entry in the JSON (issue 47:
    it overwrote them, and chapter 14 then failed with a KeyError). Tiny
    models, two steps, a few strings: the files' bookkeeping only."""
    ch, train_data, test_data, long_data = tool.setup()
    small = (
        ch,
        few(train_data, 8),
        few(test_data, 2),
        {11: few(long_data[11], 3)},
    )
    monkeypatch.setattr(tool, "setup", lambda: small)
    sizes = {"d": 8, "H": 2, "d_ff": 8, "layers": [1, 1], "max_len": 10}
    monkeypatch.setattr(tool, "SIZES", sizes)
    threads = torch.get_num_threads()
    args = ["--steps", "2", "--out", str(tmp_path)]
    try:
        tool.main([*args, "--only", "sinusoidal", "alibi"])
        first = {
            f: pd.read_csv(tmp_path / f)
            for f in (tool.LOG, tool.TABLE, tool.MAPS)
        }
        tool.main([*args, "--only", "rotary"])
        tool.main([*args, "--only", "alibi", "--evaluate-only"])
    finally:
        torch.set_num_threads(threads)
    spec = json.loads((tmp_path / tool.SPEC).read_text())
    assert list(spec["models"]) == ["sinusoidal", "rotary", "alibi"]
    for name, models in (
        (tool.LOG, ["sinusoidal", "rotary", "alibi"]),
        (tool.TABLE, ["gru", "sinusoidal", "rotary", "alibi"]),
        (tool.MAPS, ["gru", "sinusoidal", "rotary", "alibi"]),
    ):
        table = pd.read_csv(tmp_path / name)
        assert list(table.model.unique()) == models, name
        kept = table[table.model == "sinusoidal"].reset_index(drop=True)
        before = first[name][first[name].model == "sinusoidal"]
        pd.testing.assert_frame_equal(kept, before.reset_index(drop=True))
    with pytest.raises(SystemExit, match="other settings"):  # other steps
        tool.main(["--steps", "3", "--out", str(tmp_path), "--only", "none"])
    assert not (tmp_path / "seq2seq" / "none.pt").exists()


def test_alibi_layers_build_their_bias_on_the_inputs_device():
    """AlibiSelfAttention built positions, mask and bias on the CPU: on
    meta it raised 'bias is on cpu, Q on meta' (fresh review of issue 47,
    round 4, F1); now it reaches attend_biased, which refuses meta (F3)."""
    for causal in (True, False):
        layer = seq2seq.AlibiSelfAttention(8, 2, causal=causal).to("meta")
        x = torch.ones(2, 5, 8, device="meta")
        raises("^Q is on meta: attention needs values", layer, x)
    pos = torch.arange(3)
    raises(
        "^pos_q is on meta, pos_k on cpu", alibi_bias, 2, pos.to("meta"), pos
    )


def test_attend_biased_refuses_meta_float8_and_sparse():
    """attend_biased returned meta tensors for Q, K, V on meta (F3); float8
    and sparse tensors raised NotImplementedError (F4)."""
    Q, K, V = (t.to("meta") for t in qkv())
    raises("^Q is on meta: attention needs values", attend_biased, Q, K, V)
    bias = torch.zeros(4, 5, dtype=torch.float64, device="meta")
    raises("^Q is on meta", attend_biased, Q, K, V, None, bias)
    mask = torch.ones(4, 5, dtype=torch.bool, device="meta")
    raises("^Q is on meta", attend_biased, Q, K, V, mask)
    Q, K, V = (t.to(torch.float8_e5m2) for t in qkv())
    raises(r"^Q is torch\.float8_e5m2 .*strided", attend_biased, Q, K, V)
    Q, K, V = (t[0, 0].to_sparse() for t in qkv())
    raises(r"^Q is .*sparse_coo.*strided", attend_biased, Q, K, V)


def test_attend_biased_refuses_float16_scores_that_overflow():
    """Finite float16 Q and K whose scores overflow float16 (300 * 300 * 8 =
    720,000 > 65,504) gave NaN outputs without an error (issue 47, s6
    item 1), with a bias or without."""
    Q = torch.full((1, 2, 8), 300.0, dtype=torch.float16)
    V = torch.ones(1, 2, 8, dtype=torch.float16)
    bias = torch.zeros(2, 2, dtype=torch.float16)
    overflow = r"^a score .* overflowed torch\.float16"
    raises(overflow, attend_biased, Q, Q, V, None, bias)
    raises(overflow, attend_biased, Q, Q, V)
    small = Q / 100  # scores 72 / sqrt(8): they fit
    out, _ = attend_biased(small, small, V, None, bias)
    assert out.isfinite().all()
    # scores of 20 that fit, and a bias of 65,504 that makes them overflow:
    # the message names the bias (it named Q K^T alone)
    one = torch.ones(1, 2, 4, dtype=torch.float16)
    big = torch.full((2, 2), 65504.0, dtype=torch.float16)
    raises(
        r"^a score Q K\^T / sqrt\(d_k\) \+ bias overflowed torch\.float16",
        attend_biased,
        one,
        10 * one,
        one,
        None,
        big,
    )
    # the product alone overflows (scores 28,284 after the division would
    # fit): the message names Q K^T, not the bias, whatever the bias
    hundred = torch.full((1, 2, 8), 100.0, dtype=torch.float16)
    for b in (0.0, -60000.0):
        raises(
            r"^a score Q K\^T / sqrt\(d_k\) or its product Q K\^T overflowed",
            attend_biased,
            hundred,
            hundred,
            V,
            None,
            torch.full_like(bias, b),
        )
    # a 1-D sparse position tensor (RuntimeError: add(sparse, dense))
    pos = torch.arange(3)
    raises(r"^pos_q must be a dense", alibi_bias, 2, pos.to_sparse(), pos)


@pytest.mark.parametrize("name", ["Q", "K", "V", "bias"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_attend_biased_refuses_non_finite_inputs(name, bad):
    """A NaN or infinite Q, K or bias could give NaN weights, and one in V
    NaN or infinite outputs, without an error (F5): a bias row of -inf
    leaves a query no key (mask it instead)."""
    Q, K, V = qkv()
    tensors = {"Q": Q, "K": K, "V": V, "bias": torch.zeros(4, 5).double()}
    tensors[name].view(-1)[7] = bad
    Q, K, V, bias = tensors.values()
    raises(
        f"^{name} contains NaN or infinite", attend_biased, Q, K, V, None, bias
    )
    if name != "bias":  # without a bias: attend's check
        raises(f"^{name} contains NaN or infinite", attend_biased, Q, K, V)


def test_attend_biased_refuses_a_bias_row_of_minus_inf():
    Q, K, V = qkv()
    bias = torch.zeros(4, 5, dtype=torch.float64)
    bias[2] = float("-inf")  # query 2 sees no key: its softmax is 0 / 0
    raises(
        "^bias contains NaN or infinite", attend_biased, Q, K, V, None, bias
    )


def test_layers_refuse_inputs_on_another_device_than_their_weights():
    """x or memory on another device than the weights, or a memory_mask on
    another device than x, were RuntimeErrors (F2)."""
    x, meta = torch.ones(2, 5, 8), torch.ones(2, 5, 8, device="meta")
    cross = seq2seq.CrossAttention(8, 2)
    raises(
        "^memory is on meta, the layer's weights on cpu",
        cross.keys_values,
        meta,
    )
    kv = cross.keys_values(x)
    raises("^x is on meta, the layer's weights on cpu", cross, meta, kv)
    block = seq2seq.CrossDecoderBlock(8, 2, 16)
    raises("^memory is on meta, the layer's weights", block, x, meta)
    raises("^x is on meta, the layer's weights", block, meta, x)
    memory_mask = torch.ones(2, 5, dtype=torch.bool, device="meta")
    raises("^memory_mask is on meta, x on cpu$", block, x, x, memory_mask)
    alibi = seq2seq.AlibiSelfAttention(8, 2)
    raises("^x is on meta, the layer's weights on cpu", alibi, meta)


# --- issue 47, s6: sparse or nested masks, biases and x; float8 dtypes ------


def nested(t):
    """t's rows as a nested tensor (torch warns: a prototype API)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor(list(t))


@pytest.mark.parametrize(
    "make, named",
    [
        (lambda t: t.to_sparse(), r"torch\.sparse_coo"),
        (lambda t: t.to_sparse_csr(), r"torch\.sparse_csr"),
        (nested, "a nested tensor"),
    ],
)
def test_masks_biases_and_x_must_be_dense(make, named):
    """A sparse or nested mask, bias or x passed the checks and then raised
    NotImplementedError or RuntimeError (issue 47, s6 item 2)."""
    Q, K, V = qkv(T_k=4)
    mask = torch.ones(4, 4, dtype=torch.bool)
    bias = torch.zeros(4, 4, dtype=torch.float64)
    x = torch.ones(2, 4, 8, dtype=torch.float64)
    alibi = seq2seq.AlibiSelfAttention(8, 2).double()
    pos = torch.arange(4)
    calls = [
        ("mask", lambda: attend_biased(Q, K, V, make(mask))),
        ("mask", lambda: attend_biased(Q, K, V, make(mask), bias)),
        ("bias", lambda: attend_biased(Q, K, V, None, make(bias))),
        ("x", lambda: alibi(make(x))),
        ("mask", lambda: alibi(x, make(mask))),
        ("pos_q", lambda: alibi_bias(2, make(pos[None]), pos)),  # (1, T)
        ("pos_k", lambda: alibi_bias(2, pos, make(pos[None]))),
    ]
    for name, call in calls:
        raises(
            rf"^{name} must be a dense \(strided\) tensor, got {named}$", call
        )


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_alibi_refuses_float8(dtype):
    """alibi_bias took a float8 dtype and raised NotImplementedError
    ('neg_cpu'); alibi_slopes returned float8 slopes (issue 47, s6 item 3)."""
    named = r"float16, bfloat16, float32 or float64\), got torch\.float8"
    pos = torch.arange(3)
    raises(rf"^dtype must be .*{named}", alibi_bias, 2, pos, pos, dtype)
    raises(rf"^dtype must be .*{named}", alibi_slopes, 2, dtype)
