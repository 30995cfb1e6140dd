"""experiments/stats.py: the report's intervals and p-values against tables, hand-computed
values, and their coverage on simulated comparisons with a known mean."""

import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))

import stats  # noqa: E402


@pytest.mark.parametrize("df, expected", [(1, 12.7062047), (2, 4.3026527), (3, 3.1824463), (4, 2.7764451),
                                          (5, 2.5705818), (10, 2.2281389), (30, 2.0422725)])
def test_t_quantile_matches_the_table(df, expected):
    assert stats.t_quantile(0.975, df) == pytest.approx(expected, abs=1e-6)


def test_t_quantile_other_levels_and_the_normal_limit():
    assert stats.t_quantile(0.95, 4) == pytest.approx(2.1318468, abs=1e-6)
    assert stats.t_quantile(0.995, 2) == pytest.approx(9.9248432, abs=1e-6)
    assert stats.t_quantile(0.975, 100_000) == pytest.approx(1.959964, abs=1e-4)
    with pytest.raises(ValueError):
        stats.t_quantile(0.4, 3)


def test_t_interval_by_hand_and_three_seeds_are_not_min_max():
    mean, lo, hi = stats.t_interval([0.0, 0.1, 0.3])
    sd = math.sqrt(((0 - 0.4 / 3) ** 2 + (0.1 - 0.4 / 3) ** 2 + (0.3 - 0.4 / 3) ** 2) / 2)
    half = 4.3026527 * sd / math.sqrt(3)
    assert mean == pytest.approx(0.4 / 3) and (lo, hi) == (pytest.approx(mean - half), pytest.approx(mean + half))
    assert lo < 0.0 and hi > 0.3  # wider than [min, max], which is what a 3-value bootstrap returns
    with pytest.raises(ValueError):
        stats.t_interval([0.1])


def test_sign_flip_p_by_enumeration():
    assert stats.sign_flip_p([1, 2, 3, 4, 5]) == pytest.approx(2 / 32)  # only all + and all - reach |mean| 3
    assert stats.sign_flip_p([1, -1, 1, -1, 1]) == 1.0  # every pattern's |sum| is odd, so >= 1
    # [3, 1, -1] (observed sum 3): the 8 patterns' |sums| are 3, 5, 1, 3, 3, 1, 5, 3 -> 6 of 8 reach 3
    assert stats.sign_flip_p([3, 1, -1]) == pytest.approx(6 / 8)
    assert stats.sign_flip_p([0.0, 0.0, 0.0, 0.0, 0.0]) == 1.0


def test_hierarchical_bootstrap_properties():
    a = np.full((5, 40), 0.3)
    assert stats.hierarchical_bootstrap(a, a - 0.1)[1:] == (pytest.approx(0.1), pytest.approx(0.1))  # constant
    rng = np.random.default_rng(1)
    a, b = rng.random((3, 40)), rng.random((3, 40))
    mean, lo, hi = stats.hierarchical_bootstrap(a, b)
    assert mean == pytest.approx((a - b).mean()) and lo < mean < hi
    per_seed = (a - b).mean(axis=1)
    assert (lo, hi) != (pytest.approx(per_seed.min()), pytest.approx(per_seed.max()))
    assert stats.hierarchical_bootstrap(a, b) == stats.hierarchical_bootstrap(a, b)  # seeded
    # pairing: the same problem indices for both arms, so a shared problem effect cancels
    shared = rng.normal(0, 1, 40)
    narrow = stats.hierarchical_bootstrap(a + shared, b + shared)
    assert narrow[2] - narrow[1] == pytest.approx(hi - lo, rel=1e-9)


def test_hierarchical_bootstrap_draws_one_problem_sample_for_all_seeds():
    """Problems are drawn once per resample and shared by every seed: with differences that are a
    problem effect alone (the same in every seed), the interval is the one-sample interval over
    problems (half-width 1.96 sd / sqrt(problems)), not sqrt(seeds) narrower as independent
    problem draws per seed would make it."""
    effect = np.random.default_rng(2).normal(0, 1, 40)
    d = np.tile(effect, (5, 1))
    mean, lo, hi = stats.hierarchical_bootstrap(d, np.zeros_like(d), n=20_000)
    assert (hi - lo) / 2 == pytest.approx(1.96 * effect.std() / math.sqrt(40), rel=0.06)


