"""Chapter 7: the sentiment model, its hand-written gradients and its training.

Every number the Julia post printed lives in the chapter (SOURCE_RED,
SOURCE_TOKENS); these tests hold none of them.
"""

import json
import re

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import BOOK, load_chapter
from numpy.testing import assert_allclose, assert_array_equal

NOTEBOOK = "07_sentiment.ipynb"
GRAD_NAMES = ("Q_jl", "b_Q", "K_jl", "b_K", "V_jl", "b_V", "W", "b")


@pytest.fixture(scope="module")
def ch06():
    return load_chapter(NOTEBOOK)


def realistic(ch06, seed, n):
    """Parameters and biases drawn as 0.3 * N(0, 1), a sentence of n words."""
    rng = np.random.default_rng(seed)
    params = {
        name: 0.3 * rng.standard_normal(value.shape)
        for name, value in ch06.init_params(rng).items()
    }
    # the embedding size (the position row aside)
    d = params["Q_jl"].shape[0] - 1
    x = 0.5 * rng.standard_normal((d, n))
    y = ch06.one_hot(ch06.CLASSES[rng.integers(3)])
    return x, y, params


def embedding_size(ch06):
    """The words' vector size, read from the chapter's parameters."""
    return ch06.init_params(np.random.default_rng(0))["Q_jl"].shape[0] - 1


def rel(g, ref):
    return np.linalg.norm(g - ref) / np.linalg.norm(ref)


# --- gradients ----------------------------------------------------------------


@pytest.mark.parametrize("n", range(1, 13))
@pytest.mark.parametrize("seed", [0, 1])
def test_corrected_gradients_equal_autograd(ch06, n, seed):
    x, y, params = realistic(ch06, seed, n)
    ours = ch06.backprop_corrected(ch06.forward(x, params), y, params)
    ref = ch06.autograd_gradients(x, y, params)
    for name in GRAD_NAMES:
        assert ours[name].shape == params[name].shape
        if name == "b_K":  # the true gradient is zero: compare absolutely
            assert np.linalg.norm(ours[name] - ref[name]) <= 1e-10
        elif n == 1 and name in ("Q_jl", "b_Q", "K_jl"):
            # one word: alpha = [[1]] whatever the scores, so these are zero
            assert np.abs(ref[name]).max() <= 1e-12
            assert np.abs(ours[name]).max() <= 1e-12
        else:
            assert rel(ours[name], ref[name]) <= 1e-10, name


@pytest.mark.parametrize("n", range(2, 13))
def test_source_gradients_differ_from_autograd_for_q_and_k(ch06, n):
    x, y, params = realistic(ch06, 7, n)
    cache = ch06.forward(x, params)
    source = ch06.backprop_source(cache, y, params)
    ref = ch06.autograd_gradients(x, y, params)
    s = np.sqrt(cache["q"].size)  # the forward pass's scale
    for name in ("Q_jl", "K_jl"):
        assert rel(source[name], ref[name]) > 1.0, name
        # not only the missing scale: the Jacobian is wrong too
        assert rel(source[name] / s, ref[name]) > 1e-2, name
    for name in ("V_jl", "b_V", "W", "b"):  # these are right
        assert rel(source[name], ref[name]) <= 1e-10, name


def test_source_gradient_is_only_mis_scaled_when_attention_is_uniform(ch06):
    # Q_jl = 0 and b_Q = 0 make every score 0: the first-column Jacobian is
    # every row's Jacobian, and only the missing 1/s remains (defect 2).
    x, y, params = realistic(ch06, 3, 6)
    zero = {
        "Q_jl": np.zeros_like(params["Q_jl"]),
        "b_Q": np.zeros_like(params["b_Q"]),
    }
    params = dict(params, **zero)
    cache = ch06.forward(x, params)
    assert_allclose(cache["alpha"], np.full((6, 6), 1 / 6), rtol=0, atol=1e-15)
    source = ch06.backprop_source(cache, y, params)
    true = ch06.backprop_corrected(cache, y, params)
    s = np.sqrt(cache["q"].size)
    for name in ("Q_jl", "b_Q", "K_jl"):
        assert_allclose(source[name] / s, true[name], rtol=1e-12, atol=1e-15)


def test_source_softmax_jacobian_uses_the_first_column(ch06):
    # The post's query gradient equals the chain rule with diag(a) - a a^T,
    # a = the first column of alpha, for every row (defect 3), without 1/s.
    x, y, params = realistic(ch06, 5, 4)
    cache = ch06.forward(x, params)
    source = ch06.backprop_source(cache, y, params)
    alpha, v, k = cache["alpha"], cache["v"], cache["k"]
    d_f = (cache["p"] - y) @ np.ones((1, 4)) / 4
    G = (params["W"].T @ d_f).T @ v
    a = alpha[:, 0]
    d_e = G @ (np.diag(a) - np.outer(a, a))
    assert_allclose(
        source["Q_jl"], (k @ d_e.T) @ cache["x"].T, rtol=1e-12, atol=1e-15
    )


