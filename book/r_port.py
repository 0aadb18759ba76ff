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

import math
from fractions import Fraction

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
    state = check_seed(seed) % 2**32  # a negative seed wraps around
    for _ in range(50):  # initial scrambling
        state = (69069 * state + 1) % 2**32
    words = []
    for _ in range(625):  # a position counter, then 624 state words
        state = (69069 * state + 1) % 2**32
        words.append(state)
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


def check_count(n):
    """n as an int, if it is a count of draws."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    return int(n)


def check_generator(generator):
    """Refuse a generator that R's draws cannot come from."""
    if not isinstance(generator, np.random.MT19937):
        raise ValueError(
            "R's draws come from an np.random.MT19937 bit generator "
            f"(r_set_seed makes one), got {type(generator).__name__}"
        )


def r_unif_rand(generator, n):
    """n uniform numbers in (0, 1), drawn as R's unif_rand() draws them."""
    check_generator(generator)
    y = generator.random_raw(check_count(n))  # 32-bit words
    u = y * 2.3283064365386963e-10  # y / 2^32
    u[u <= 0.0] = 0.5 * 2.328306437080797e-10  # R keeps u > 0
    return u


def check_runif(generator, n, min, max):
    """(min, max) as the doubles R holds, if R's runif(n, min, max) takes
    them: refuse what R refuses or would return NaN for."""
    check_generator(generator)
    check_count(n)
    bounds = []
    for name, value in (("min", min), ("max", max)):
        if isinstance(value, bool) or not isinstance(
            value, (int, float, np.integer, np.floating)
        ):
            raise ValueError(f"{name} must be a real number, got {value!r}")
        try:
            bounds.append(float(value))  # R's arguments are doubles
        except OverflowError:  # an int beyond the largest double
            raise ValueError(
                f"runif needs finite min <= max, got {name} beyond the "
                f"largest double ({len(str(value))} digits)"
            ) from None
    min, max = bounds
    if not (math.isfinite(min) and math.isfinite(max)) or min > max:
        raise ValueError(
            f"runif needs finite min <= max, got min={min}, max={max}"
        )
    return min, max


def r_runif(generator, n, min=0.0, max=1.0):
    """R's runif(n, min, max), drawing from `generator`."""
    min, max = check_runif(generator, n, min, max)
    if min == max:
        return np.full(n, min)  # R returns min and draws nothing
    return min + (max - min) * r_unif_rand(generator, n)


def check_numbers(x, name):
    """x as a non-empty 1-D float array of finite numbers, -0.0 made 0.0."""
    x = check_real_array(x, name)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(
            f"{name} needs a non-empty 1-D array, got shape {x.shape}"
        )
    return x


MAX_PRINT = 99999  # R's default getOption("max.print")


def check_matrix(M):
    """M as a non-empty 2-D float array of finite numbers, -0.0 made 0.0,
    with no more entries than R's print shows."""
    M = check_real_array(M, "r_format_matrix")
    if M.ndim != 2 or 0 in M.shape:
        raise ValueError(
            f"r_format_matrix needs a non-empty 2-D array, got shape {M.shape}"
        )
    # printMatrix prints max.print // ncol rows, then "[ reached
    # getOption("max.print") -- omitted ... rows ]"; a one-line vector is
    # far shorter (printVector omits entries beyond max.print + 1 only)
    if M.size > MAX_PRINT:
        raise ValueError(
            f"r_format_matrix: {M.size} entries, more than R's max.print "
            f"({MAX_PRINT}); R would omit rows, which this formatter does not"
        )
    return M