def test_t_interval_covers_95_percent_of_simulated_comparisons():
    """5 seeds, known mean: the coverage is 0.95 up to simulation error (2,000 runs: sd 0.005)."""
    coverage = stats.simulate_coverage(5, sims=2000, boot=200)
    assert 0.93 <= coverage["t"] <= 0.97


def test_hierarchical_bootstrap_covers_with_many_seeds():
    """The percentile bootstrap is asymptotic: with 20 seeds its coverage nears 0.95."""
    coverage = stats.simulate_coverage(20, sims=600, boot=500)
    assert 0.91 <= coverage["bootstrap"] <= 0.98


def test_t_interval_undercovers_when_one_seed_in_five_learns():
    """Lopsided seed effects (+0.15 with probability 0.2, else 0): with 5 seeds, none learns with
    probability 0.8^5 = 0.33, and then the interval sits around 0.05, well below the truth 0.08,
    so coverage is near 1 - 0.33 = 0.67, far from 0.95 (1,000 runs: sd 0.015); with 20 seeds a
    learner is almost always drawn (0.8^20 = 0.01) and coverage returns towards 0.95."""
    effects = {"seed_sd": 0.005, "problem_sd": 0.02, "learn_p": 0.2, "learn_effect": 0.15}
    five = stats.simulate_coverage(5, sims=1000, boot=0, **effects)["t"]
    twenty = stats.simulate_coverage(20, sims=1000, boot=0, **effects)["t"]
    assert 0.6 <= five <= 0.8 and 0.9 <= twenty <= 0.97


# ----------------------------------------------------------------------------- the confirmatory study's tests

# Barnard's test, two-sided, pooled score statistic: tables (x1 of n1, x2 of n2) and the values R's
# Barnard package (barnard.test, nuisance resolution 1e-6) gives for them, as published with
# SciPy's test suite (scipy/stats/tests/test_hypotests.py, TestBarnardExact.test_precise).
R_BARNARD = [((43, 53, 40, 79), 3.555406779643, 0.000362832367), ((100, 1100, 2, 7), -1.776382925679, 0.135126970878),
             ((2, 10, 7, 9), -2.518474945157, 0.019210815430), ((5, 15, 1, 11), 1.449486150679, 0.156277546306),
             ((5, 25, 15, 35), -1.851640199545, 0.066363501421), ((5, 25, 16, 41), -1.609639949352, 0.116984852192),
             ((10, 20, 5, 6), -1.449486150679, 0.177536588915), ((5, 6, 0, 4), 2.581988897472, 0.013671875000),
             ((0, 3, 1, 3), -1.095445115010, 0.509667991877), ((0, 6, 2, 6), -1.549193338483, 0.197019618792)]


@pytest.mark.parametrize("table, statistic, p", R_BARNARD)
def test_barnard_matches_published_values(table, statistic, p):
    z, got = stats.barnard(*table)
    assert z == pytest.approx(statistic, rel=1e-9)
    assert got == pytest.approx(p, rel=1e-6)


def test_barnard_properties():
    assert stats.barnard(3, 10, 3, 10)[1] == pytest.approx(1.0)  # equal proportions: nothing is more extreme
    assert stats.barnard(0, 5, 0, 5) == (0.0, 1.0)
    # symmetric in the arms; all of one arm against none of the other is the most extreme table
    assert stats.barnard(4, 12, 0, 10)[1] == pytest.approx(stats.barnard(0, 10, 4, 12)[1])
    z, p = stats.barnard(6, 6, 0, 6)
    # only (6, 0) and (0, 6) reach |z|; P = 2 pi^6 (1 - pi)^6, largest at pi = 1/2: 2 / 4^6
    assert p == pytest.approx(2 / 4 ** 6)
    # more learners against the same control: never a larger p
    ps = [stats.barnard(x, 12, 0, 16)[1] for x in range(13)]
    assert all(b <= a + 1e-12 for a, b in zip(ps, ps[1:]))
    with pytest.raises(ValueError):
        stats.barnard(5, 4, 0, 4)