@pytest.mark.parametrize("seed", range(5))
def test_key_bias_true_gradient_is_zero_and_forward_ignores_it(ch06, seed):
    x, y, params = realistic(ch06, seed, 3 + seed)
    cache = ch06.forward(x, params)
    true = ch06.backprop_corrected(cache, y, params)
    ref = ch06.autograd_gradients(x, y, params)
    scale = np.linalg.norm(true["K_jl"])
    assert np.abs(true["b_K"]).max() <= 1e-12 * scale
    assert np.abs(ref["b_K"]).max() <= 1e-12 * scale
    assert np.abs(ch06.backprop_source(cache, y, params)["b_K"]).max() > 1e-6
    rng = np.random.default_rng(seed)
    shift = rng.standard_normal(params["b_K"].shape) * 10
    shifted = ch06.forward(x, dict(params, b_K=params["b_K"] + shift))
    assert_allclose(shifted["alpha"], cache["alpha"], rtol=0, atol=1e-12)
    assert_allclose(shifted["p"], cache["p"], rtol=0, atol=1e-12)


def test_finite_differences_agree_with_corrected_gradients(ch06):
    x, y, params = realistic(ch06, 11, 3)
    true = ch06.backprop_corrected(ch06.forward(x, params), y, params)
    fd = ch06.finite_difference_gradients(x, y, params)
    for name in GRAD_NAMES:
        if name == "b_K":
            assert np.linalg.norm(fd[name] - true[name]) <= 1e-8
        else:
            assert rel(true[name], fd[name]) <= 1e-6, name


def test_gradient_check_table_and_its_display(ch06):
    x, y, params = realistic(ch06, 4, 3)
    table = ch06.gradient_check_table(x, y, params)
    assert list(table.index) == list(GRAD_NAMES)
    b_auto, b_fd = table.columns[2], table.columns[3]
    assert (table[b_auto] < 1e-14).all() and (table[b_fd] < 1e-6).all()
    assert table.loc["Q_jl", table.columns[1]] > 1.0  # the post's Q gradient
    # the largest entry error lies between the norm of the error over the
    # square root of the number of entries and the norm itself
    true, b_fd_rel, entry = (
        table.columns[0],
        table.columns[3],
        table.columns[4],
    )
    for name in GRAD_NAMES:
        if name == "b_K":  # absolute errors: the true gradient is zero
            norm, size = table.loc[name, b_fd_rel], params[name].size
        else:
            norm = table.loc[name, b_fd_rel] * table.loc[name, true]
            size = params[name].size
        assert table.loc[name, entry] <= 1.01 * norm, name
        assert table.loc[name, entry] >= 0.99 * norm / np.sqrt(size), name
    shown = ch06.show(table)
    assert (shown[b_auto] == "< 1e-14").all() and b_fd not in shown.columns
    assert (
        shown.loc["Q_jl", "|true grad|"]
        == f"{table.loc['Q_jl', '|true grad|']:.1e}"
    )


def test_error_is_absolute_for_the_key_bias_only(ch06):
    g, ref = np.array([3.0, 4.0]), np.array([0.0, 2.0])
    assert ch06.error("b_K", g, ref) == pytest.approx(np.hypot(3, 2))
    assert ch06.error("K_jl", g, ref) == pytest.approx(np.hypot(3, 2) / 2)


def test_cosines_are_one_when_attention_is_uniform(ch06):
    # Uniform attention: the post's Q gradient is s times the true one (see
    # above), so every cosine is 1; with uneven attention, not.
    pairs = [realistic(ch06, seed, 5)[:2] for seed in range(3)]
    _, _, params = realistic(ch06, 9, 5)
    uniform = dict(
        params,
        Q_jl=np.zeros_like(params["Q_jl"]),
        b_Q=np.zeros_like(params["b_Q"]),
    )
    cosines = ch06.gradient_cosines(pairs, uniform, "Q_jl")
    assert_allclose(cosines, 1.0, rtol=0, atol=1e-12)
    assert ch06.gradient_cosines(pairs, params, "Q_jl").min() < 0.99
    with pytest.raises(ValueError, match="zero gradient"):
        ch06.gradient_cosines(pairs, uniform, "K_jl")  # q = 0: dL/dK = 0
    one_word = [(pairs[0][0][:, :1], pairs[0][1])]  # left out: no gradient
    assert ch06.gradient_cosines(one_word, params, "Q_jl").size == 0


# --- tokens, data, parameters ---------------------------------------------


def test_tokeniser_reproduces_the_source_and_keeps_empty_tokens(ch06):
    sentence = " ".join(ch06.SOURCE_TOKENS)
    assert ch06.tokenise(sentence) == ch06.SOURCE_TOKENS
    vocab = {"good": 0, "price": 1}
    assert ch06.tokenise("good price ") == ["good", "price", ""]
    assert ch06.tokenise("good  price") == ["good", "", "price"]
    assert ch06.known_words("good price ", vocab) == ["good", "price"]
    assert ch06.known_words("jbl good usb price ", vocab) == ["good", "price"]
    assert ch06.known_words("", vocab) == []
    with pytest.raises(ValueError, match="must be a string"):
        ch06.tokenise(None)