def check_real_array(x, name):
    """x as a float array, if R would hold exactly these finite doubles."""
    try:
        x = np.ma.asarray(x)  # a masked array, even in a list, keeps its mask
    except ValueError as error:  # rows of different lengths
        raise ValueError(
            f"{name} needs a rectangular array: {error}"
        ) from None
    if x.dtype.kind not in "iuf" or x.dtype.itemsize > 8:
        raise ValueError(
            f"{name} prints real numbers (an integer or float array of at "
            f"most 64 bits), got dtype {x.dtype}"
        )
    masked = int(np.ma.getmaskarray(x).sum())
    if masked:  # np.asarray would print the hidden values
        raise ValueError(
            f"{name} got a masked array with {masked} masked "
            f"entr{'y' if masked == 1 else 'ies'}: R prints NA for a "
            "missing value, which this port does not"
        )
    x = np.asarray(np.ma.getdata(x))
    doubles = x.astype(float)
    if (
        x.dtype.kind in "iu"
        and (doubles.astype(object) != x.astype(object)).any()
    ):
        raise ValueError(
            f"{name}: an integer beyond 2^53 here is not exactly a double; "
            "R would round it"
        )
    x = doubles
    if not np.isfinite(x).all():
        raise ValueError(
            f"{name} needs finite numbers: R prints NA, NaN and Inf, "
            "which this port does not"
        )
    return x + 0.0  # -0.0 becomes 0.0: R prints no "-0"


def check_digits(digits):
    """digits as an int, if R's long-double path formats with it."""
    if isinstance(digits, bool) or not isinstance(digits, (int, np.integer)):
        raise ValueError(f"digits must be an integer, got {digits!r}")
    if not 1 <= digits <= 15:
        raise ValueError(
            "digits must be from 1 to 15 (R allows up to 22, but formats "
            f"digits >= 16 another way, not ported), got {digits}"
        )
    return int(digits)


def check_width(lines, width, what):
    """Refuse text R would wrap, which we do not: a vector wider than
    `width` (printVector: a line may be `width` wide), a matrix `width`
    wide or wider (printMatrix adds a column to a block of columns only
    while the line stays under `width`)."""
    if isinstance(width, bool) or not isinstance(width, (int, np.integer)):
        raise ValueError(f"width must be an integer, got {width!r}")
    if not 10 <= width <= 10000:
        raise ValueError(f"R's width is from 10 to 10000, got {width}")
    if (
        not isinstance(lines, (list, tuple))
        or not lines
        or not all(isinstance(line, str) for line in lines)
    ):
        raise ValueError(
            "check_width needs a non-empty list of lines, each a str"
        )
    if what not in ("vector", "matrix"):
        raise ValueError(
            f"check_width checks a vector or a matrix, not {what}"
        )
    limit = width - 1 if what == "matrix" else width  # a matrix stays under
    widest = max(len(line) for line in lines)
    if widest > limit:
        size = (
            f"wider than {width} characters"
            if widest > width
            else f"{width} characters wide, and R keeps a matrix's lines "
            f"under {width}"
        )
        raise ValueError(
            f"the {what} is {size}; R would wrap it, which this formatter "
            "does not do"
        )


def long_double(q):
    """The exact fraction q rounded to 64 significant bits, ties to even:
    C's long double on x86-64, the x87's 80-bit format, in which R scales a
    number to its digits. R built with another long double (113 bits on
    aarch64 Linux) may round some ties otherwise."""
    if isinstance(q, bool) or not isinstance(
        q, (int, float, Fraction, np.integer, np.floating)
    ):
        raise ValueError(f"long_double needs a real number, got {q!r}")
    if isinstance(q, (float, np.floating)):
        if not np.isfinite(q):
            raise ValueError(f"long_double needs a finite number, got {q!r}")
        q = Fraction(*q.as_integer_ratio())  # exact: float16 to longdouble
    q = Fraction(q)
    if q == 0:
        return q
    e = q.numerator.bit_length() - q.denominator.bit_length()
    e -= abs(q) < Fraction(2) ** e  # now 2^e <= |q| < 2^(e + 1)
    unit = Fraction(2) ** (e - 63)
    return round(q / unit) * unit  # round() takes a tie to even