def test_holm_by_hand():
    # sorted 0.005, 0.01, 0.03, 0.04 -> x4, x3, x2, x1: 0.02, 0.03, 0.06, 0.04 -> running max 0.06
    assert stats.holm([0.01, 0.04, 0.03, 0.005]) == [pytest.approx(v) for v in (0.03, 0.06, 0.06, 0.02)]
    assert stats.holm([0.5, 0.9]) == [pytest.approx(1.0), pytest.approx(1.0)]  # capped at 1
    assert stats.holm([0.02, None, 0.04]) == [pytest.approx(0.04), None, pytest.approx(0.04)]  # None not counted
    rng = np.random.default_rng(0)
    for _ in range(50):  # never below the raw p, never above Bonferroni
        p = list(rng.random(4))
        for raw, adj in zip(p, stats.holm(p)):
            assert raw - 1e-15 <= adj <= min(1.0, 4 * raw) + 1e-15


def test_welch_on_the_textbook_example():
    # Welch's t-test, the worked example of its Wikipedia article (two samples of 15): t = -2.46,
    # Welch-Satterthwaite df 24.99, p 0.021; here df is rounded down to 24 (p a little larger)
    a1 = [27.5, 21.0, 19.0, 23.6, 17.0, 17.9, 16.9, 20.1, 21.9, 22.6, 23.1, 19.6, 19.0, 21.7, 21.4]
    a2 = [27.1, 22.0, 20.8, 23.4, 23.4, 23.5, 25.8, 22.0, 24.8, 20.2, 21.9, 22.1, 22.9, 20.5, 24.4]
    w = stats.welch(a1, a2)
    assert w["df"] == 24 and w["mean"] == pytest.approx(np.mean(a1) - np.mean(a2))
    se = math.sqrt(np.var(a1, ddof=1) / 15 + np.var(a2, ddof=1) / 15)
    assert w["mean"] / se == pytest.approx(-2.4554, abs=1e-4)
    assert 0.021 < w["p"] < 0.0225
    half = stats.t_quantile(0.975, 24) * se
    assert (w["low"], w["high"]) == (pytest.approx(w["mean"] - half), pytest.approx(w["mean"] + half))


def test_welch_equal_sizes_and_variances_is_the_pooled_t():
    a, b = [1.0, 2.0, 3.0], [2.0, 3.0, 4.0]  # df = 2n - 2 = 4 exactly, se = sqrt(2/3)
    w = stats.welch(a, b)
    assert w["df"] == 4 and w["mean"] == pytest.approx(-1.0)
    assert w["high"] == pytest.approx(-1.0 + 2.7764451 * math.sqrt(2 / 3), abs=1e-6)
    assert stats.welch([1.0, 1.0], [1.0, 1.0])["p"] == 1.0 and stats.welch([1.0, 1.0], [2.0, 2.0])["p"] == 0.0
    rounding = stats.welch([0.1] * 10, [0.1] * 14)  # means differ by 1e-17: still no variance, no difference
    assert rounding["p"] == 1.0 and rounding["df"] is None and rounding["mean"] == 0.0
    with pytest.raises(ValueError):
        stats.welch([1.0], [1.0, 2.0])


def test_welch_coverage_under_unequal_variances():
    # 6 against 12 values, sd 1 and 3: the 95% interval holds the true difference ~95% of the time
    rng = np.random.default_rng(3)
    hits = 0
    for _ in range(2000):
        w = stats.welch(rng.normal(0.5, 1.0, 6), rng.normal(0.0, 3.0, 12))
        hits += w["low"] <= 0.5 <= w["high"]
    assert 0.935 <= hits / 2000 <= 0.975


def test_gatekeeping_opens_a_family_only_after_all_before_it_are_rejected():
    assert stats.gatekeep([[0.01, 0.02], [0.03, 0.5]]) == [[pytest.approx(0.02), pytest.approx(0.02)],
                                                         [pytest.approx(0.06), pytest.approx(0.5)]]
    assert stats.gatekeep([[0.01, 0.2], [0.001, 0.001]]) == [[pytest.approx(0.02), pytest.approx(0.2)], [None, None]]
    assert stats.gatekeep([[0.01], [0.04], [0.001]], alpha=0.03) == [[pytest.approx(0.01)], [pytest.approx(0.04)],
                                                                     [None]]
    # rejected with the wrong sign: confirmed nothing, so the next family stays shut
    assert stats.gatekeep([[0.01], [0.001]], signs=[[False], [True]]) == [[pytest.approx(0.01)], [None]]
    assert stats.gatekeep([[0.01], [0.001]], signs=[[True], [True]]) == [[pytest.approx(0.01)], [pytest.approx(0.001)]]


