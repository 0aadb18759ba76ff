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

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
import train_seq2seq as tool  # tools/train_seq2seq.py
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