def r_power_of_ten(k):
    """tbl[k] of R's format.c, 0 <= k <= 27: the literal 1e<k>, a double
    stored as a long double, so 10^k exactly up to 10^22 and from 10^23 on
    the double nearest 10^k (1e23 is 10^23 - 8388608)."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise ValueError(f"the power must be an integer, got {k!r}")
    if not 0 <= k <= 27:
        raise ValueError(f"R's table holds 10^0 to 10^27, got 10^{k}")
    return Fraction(float(10 ** int(k)))


def r_significant(value, digits=7):
    """(significant digits, decimal exponent, widens) R finds for `value`:
    scientific() in R's src/main/format.c, long doubles included."""
    digits = check_digits(digits)
    value = check_real_array(value, "r_significant")
    if value.ndim != 0:
        raise ValueError(
            f"r_significant takes one number, got shape {value.shape}"
        )
    r = abs(float(value))
    if r == 0:
        return 1, 0, False
    kp = math.floor(math.log10(r)) - digits + 1  # 10^(kp+digits-1) <= r
    tabled = abs(kp) <= 27  # R scales by its table tbl[|kp|], else by powl
    power = r_power_of_ten(abs(kp)) if tabled else Fraction(10) ** abs(kp)
    scaled = Fraction(r) / power if kp > 0 else Fraction(r) * power
    alpha = long_double(scaled) if tabled else scaled
    if alpha < 10 ** (digits - 1):  # log10 rounded up: one digit short
        alpha = long_double(10 * alpha) if tabled else 10 * alpha
        kp -= 1
    # powl's last bit is not modelled: near a tie, try both roundings
    unsure = not tabled and abs(alpha % 1 - Fraction(1, 2)) < alpha / 2**60
    found = set()
    for a in {math.floor(alpha), math.ceil(alpha)} if unsure else {alpha}:
        a, sig = round(a), digits  # round(): ties to even, as R's
        while sig > 0 and a % 10 == 0:  # drop trailing zeros
            a, sig = a // 10, sig - 1
        # sig == 0: rounded up to a power of 10, one digit more on the left
        found.add((max(sig, 1), kp + digits - 1 + (sig == 0)))
    if len(found) > 1:
        raise ValueError(
            f"{float(value)!r} is within R's powl error of a tie at "
            f"{digits} digits: which way R rounds it is not ported"
        )
    ((sig, exponent),) = found
    # R: does the fixed layout keep one digit fewer than the rounding?
    fuzz = 0.5 / float(r_power_of_ten(min(max(digits - exponent, 0), 27)))
    widens = 0 < exponent <= 27 and r < long_double(
        r_power_of_ten(exponent) - Fraction(fuzz)
    )
    return sig, exponent, bool(widens)


def r_layout(x, digits=7):
    """(width, decimals, scientific): R's formatReal() for the entries of x."""
    x = check_numbers(x, "r_layout")
    sig, exps, widens = zip(*(r_significant(v, digits) for v in x))
    left = [e + 1 - w for e, w in zip(exps, widens)]  # digits before "."
    neg = int((x < 0).any())
    fixed_left = max(int(v < 0) + max(n, 1) for v, n in zip(x, left))
    decimals = max(max(s - n for s, n in zip(sig, left)), 0)
    fixed = fixed_left + decimals + (decimals > 0)  # R's width wF
    mantissa = max(sig) - 1  # decimals in scientific notation
    exp_digits = 3 if max(left) > 100 or min(left) <= -99 else 2
    sci = neg + (mantissa > 0) + mantissa + 3 + exp_digits  # d.ddde+XX
    if fixed <= sci:  # a tie goes to fixed notation (R's scipen = 0)
        return fixed, decimals, False
    return sci, mantissa, True


def r_format_column(x, digits=7):
    """The entries of x in one common layout and width, as R prints them."""
    x = check_numbers(x, "r_format_column")
    width, decimals, scientific = r_layout(x, digits)
    kind = "e" if scientific else "f"  # C's %*.*e or %*.*f, as R's
    return [f"{v:{width}.{decimals}{kind}}" for v in x]


def r_format_matrix(M, digits=7, width=80):
    """The text R's print(M) shows for a numeric matrix M without dimnames."""
    M = check_matrix(M)
    columns = []
    for j in range(M.shape[1]):  # every column gets its own layout
        cells = [f"[,{j + 1}]", *r_format_column(M[:, j], digits)]
        cell_width = max(map(len, cells))  # once per column, not per cell
        columns.append([cell.rjust(cell_width) for cell in cells])
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
    x = check_numbers(np.atleast_1d(x), "r_format_vector")
    cells = r_format_column(x, digits)
    label = "[1]".rjust(len(str(len(cells))) + 2)  # as wide as R's "[n]"
    line = " ".join([label, *cells])
    check_width([line], width, "vector")
    return line
