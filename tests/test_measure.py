"""tools/measure.py, the benchmarks' one measuring module, with a fake
clock: no real timing, so the statistics are tested exactly."""

import dataclasses
import math
import random
import statistics
import sys
import types
from pathlib import Path

import measure  # tools/, on the path by tests/conftest.py
import measure_csv
import pytest


class FakeMachine:
    """A clock that advances only when a fake program runs: each program
    draws its duration from `draw(name, rng)`, times a slowdown shared by
    every program of the same round (a busy machine)."""

    def __init__(self, draw, seed, shared_slowdown=0.0):
        self.now, self.cpu, self.rng = 0.0, 0.0, random.Random(seed)
        self.draw, self.shared = draw, shared_slowdown
        self.factor, self.calls = 1.0, 0

    def program(self, name):
        def call():
            self.calls += 1
            duration = self.draw(name, self.rng) * self.factor
            self.now += duration
            self.cpu += duration * 0.9

        return call

    def new_round(self):
        self.factor = math.exp(self.rng.gauss(0.0, self.shared))


def lognormal(median, sigma):
    return lambda rng: median * math.exp(rng.gauss(0.0, sigma))


def run(draws, rounds, seed, shared=0.0):
    """Interleaved fake timing of programs {name: draw(rng)}."""
    m = FakeMachine(lambda name, rng: draws[name](rng), seed, shared)
    names = list(draws)

    def first(call):  # the first program of a round starts a new round
        def wrapped():
            m.new_round()
            call()

        return wrapped

    calls = {n: m.program(n) for n in names}
    calls[names[0]] = first(calls[names[0]])
    timing = measure.interleave(
        calls,
        rounds,
        warmup=1,
        wall_clock=lambda: m.now,
        cpu_clock=lambda: m.cpu,
        loadavg=lambda: 0.25,
        cores=2,
    )
    return timing, m


def test_interleave_times_every_call_of_every_round():
    timing, m = run({"a": lambda r: 1.0, "b": lambda r: 2.0}, 7, seed=0)
    assert m.calls == 2 * (7 + 1)  # one warm-up each
    assert timing.wall == {"a": [1.0] * 7, "b": [2.0] * 7}
    assert timing.cpu["b"] == pytest.approx([1.8] * 7)
    assert not timing.busy and timing.load_after == 0.25


def test_busy_flag_above_half_a_core_per_core():
    t = measure.Timing(load_before=2.01, cores=2, own_threads=1)
    assert t.busy
    assert not measure.Timing(load_before=2.0, cores=2, own_threads=1).busy


def test_busy_discounts_the_benchmarks_own_threads(monkeypatch):
    """A two-thread part on an idle 2-core machine loads it by about 2: not
    busy; the same load with one thread of its own is another's work."""
    assert not measure.Timing(load_before=2.2, cores=2, own_threads=2).busy
    assert measure.Timing(load_before=2.2, cores=2, own_threads=1).busy
    timing = measure.interleave(
        {"a": lambda: None}, 1, loadavg=lambda: 2.2, cores=2, threads=2
    )
    assert timing.own_threads == 2 and not timing.busy
    fake_torch = types.SimpleNamespace(get_num_threads=lambda: 2)
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    assert measure.Timing().own_threads == 2
    timing = measure.interleave({"a": lambda: None}, 1, loadavg=lambda: 2.2)
    assert timing.own_threads == 2


def test_load_is_read_before_the_warm_up():
    """The warm-up's own threads raise the load average: the load before
    is read before it, so an idle machine is not flagged busy."""
    state = {"load": 0.3}

    def warm():  # each call adds its thread's share to the fake load
        state["load"] += 1.0

    timing = measure.interleave(
        {"a": warm},
        1,
        warmup=2,
        loadavg=lambda: state["load"],
        cores=2,
        threads=1,
    )
    assert timing.load_before == 0.3 and timing.load_after == 3.3
    assert not timing.busy


