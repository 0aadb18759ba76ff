"""Chapter 6: the sentiment model, its hand-written gradients and its training."""

import numpy as np
import pandas as pd
import pytest
from conftest import BOOK, load_chapter
from numpy.testing import assert_allclose, assert_array_equal

GRAD_NAMES = ("Q", "Qb", "K", "Kb", "V", "Vb", "W", "b")


@pytest.fixture(scope="module")
def ch06():
    return load_chapter("06_sentiment.ipynb")


def realistic(ch06, seed, n):
    """Parameters and biases drawn as 0.3 * N(0, 1), a sentence of n words."""
    rng = np.random.default_rng(seed)
    params = {
        name: 0.3 * rng.standard_normal(value.shape)
        for name, value in ch06.init_params(rng).items()
    }
    x = 0.5 * rng.standard_normal((50, n))
    y = np.zeros((3, 1))
    y[rng.integers(3)] = 1.0
    return x, y, params


def rel(g, ref):
    return np.linalg.norm(g - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("n", range(1, 13))
@pytest.mark.parametrize("seed", [0, 1])
def test_corrected_gradients_equal_autograd(ch06, n, seed):
    x, y, params = realistic(ch06, seed, n)
    ours = ch06.backprop_corrected(ch06.forward(x, params), y, params)
    ref = ch06.autograd_gradients(x, y, params)
    for name in GRAD_NAMES:
        assert ours[name].shape == params[name].shape
        if name == "Kb":  # the true gradient is zero: compare absolutely
            assert np.linalg.norm(ours[name] - ref[name]) <= 1e-10
        elif n == 1 and name in ("Q", "Qb", "K"):
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
    s = np.sqrt(cache["q"].size)  # sqrt(51 n)
    for name in ("Q", "K"):
        assert rel(source[name], ref[name]) > 1.0, name
        # not only the missing scale: the Jacobian is wrong too
        assert rel(source[name] / s, ref[name]) > 1e-2, name
    for name in ("V", "Vb", "W", "b"):  # these are right
        assert rel(source[name], ref[name]) <= 1e-10, name


def test_source_gradient_is_only_mis_scaled_when_attention_is_uniform(ch06):
    # Q = 0 and Qb = 0 make every score 0: the first-column Jacobian is then
    # every row's Jacobian, and only the missing 1/s remains (defect 2).
    x, y, params = realistic(ch06, 3, 6)
    params = dict(params, Q=np.zeros((51, 51)), Qb=np.zeros((51, 1)))
    cache = ch06.forward(x, params)
    assert_allclose(cache["alpha"], np.full((6, 6), 1 / 6), rtol=0, atol=1e-15)
    source = ch06.backprop_source(cache, y, params)
    true = ch06.backprop_corrected(cache, y, params)
    s = np.sqrt(51 * 6)
    for name in ("Q", "Qb"):
        assert_allclose(source[name] / s, true[name], rtol=1e-12, atol=1e-15)


def test_source_softmax_jacobian_uses_the_first_column(ch06):
    # Build a case where only dL/dalpha matters and compare the source's
    # query gradient with diag(a) - a a^T for a = first column of alpha.
    x, y, params = realistic(ch06, 5, 4)
    cache = ch06.forward(x, params)
    source = ch06.backprop_source(cache, y, params)
    alpha, v, k = cache["alpha"], cache["v"], cache["k"]
    d_f = (cache["p"] - y) @ np.ones((1, 4)) / 4
    G = (params["W"].T @ d_f).T @ v
    a = alpha[:, 0]
    d_e = G @ (np.diag(a) - np.outer(a, a))
    assert_allclose(
        source["Q"], (k @ d_e.T) @ cache["x"].T, rtol=1e-12, atol=1e-15
    )


@pytest.mark.parametrize("seed", range(5))
def test_key_bias_true_gradient_is_zero_and_forward_ignores_it(ch06, seed):
    x, y, params = realistic(ch06, seed, 3 + seed)
    cache = ch06.forward(x, params)
    true = ch06.backprop_corrected(cache, y, params)
    ref = ch06.autograd_gradients(x, y, params)
    scale = np.linalg.norm(true["K"])
    assert np.abs(true["Kb"]).max() <= 1e-12 * scale
    assert np.abs(ref["Kb"]).max() <= 1e-12 * scale
    assert np.abs(ch06.backprop_source(cache, y, params)["Kb"]).max() > 1e-6
    shift = np.random.default_rng(seed).standard_normal((51, 1)) * 10
    shifted = ch06.forward(x, dict(params, Kb=params["Kb"] + shift))
    assert_allclose(shifted["alpha"], cache["alpha"], rtol=0, atol=1e-12)
    assert_allclose(shifted["p"], cache["p"], rtol=0, atol=1e-12)


def test_finite_differences_agree_with_corrected_gradients(ch06):
    x, y, params = realistic(ch06, 11, 3)
    true = ch06.backprop_corrected(ch06.forward(x, params), y, params)
    fd = ch06.finite_difference_gradients(x, y, params)
    for name in GRAD_NAMES:
        if name == "Kb":
            assert np.linalg.norm(fd[name] - true[name]) <= 1e-8
        else:
            assert rel(true[name], fd[name]) <= 1e-6, name


def test_tokeniser_trailing_space_and_unknown_words(ch06):
    vocab = {"good": 0, "price": 1}
    assert ch06.tokenise("good price ") == ["good", "price", ""]
    assert ch06.tokenise("good  price") == ["good", "", "price"]
    assert ch06.known_words("good price ", vocab) == ["good", "price"]
    assert ch06.known_words("jbl good usb price ", vocab) == ["good", "price"]
    assert ch06.known_words("", vocab) == []
    with pytest.raises(ValueError, match="must be a string"):
        ch06.tokenise(None)


def test_evaluate_rejects_a_sentence_without_known_words(ch06):
    rng = np.random.default_rng(0)
    vocab, vectors = {"good": 0, "price": 1}, rng.standard_normal((2, 50))
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
    vocab, vectors = {"good": 0, "bad": 1}, np.eye(2, 50)
    table = pd.DataFrame(
        {
            "sentiments": ["positive", "neutral", "negative"],
            "cleaned_review": ["good ", "jbl usb ", "bad bad"],
        }
    )
    dataset, skipped = ch06.make_dataset(table, vocab, vectors)
    assert skipped == [1]
    assert [x.shape for x, _ in dataset] == [(50, 1), (50, 2)]
    assert_array_equal(dataset[1][1].ravel(), [1, 0, 0])


def test_bad_inputs_raise_value_error(ch06):
    params = ch06.init_params(np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"x must be \(50, n\)"):
        ch06.forward(np.ones((51, 3)), params)
    with pytest.raises(ValueError, match=r"x must be \(50, n\)"):
        ch06.forward(np.ones((50, 0)), params)
    with pytest.raises(ValueError, match="unknown sentiment"):
        ch06.one_hot("happy")
    with pytest.raises(ValueError, match="NaN or infinite"):
        ch06.softmax(np.array([[1.0, np.nan]]), axis=1)
    with pytest.raises(ValueError, match="n_words"):
        ch06.load_glove(0)
    with pytest.raises(ValueError, match="Kb must have shape"):
        ch06.check_params(dict(params, Kb=np.zeros((51, 2))))
    with pytest.raises(ValueError, match="missing parameters"):
        ch06.check_params({"Q": params["Q"]})
    dataset = [(np.ones((50, 2)), ch06.one_hot("neutral"))]
    with pytest.raises(ValueError, match="unknown parameters"):
        ch06.train(
            dataset, params, ch06.backprop_corrected, epochs=1, frozen=("w",)
        )
    with pytest.raises(ValueError, match="empty"):
        ch06.train([], params, ch06.backprop_corrected, epochs=1)
    with pytest.raises(ValueError, match="reference is zero"):
        ch06.relative_error(np.ones(2), np.zeros(2))


def test_one_word_sentence_as_a_vector(ch06):
    params = ch06.init_params(np.random.default_rng(0))
    word = np.random.default_rng(1).standard_normal(50)
    a = ch06.forward(word, params)
    b = ch06.forward(word.reshape(50, 1), params)
    assert a["x"].shape == (51, 1)
    assert_array_equal(a["p"], b["p"])


@pytest.fixture(scope="module")
def small_data(ch06):
    vocab, vectors = ch06.load_glove(10_000)
    table = pd.read_csv(BOOK / "data" / "small.csv", keep_default_na=False)
    dataset, skipped = ch06.make_dataset(table, vocab, vectors)
    return vocab, vectors, table, dataset, skipped


def test_glove_rows_follow_the_file_and_data_is_complete(ch06, small_data):
    vocab, vectors, _, dataset, skipped = small_data
    assert vectors.shape == (10_000, 50) and vectors.dtype == np.float64
    assert [w for w, _ in sorted(vocab.items(), key=lambda kv: kv[1])][:4] == [
        "the",
        ",",
        ".",
        "of",
    ]
    assert_allclose(
        vectors[vocab["red"], :3],
        [-0.12878, 0.8798, -0.60694],
        rtol=0,
        atol=1e-7,
    )
    assert "doesn" not in vocab and "flip" not in vocab
    assert len(dataset) == 39 and skipped == []


def test_sgd_step_builds_new_arrays_and_respects_frozen(ch06):
    params = ch06.init_params(np.random.default_rng(0))
    grads = {name: np.ones_like(value) for name, value in params.items()}
    before = {name: value.copy() for name, value in params.items()}
    new = ch06.sgd_step(params, grads, 0.5, frozen=("W", "b"))
    for name in params:
        assert_array_equal(params[name], before[name])  # nothing in place
    assert new["W"] is params["W"] and new["b"] is params["b"]
    assert_allclose(new["Q"], params["Q"] - 0.5, rtol=0, atol=0)


@pytest.mark.parametrize("which", ["backprop_source", "backprop_corrected"])
def test_training_is_deterministic(ch06, small_data, which):
    dataset = small_data[3][:8]
    params = ch06.init_params(np.random.default_rng(12))
    backprop = getattr(ch06, which)
    p1, l1 = ch06.train(dataset, params, backprop, epochs=5)
    p2, l2 = ch06.train(dataset, params, backprop, epochs=5)
    assert_array_equal(l1, l2)
    for name in p1:
        assert_array_equal(p1[name], p2[name])
    assert_array_equal(p1["W"], params["W"])  # frozen by default
    assert l1[-1] < l1[0]


def test_autograd_training_follows_the_corrected_training(ch06, small_data):
    dataset = small_data[3][:8]
    params = ch06.init_params(np.random.default_rng(12))
    p_np, l_np = ch06.train(
        dataset, params, ch06.backprop_corrected, epochs=5, frozen=()
    )
    p_t, l_t = ch06.train_torch(dataset, params, epochs=5, frozen=())
    assert_allclose(l_t, l_np, rtol=0, atol=1e-12)
    for name in p_np:
        assert_allclose(p_t[name], p_np[name], rtol=0, atol=1e-12)