def test_gatekeeping_controls_the_family_wise_error():
    # every null true, p uniform and independent: some rejection in at most ~5% of studies
    rng = np.random.default_rng(4)
    errors = sum(any(a is not None and a <= 0.05 for fam in stats.gatekeep([list(rng.random(3)) for _ in range(3)])
                     for a in fam) for _ in range(4000))
    assert errors / 4000 <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 4000)


def test_fixed_sequences_by_hand():
    # two chains, each tested at 0.05 / 2: p x 2, the next of a chain only after a rejection of its own
    got = stats.fixed_sequences([[0.01, 0.02, 0.2], [0.03, 0.001]])
    assert got == [[pytest.approx(0.02), pytest.approx(0.04), pytest.approx(0.4)], [pytest.approx(0.06), None]]
    # the wrong sign stops a chain; a None p (no test) stops it too; one chain never stops another
    assert stats.fixed_sequences([[0.001, 0.001]], signs=[[False, True]]) == [[pytest.approx(0.001), None]]
    assert stats.fixed_sequences([[None, 0.001], [0.001, 0.001]]) == [[None, None], [pytest.approx(0.002)] * 2]
    assert stats.fixed_sequences([[0.6, 0.1]]) == [[pytest.approx(0.6), None]]


def test_fixed_sequences_control_the_family_wise_error():
    # four chains of three, every null true, p uniform and independent: some rejection in at most ~5% of studies
    rng = np.random.default_rng(5)
    errors = sum(any(a is not None and a <= 0.05 for chain in stats.fixed_sequences([list(rng.random(3))
                                                                                      for _ in range(4)])
                     for a in chain) for _ in range(4000))
    assert errors / 4000 <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 4000)


def test_binomial_tail_by_hand():
    assert stats.binomial_tail(0, 5, 0.3) == pytest.approx(1.0)
    assert stats.binomial_tail(5, 5, 0.5) == pytest.approx(1 / 32)
    assert stats.binomial_tail(2, 3, 0.5) == pytest.approx(0.5)  # 3 + 1 of 8
    assert stats.binomial_tail(11, 640, 3 / 640) == pytest.approx(1 - sum(
        math.comb(640, x) * (3 / 640) ** x * (637 / 640) ** (640 - x) for x in range(11)))


def test_simulated_power_is_the_tests_size_under_the_null_and_grows_with_seeds():
    null = stats.simulate_power(5, sims=1500, mean=0.0, seed_sd=0.03, problem_sd=0.02)
    assert abs(null["power"] - 0.05) < 3 * math.sqrt(0.05 * 0.95 / 1500) and abs(null["coverage"] - 0.95) < 0.02
    floor = {"mean": 0.0, "seed_sd": 0.005, "problem_sd": 0.02, "learn_p": 0.2, "learn_effect": 0.15}
    few, many = stats.simulate_power(5, sims=800, **floor), stats.simulate_power(40, sims=800, **floor)
    assert few["power"] < 0.15 < 0.8 < many["power"]  # a lopsided process at the floor needs tens of seeds


def test_a_whole_number_welch_df_is_not_rounded_one_too_low():
    # equal variances and sizes: df = 2 (n - 1) = 4 exactly, which float noise computes as 3.9999...
    got = stats.welch([13 / 720, 41 / 720, 59 / 720], [8 / 720, 36 / 720, 54 / 720])
    assert got["df"] == 4


def test_paired_test_by_hand():
    # differences 0.04, 0.04, 0.05: mean 0.04333, se 0.003333, t(0.975, 2) 4.3027; t = 13, p = 1 - 13 / sqrt(171)
    got = stats.paired_test([0.04, 0.04, 0.05])
    assert got["df"] == 2 and got["mean"] == pytest.approx(0.0433333, abs=1e-7)
    assert (got["low"], got["high"]) == (pytest.approx(0.0290, abs=1e-4), pytest.approx(0.0577, abs=1e-4))
    assert got["p"] == pytest.approx(1 - 13 / math.sqrt(171), rel=1e-6)
    assert stats.paired_test([0.0, 0.0, 0.0]) == {"mean": 0.0, "low": 0.0, "high": 0.0, "p": 1.0, "df": None}
    assert stats.paired_test([0.03, 0.03])["df"] is None and stats.paired_test([0.03, 0.03])["p"] == 0.0