def test_median_ranks_match_the_binomial():
    k, high, coverage = measure.median_ranks(15)
    assert (k, high) == (4, 12)
    assert coverage == pytest.approx(0.96484375)
    for n in range(6, 60):
        k, high, coverage = measure.median_ranks(n)
        assert coverage >= 0.95
        # one rank further in would fall below 95 %
        if k + 1 <= n // 2:
            assert 1 - 2 * measure.binomial_cdf(k, n) < 0.95
    with pytest.raises(ValueError, match="at least 6"):
        measure.median_ranks(5)


def test_interval_contains_one_when_both_draw_alike():
    same = lognormal(0.010, 0.1)
    timing, _ = run({"a": same, "b": same}, 15, seed=3, shared=0.3)
    c = measure.paired_ratio(timing.wall["a"], timing.wall["b"])
    assert c["ratio_lo"] <= 1.0 <= c["ratio_hi"]
    assert measure.verdict(c["ratio_lo"], c["ratio_hi"]) == (
        "cannot be told apart"
    )


@pytest.mark.parametrize("shared", [0.0, 0.5])
def test_coverage_of_a_known_ratio(shared):
    """2,000 seeded draws of 15 rounds: the interval holds the true median
    ratio (1.25) at least at the stated rate minus 2 points, whatever the
    slowdown the rounds share."""
    true_ratio, hits = 1.25, 0
    for seed in range(2000):
        rng = random.Random(seed)
        a = [0.010 * math.exp(rng.gauss(0, 0.15)) for _ in range(15)]
        noise = [math.exp(rng.gauss(0, 0.15)) for _ in range(15)]
        slow = [math.exp(rng.gauss(0, shared)) for _ in range(15)]
        b = [true_ratio * x * e for x, e in zip(a, noise)]
        c = measure.paired_ratio(
            [x * s for x, s in zip(b, slow)], [x * s for x, s in zip(a, slow)]
        )
        hits += c["ratio_lo"] <= true_ratio <= c["ratio_hi"]
    assert hits / 2000 >= measure.LEVEL - 0.02


def test_a_real_difference_is_stated():
    timing, _ = run(
        {"a": lognormal(0.010, 0.05), "b": lognormal(0.015, 0.05)},
        15,
        seed=1,
    )
    c = measure.paired_ratio(timing.wall["b"], timing.wall["a"])
    assert measure.verdict(c["ratio_lo"], c["ratio_hi"]) == "above"
    assert 1.3 < c["ratio_median"] < 1.7
    assert c["rounds"] == 15 and c["interval"] == measure.INTERVAL


def test_ratios_are_taken_round_by_round():
    """Each round's slowdown hits both programs: paired, the ratio is
    exactly 2 in every round; unpaired, it would spread from 1/3 to 12."""
    slow = [1, 6, 2, 5, 3, 4]
    c = measure.paired_ratio([2 * s for s in slow], slow)
    assert c["ratio_median"] == c["ratio_lo"] == c["ratio_hi"] == 2.0


def test_t_interval_and_between_runs():
    values = [0.82, 0.79, 0.80]
    mean, low, high, df = measure.t_interval(values)
    half = 4.302652729749462 * statistics.stdev(values) / math.sqrt(3)
    assert df == 2
    assert mean == pytest.approx(statistics.fmean(values))
    assert (low, high) == pytest.approx((mean - half, mean + half))
    out = measure.between_runs(values, within=[(0.7, 0.9), (0.75, 0.8)])
    assert out["runs"] == 3 and out["min"] == 0.79 and out["max"] == 0.82
    assert out["widest_within"] == pytest.approx(0.2)


@pytest.mark.parametrize(
    "df, quantile",  # scipy.stats.t.ppf(0.975, df), scipy 1.17.1
    [
        (1, 12.706204736174694),
        (2, 4.302652729749462),
        (3, 3.1824463052837078),
        (4, 2.7764451051977934),
        (9, 2.262157162798205),
        (29, 2.045229642132703),
        (100, 1.9839715185235518),
    ],
)
def test_t_quantile_equals_scipys(df, quantile):
    assert measure.t_quantile(0.975, df) == pytest.approx(quantile, rel=1e-12)
    assert measure.t_cdf(quantile, df) == pytest.approx(0.975, rel=1e-12)