def test_one_hot_follows_classes(ch06):
    for i, label in enumerate(ch06.CLASSES):
        assert_array_equal(
            ch06.one_hot(label), np.eye(len(ch06.CLASSES))[:, [i]]
        )


def test_init_params_copies_k_into_v(ch06):
    params = ch06.init_params(np.random.default_rng(ch06.SEED))
    ch06.check_params(params)
    assert_array_equal(params["V_jl"], params["K_jl"])
    assert not np.shares_memory(params["V_jl"], params["K_jl"])
    for name in ("b_Q", "b_K", "b_V", "b"):
        assert not params[name].any()


def test_evaluate_rejects_a_sentence_without_known_words(ch06):
    rng, d = np.random.default_rng(0), embedding_size(ch06)
    vocab, vectors = {"good": 0, "price": 1}, rng.standard_normal((2, d))
    params = ch06.init_params(rng)
    words, alpha, p = ch06.evaluate("good price ", params, vocab, vectors)
    assert (
        words == ["good", "price"]
        and alpha.shape == (2, 2)
        and p.shape == (3,)
    )
    assert_allclose(alpha.sum(axis=1), 1.0, rtol=0, atol=1e-15)
    for sentence in ["", " ", "jbl usb ", "unknown"]:
        with pytest.raises(ValueError, match="nothing to evaluate"):
            ch06.evaluate(sentence, params, vocab, vectors)
    with pytest.raises(ValueError, match="empty sentence"):
        ch06.embed([], vocab, vectors)
    with pytest.raises(ValueError, match="not in the vocabulary"):
        ch06.embed(["good", "jbl"], vocab, vectors)


def test_make_dataset_skips_empty_sentences(ch06):
    d = embedding_size(ch06)
    vocab, vectors = {"good": 0, "bad": 1}, np.eye(2, d)
    table = pd.DataFrame(
        {
            "sentiments": ["positive", "neutral", "negative"],
            "cleaned_review": ["good ", "jbl usb ", "bad bad"],
        }
    )
    dataset, skipped = ch06.make_dataset(table, vocab, vectors)
    assert skipped == [1]
    assert [x.shape for x, _ in dataset] == [(d, 1), (d, 2)]
    assert_array_equal(dataset[1][1], ch06.one_hot("negative"))


def test_bad_inputs_raise_value_error(ch06):
    params, d = (
        ch06.init_params(np.random.default_rng(0)),
        embedding_size(ch06),
    )
    with pytest.raises(ValueError, match=rf"x must be \({d}, n\)"):
        ch06.forward(np.ones((d + 1, 3)), params)
    with pytest.raises(ValueError, match=rf"x must be \({d}, n\)"):
        ch06.forward(np.ones((d, 0)), params)
    with pytest.raises(ValueError, match="unknown sentiment"):
        ch06.one_hot("happy")
    with pytest.raises(ValueError, match="NaN or infinite"):
        ch06.softmax(np.array([[1.0, np.nan]]), axis=1)
    with pytest.raises(ValueError, match="same shape"):
        ch06.cross_entropy(np.ones((3, 1)) / 3, np.ones(3))
    with pytest.raises(ValueError, match="n_words"):
        ch06.load_glove(0)
    with pytest.raises(ValueError, match="b_K must have shape"):
        ch06.check_params(dict(params, b_K=np.zeros((d + 1, 2))))
    with pytest.raises(ValueError, match="missing parameters"):
        ch06.check_params({"Q_jl": params["Q_jl"]})
    dataset = [(np.ones((d, 2)), ch06.one_hot("neutral"))]
    with pytest.raises(ValueError, match="unknown parameters"):
        ch06.train(
            dataset, params, ch06.backprop_corrected, epochs=1, frozen=("w",)
        )
    with pytest.raises(ValueError, match="at least 1"):
        ch06.train(dataset, params, ch06.backprop_corrected, epochs=0)
    with pytest.raises(ValueError, match="empty"):
        ch06.train([], params, ch06.backprop_corrected, epochs=1)
    with pytest.raises(ValueError, match="reference is zero"):
        ch06.relative_error(np.ones(2), np.zeros(2))


def test_one_word_sentence_as_a_vector(ch06):
    params, d = (
        ch06.init_params(np.random.default_rng(0)),
        embedding_size(ch06),
    )
    word = np.random.default_rng(1).standard_normal(d)
    a = ch06.forward(word, params)
    b = ch06.forward(word.reshape(d, 1), params)
    assert a["x"].shape == (d + 1, 1)  # the position row appended
    assert_array_equal(a["p"], b["p"])


# --- training -------------------------------------------------------------------


@pytest.fixture(scope="module")
def reviews():
    return pd.read_csv(BOOK / "data" / "small.csv", keep_default_na=False)


@pytest.fixture(scope="module")
def full_data(ch06, reviews):
    vocab, vectors = ch06.load_glove()  # the chapter's default vocabulary
    dataset, skipped = ch06.make_dataset(reviews, vocab, vectors)
    assert skipped == []
    return dataset


