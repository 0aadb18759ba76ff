"""The one measuring module of the book's benchmarks (issue 46).

Timing. `interleave` calls every program once per round, in the same order
each round (A, B, A, B, ...), after untimed warm-up calls, and records the
wall time (`time.perf_counter`) and the CPU time of the process
(`time.process_time`, all its threads) of every call. A machine that slows
down for a while slows the programs of the same rounds alike, so the
comparison is made round by round.

Comparison. `paired_ratio` takes the per-round times of two programs (a
paired sample), forms one ratio per round and reports its median with a
distribution-free 95 % confidence interval for the median: the
ORDER-STATISTIC interval. Sorted, the n ratios r_(1) <= ... <= r_(n) give
the interval [r_(k), r_(n+1-k)], with k the largest integer such that
P(Binomial(n, 1/2) <= k - 1) <= 2.5 %; its coverage is at least 95 % for
any continuous distribution of independent rounds (it is 96.5 % for
n = 15: k = 4). No bootstrap: with 15 rounds a bootstrap's percentiles
under-cover, and the order-statistic interval assumes nothing of the shape.
At least 6 rounds are needed (with 5, even [r_(1), r_(5)] covers only
93.75 %).

Repeats. A claim that compares numbers from different runs (two tables,
two sessions) uses `between_runs`: the t interval of the mean of the runs'
values (n - 1 degrees of freedom), beside the spread within each run.
`t_interval` serves paired differences of any kind (losses at matched seeds).

The rule. `verdict` states a difference only when the interval excludes no
difference (a ratio of 1, a difference of 0); otherwise the two cannot be
told apart on this machine.

The machine. `machine` describes the processor, cores, torch version and
threads; `Timing` carries the one-minute load average before and after the
timed rounds, and `busy` flags a run that started on a loaded machine: the
load, read before the warm-up, less the math threads the benchmark itself
runs (`own_threads`: torch's thread count where torch is loaded, else 1;
the process's own threads count in the load average), above
`BUSY_PER_CORE` (0.5) per core. A two-thread part on an idle 2-core
machine is thus not busy. `row` joins all of it into one CSV row;
`median_columns` gives a time's median with its interval (empty below 6
rounds). Writing the tables and reading a benchmark's command line:
tools/measure_csv.py.
"""

import math
import numbers
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

LEVEL = 0.95
BUSY_PER_CORE = 0.5
INTERVAL = "order statistic, 95 %"


def cpu_model():
    """The processor's model name (from /proc/cpuinfo), or what platform
    knows of it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(threads):
    """The columns that describe the machine of a run, and its date."""
    import datetime

    import torch  # imported here: the statistics need no torch

    cpu, cores = cpu_model(), os.cpu_count()
    return {
        "machine": f"{cpu}, {cores} cores",
        "cpu": cpu,
        "cores": cores,
        "torch": torch.__version__,
        "threads": threads,
        "date": datetime.date.today().isoformat(),
    }


class Stopwatch:
    """Wall and CPU seconds of one block of code that runs once (a
    training), not in rounds: ``with Stopwatch() as clock: ...``, then
    ``clock.wall`` and ``clock.cpu`` (the process's CPU time, all its
    threads; `time.process_time`)."""

    def __enter__(self):
        self.wall, self.cpu = -time.perf_counter(), -time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall += time.perf_counter()
        self.cpu += time.process_time()
        return False


def load_average():
    """The one-minute load average (0.0 where the system has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def running_threads():
    """The math threads this process runs: torch's count where torch is
    loaded (benchmarks set it), else 1."""
    torch = sys.modules.get("torch")
    return getattr(torch, "get_num_threads", lambda: 1)()


@dataclass
class Timing:
    """Per-call seconds of interleaved programs, and the load around them."""

    wall: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)
    results: dict[str, object] = field(default_factory=dict)
    load_before: float = 0.0
    load_after: float = 0.0
    cores: int = 1
    own_threads: int = field(default_factory=running_threads)

    @property
    def busy(self):
        """True when the machine was loaded, besides the benchmark's own
        threads, before the warm-up."""
        others = self.load_before - self.own_threads
        return others > BUSY_PER_CORE * self.cores