def test_verdict_below_and_on_differences():
    assert measure.verdict(1.001, 1.2) == "above"
    assert measure.verdict(0.999, 1.2) == "cannot be told apart"
    assert measure.verdict(0.7, 0.9) == "below"
    assert measure.verdict(-0.06, 0.01, null=0.0) == "cannot be told apart"
    assert measure.verdict(0.01, 0.02, null=0.0) == "above"


def test_row_joins_the_columns():
    timing = measure.Timing(load_before=0.1, load_after=0.3, cores=2)
    comparison = measure.paired_ratio([2.0] * 6, [1.0] * 6)
    out = measure.row(comparison, timing, {"threads": 1}, T=4096)
    assert out["T"] == 4096 and out["ratio_median"] == 2.0
    assert out["busy"] is False and out["load_after"] == 0.3
    assert out["threads"] == 1


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: measure.interleave({}, 5), "no program"),
        (lambda: measure.interleave({"a": int}, 0), "rounds must be"),
        (lambda: measure.paired_ratio([1.0] * 6, [1.0] * 5), "not pairs"),
        (lambda: measure.paired_ratio([1.0] * 6, [0.0] * 6), "not positive"),
        (lambda: measure.paired_ratio([1.0] * 5, [1.0] * 5), "at least 6"),
        (lambda: measure.t_interval([1.0]), "at least 2"),
        (lambda: measure.t_interval([1.0, math.nan]), "NaN"),
        (lambda: measure.median_interval([1.0] * 5 + [math.nan]), "NaN"),
        (lambda: measure.verdict(2.0, 1.0), "empty"),
        (lambda: measure.t_quantile(0.975, 1.5), "integer df"),
        (lambda: measure.t_quantile(0.975, 2.0), "integer df"),
        (lambda: measure.t_interval([1.0, math.inf, 2.0]), "infinite"),
        (lambda: measure.median_columns("s", [math.nan, 1, 2]), "NaN"),
        (lambda: measure.median_columns("s", [1.0] * 6, per=math.nan), "per"),
        (lambda: measure.median_columns("s", [1.0], per=math.inf), "per"),
        (lambda: measure.verdict(math.nan, math.nan), "NaN"),
        (lambda: measure.verdict(0.5, 2.0, null=math.nan), "NaN"),
        (lambda: measure.verdict(None, 1.0), "not numbers"),
        (lambda: measure.paired_ratio([1.0] * 6, [math.inf] * 6), "infinite"),
        (lambda: measure.paired_ratio([math.nan] * 6, [1.0] * 6), "NaN"),
    ],
)
def test_bad_input_raises_a_named_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_a_slow_program_leaves_the_rounds_after_its_budget():
    """With max_seconds, a program stops once it has min_rounds calls and
    that much wall time; the others go on to `rounds`, still in turn."""
    m = FakeMachine(lambda name, rng: {"slow": 1.0, "fast": 0.01}[name], 0)
    calls = {n: m.program(n) for n in ("slow", "fast")}
    timing = measure.interleave(
        calls,
        15,
        warmup=0,
        wall_clock=lambda: m.now,
        cpu_clock=lambda: m.cpu,
        loadavg=lambda: 0.0,
        cores=1,
        max_seconds=3.0,
        min_rounds=6,
    )
    assert len(timing.wall["slow"]) == 6  # 6 s > 3 s, but 6 calls first
    assert len(timing.wall["fast"]) == 15  # 0.15 s: never the budget
    assert timing.results == {}


def test_interleave_keeps_the_last_results_when_asked():
    values = iter(range(100))
    timing = measure.interleave(
        {"a": lambda: next(values), "b": lambda: "b"},
        3,
        warmup=1,
        keep_results=True,
        loadavg=lambda: 0.0,
    )
    assert timing.results == {"a": 3, "b": "b"}  # 0 is the warm-up's