@pytest.fixture(scope="module")
def small_data(full_data):
    return full_data[:8]


def test_sgd_step_builds_new_arrays_and_respects_frozen(ch06):
    params = ch06.init_params(np.random.default_rng(0))
    grads = {name: np.ones_like(value) for name, value in params.items()}
    before = {name: value.copy() for name, value in params.items()}
    new = ch06.sgd_step(params, grads, 0.5, frozen=("W", "b"))
    for name in params:
        assert_array_equal(params[name], before[name])  # nothing in place
    assert new["W"] is params["W"] and new["b"] is params["b"]
    assert_allclose(new["Q_jl"], params["Q_jl"] - 0.5, rtol=0, atol=0)


@pytest.mark.parametrize("which", ["backprop_source", "backprop_corrected"])
def test_training_freezes_w_and_b_and_lowers_the_loss(ch06, small_data, which):
    params = ch06.init_params(np.random.default_rng(ch06.SEED))
    new, losses = ch06.train(
        small_data, params, getattr(ch06, which), epochs=5
    )
    assert_array_equal(new["W"], params["W"])  # frozen by default
    assert_array_equal(new["b"], params["b"])
    assert not np.allclose(new["K_jl"], params["K_jl"])
    assert losses.shape == (5,) and (np.diff(losses) < 0).all()
    # epoch 1's first loss is taken before any update: at the start, every
    # class is about equally likely
    assert abs(losses[0] - np.log(3)) < 0.01


def test_autograd_training_follows_the_corrected_training(ch06, small_data):
    params = ch06.init_params(np.random.default_rng(ch06.SEED))
    p_np, l_np = ch06.train(
        small_data, params, ch06.backprop_corrected, epochs=5, frozen=()
    )
    p_t, l_t = ch06.train_torch(small_data, params, epochs=5, frozen=())
    assert_allclose(l_t, l_np, rtol=0, atol=1e-12)
    for name in p_np:
        assert_allclose(p_t[name], p_np[name], rtol=0, atol=1e-12)


def test_train_watching_logs_what_train_does(ch06, small_data):
    params = ch06.init_params(np.random.default_rng(ch06.SEED))
    big = {name: 30 * value for name, value in params.items()}  # sharp start
    final, log = ch06.train_watching(
        small_data, big, ch06.backprop_source, epochs=4, keep=(2,)
    )
    expected, losses = ch06.train(
        small_data, big, ch06.backprop_source, epochs=4
    )
    assert_allclose(log["loss"], losses, rtol=0, atol=0)
    for name in final:
        assert_array_equal(final[name], expected[name])
    # replay the epochs to count the attention rows whose winner changed
    p, changed, steps = big, [], []
    winners, _ = ch06.attention_state(small_data, p)
    for _ in range(4):
        new, _ = ch06.train(small_data, p, ch06.backprop_source, epochs=1)
        steps.append(
            np.sqrt(
                sum(np.sum((new[n] - p[n]) ** 2) for n in ("Q_jl", "K_jl"))
            )
        )
        previous, (winners, _) = winners, ch06.attention_state(small_data, new)
        changed.append(int(np.sum(winners != previous)))
        p = new
    assert_array_equal(log["changed"], changed)
    assert_allclose(log["step"], steps, rtol=1e-12, atol=0)
    assert list(log["kept"]) == [2] and log["sharpness"].shape == (4,)
    assert ((log["sharpness"] > 0) & (log["sharpness"] <= 1)).all()


def test_attention_state_counts_one_row_per_word(ch06, small_data):
    params = ch06.init_params(np.random.default_rng(0))
    winners, sharpness = ch06.attention_state(small_data, params)
    assert winners.shape == (sum(x.shape[1] for x, _ in small_data),)
    lengths = [x.shape[1] for x, _ in small_data]
    assert 1 / max(lengths) <= sharpness <= 1


# --- the page: each Julia listing followed by the code that runs ---------------


JULIA = re.compile(r"```(\{code-block\} )?julia\n")


def tab_cells():
    """Each markdown cell that quotes the post's Julia, with the cell after it."""
    cells = json.loads((BOOK / NOTEBOOK).read_text(encoding="utf-8"))["cells"]
    for i, cell in enumerate(cells):
        text = "".join(cell["source"])
        if cell["cell_type"] == "markdown" and JULIA.search(text):
            yield text, cells[i + 1]


def test_julia_listings_are_followed_by_their_visible_port():
    checked = 0
    for text, following in tab_cells():
        assert "```python" not in text, "the port is the code cell, not a copy"
        assert following["cell_type"] == "code"
        assert "hide-input" not in following["metadata"].get("tags", [])
        checked += 1
    assert checked == 6