def interleave(
    calls: dict[str, Callable[[], object]],
    rounds: int,
    warmup: int = 1,
    wall_clock: Callable[[], float] = time.perf_counter,
    cpu_clock: Callable[[], float] = time.process_time,
    loadavg: Callable[[], float] = load_average,
    cores: int | None = None,
    max_seconds: float | None = None,
    min_rounds: int = 6,
    keep_results: bool = False,
    threads: int | None = None,
) -> Timing:
    """Time `calls` (name -> function of no argument) for `rounds` rounds,
    each program once per round in the order given, after `warmup` untimed
    calls of each. With `max_seconds`, a program leaves the rounds once it
    has `min_rounds` calls and has spent `max_seconds` of wall time (slow
    programs get fewer calls; the others go on, still in turn). With
    `keep_results`, `Timing.results` holds each program's last result. The
    load is read before the warm-up; `threads` (default: `running_threads`)
    are the benchmark's own, which `Timing.busy` discounts. The clocks and
    the load are arguments so that a test can pass fake ones."""
    if not calls:
        raise ValueError("interleave: no program to time")
    if rounds < 1 or warmup < 0:
        raise ValueError(
            f"interleave: rounds must be >= 1 and warmup >= 0, "
            f"got rounds={rounds}, warmup={warmup}"
        )
    load_before = loadavg()  # before the warm-up's threads raise it
    for _ in range(warmup):
        for call in calls.values():
            call()
    timing = Timing(
        wall={name: [] for name in calls},
        cpu={name: [] for name in calls},
        load_before=load_before,
        cores=cores or os.cpu_count() or 1,
        own_threads=running_threads() if threads is None else threads,
    )
    active = list(calls)
    while active:
        for name in list(active):
            wall0, cpu0 = wall_clock(), cpu_clock()
            result = calls[name]()
            cpu1, wall1 = cpu_clock(), wall_clock()
            timing.wall[name].append(wall1 - wall0)
            timing.cpu[name].append(cpu1 - cpu0)
            if keep_results:
                timing.results[name] = result
            n = len(timing.wall[name])
            if n >= rounds or (
                max_seconds is not None
                and n >= min_rounds
                and sum(timing.wall[name]) >= max_seconds
            ):
                active.remove(name)
    timing.load_after = loadavg()
    return timing


