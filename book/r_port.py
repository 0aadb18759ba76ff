"""R's random numbers and R's print layout, in NumPy (the book's appendix,
book/appendix_r_internals.ipynb, explains and checks every function but the
input checks).

Chapter 2 uses them to reproduce, character for character, what the R
vignette of Bastiaan Quast's `attention` package prints: its weight matrices
come from R's `set.seed(0)` and `runif`, and R prints matrices in its own
layout.

- `r_set_seed(seed)`: a NumPy MT19937 bit generator in the state R's
  `set.seed(seed)` leaves (R's default generator, Mersenne-Twister).
- `r_runif(generator, n, min, max)`: R's `runif`, bit for bit.
- `r_format_matrix(M)`, `r_format_vector(x)`: the text R's `print` shows.
"""

import numpy as np


def check_seed(seed):
    """seed as a Python int, if R's set.seed takes it unchanged."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"the seed must be an integer, got {seed!r}")
    if not -(2**31 - 1) <= seed <= 2**31 - 1:
        raise ValueError(
            f"R's seeds are 32-bit integers between -(2^31 - 1) and "
            f"2^31 - 1, got {seed}"
        )
    return int(seed)


def r_seed_words(seed):
    """The 625 numbers R's set.seed(seed) computes with its LCG."""
    s = check_seed(seed) % 2**32  # a negative seed wraps around
    for _ in range(50):  # initial scrambling
        s = (69069 * s + 1) % 2**32
    words = []
    for _ in range(625):  # a position counter, then 624 state words
        s = (69069 * s + 1) % 2**32
        words.append(s)
    return words


def r_set_seed(seed):
    """A NumPy MT19937 bit generator in the state R's set.seed(seed) leaves."""
    key = np.array(r_seed_words(seed)[1:], dtype=np.uint32)
    generator = np.random.MT19937()
    generator.state = {
        "bit_generator": "MT19937",
        "state": {"key": key, "pos": 624},  # 624: twist before drawing
    }
    return generator


def r_unif_rand(generator, n):
    """n uniform numbers in (0, 1), drawn as R's unif_rand() draws them."""
    u = generator.random_raw(n) * 2.3283064365386963e-10  # y / 2^32
    u[u <= 0.0] = 0.5 * 2.328306437080797e-10  # R keeps u > 0
    return u


def check_runif(n, min, max):
    """Refuse what R's runif(n, min, max) refuses or would return NaN for."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    if not (np.isfinite(min) and np.isfinite(max)) or min > max:
        raise ValueError(
            f"runif needs finite min <= max, got min={min}, max={max}"
        )


def r_runif(generator, n, min=0.0, max=1.0):
    """R's runif(n, min, max), drawing from `generator`."""
    check_runif(n, min, max)
    if min == max:
        return np.full(n, float(min))  # R returns min and draws nothing
    return min + (max - min) * r_unif_rand(generator, n)


def check_numbers(x, name):
    """x as a non-empty 1-D float array of finite numbers, -0.0 made 0.0."""
    x = np.asarray(x, dtype=float)
    if x.ndim != 1 or x.size == 0 or not np.isfinite(x).all():
        raise ValueError(
            f"{name} needs a non-empty 1-D array of finite numbers, "
            f"got shape {x.shape}"
        )
    return x + 0.0  # -0.0 becomes 0.0: R prints no "-0"


def check_matrix(M):
    """M as a non-empty 2-D float array."""
    M = np.asarray(M, dtype=float)
    if M.ndim != 2 or 0 in M.shape:
        raise ValueError(
            f"r_format_matrix needs a non-empty 2-D array, got shape {M.shape}"
        )
    return M


def check_width(lines, width, what):
    """Refuse text wider than R's line: R would wrap it, and we do not."""
    if max(len(line) for line in lines) > width:
        raise ValueError(
            f"the {what} is wider than {width} characters; R would wrap "
            "it, which this formatter does not do"
        )


def r_significant(value, digits=7):
    """(significant digits, decimal exponent) R needs to show `value`."""
    mantissa, exponent = f"{abs(value):.{digits - 1}e}".split("e")
    sig = len(mantissa.replace(".", "").rstrip("0")) or 1
    return sig, int(exponent) if value != 0 else 0


def r_sci_width(x, sig, exps):
    """Width of R's scientific layout: sign, mantissa, e+XX or e+XXX."""
    mantissa = max(sig) + (max(sig) > 1)  # its digits and the point
    return int((x < 0).any()) + mantissa + 4 + (max(abs(exps)) >= 100)


def r_format_column(x, digits=7):
    """The entries of x in one common layout and width, as R formats them."""
    x = check_numbers(x, "r_format_column")
    sig, exps = np.array([r_significant(v, digits) for v in x]).T
    left = max(int(v < 0) + max(e + 1, 1) for v, e in zip(x, exps))
    decimals = max(int((sig - exps - 1).max()), 0)
    if left + decimals + (decimals > 0) <= r_sci_width(x, sig, exps):
        cells = [f"{v:.{decimals}f}" for v in x]  # fixed notation
    else:
        cells = [f"{v:.{sig.max() - 1}e}" for v in x]
    width = max(len(cell) for cell in cells)
    return [cell.rjust(width) for cell in cells]  # one common width


def r_format_matrix(M, digits=7, width=80):
    """The text R's print(M) shows for a numeric matrix M without dimnames."""
    M = check_matrix(M)
    columns = []
    for j in range(M.shape[1]):  # every column gets its own layout
        cells = [f"[,{j + 1}]", *r_format_column(M[:, j], digits)]
        columns.append([cell.rjust(max(map(len, cells))) for cell in cells])
    label_width = len(str(M.shape[0] + 1)) + 3  # R: digits of nrow + 1
    labels = ["", *(f"[{i + 1},]" for i in range(M.shape[0]))]
    lines = [
        " ".join([label.rjust(label_width)] + [col[i] for col in columns])
        for i, label in enumerate(labels)
    ]
    check_width(lines, width, "matrix")
    return "\n".join(lines)


def r_format_vector(x, digits=7, width=80):
    """The text R's print(x) shows for a numeric vector that fits one line."""
    cells = r_format_column(np.atleast_1d(x), digits)
    label = "[1]".rjust(len(str(len(cells))) + 2)  # as wide as R's "[n]"
    line = " ".join([label, *cells])
    check_width([line], width, "vector")
    return line