def test_julia_listings_highlight_the_four_defects():
    # every highlighted Julia line is one of the defects the prose names
    defects = {
        "sqrt(length(q))": 1,  # defect 1: the scale
        "k', q'": 2,  # defect 2: no 1/s in the backward pass
        "α[j]": 3,  # defect 3: the first column as every row's Jacobian
        "∂L_∂Kb": 4,  # defect 4: a gradient for the key bias
    }
    found = set()
    for text, _ in tab_cells():
        for options, body in re.findall(
            r"```\{code-block\} julia\n:emphasize-lines: ([\d,]+)\n\n(.*?)```",
            text,
            flags=re.S,
        ):
            lines = body.split("\n")
            for number in map(int, options.split(",")):
                hits = [
                    d for key, d in defects.items() if key in lines[number - 1]
                ]
                assert len(hits) == 1, lines[number - 1]
                found |= set(hits)
    assert found == {1, 2, 3, 4}


# --- what the text states, against independent references (issue 31) --------


def test_glove_rows_follow_the_file(ch06):
    # the default keeps the post's max_vocab_size; row i is word i's vector
    vocab, vectors = ch06.load_glove()
    assert len(vocab) == 10_000 and vectors.shape == (10_000, 50)
    assert vectors.dtype == np.float64
    assert list(vocab)[:4] == ["the", ",", ".", "of"]
    assert [vocab[w] for w in ("the", ",", ".")] == [0, 1, 2]
    assert_allclose(
        vectors[0, :5], ch06.GLOVE_FILE_FIRST_ROW, rtol=0, atol=1e-7
    )
    head, tail = (
        np.array(part.split(), float) for part in ch06.SOURCE_RED.split("⋮")
    )
    red = vectors[vocab["red"]]
    assert_allclose(red[:13], head, rtol=0, atol=1e-7)
    assert_allclose(red[-12:], tail, rtol=0, atol=1e-7)
    small, small_vectors = ch06.load_glove(3)
    assert small == {"the": 0, ",": 1, ".": 2} and small_vectors.shape[0] == 3
    with pytest.raises(ValueError, match="n_words"):
        ch06.load_glove(400_001)


def test_embed_puts_each_words_vector_in_its_column(ch06):
    vocab = {"good": 0, "bad": 1, "price": 2}
    vectors = np.arange(3 * 50, dtype=float).reshape(3, 50)
    x = ch06.embed(["price", "good", "price"], vocab, vectors)
    assert x.shape == (50, 3)
    assert_array_equal(x[:, 0], vectors[2])
    assert_array_equal(x[:, 1], vectors[0])
    assert_array_equal(x[:, 2], vectors[2])
    table = pd.DataFrame(
        {"sentiments": ["positive"], "cleaned_review": ["bad good "]}
    )
    (pair,), _ = ch06.make_dataset(table, vocab, vectors)
    assert_array_equal(pair[0], vectors[[1, 0]].T)
    assert_array_equal(pair[1], [[0], [0], [1]])


def test_one_hot_is_the_posts_sent_dict(ch06):
    # sent_dict = Dict("positive"=>[0,0,1],"negative"=>[1,0,0],"neutral"=>[0,1,0])
    sent_dict = {
        "positive": [0, 0, 1],
        "negative": [1, 0, 0],
        "neutral": [0, 1, 0],
    }
    for label, column in sent_dict.items():
        assert_array_equal(ch06.one_hot(label), np.array(column)[:, None])


def test_init_params_draws_q_k_w_over_100_in_the_posts_order(ch06):
    params = ch06.init_params(np.random.default_rng(5))
    rng = np.random.default_rng(5)
    Q, K, W = (
        rng.standard_normal(shape) / 100
        for shape in [(51, 51)] * 2 + [(3, 51)]
    )
    assert_allclose(params["Q_jl"], Q, rtol=1e-15, atol=0)
    assert_allclose(params["K_jl"], K, rtol=1e-15, atol=0)
    assert_allclose(params["W"], W, rtol=1e-15, atol=0)
    assert [params[n].shape for n in GRAD_NAMES] == [
        (51, 51),
        (51, 1),
        (51, 51),
        (51, 1),
        (51, 51),
        (51, 1),
        (3, 51),
        (3, 1),
    ]


def reference_forward(x, params):
    """Equations (ch6-qkv) to (ch6-head), one word and one class at a time."""
    n = x.shape[1]
    x = np.vstack([x, np.arange(n)])  # positions 0 .. n - 1
    q, k, v = (params[m + "_jl"] @ x + params["b_" + m] for m in "QKV")
    s = np.sqrt(51 * n)
    alpha = np.zeros((n, n))
    for i in range(n):
        e = [float(q[:, i] @ k[:, j]) / s for j in range(n)]
        w = [np.exp(ej - max(e)) for ej in e]
        alpha[i] = np.array(w) / sum(w)
    z = np.stack(
        [sum(alpha[i, j] * v[:, j] for j in range(n)) for i in range(n)]
    )
    f = params["W"] @ z.T + params["b"]  # (3, n)
    m = f.sum(axis=1) / n
    p = np.exp(m - m.max()) / np.exp(m - m.max()).sum()
    return alpha, p[:, None]