def test_median_columns_with_and_without_an_interval():
    values = [
        float(v) for v in (9, 1, 8, 2, 7, 3, 6, 4, 5, 10, 11, 12, 13, 14, 15)
    ]
    out = measure.median_columns("cpu_s", values, per=10)
    assert out == {"cpu_s": 0.8, "cpu_s_lo": 0.4, "cpu_s_hi": 1.2}
    few = measure.median_columns("wall_s", [3.0, 1.0, 2.0])
    assert few["wall_s"] == 2.0
    assert math.isnan(few["wall_s_lo"]) and math.isnan(few["wall_s_hi"])
    with pytest.raises(ValueError, match="per must be positive"):
        measure.median_columns("x", [1.0], per=0)


def test_write_csv_replaces_or_appends_a_run(tmp_path, monkeypatch):
    import pandas as pd

    path = tmp_path / "sub" / "table.csv"
    measure_csv.write_csv([{"a": 1}], path)
    measure_csv.write_csv([{"a": 2}], path)
    assert pd.read_csv(path).to_dict("list") == {"a": [2]}
    monkeypatch.setenv("BENCH_RUN", "3")
    measure_csv.write_csv([{"a": 3}], path, run=measure_csv.run_id())
    measure_csv.write_csv([{"a": 4}], path, run="4")
    table = pd.read_csv(path)
    assert table["a"].tolist() == [2, 3, 4]
    assert table["run"].tolist()[1:] == [3, 4]
    monkeypatch.setenv("BENCH_RUN", " ")
    assert measure_csv.run_id() is None


def test_machine_names_the_processor_and_threads(monkeypatch):
    fake_torch = types.SimpleNamespace(__version__="2.x")  # no torch import
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    out = measure.machine(2)
    assert out["torch"] == "2.x"
    assert out["threads"] == 2 and out["cores"] >= 1
    assert out["machine"] == f"{out['cpu']}, {out['cores']} cores"
    assert len(out["date"]) == 10 and out["date"][4] == "-"


def test_ratio_columns_without_an_interval_below_six_rounds():
    out = measure.ratio_columns([2.0, 4.0, 9.0], [1.0, 1.0, 1.0])
    assert out["ratio_median"] == 4.0 and out["rounds"] == 3
    assert math.isnan(out["ratio_lo"]) and math.isnan(out["ratio_hi"])
    full = measure.ratio_columns([2.0] * 6, [1.0] * 6)
    assert full == measure.paired_ratio([2.0] * 6, [1.0] * 6)


def test_ratio_columns_takes_numpy_arrays_below_six_rounds():
    """An array times 6 multiplies its values; the rounds are repeated."""
    import numpy as np

    out = measure.ratio_columns(np.array([2.0, 4.0, 9.0]), np.ones(3))
    assert out["ratio_median"] == 4.0 and out["rounds"] == 3
    assert math.isnan(out["ratio_lo"])
    full = measure.ratio_columns(np.full(6, 2.0), np.ones(6))
    assert full["ratio_median"] == 2.0 and full["rounds"] == 6


def test_interval_only_keeps_the_bounds():
    columns = measure.median_columns("cpu_s", [float(v) for v in range(1, 8)])
    assert measure.interval_only(columns) == {"cpu_s_lo": 1.0, "cpu_s_hi": 7.0}


def test_quick_or_full_reads_the_command_line(tmp_path):
    @dataclasses.dataclass(frozen=True)
    class Config:
        size: int = 512
        csv: Path = Path("book/data/x.csv")

    full, quick = Config(), Config(size=8)
    assert measure_csv.quick_or_full("d", full, quick, []) == full
    out = measure_csv.quick_or_full(
        "d", full, quick, ["--quick", "--csv", "a.csv"]
    )
    assert out == Config(8, Path("a.csv"))


def test_stopwatch_counts_wall_and_cpu_seconds_of_its_block(monkeypatch):
    """A training is timed once: the wall and CPU seconds between entering
    and leaving the block, each from its own clock."""
    wall, cpu = iter([10.0, 12.5]), iter([3.0, 4.25])
    monkeypatch.setattr(measure.time, "perf_counter", lambda: next(wall))
    monkeypatch.setattr(measure.time, "process_time", lambda: next(cpu))
    with measure.Stopwatch() as clock:
        pass
    assert (clock.wall, clock.cpu) == (2.5, 1.25)