def binomial_cdf(k, n):
    """P(Binomial(n, 1/2) <= k)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2**n


def median_ranks(n, level=LEVEL):
    """1-based ranks (k, n + 1 - k) of the order-statistic interval of the
    median of n draws, and its exact coverage."""
    tail = (1 - level) / 2
    k = 0
    while k + 1 <= n // 2 and binomial_cdf(k, n) <= tail:
        k += 1
    if k == 0:
        raise ValueError(
            f"{n} rounds give no {level:.0%} interval for a median: "
            f"at least 6 are needed"
        )
    return k, n + 1 - k, 1 - 2 * binomial_cdf(k - 1, n)


def check_finite(where, values):
    """A ValueError naming `where` if a value is NaN or infinite."""
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"{where}: a value is NaN or infinite: {values}")


def median_interval(values, level=LEVEL):
    """(median, low, high) of the values: the order-statistic interval."""
    check_finite("median_interval", values)
    values = sorted(values)
    low, high, _ = median_ranks(len(values), level)
    return statistics.median(values), values[low - 1], values[high - 1]


def median_columns(name, values, per=1.0, level=LEVEL):
    """{name: median, name_lo: low, name_hi: high} of values / per (per:
    calls in one timed block); low and high are NaN below 6 values, where
    no order-statistic interval exists."""
    if not 0 < per < math.inf:
        raise ValueError(f"median_columns: per must be positive, got {per}")
    check_finite("median_columns", values)
    values = [v / per for v in values]
    if len(values) >= 6:
        median, low, high = median_interval(values, level)
    else:
        median, low, high = statistics.median(values), math.nan, math.nan
    return {name: median, f"{name}_lo": low, f"{name}_hi": high}


def interval_only(columns):
    """The _lo and _hi columns of `median_columns` (for a row that writes
    its medians rounded)."""
    return {k: v for k, v in columns.items() if k.endswith(("_lo", "_hi"))}


def paired_ratio(numerator, denominator, level=LEVEL):
    """The per-round ratios numerator_i / denominator_i of a paired sample
    (for instance SDPA's time over ours: above 1, ours is faster): a dict
    with their median, the order-statistic interval and the rounds."""
    if len(numerator) != len(denominator):
        raise ValueError(
            f"paired_ratio: {len(numerator)} and {len(denominator)} "
            f"times are not pairs"
        )
    check_finite("paired_ratio", [*numerator, *denominator])
    if any(t <= 0 for t in (*numerator, *denominator)):
        raise ValueError("paired_ratio: a time is not positive")
    ratios = [a / b for a, b in zip(numerator, denominator)]
    median, low, high = median_interval(ratios, level)
    return {
        "ratio_median": median,
        "ratio_lo": low,
        "ratio_hi": high,
        "rounds": len(ratios),
        "interval": INTERVAL,
    }


def ratio_columns(numerator, denominator, level=LEVEL):
    """`paired_ratio`'s columns; below 6 rounds (a quick run) the median
    alone, its interval NaN. Lists or NumPy arrays."""
    numerator, denominator = list(numerator), list(denominator)
    if len(numerator) >= 6:
        return paired_ratio(numerator, denominator, level)
    out = paired_ratio(numerator * 6, denominator * 6, level)
    return out | {
        "ratio_lo": math.nan,
        "ratio_hi": math.nan,
        "rounds": len(numerator),
        "interval": "none: fewer than 6 rounds",
    }


def t_cdf(t, df):
    """P(T <= t) for Student's t with an integer number of degrees of
    freedom, in closed form (Abramowitz and Stegun 26.7.3 and 26.7.4)."""
    theta = math.atan(t / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2:  # odd: 2/pi (theta + sin cos (1 + 2/3 cos^2 + ...))
        term, total = 1.0, 1.0 if df > 1 else 0.0
        for j in range(3, df - 1, 2):
            term *= c2 * (j - 1) / j
            total += term
        inside = theta + (s * math.cos(theta) * total if df > 1 else 0.0)
        a = 2 / math.pi * inside
    else:  # even: sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...)
        term, total = 1.0, 1.0
        for j in range(2, df - 1, 2):
            term *= c2 * (j - 1) / j
            total += term
        a = s * total
    return (1 + a) / 2


def t_quantile(p, df):
    """Student's t quantile, by bisection on `t_cdf` (no scipy: importing
    it costs seconds)."""
    if not 0 < p < 1 or not isinstance(df, int) or df < 1:
        raise ValueError(
            f"t_quantile: need 0 < p < 1, integer df >= 1; got p={p}, df={df}"
        )
    low, high = -1e6, 1e6
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if t_cdf(mid, df) < p else (low, mid)
    return (low + high) / 2


def t_interval(values, level=LEVEL):
    """(mean, low, high, degrees of freedom) of the mean of independent
    values (for instance paired differences at matched seeds), from
    Student's t with n - 1 degrees of freedom."""
    n = len(values)
    if n < 2:
        raise ValueError(f"t_interval: {n} value(s); at least 2 are needed")
    check_finite("t_interval", values)
    mean = statistics.fmean(values)
    half = t_quantile(1 - (1 - level) / 2, n - 1) * (
        statistics.stdev(values) / math.sqrt(n)
    )
    return mean, mean - half, mean + half, n - 1


def between_runs(run_values, within=None, level=LEVEL):
    """The spread between independent runs (separate processes, different
    times) of one figure: the mean of the runs' values with its t interval,
    their range, and (if given) the widest interval within one run."""
    mean, low, high, df = t_interval(run_values, level)
    out = {
        "runs": len(run_values),
        "mean": mean,
        "lo": low,
        "hi": high,
        "df": df,
        "min": min(run_values),
        "max": max(run_values),
    }
    if within is not None:
        out["widest_within"] = max(hi - lo for lo, hi in within)
    return out


def verdict(low, high, null=1.0):
    """'above', 'below', or 'cannot be told apart': where the interval
    [low, high] lies with respect to no difference (`null`)."""
    if not all(isinstance(v, numbers.Real) for v in (low, high, null)):
        raise ValueError(f"verdict: [{low}, {high}], null {null}: not numbers")
    if any(math.isnan(v) for v in (low, high, null)):
        raise ValueError(f"verdict: NaN in [{low}, {high}] or null {null}")
    if low > high:
        raise ValueError(f"verdict: interval [{low}, {high}] is empty")
    if low > null:
        return "above"
    if high < null:
        return "below"
    return "cannot be told apart"


def row(comparison, timing, machine_columns, **columns):
    """One CSV row: the caller's columns, the comparison (median and
    interval), the load before and after, and the machine."""
    return (
        columns
        | comparison
        | {
            "load_before": round(timing.load_before, 2),
            "load_after": round(timing.load_after, 2),
            "busy": timing.busy,
        }
        | machine_columns
    )