@pytest.mark.parametrize("n", [1, 2, 5])
def test_forward_follows_the_equations(ch06, n):
    x, y, params = realistic(ch06, 20 + n, n)
    cache = ch06.forward(x, params)
    alpha, p = reference_forward(x, params)
    assert_array_equal(cache["x"][-1], np.arange(n))  # the position row
    assert_array_equal(cache["x"][:-1], x)
    assert_allclose(cache["alpha"], alpha, rtol=1e-12, atol=1e-15)
    assert_allclose(cache["p"], p, rtol=1e-12, atol=1e-15)
    assert cache["z"].shape == (51, n) and cache["q"].shape == (51, n)
    assert ch06.cross_entropy(cache["p"], y) == pytest.approx(
        -np.log(p[np.argmax(y), 0]), rel=1e-12
    )


def test_softmax_is_stable_and_normalises_along_its_axis(ch06):
    s = np.array([[1000.0, 1001.0, 1002.0], [-5.0, 0.0, 5.0]])
    e = np.exp(s - s.max(axis=1, keepdims=True))
    assert_allclose(
        ch06.softmax(s, axis=1), e / e.sum(axis=1, keepdims=True), rtol=1e-14
    )
    e0 = np.exp(s.T - s.T.max(axis=0))
    assert_allclose(ch06.softmax(s.T), e0 / e0.sum(axis=0), rtol=1e-14)


def test_cross_entropy_is_minus_sum_y_log_p(ch06):
    p = np.array([[0.2], [0.3], [0.5]])
    for i in range(3):
        y = np.eye(3)[:, [i]]
        assert ch06.cross_entropy(p, y) == pytest.approx(-np.log(p[i, 0]))


def test_accuracy_counts_the_argmax_hits(ch06, small_data):
    # against the PyTorch forward pass and a count by hand
    params = ch06.init_params(np.random.default_rng(1))
    params = {n: 30 * v for n, v in params.items()}  # predictions that vary
    leaves = {n: torch.tensor(v) for n, v in params.items()}
    predicted = [
        int(ch06.forward_torch(torch.tensor(x), leaves)[0].argmax())
        for x, _ in small_data
    ]
    labels = [int(np.flatnonzero(y.ravel())[0]) for _, y in small_data]
    assert len(set(predicted)) > 1 and 0 < sum(
        a == b for a, b in zip(predicted, labels)
    ) < len(labels)
    for part in (slice(None), slice(0, 3), slice(5, None)):
        hits = [a == b for a, b in zip(predicted[part], labels[part])]
        expected = sum(hits) / len(hits)
        assert ch06.accuracy(small_data[part], params) == pytest.approx(
            expected
        )
    with pytest.raises(ValueError, match="empty"):
        ch06.accuracy([], params)


def test_training_step_is_sgd_with_the_posts_defaults(ch06, small_data):
    # one epoch by hand: sentence by sentence in order, lr 0.001, W and b
    # frozen, each loss taken before its sentence's update
    params = ch06.init_params(np.random.default_rng(3))
    new, losses = ch06.train(
        small_data, params, ch06.backprop_corrected, epochs=1
    )
    p, total = params, 0.0
    for x, y in small_data:
        ref = ch06.autograd_gradients(x, y, p)
        leaves = {n: torch.tensor(v) for n, v in p.items()}
        prob = ch06.forward_torch(torch.tensor(x), leaves)[0].numpy()
        total += float(-np.log(prob[np.argmax(y), 0]))
        p = {
            n: v if n in ("W", "b") else v - 0.001 * ref[n]
            for n, v in p.items()
        }
    assert losses[0] == pytest.approx(total / len(small_data), rel=1e-12)
    for n in GRAD_NAMES:
        assert_allclose(new[n], p[n], rtol=0, atol=1e-14)


@pytest.mark.parametrize("name", ["Q_jl", "K_jl", "V_jl", "b_Q", "W", "b"])
def test_corrected_gradient_of_each_formula(ch06, name):
    # one non-symmetric case per formula of (ch6-head-backward) to
    # (ch6-qk-backward), against autograd, with d_v != d_z alpha^T
    x, y, params = realistic(ch06, 40, 4)
    ours = ch06.backprop_corrected(ch06.forward(x, params), y, params)
    ref = ch06.autograd_gradients(x, y, params)
    assert rel(ours[name], ref[name]) <= 1e-10


def test_attention_state_reads_the_rows(ch06, small_data):
    params = ch06.init_params(np.random.default_rng(2))
    params = {n: 30 * v for n, v in params.items()}
    leaves = {n: torch.tensor(v) for n, v in params.items()}
    alphas = [
        ch06.forward_torch(torch.tensor(x), leaves)[1].numpy()
        for x, _ in small_data
    ]
    winners, sharpness = ch06.attention_state(small_data, params)
    # every attention row (one per word), sentence by sentence
    expected = [int(np.argmax(row)) for alpha in alphas for row in alpha]
    assert_array_equal(winners, expected)
    tops = [row.max() for alpha in alphas for row in alpha]
    assert sharpness == pytest.approx(np.mean(tops), rel=1e-12)
    assert len(set(expected)) > 1


def test_cosine_is_the_normalised_dot_product(ch06):
    g, h = np.array([[3.0, 0.0]]), np.array([[1.0, 1.0]])
    assert ch06.cosine(g, h) == pytest.approx(3 / (3 * np.sqrt(2)))
    assert ch06.cosine(g, -g) == pytest.approx(-1.0)


def test_summary_counts_rises_per_block(ch06):
    # a loss that rises at epochs 3 and 6 (1-based), blocks of 4 epochs
    log = {
        "loss": np.array([5.0, 4.0, 4.5, 3.0, 2.0, 2.5, 1.0, 0.5]),
        "changed": np.array([0, 1, 2, 0, 0, 3, 0, 1]),
        "sharpness": np.linspace(0.1, 0.8, 8),
        "step": np.array([1.0, 2.0, 9.0, 1.0, 1.0, 1.0, 7.0, 1.0]),
    }
    table = ch06.summary(log, block=4)
    assert list(table.index) == ["1-4", "5-8"]
    assert table["loss rises"].tolist() == [1, 1]
    assert table["winners changed"].tolist() == [3, 4]
    assert_allclose(table["sharpness"], [0.4, 0.8], rtol=1e-12)
    assert table["largest step"].tolist() == [9.0, 7.0]


def test_print_losses_prints_epoch_one_and_every_hundredth(ch06, capsys):
    losses = np.arange(1, 301) / 1000
    ch06.print_losses(losses, 2 * losses, every=100)
    lines = capsys.readouterr().out.splitlines()[1:]
    assert [int(line.split()[0]) for line in lines] == [1, 100, 200, 300]
    assert lines[-1].split()[1:] == ["0.3000", "0.6000"]


# --- the stored full trainings (make train-sentiment, issue 39) ---------------


STORED_RUNS = (
    "a",
    "a_100",
    "a_500",
    "a_800",
    "b",
    "autograd",
    "held_out",
    "all",
)


@pytest.fixture(scope="module")
def stored(ch06):
    weights = np.load(BOOK / "data" / "sentiment_params.npz")
    log = pd.read_csv(BOOK / "data" / "sentiment_train_log.csv")
    params = {run: ch06.stored_params(weights, run) for run in STORED_RUNS}
    return params, log


def test_stored_files_are_small_and_hold_every_run(stored):
    params, log = stored
    for name in ("sentiment_params.npz", "sentiment_train_log.csv"):
        assert (BOOK / "data" / name).stat().st_size < 1_000_000, name
    epochs = log.groupby("run", sort=False)["epoch"].agg(["min", "max"])
    assert list(epochs.index) == ["a", "b", "autograd", "held_out", "all"]
    assert (epochs["min"] == 1).all()
    assert epochs["max"].tolist() == [1000, 1000, 1000, 1000, 300]
    last = log.dropna(subset=["accuracy"])
    assert last["run"].tolist() == list(epochs.index)
    assert (last["epoch"].to_numpy() == epochs["max"].to_numpy()).all()
    assert (last[["cpu_seconds", "wall_seconds"]] > 0).all().all()
    for name in ("a", "b"):  # train_watching's record, every epoch
        rows = log[log["run"] == name]
        assert rows[["changed", "sharpness", "step"]].notna().all().all()
    assert set(params["a"]) == set(GRAD_NAMES)


def test_stored_weights_reproduce_the_logged_accuracies(
    ch06, stored, full_data, reviews
):
    params, log = stored
    logged = log.dropna(subset=["accuracy"]).set_index("run")
    for run in ("a", "b", "autograd", "all"):
        accuracy = ch06.accuracy(full_data, params[run])
        assert accuracy == pytest.approx(
            logged.loc[run, "accuracy"], abs=1e-12
        )
    held_out = ch06.stratified_hold_out(
        reviews["sentiments"].to_numpy(),
        ch06.HOLD_OUT,
        np.random.default_rng(ch06.SPLIT_SEED),
    )
    train_part = [p for i, p in enumerate(full_data) if i not in held_out]
    test_part = [full_data[i] for i in held_out]
    for part, column in [
        (train_part, "accuracy"),
        (test_part, "held_out_accuracy"),
    ]:
        accuracy = ch06.accuracy(part, params["held_out"])
        assert accuracy == pytest.approx(
            logged.loc["held_out", column], abs=1e-12
        )


def test_stored_weights_reproduce_the_logged_sharpness(
    ch06, stored, full_data
):
    params, log = stored
    for run, epoch in [
        ("a_100", 100),
        ("a_500", 500),
        ("a_800", 800),
        ("a", 1000),
        ("b", 1000),
    ]:
        _, sharpness = ch06.attention_state(full_data, params[run])
        row = log[(log["run"] == run.split("_")[0]) & (log["epoch"] == epoch)]
        assert sharpness == pytest.approx(row["sharpness"].item(), abs=1e-12)


def test_stored_runs_start_where_the_chapter_starts(ch06, stored, full_data):
    # the first epochs again, from the chapter's seed: the log's first rows
    params, log = stored
    params0 = ch06.init_params(np.random.default_rng(ch06.SEED))
    for run, backprop in [
        ("a", ch06.backprop_source),
        ("b", ch06.backprop_corrected),
    ]:
        _, record = ch06.train_watching(full_data, params0, backprop, epochs=2)
        rows = log[log["run"] == run].iloc[:2]
        for column in ("loss", "sharpness", "step"):
            assert_allclose(rows[column], record[column], rtol=1e-9, atol=0)
        assert_array_equal(rows["changed"], record["changed"])
    # frozen W and b in every run but exercise 1's
    for run in ("a", "a_100", "b", "autograd", "held_out"):
        assert_array_equal(params[run]["W"], params0["W"])
        assert_array_equal(params[run]["b"], params0["b"])
    assert not np.allclose(params["all"]["W"], params0["W"])
    # autograd's run and the corrected one, step for step
    autograd, b = (
        log[log["run"] == r]["loss"].to_numpy() for r in ("autograd", "b")
    )
    assert np.abs(autograd - b).max() < 1e-13
    for name in GRAD_NAMES:
        assert_allclose(
            params["autograd"][name], params["b"][name], rtol=0, atol=1e-9
        )


def test_stored_params_and_run_log_read_one_run(ch06):
    rng = np.random.default_rng(0)
    params = ch06.init_params(rng)
    files = {f"x.{n}": v for n, v in params.items()}
    files |= {
        "y.Q_jl": params["Q_jl"],
        "x_1.Q_jl": 2 * params["Q_jl"],
    }  # other runs
    got = ch06.stored_params(_Stored(files), "x")
    assert set(got) == set(GRAD_NAMES)
    for name in GRAD_NAMES:
        assert got[name] is files[f"x.{name}"]
    with pytest.raises(ValueError, match="missing parameters"):
        ch06.stored_params(_Stored(files), "y")
    log = pd.DataFrame(
        {
            "run": ["x", "x", "z"],
            "epoch": [1, 2, 1],
            "loss": [3.0, 2.0, 9.0],
            "step": [0.5, np.nan, 7.0],
        }
    )
    record = ch06.run_log(log, "x")
    assert set(record) == {"loss", "step"}
    assert_array_equal(record["loss"], [3.0, 2.0])
    assert_array_equal(record["step"], [0.5, np.nan])
    with pytest.raises(ValueError, match="no run"):
        ch06.run_log(log, "w")


class _Stored(dict):
    """What np.load gives for an .npz file: its names in .files."""

    @property
    def files(self):
        return list(self)


def test_stratified_hold_out_draws_the_counts_of_each_label(ch06):
    labels = np.array(["n", "p", "n", "u", "p", "n", "u", "n"])
    counts = {"n": 2, "p": 1, "u": 1}
    rows = ch06.stratified_hold_out(labels, counts, np.random.default_rng(3))
    assert rows == sorted(set(rows)) and len(rows) == 4
    assert [labels[rows].tolist().count(k) for k in counts] == [2, 1, 1]
    again = ch06.stratified_hold_out(labels, counts, np.random.default_rng(3))
    assert again == rows
    with pytest.raises(ValueError):
        ch06.stratified_hold_out(labels, {"u": 3}, np.random.default_rng(0))


def test_training_script_runs_the_chapters_own_functions(ch06, monkeypatch):
    import train_sentiment

    monkeypatch.setattr(
        train_sentiment, "load_chapter", lambda name: {NOTEBOOK: ch06}[name]
    )
    ch, dataset, params0, held_out = train_sentiment.setup()
    assert ch is ch06 and len(dataset) == 39
    seeded = ch06.init_params(np.random.default_rng(ch06.SEED))
    for name in GRAD_NAMES:
        assert_array_equal(params0[name], seeded[name])
    assert len(held_out) == sum(ch06.HOLD_OUT.values())
    calls = []
    for name in ("train_watching", "train", "train_torch"):
        monkeypatch.setattr(
            ch06, name, lambda *a, _name=name, **k: calls.append((_name, a, k))
        )
    runs = train_sentiment.runs(ch, dataset, params0, held_out)
    for _, fn, _, _ in runs:
        fn()
    names = [run[0] for run in runs]
    assert names == ["a", "b", "autograd", "held_out", "all"]
    functions = [(c[0], c[1][2] if len(c[1]) > 2 else None) for c in calls]
    assert functions == [
        ("train_watching", ch06.backprop_source),
        ("train_watching", ch06.backprop_corrected),
        ("train_torch", None),
        ("train", ch06.backprop_corrected),
        ("train", ch06.backprop_corrected),
    ]
    for name, args, _ in calls:
        assert args[1] is params0, name
    assert [len(c[1][0]) for c in calls] == [39, 39, 39, 30, 39]
    assert calls[0][2] == {"keep": (100, 500, 800)}
    assert calls[4][2] == {"epochs": 300, "frozen": ()}
    assert calls[3][2] == {} and calls[1][2] == {"keep": ()}
